"""API side of one worker process: talk JSON lines, bound every wait, fail fast.

Each replica is one ``worker_proc`` subprocess owning one model and one transfer
engine (rank ``rank_offset + i`` of the transfer group). The API process writes one
JSON object per line to the worker's stdin and reads one per line from its stdout:

    request  {"id": 7, "op": "update", "args": {...}}
    reply    {"id": 7, "ok": true, "result": ...}
           | {"id": 7, "ok": false, "kind": "invalid|conflict|transfer|timeout|internal|model",
              "error": "..."}

JSON instead of pickle: a pickle stream is code execution for whoever can write
into it; these messages carry nothing but metadata and small results.

Every wait is bounded: a reply that does not come within the call's timeout becomes a
504 naming the replica, and a worker that exits fails all of its pending calls at
once (its stdout reaches EOF) instead of leaving them hanging.

A call the API gives up on (its timeout, or its HTTP client went away) is cancelled on
the worker too: ``{"op": "cancel_call", "args": {"target": 7}}``, so a generation nobody
waits for stops at its next decode step instead of holding the model.

No reply line is longer than ``WorkerSpec.max_reply_bytes`` (the worker answers an error
instead); a longer line all the same fails only the call it answers, never the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

from weightwire.shared.errors import ReferenceServerError

DEFAULT_MAX_REPLY_BYTES = 256 << 20
"""Largest reply line a worker sends (``--max-reply-bytes``): a batch of logprobs can be big."""
LINE_SLACK = 1 << 20
"""On top of the reply limit in the pipe's line limit: the worker's own error reply for a
too-big reply, and the envelope, always fit."""
_LINE_LIMIT = DEFAULT_MAX_REPLY_BYTES + LINE_SLACK
_REPLY_ID = re.compile(rb'^\{"id":(\d+),')

KIND_STATUS = {
    "invalid": 400,
    "conflict": 409,
    "delta_base": 409,  # errors.DeltaBaseMismatch: the reply names it (routes.REFUSAL_FIELD)
    "transfer": 502,
    "timeout": 504,
    "internal": 500,
    "dead": 503,
    "aborted": 503,
    "model": 500,
    "unavailable": 503,
    "incomplete": 503,
}
"""HTTP status for each failure kind a worker (or the pool) reports."""


_BULKY_OPS = frozenset({"update"})
_CANCELLABLE_OPS = frozenset({"generate"})
"""Ops a worker stops when the API gives up on them (``cancel_call``)."""
_INLINE_ENCODE_NAMES = 1024
"""A bulky op whose metadata lists at most this many names is encoded on the event loop
(tens of microseconds), not on a thread: the hop alone costs more than that."""


def _encode_line(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":")) + "\n"


class ReplicaError(ReferenceServerError):
    """One replica failed one call; ``status`` is the HTTP status it maps to."""

    def __init__(self, replica: int, kind: str, message: str) -> None:
        super().__init__(f"replica {replica}: {message}")
        self.replica, self.kind, self.message = replica, kind, message
        self.status = KIND_STATUS.get(kind, 500)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker process needs to start (passed as JSON on its command line)."""

    model_dir: str
    backend: str
    device: str
    replicas: int
    threads: int
    index: int = 0
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    """The worker answers an error instead of a reply line longer than this."""
    check_finite: bool = False
    """Refuse to commit a round whose floating-point tensors hold NaN or infinity."""
    max_lora_rank: int = 0
    """Serve LoRA adapters up to this rank (``--enable-lora``); 0: no adapters."""
    decode_step_delay_s: float = 0.0
    """Seconds to wait after each decode step (``--decode-step-delay``)."""


class Replica:
    """One worker subprocess and its in-flight calls."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process) -> None:
        self.index = index
        self.proc = proc
        self.info: dict[str, Any] = {}
        self.inflight_generations = 0
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._write_lock = asyncio.Lock()
        self._dead_reason: str | None = None
        self._reader = asyncio.create_task(
            self._read_loop(), name=f"weightwire-replica-{index}-reader"
        )

    @property
    def alive(self) -> bool:
        return self._dead_reason is None

    async def _read_loop(self) -> None:
        assert self.proc.stdout is not None
        try:
            while True:
                line = await self._read_line(self.proc.stdout)
                if line is None:
                    continue  # an over-long line, already answered as its call's failure
                if not line:
                    code = await _wait_exit(self.proc, 5.0)
                    self._die(f"worker process exited (code {code})")
                    break
                try:
                    msg = json.loads(line)
                    msg_id = msg["id"]
                except (ValueError, KeyError, TypeError):
                    self._die(f"sent a malformed reply line {line[:80]!r}")
                    break
                self._resolve(msg_id, msg)
        except asyncio.CancelledError:
            self._die("replica pool closed")
            raise

    async def _read_line(self, stream: asyncio.StreamReader) -> bytes | None:
        """The next reply line (``b""`` at EOF), or ``None`` after skipping one over the pipe's
        line limit: that line fails only the call whose id it starts with."""
        try:
            return await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial  # EOF (a partial last line is malformed, and says so)
        except asyncio.LimitOverrunError as exc:
            head = await stream.read(exc.consumed)
        size = len(head)
        while True:  # drop the rest of the line, a buffer at a time, without holding it
            try:
                size += len(await stream.readuntil(b"\n"))
                break
            except asyncio.IncompleteReadError as exc:
                size += len(exc.partial)
                break
            except asyncio.LimitOverrunError as exc:
                size += len(await stream.read(exc.consumed))
        match = _REPLY_ID.match(head)
        if match is not None:
            self._resolve(
                int(match[1]),
                {
                    "ok": False,
                    "kind": "internal",
                    "error": (
                        f"the worker's reply was {size} bytes, over the pipe's line limit; this "
                        "request failed, the replica serves on"
                    ),
                },
            )
        return None

    def _resolve(self, msg_id: int, msg: dict[str, Any]) -> None:
        if msg_id == 0:
            if self._ready.done():
                return
            if msg.get("ok"):
                self._ready.set_result(msg.get("result") or {})
            else:
                self._ready.set_exception(
                    ReplicaError(self.index, "internal", f"failed to start: {msg.get('error')}")
                )
            return
        fut = self._pending.pop(msg_id, None)
        if fut is None or fut.done():
            return  # a reply to a call that already timed out on this side
        if msg.get("ok"):
            fut.set_result(msg.get("result"))
        else:
            fut.set_exception(
                ReplicaError(self.index, str(msg.get("kind", "internal")), str(msg.get("error")))
            )

    def _die(self, reason: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = reason
        err = ReplicaError(self.index, "dead", reason)
        if not self._ready.done():
            self._ready.set_exception(err)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
        self._pending.clear()

    async def wait_ready(self, timeout: float) -> dict[str, Any]:
        try:
            self.info = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise ReplicaError(
                self.index, "timeout", f"worker did not become ready within {timeout:.0f}s"
            ) from None
        return self.info

    async def call(self, op: str, args: dict[str, Any] | None = None, *, timeout: float) -> Any:
        """Send one request and wait (at most ``timeout`` s) for its reply."""
        if self._dead_reason is not None:
            raise ReplicaError(self.index, "dead", self._dead_reason)
        msg_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        message = {"id": msg_id, "op": op, "args": args or {}}
        if op in _BULKY_OPS and _names(args) > _INLINE_ENCODE_NAMES:
            # A round's metadata: seconds of encoding that must not stall the loop.
            line = await asyncio.to_thread(_encode_line, message)
        else:
            line = _encode_line(message)
        assert self.proc.stdin is not None
        # asyncio.timeout, not wait_for: no extra task per wait (wait_for wraps its awaitable in
        # one).
        try:
            async with (
                self._write_lock
            ):  # the lock wait stays unbounded, as before: only the drain is timed
                self.proc.stdin.write(line.encode())
                async with asyncio.timeout(timeout):
                    await self.proc.stdin.drain()
        except (ConnectionError, TimeoutError) as exc:
            self._pending.pop(msg_id, None)
            self._die(f"cannot send {op!r} to the worker ({type(exc).__name__})")
            raise ReplicaError(self.index, "dead", self._dead_reason or "worker gone") from None
        try:
            # Awaited directly (no shield): if this call is cancelled (client gone) or times out,
            # the future is cancelled too, and the reply that still arrives finds it done and
            # is dropped (``_resolve``); a timeout also forgets the id at once.
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            self._pending.pop(msg_id, None)
            self._cancel_on_worker(op, msg_id)
            raise ReplicaError(
                self.index, "timeout", f"no reply to {op!r} within {timeout:.0f}s"
            ) from None
        except asyncio.CancelledError:
            self._pending.pop(msg_id, None)
            self._cancel_on_worker(op, msg_id)
            raise

    def post(self, op: str, args: dict[str, Any] | None = None) -> None:
        """Send one request whose reply nobody awaits (dropped on arrival, as a late one):
        written at once, so the worker reads it before any call sent after it (it reads its
        pipe in order). Without the write lock and without a drain, as ``_cancel_on_worker``:
        one ``write`` appends a whole line. Nothing is sent to a dead worker."""
        if self.proc.stdin is None or self._dead_reason is not None:
            return
        line = _encode_line({"id": next(self._ids), "op": op, "args": args or {}})
        with contextlib.suppress(ConnectionError, RuntimeError):  # a closing pipe: going anyway
            self.proc.stdin.write(line.encode())

    def _cancel_on_worker(self, op: str, msg_id: int) -> None:
        """Tell the worker that nobody waits for call ``msg_id`` any more (generations stop at
        their next step). Written without the write lock and without a drain: one
        ``write`` appends a whole line to the pipe's buffer, so lines never interleave, and
        this runs where awaiting is not possible (a cancelled call)."""
        if op not in _CANCELLABLE_OPS or self.proc.stdin is None or self._dead_reason is not None:
            return
        line = _encode_line(
            {"id": next(self._ids), "op": "cancel_call", "args": {"target": msg_id}}
        )
        with contextlib.suppress(
            ConnectionError, RuntimeError
        ):  # a closing pipe: the worker is going anyway
            self.proc.stdin.write(line.encode())

    async def close(self, grace: float) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # EOF: the worker exits on its own
            if await _wait_exit(self.proc, grace) is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await _wait_exit(self.proc, grace)
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader


def _names(args: dict[str, Any] | None) -> int:
    """How many tensor names an update's args list (its encoding cost), without trusting their
    shape."""
    info = (args or {}).get("update_info")
    names = info.get("names") if isinstance(info, dict) else None
    return len(names) if isinstance(names, list) else 0


async def _wait_exit(proc: asyncio.subprocess.Process, timeout: float) -> int | None:
    try:
        return await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        return None
