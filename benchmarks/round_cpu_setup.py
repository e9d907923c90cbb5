"""The set-up of ``bench_round_cpu.py``: its sources (Qwen2-0.5B's 290 tensor names at toy
widths, JAX or torch) and an in-process worker (``WeightwireTCPEngine`` over a model that drops
what it loads) behind a client that calls it directly, with no HTTP."""

from __future__ import annotations

import cProfile
from collections.abc import Callable
from typing import Any

TENSORS = 290
LAYERS = 24
SMALL = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
}
"""Qwen2-0.5B's structure (24 layers, GQA, q/k/v biases, tied embeddings) at toy widths."""


# ------------------------------------------------------------------------------ sources


def jax_source() -> tuple[Any, Any]:
    import jax

    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.jax_side.source import PytreeSource
    from weightwire.tools.models import qwen2

    cfg = qwen2.config(**SMALL, tie_word_embeddings=True, param_dtype="bfloat16")
    params = qwen2.init(jax.random.key(0), cfg)
    return JAXTrainerEngine, PytreeSource(params, qwen2.naming(cfg))


def torch_source() -> tuple[Any, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.source import ModuleSource

    torch.manual_seed(0)
    cfg = Qwen2Config(**SMALL, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return TorchTrainerEngine, ModuleSource(model)


# ------------------------------------------------------------------------------ worker side


class DropHost:
    """A model that takes what it is given and keeps nothing: the engine's cost only."""

    def __init__(self) -> None:
        self.loaded = 0

    def load_weights(self, weights: Any) -> None:
        for _ in weights:
            self.loaded += 1


class InProcessClient:
    """The engine's call set, answered by a worker engine in this process."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.profile: cProfile.Profile | None = (
            None  # the worker's side of the round (its own thread)
        )

    def version(self) -> str:
        return "0.33.0"

    def get_world_size(self) -> int:
        return 1

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.worker.init_transfer_engine(self.worker.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.worker.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if self.profile is None:
            self.worker.update_weights(update_info)
            return
        self.profile.enable()
        try:
            self.worker.update_weights(update_info)
        finally:
            self.profile.disable()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.worker.finish_weight_update()

    def shutdown_weight_transfer_engine(self) -> None:
        self.worker.shutdown()


def connect(make: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any, DropHost]:
    from weightwire.shared.timeouts import Timeouts
    from weightwire.torch_side.worker.engines import WeightwireTCPEngine
    from weightwire.trainer import TrainerInitInfo

    engine_cls, source = make()
    metas = source.metadata()
    if len(metas) != TENSORS:
        raise SystemExit(f"expected {TENSORS} tensors, the source has {len(metas)}")
    host = DropHost()
    worker = WeightwireTCPEngine.standalone(model=host, device="cpu")
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        pause_mode=None,
        reset_prefix_cache=False,  # the worker loads into a sink: no model, no KV cache
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    engine = engine_cls.trainer_init(info, client=InProcessClient(worker), source=source)
    return engine, worker, host
