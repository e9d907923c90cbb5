"""A replica's worker process: one model, one ``HFModelHost``, one transfer engine.

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

A round over the stage budget is written in place (``strategy.StreamingRound``): each
write takes ``model_lock``, and from the round's first write until a complete round
commits a generation is refused (``ModelIncomplete``, HTTP 503 naming why), so no request is
answered by a half-updated model.

A finish waits for the model lock at most its ``timeout_s`` and never commits after
an ``abort`` that arrived while it waited: otherwise the API, having answered "timed
out, the previous weights are served", would be contradicted by a commit that lands
when the blocking generation ends. A sleep follows the same rule (``sleep.WorkerSleep``).

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

from weightwire import backends
from weightwire.tools._cli import env_log_level
from weightwire.tools.server.failures import (
    CommitAborted,
    GenerationAborted,
    ModelIncomplete,
    classify,
)
from weightwire.tools.server.guards import LiveCalls, refuse_non_finite
from weightwire.tools.server.replicas import WorkerSpec
from weightwire.tools.server.reply_size import encode_reply, max_piece_json_bytes
from weightwire.tools.server.sleep import WorkerSleep

log = logging.getLogger(__name__)

_CONTROL_OPS = ("init", "start", "update", "finish", "shutdown", "sleep", "wake", "load_lora")
_SERVE_OPS = ("generate", "checksum", "reset")


_LOCK_POLL_S = 0.05  # how often a finish waiting for the model lock looks for an abort


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        import torch
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        from weightwire.tools.server.generate import Generator
        from weightwire.tools.server.lora import HFAdapters
        from weightwire.torch_side.worker import HFModelHost
        from weightwire.torch_side.worker.weight_state import WeightState

        self.spec = spec
        hf_logging.disable_progress_bar()  # the worker's stderr is the server's log
        torch.set_num_threads(max(1, spec.threads))
        if spec.device == "cuda":
            self.device = torch.device("cuda", spec.index % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device(spec.device)
        self.model = _load_model(spec.model_dir).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)
        self.model_lock = threading.Lock()
        self.host = HFModelHost(self.model, write_lock=self.model_lock)
        self.weights = WeightState()
        """Whether the model is whole: kept across this replica's engines (sessions)."""
        cfg = self.model.config
        self.max_model_len = int(getattr(cfg, "max_position_embeddings", 2048))
        self.vocab_size = int(cfg.vocab_size)
        # No token spans more characters than its vocabulary string (byte-level BPE: one
        # character per byte); x4 covers normalizers that merge characters (NFKC). A text
        # prompt longer than this cannot fit max_model_len, and the API refuses it before
        # anyone spends seconds tokenizing it on the serve lane.
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.max_model_len * max(1, longest) * 4
        self.max_piece_bytes = max_piece_json_bytes(self.tokenizer, self.vocab_size)
        self.generator = Generator(
            self.model,
            self.tokenizer,
            device=self.device,
            model_name=os.path.basename(os.path.normpath(spec.model_dir)),
            max_model_len=self.max_model_len,
        )
        self.sleep = WorkerSleep(self.model, self.device, self.model_lock, self.host.param_names)
        self.adapters = HFAdapters(self.model, spec.max_lora_rank) if spec.max_lora_rank else None
        self.engine: Any = None
        self.cancel_epoch = 0
        self.calls = LiveCalls()
        self.abort_epoch = 0
        """Bumped by every ``abort``; a finish commits only if it is unchanged since its arrival."""

    def describe(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "device": str(self.device),
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "max_prompt_chars": self.max_prompt_chars,
            "max_piece_bytes": self.max_piece_bytes,
            "params": len(self.host.param_names()),
        }

    # -- control lane ---------------------------------------------------------------
    def _new_engine(self) -> Any:
        cls = backends.load(backends.get(self.spec.backend).worker_engine)
        return cls.standalone(
            model=self.host,
            device=self.device,
            worker_rank=self.spec.index,
            weights=self.weights,
            adapters=lambda: self.adapters,
        )

    def op_init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        self._teardown()
        engine = self._new_engine()
        info = engine.parse_init_info(init_info)
        try:
            engine.init_transfer_engine(info)
        except BaseException:
            engine.shutdown()
            raise
        self.engine = engine
        return {"rank": info.rank_offset + self.spec.index}

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("weight transfer engine is not initialized on this replica")
        return self.engine

    def op_start(self) -> None:
        engine = self._require_engine()
        self.sleep.check_round()
        engine.start_weight_update()

    def op_update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        engine = self._require_engine()
        engine.update_weights(update_info)
        stats = engine.last_stats
        return (
            {}
            if stats is None
            else {
                "tensors": stats.tensors,
                "chunks": stats.chunks,
                "nbytes": stats.nbytes,
                "seconds": stats.seconds,
            }
        )

    def op_finish(self, epoch: int | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """Commit the staged round under the model lock (a generation may be reading the
        parameters). Raises ``TimeoutError`` if the lock is not free within ``timeout_s``
        and ``CommitAborted`` if an abort arrived since the request did; either way
        nothing is committed and the caller's teardown drops the staged round."""
        engine = self._require_engine()
        epoch = self.abort_epoch if epoch is None else epoch
        if self.spec.check_finite:
            refuse_non_finite(
                [*engine.held_tensors(), *self.host.staged_tensors()]
            )  # outside the model lock: generations go on meanwhile
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.model_lock.acquire(timeout=_LOCK_POLL_S):
            if self.abort_epoch != epoch:
                raise CommitAborted(
                    "the round was aborted while finish waited for the model; nothing was committed"
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    "the model stayed busy (a generation held it) for "
                    f"{timeout_s:g} s, so the round was not committed"
                )
        try:
            if self.abort_epoch != epoch:
                raise CommitAborted(
                    "the round was aborted before finish could commit; nothing was committed"
                )
            engine.finish_weight_update()
            self.sleep.committed(self.host.last_committed)
        finally:
            self.model_lock.release()
        return self.sleep.reply()

    def op_shutdown(self) -> None:
        self._teardown()

    def op_load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Register adapter ``name`` from a PEFT directory (between completions)."""
        if self.adapters is None:
            raise ValueError("this server was started without --enable-lora")
        with self.model_lock:
            return self.adapters.load_dir(name, path)

    def op_sleep(self, level: int, epoch: int, timeout_s: float | None = None) -> dict[str, Any]:
        return self.sleep.sleep(
            level, epoch, timeout_s
        )  # under the model lock: never under a generation

    def op_wake(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self.sleep.wake(tags)

    def round_stale(self) -> str | None:
        """Why a new init may replace the open round (its trainer's data link closed, ...), or
        None."""
        engine = self.engine
        return "this replica has no transfer engine" if engine is None else engine.stale_round()

    def _teardown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()  # aborts an open round; the served weights stay
        self.host.abort_round()

    def abort_link(self) -> None:
        """Out of band: wake a receive blocked on the control thread by aborting its link."""
        engine = self.engine
        if engine is not None:
            engine.abort_transfer()

    # -- serve lane ---------------------------------------------------------------------
    def op_generate(self, request: dict[str, Any], epoch: int, call_id: int) -> dict[str, Any]:
        def cancelled() -> bool:
            return self.cancel_epoch != epoch or self.calls.cancelled(call_id)

        try:
            with self.model_lock:
                if self.cancel_epoch != epoch:
                    raise GenerationAborted(
                        "request aborted by /pause?mode=abort before it started"
                    )
                if cancelled():
                    raise GenerationAborted(
                        "request dropped before it started: the API stopped waiting for it"
                    )
                self.sleep.check_serving()
                refusal = self.refusal()
                if refusal is not None:
                    raise ModelIncomplete(refusal)
                if self.adapters is None:
                    return self.generator.complete(request, cancelled)
                with self.adapters.applied(request.get("model")):
                    return self.generator.complete(request, cancelled)
        finally:
            self.calls.ended(call_id)

    def refusal(self) -> str | None:
        """Why generation is refused now (a round in place, or one left incomplete), or None."""
        incomplete = self.weights.incomplete
        if incomplete is not None:
            return f"{incomplete.describe()}; generation is refused until then"
        if self.host.in_place_round:
            return (
                "a weight round is being applied in place (it exceeded the stage budget); "
                "generation is refused until it commits"
            )
        return None

    def weights_state(self) -> dict[str, Any]:
        """``/weight_info``'s view of this replica: is the model whole."""
        incomplete = self.weights.incomplete
        return {
            "round_incomplete": incomplete is not None or self.host.in_place_round,
            "reason": self.refusal(),
            "tensors_in_doubt": 0 if incomplete is None else len(incomplete.names),
        }

    def op_checksum(self) -> dict[str, str]:
        with self.model_lock:
            return self.host.state_checksums()

    def op_reset(self) -> None:
        """Zero every weight, so a later compare shows which tensors an update did not write."""
        import torch

        with self.model_lock, torch.no_grad():
            for p in self.model.parameters():
                p.zero_()


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


def _load_model(model_dir: str) -> Any:
    """The HF model, its load report kept out of the log unless at DEBUG; weights that do
    not fit the config raise one line naming the first tensor that differs."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from weightwire.tools.server.model_check import shape_mismatch

    quiet = not log.isEnabledFor(logging.DEBUG)
    before = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    except RuntimeError as exc:
        if "mismatched_sizes" not in str(exc):
            raise
        raise ValueError(shape_mismatch(model_dir) or str(exc)) from None
    finally:
        hf_logging.set_verbosity(before)


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
