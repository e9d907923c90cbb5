"""``Replica.call`` / ``ReplicaPool.fan_out`` over a real pipe to a stub worker process:
replies, timeouts, late replies, cancellation, a dying worker, and the one-replica fan-out
(called directly, no task) failing exactly like the general one. The stub speaks the
worker protocol (``replica`` docstring) and nothing else, so no model is loaded."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from weightwire.tools.server import replica
from weightwire.tools.server.replica import Replica, ReplicaError
from weightwire.tools.server.replicas import FanOutError, ReplicaPool

pytestmark = pytest.mark.timeout(60)

_STUB = r"""
import json, sys, time
out = sys.stdout
cancelled = []
out.write(json.dumps({"id": 0, "ok": True, "result": {"stub": True}}) + "\n"); out.flush()
for line in sys.stdin:
    msg = json.loads(line)
    op, args = msg["op"], msg["args"]
    if op == "exit":
        sys.exit(7)
    if op == "slow":
        time.sleep(args["s"])
    # a reply line far over the API's line limit (the replica's reader must survive it)
    if op == "huge":
        time.sleep(args.get("s", 0))
        out.write('{"id":%d,"ok":true,"result":"%s"}\n' % (msg["id"], "x" * args["size"]))
        out.flush()
        continue
    if op == "cancel_call":
        cancelled.append(args["target"])
    if op == "cancelled":
        args = {"targets": cancelled}
    if op == "fail":
        reply = {"id": msg["id"], "ok": False, "kind": args["kind"], "error": "it failed"}
    else:
        reply = {"id": msg["id"], "ok": True, "result": {"op": op, "args": args}}
    out.write(json.dumps(reply) + "\n"); out.flush()
"""


LINE_LIMIT = 64 << 10


async def _replica() -> Replica:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _STUB,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        limit=LINE_LIMIT,
    )
    replica = Replica(0, proc)
    assert await replica.wait_ready(30) == {"stub": True}
    return replica


def _run(scenario: Any) -> None:
    async def main() -> None:
        replica = await _replica()
        try:
            await scenario(replica)
        finally:
            await replica.close(2.0)

    asyncio.run(main())


def test_a_call_returns_its_reply_and_a_timeout_names_the_op() -> None:
    async def scenario(r: Replica) -> None:
        assert await r.call("start", timeout=5) == {"op": "start", "args": {}}
        with pytest.raises(ReplicaError, match=r"replica 0: no reply to 'slow' within 0s") as info:
            await r.call("slow", {"s": 0.5}, timeout=0.1)
        assert info.value.kind == "timeout" and info.value.status == 504
        assert r._pending == {}  # the timed-out id is forgotten at once
        # The late reply arrives while this call waits; it must not be taken for this call's answer.
        assert await r.call("finish", {"n": 1}, timeout=5) == {"op": "finish", "args": {"n": 1}}
        assert r.alive

    _run(scenario)


def test_a_cancelled_call_leaves_the_replica_usable() -> None:
    async def scenario(r: Replica) -> None:
        task = asyncio.ensure_future(r.call("slow", {"s": 0.3}, timeout=5))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await r.call("start", timeout=5) == {
            "op": "start",
            "args": {},
        }  # after the late reply
        assert r._pending == {} and r.alive

    _run(scenario)


def test_a_worker_that_exits_fails_its_pending_call_at_once() -> None:
    async def scenario(r: Replica) -> None:
        with pytest.raises(ReplicaError, match=r"worker process exited \(code 7\)") as info:
            await r.call("exit", timeout=20)
        assert info.value.kind == "dead" and not r.alive
        with pytest.raises(ReplicaError, match="exited"):
            await r.call("start", timeout=5)

    _run(scenario)


def test_one_replica_fan_out_fails_like_the_general_one() -> None:
    async def scenario(r: Replica) -> None:
        pool = ReplicaPool([r])
        assert await pool.fan_out("start", timeout=5) == [{"op": "start", "args": {}}]
        assert await pool.fan_out("update", [{"x": 1}], timeout=5) == [
            {"op": "update", "args": {"x": 1}}
        ]
        aborted: list[bool] = []

        async def abort_all(timeout: float = 30.0) -> None:
            aborted.append(True)

        pool.abort_all = abort_all  # type: ignore[method-assign]
        with pytest.raises(FanOutError, match=r"^replica 0: it failed$") as info:
            await pool.fan_out("fail", {"kind": "conflict"}, timeout=5)
        assert info.value.status == 409 and info.value.aborted == [] and aborted == []
        with pytest.raises(FanOutError) as info:
            await pool.fan_out("fail", {"kind": "transfer"}, timeout=5, abort_on_failure=True)
        assert info.value.status == 502 and aborted == [True]
        with pytest.raises(FanOutError, match="no reply to 'slow'") as info:
            await pool.fan_out("slow", {"s": 0.5}, timeout=0.1)
        assert info.value.status == 504
        with pytest.raises(ValueError, match="2 argument sets for 1 replicas"):
            await pool.fan_out("start", [{}, {}], timeout=5)

    _run(scenario)


def test_only_a_big_update_is_encoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    hops: list[str] = []
    real = asyncio.to_thread

    async def to_thread(fn: Any, *args: Any) -> Any:
        hops.append(fn.__name__)
        return await real(fn, *args)

    monkeypatch.setattr(replica.asyncio, "to_thread", to_thread)
    many = replica._INLINE_ENCODE_NAMES + 1

    async def scenario(r: Replica) -> None:
        small = {"update_info": {"names": [], "dtype_names": [], "shapes": []}}
        assert (await r.call("update", small, timeout=5))["args"] == small
        assert hops == []
        big = {
            "update_info": {
                "names": [f"w{i}" for i in range(many)],
                "dtype_names": ["float32"] * many,
                "shapes": [[1]] * many,
            }
        }
        assert (await r.call("update", big, timeout=10))["args"] == big
        assert hops == ["_encode_line"]

    _run(scenario)


def test_a_reply_over_the_line_limit_fails_only_its_call() -> None:
    """A reply line longer than the pipe's limit used to kill the reader: the replica was
    dead for good (every later call 503) while its worker lived."""

    async def scenario(r: Replica) -> None:
        with pytest.raises(
            ReplicaError, match=r"reply was \d+ bytes, over the pipe's line limit"
        ) as info:
            await r.call("huge", {"size": 10 * LINE_LIMIT}, timeout=20)
        assert info.value.status == 500
        assert r.alive and r._pending == {}
        assert await r.call("start", timeout=5) == {"op": "start", "args": {}}

    _run(scenario)


def test_a_late_reply_over_the_line_limit_is_dropped() -> None:
    """The API timed out first; the worker's (huge) reply comes later and must not kill the
    reader."""

    async def scenario(r: Replica) -> None:
        with pytest.raises(ReplicaError, match="no reply to 'huge'"):
            await r.call("huge", {"size": 10 * LINE_LIMIT, "s": 0.3}, timeout=0.1)
        assert await r.call("start", timeout=10) == {
            "op": "start",
            "args": {},
        }  # answered after the late line
        assert r.alive

    _run(scenario)


def test_a_generation_the_api_gives_up_on_is_cancelled_on_the_worker() -> None:
    """A timed-out or cancelled generate is followed by a cancel_call naming its id; other ops are
    not."""

    async def scenario(r: Replica) -> None:
        with pytest.raises(ReplicaError, match="no reply to 'generate'"):
            await r.call("generate", {"s": 0}, timeout=0)
        task = asyncio.ensure_future(r.call("generate", {}, timeout=5))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ReplicaError, match="no reply to 'slow'"):
            await r.call("slow", {"s": 0.2}, timeout=0.05)
        got = await r.call("cancelled", timeout=5)
        assert got["args"]["targets"] == [
            1,
            3,
        ]  # ids: 1 generate, 2 its cancel_call, 3 generate, 4 its cancel_call
        assert r.alive and r._pending == {}

    _run(scenario)


def test_a_posted_request_is_read_before_a_later_call_and_its_reply_is_dropped() -> None:
    async def scenario(r: Replica) -> None:
        r.post("cancel_call", {"target": 99})  # not awaited: a start's cancel, posted ahead
        # the stub lists what it was told to cancel: the posted line came first
        assert await r.call("cancelled", timeout=5) == {
            "op": "cancelled",
            "args": {"targets": [99]},
        }
        assert r._pending == {} and r.alive  # the post's reply found no one waiting
        assert await r.call("start", timeout=5) == {"op": "start", "args": {}}

    _run(scenario)
