"""A replica's worker: one model, one ``HFModelHost``, one transfer engine, and the
operations the request loop (``worker_proc``) runs on its lanes.

A round over the stage budget is written in place (``strategy.StreamingRound``): each
write takes ``model_lock``, and from the round's first write until a complete round
commits a generation is refused (``ModelIncomplete``, HTTP 503 naming why), so no request is
answered by a half-updated model.

A finish waits for the model lock at most its ``timeout_s`` and never commits after
an ``abort`` that arrived while it waited: otherwise the API, having answered "timed
out, the previous weights are served", would be contradicted by a commit that lands
when the blocking generation ends. A sleep follows the same rule (``sleep.WorkerSleep``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from weightwire import backends
from weightwire.tools.server.failures import CommitAborted, GenerationAborted, ModelIncomplete
from weightwire.tools.server.guards import LiveCalls, refuse_non_finite
from weightwire.tools.server.replica import WorkerSpec
from weightwire.tools.server.reply_size import max_piece_json_bytes
from weightwire.tools.server.sleep import WorkerSleep

log = logging.getLogger(__name__)

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
        self.step_lock = threading.Lock()
        """Held by a generation through each forward pass; a round's start takes it."""
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
            step_lock=self.step_lock,
            step_delay_s=spec.decode_step_delay_s,
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
        cls = backends.worker_engine(self.spec.backend)
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
        return {
            "rank": info.rank_offset + self.spec.index,
            # asleep at level 2, the parameters are empty: tell the shapes the wake restores
            "served_model": self.host.served_model(self.sleep.sleeper.shape_of).to_dict(),
        }

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("weight transfer engine is not initialized on this replica")
        return self.engine

    def op_start(self, timeout_s: float | None = None) -> None:
        """Open the round between two generation steps, as vLLM's ``collective_rpc`` runs: a
        worker written through sends its go from inside its start, and the trainer writes
        the parameters from that go on, so the forward pass in progress (which a
        ``pause=abort`` cancel stops only after it) must have ended first. Raises
        ``TimeoutError`` if it did not within ``timeout_s``; nothing is started then."""
        engine = self._require_engine()
        self.sleep.check_round()
        if not self.step_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TimeoutError(
                f"a generation step kept the model for {timeout_s:g} s, so the round was not "
                "started (nothing was written)"
            )
        try:  # no step starts until the start returned: a cancelled request stops before it
            engine.start_weight_update()
        finally:
            self.step_lock.release()

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
                [*engine.held_tensors(), *self.host.round_tensors()],
                in_place=self.host.in_place_round,
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

    def op_unload_lora(self, name: str) -> None:
        """Unregister adapter ``name`` (between completions)."""
        if self.adapters is None:
            raise ValueError("this server was started without --enable-lora")
        with self.model_lock:
            self.adapters.unload(name)

    def op_sleep(self, level: int, epoch: int, timeout_s: float | None = None) -> dict[str, Any]:
        reply = self.sleep.sleep(level, epoch, timeout_s)  # under the model lock
        if level == 2:  # the weights are gone, and with them the delta base
            self.weights.weights_changed("/sleep?level=2 discarded the weights", copies=True)
        return reply

    def op_wake(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self.sleep.wake(tags)

    def round_stale(self) -> str | None:
        """Why a new init may replace the open round (its trainer's data link closed, ...), or
        None."""
        engine = self.engine
        return "this replica has no transfer engine" if engine is None else engine.stale_round()

    def _teardown(self) -> None:
        from weightwire.torch_side.worker.hf_host import close_engine

        engine, self.engine = self.engine, None
        close_engine(engine, self.host)

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
            sums = self.host.state_checksums()
            if self.adapters is not None:  # an adapter round's tensors, under its names
                sums.update(self.adapters.checksums())
            return sums

    def op_reset(self) -> None:
        """Zero every weight, so a later compare shows which tensors an update did not write."""
        import torch

        with self.model_lock, torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
            self.weights.weights_changed("/weight_checker reset zeroed the weights", copies=True)


def _load_model(model_dir: str) -> Any:
    """The HF model, its load report kept out of the log unless at DEBUG; weights that do
    not fit the config raise one line naming the first tensor that differs."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from weightwire.tools.server.fp8_model import fp8_scheme, load_fp8_model
    from weightwire.tools.server.model_check import shape_mismatch

    scheme = fp8_scheme(model_dir)
    if scheme is not None:  # served as stored, not dequantized (fp8_model)
        return load_fp8_model(model_dir, scheme)
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
