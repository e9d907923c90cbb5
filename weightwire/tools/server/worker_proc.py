"""A replica's worker process: the request loop around one ``replica_worker.Worker``.

Started by ``replicas.ReplicaPool`` as ``python -m weightwire.tools.server.worker_proc SPEC``
and driven with JSON lines on stdin/stdout (protocol in ``replicas``). Three lanes,
so a long receive never stalls what must stay responsive:

- the *control* thread runs weight operations in order (init, start, update,
  finish, shutdown): they block on the network;
- the *serve* thread runs generation, checksums and reset under ``model_lock``;
  ``finish`` takes the same lock to commit, so a request sees either the old
  weights or the new ones, never a mix (staged tensors never touch parameters);
- the stdin reader handles ``abort`` / ``cancel`` / ``cancel_call`` / ``cancel_sleep`` /
  ``round_stale`` / ``ping`` / ``weights`` itself, at once: ``abort`` must reach a receive
  that is blocked on the control thread, and a ``cancel_call`` (the API stopped waiting for
  one generation) a decode loop that checks for it between steps.

The process exits when stdin reaches EOF or the parent process disappears, so
workers never outlive a killed API server.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

from weightwire.tools._cli import env_log_level
from weightwire.tools.server.failures import classify
from weightwire.tools.server.replica import WorkerSpec
from weightwire.tools.server.replica_worker import Worker
from weightwire.tools.server.reply_size import encode_reply

log = logging.getLogger(__name__)

_CONTROL_OPS = (
    "init",
    "start",
    "update",
    "finish",
    "shutdown",
    "sleep",
    "wake",
    "load_lora",
    "unload_lora",
)
_SERVE_OPS = ("generate", "checksum", "reset")


class Loop:
    """Reads requests, dispatches them to lanes, writes replies (one line each, locked)."""

    def __init__(self, worker: Worker, out: BinaryIO) -> None:
        self.worker, self.out = worker, out
        self.write_lock = threading.Lock()
        self.control = cf.ThreadPoolExecutor(1, thread_name_prefix="weightwire-control")
        self.serve = cf.ThreadPoolExecutor(1, thread_name_prefix="weightwire-serve")

    def reply(self, msg: dict[str, Any], op: str | None = None) -> None:
        encoded = encode_reply(msg, self.worker.spec.max_reply_bytes, op=op)
        if encoded.problem is not None:
            log.error(
                "the reply to call %s was replaced by an error: %s", msg.get("id"), encoded.problem
            )
        with self.write_lock:
            self.out.write(encoded.data)
            self.out.flush()

    def run_op(self, msg_id: int | None, op: str, fn: Any, kwargs: dict[str, Any]) -> None:
        try:
            result = fn(**kwargs)
        except BaseException as exc:
            kind = classify(exc)
            if kind == "internal":
                traceback.print_exc(
                    file=sys.stderr
                )  # the API returns no traceback; the log keeps it
            if op in ("init", "start", "update", "finish"):
                try:
                    self.worker._teardown()  # a failed weight op ends the session on this replica
                except Exception:
                    log.exception("teardown after a failed %s failed", op)
            self.reply(
                {"id": msg_id, "ok": False, "kind": kind, "error": f"{type(exc).__name__}: {exc}"},
                op,
            )
            return
        self.reply({"id": msg_id, "ok": True, "result": result}, op)

    def dispatch(self, msg: dict[str, Any]) -> None:
        msg_id, op, args = msg.get("id"), msg.get("op"), msg.get("args") or {}
        w = self.worker
        if op == "ping":
            self.reply({"id": msg_id, "ok": True, "result": w.describe()})
        elif op == "weights":
            self.reply({"id": msg_id, "ok": True, "result": w.weights_state()})
        elif op == "cancel":
            w.cancel_epoch += 1
            self.reply({"id": msg_id, "ok": True, "result": None})
        elif op == "cancel_call":
            w.calls.cancel(
                args.get("target")
            )  # the generation stops at its next step (or never starts)
            self.reply({"id": msg_id, "ok": True, "result": None})
        elif op == "cancel_sleep":
            w.sleep.cancel()  # a sleep still waiting for the model never runs now
            self.reply({"id": msg_id, "ok": True, "result": None})
        elif op == "round_stale":
            self.run_op(msg_id, op, w.round_stale, {})  # a non-blocking poll of the data link
        elif op == "abort":
            w.abort_epoch += 1  # first: a finish waiting for the model lock must not commit now
            w.abort_link()
            # The control lane finishes the failing op (if any) first, then tears down.
            self.control.submit(self.run_op, msg_id, "abort", w._teardown, {})
        elif op == "finish":
            # The abort epoch is read on arrival: an abort sent after this finish cancels it.
            self.control.submit(
                self.run_op, msg_id, op, w.op_finish, {**args, "epoch": w.abort_epoch}
            )
        elif op == "sleep":
            # Same rule as finish: a cancel_sleep sent after this sleep cancels it.
            self.control.submit(
                self.run_op, msg_id, op, w.op_sleep, {**args, "epoch": w.sleep.epoch}
            )
        elif op in _CONTROL_OPS:
            self.control.submit(self.run_op, msg_id, op, getattr(w, f"op_{op}"), args)
        elif op == "generate":
            # The epoch is read now, on arrival: a /pause?mode=abort also drops queued requests.
            w.calls.arrived(msg_id)  # type: ignore[arg-type]
            self.serve.submit(
                self.run_op,
                msg_id,
                op,
                w.op_generate,
                {**args, "epoch": w.cancel_epoch, "call_id": msg_id},
            )
        elif op in _SERVE_OPS:
            self.serve.submit(self.run_op, msg_id, op, getattr(w, f"op_{op}"), args)
        else:
            self.reply(
                {"id": msg_id, "ok": False, "kind": "invalid", "error": f"unknown op {op!r}"}
            )


def _claim_stdout() -> BinaryIO:
    """Keep the real stdout for replies; point fd 1 at stderr so stray prints can't corrupt them."""
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return proto


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _die_with_parent() -> None:
    """Linux: have the kernel SIGTERM us the moment the API process dies (best effort)."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux / no glibc: the stdin-EOF and parent-pid watches still apply


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line; a long message is cut after its first sentence (the
    libraries' advice that follows names no fact about this model)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    if len(text) > limit:
        end = text.find(". ", 40)
        text = text[: end + 1] if 0 < end < limit else text[:limit] + "..."
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Ctrl-C reaches the whole process group; the API process owns shutdown (it closes our
    # stdin), so a worker ignores SIGINT instead of dying mid-reply with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    out = _claim_stdout()
    logging.basicConfig(
        level=env_log_level(os.environ), stream=sys.stderr
    )  # serve checked it at start
    parent = int(os.environ.get("WEIGHTWIRE_PARENT_PID", os.getppid()))
    threading.Thread(
        target=_watch_parent, args=(parent,), daemon=True, name="weightwire-parent-watch"
    ).start()
    spec = WorkerSpec(**json.loads(argv[0]))
    try:
        worker = Worker(spec)
    except BaseException as exc:
        # The API process prints the error as one line; the traceback is for debugging only.
        if os.environ.get("WEIGHTWIRE_DEBUG") or log.isEnabledFor(logging.DEBUG):
            traceback.print_exc(file=sys.stderr)
        out.write((json.dumps({"id": 0, "ok": False, "error": _one_line(exc)}) + "\n").encode())
        return 1
    loop = Loop(worker, out)
    loop.reply({"id": 0, "ok": True, "result": worker.describe()})
    for line in sys.stdin.buffer:
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
        except ValueError:
            log.error("dropping a malformed request line")
            continue
        loop.dispatch(msg)
    os._exit(0)  # EOF: the API server is gone; do not wait for a blocked receive


if __name__ == "__main__":
    sys.exit(main())
