"""``bench_ipc.py``'s parameter sets: the worker's receiver (the IPC engine loading into a
counting sink or into a vLLM-layout parameter set), and the trainer's tensors and digests
for that layout."""

from __future__ import annotations

import os
from typing import Any

from ipc_probes import profiled, trace_worker  # beside this script

from weightwire._trace import trace, tracing
from weightwire.tools.bench import sync_shim as bench_sync_shim

TRACING = tracing  # the one switch: weightwire._trace


class IPCShimReceiver(bench_sync_shim.Receiver):
    """The shim's receiver with the IPC engine instead of NCCL (same memory probes), loading
    into the sink or, once ``layout`` named a model, into its vLLM-layout parameters."""

    layout: Any = None  # (FakeLlama, its stub kind) after a ``layout`` call

    def handle(self, call: str, args: dict[str, Any]) -> Any:
        if call in ("layout", "digests", "floor"):
            return self.on_layout(call, args)
        out = super().handle(call, args)
        if call == "mem_peak":  # pull mode's pool is raw cudaMalloc: not in torch's counters
            link = getattr(getattr(self.engine, "_core", None), "_link", None)
            held = getattr(link, "held_bytes", None)
            out["pool"] = int(held()) if callable(held) else 0
        return out

    def op(self, op: str, args: dict[str, Any]) -> Any:
        if op == "update" and os.environ.get("BENCH_PROFILE") and self.sink.nbytes == 0:
            return profiled("worker update", lambda: super(IPCShimReceiver, self).op(op, args))
        if op != "init":
            trace(f"{op}>")
            try:
                return super().op(op, args)
            finally:
                trace(f"{op}<")
        from weightwire.torch_side.worker.engines import WeightwireIPCEngine

        with self.lock:
            if self.engine is not None:
                self.engine.shutdown()
            model = self.sink if self.layout is None else self.layout[0]
            self.engine = WeightwireIPCEngine.standalone(model=model, device=self.device)
            info = self.engine.parse_init_info(args["init_info"])
            self.engine.init_transfer_engine(info)
            if TRACING:
                trace_worker(self.engine, self.sink)
            return {"rank": info.rank_offset}

    def on_layout(self, call: str, args: dict[str, Any]) -> Any:
        from tests.torch_side import vllm_stub

        with self.lock:
            if call == "layout":  # the next sessions load into this model's parameters
                kind = "llama-tied" if args["model"] == "qwen2-0.5b" else "llama"
                self.layout = None
                self.torch.cuda.empty_cache()
                model = vllm_stub.make_model(kind, args["model"], self.device)
                self.layout = (model, kind)
                return None
            model, kind = self.layout
            if call == "digests":
                return vllm_stub.model_digests(model, kind)
            return vllm_stub.copy_floor_s(
                model, model.shape, self.device, int(args["reps"]), bool(args.get("batched"))
            )


def layout_params(model: str, kind: str) -> dict[str, Any]:
    """The round's tensors for the vLLM-layout parameter set (its stub's names and shapes; a
    tied checkpoint has no ``lm_head.weight``), on the trainer's GPU."""
    import torch

    from tests.torch_side.vllm_stub import trainer_tensors

    tensors = dict(trainer_tensors(model, torch.device("cuda", 0), seed=1))
    if model == "qwen2-0.5b":
        del tensors["lm_head.weight"]
    if kind == "torch":
        return tensors
    import jax

    return {n: jax.dlpack.from_dlpack(t) for n, t in tensors.items()}  # zero-copy


def layout_digests(params: dict[str, Any], kind: str) -> dict[str, Any]:
    """The trainer's digest of every tensor as the worker reports them (the tied head is
    read back as the embedding)."""
    import torch

    from tests.torch_side.vllm_stub import digest

    out = {n: digest(a if kind == "torch" else torch.from_dlpack(a)) for n, a in params.items()}
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
