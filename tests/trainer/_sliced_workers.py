"""In-process ``weightwire_tcp`` workers hosting ``SlicedTP`` ranks, behind one client.

``TPClient`` fans the trainer's calls out to ``world`` standalone TCP engines (one thread
each: the workers join, warm up and receive concurrently, as a server's TP workers do), each
loading into its own ``SlicedTP`` rank, with the checkpoint's spec so that it tells the
trainer its wants. ``received`` keeps every worker's payload bytes of the last update (its
``last_stats``, what a server reports).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tests.torch_side._sliced_models import SlicedTP, sliced_shapes
from weightwire.torch_side.worker.engines import WeightwireTCPEngine
from weightwire.torch_side.worker.spec import ModelSpec, TensorSpec

Config = tuple[int, int, int, bool, bool]  # (world, heads, kv_heads, expert_parallel, tied)


def shapes_of(config: Config) -> dict[str, tuple[int, ...]]:
    world, heads, kv, _, tied = config
    shapes = sliced_shapes(heads, kv)
    if tied:
        del shapes["lm_head.weight"]
    return shapes


def make(config: Config, rank: int, seed: int = 0) -> SlicedTP:
    world, heads, kv, ep, tied = config
    torch.manual_seed(seed + rank)
    return SlicedTP(rank=rank, world=world, heads=heads, kv_heads=kv, tied=tied, expert_parallel=ep)


def spec_of(config: Config) -> ModelSpec:
    return ModelSpec({n: TensorSpec(s, "float32") for n, s in shapes_of(config).items()})


def expected(config: Config, full: dict[str, np.ndarray], rank: int) -> dict[str, torch.Tensor]:
    """What ``load_weights`` of the full tensors leaves in rank ``rank``'s parameters."""
    model = make(config, rank, seed=99)
    model.load_weights([(n, torch.from_numpy(np.array(a))) for n, a in full.items()])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


VLLM_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "qkv_proj.weight": "model.layers.0.self_attn.qkv_proj.weight",
    "qkv_proj.bias": "model.layers.0.self_attn.qkv_proj.bias",
    "o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
    "gate_up_proj.weight": "model.layers.0.mlp.gate_up_proj.weight",
    "down_proj.weight": "model.layers.0.mlp.down_proj.weight",
    "router.weight": "model.layers.1.mlp.gate.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
"""``SlicedTP``'s parameters as a vLLM Llama / Qwen-MoE names them (its checker's keys)."""


class TPClient:
    """The weight-sync calls a trainer makes, answered by ``world`` in-process workers."""

    def __init__(
        self,
        config: Config,
        *,
        spec: bool = True,
        model: Callable[[Config, int], torch.nn.Module] = make,
        engine: type[Any] = WeightwireTCPEngine,
        ranks: list[int] | None = None,
        devices: list[str] | None = None,
        model_spec: Callable[[], ModelSpec] | None = None,
    ) -> None:
        """``ranks``: the TP ranks hosted (default all), the group's workers in that order;
        ``devices``: each one's device (default CPU); ``model_spec``: the served checkpoint
        the workers tell their wants of (default ``spec_of(config)``)."""
        self.config = config
        self.ranks = list(range(config[0])) if ranks is None else ranks
        world = len(self.ranks)
        devices = devices or ["cpu"] * world
        self.models = [model(config, r).to(d) for r, d in zip(self.ranks, devices, strict=True)]
        self.engines = [
            engine(
                model=m,
                device=d,
                worker_rank=i,
                spec=(model_spec or (lambda: spec_of(config))) if spec else None,
            )
            for i, (m, d) in enumerate(zip(self.models, devices, strict=True))
        ]
        self.received: list[int] = [0] * world
        self.updates = 0
        self.before_update: Callable[[int], None] | None = None
        self.before_finish: Callable[[], None] | None = None
        self.after_finish: Callable[[], None] | None = None
        self._pool = cf.ThreadPoolExecutor(max_workers=world, thread_name_prefix="tp-worker")

    def _all(self, call: Callable[[int, WeightwireTCPEngine], Any]) -> None:
        futures = [self._pool.submit(call, r, e) for r, e in enumerate(self.engines)]
        errors = [f.exception(timeout=120) for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def version(self) -> str:
        return "0.33.0"

    def get_world_size(self) -> int:
        return len(self.engines)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.init_info = dict(init_info)
        self._all(lambda r, e: e.init_transfer_engine(e.parse_init_info(dict(init_info))))

    def start_weight_update(self) -> None:
        self._all(lambda r, e: e.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.last_update = dict(update_info)
        self.updates += 1
        if self.before_update is not None:
            self.before_update(self.updates)

        def one(r: int, e: WeightwireTCPEngine) -> None:
            e.update_weights(dict(update_info))
            stats = e.last_stats
            self.received[r] = stats.nbytes if stats is not None else 0

        self._all(one)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.before_finish is not None:
            self.before_finish()
        self._all(lambda r, e: e.finish_weight_update())
        if self.after_finish is not None:
            self.after_finish()

    def shutdown_weight_transfer_engine(self) -> None:
        """The trainer's reopen after a refused round (a delta round's dense retry)."""
        self._all(lambda r, e: e.shutdown())

    def reset_prefix_cache(self) -> None:
        return None

    def pause(self, mode: str = "keep") -> None:
        return None

    def resume(self) -> None:
        return None

    def weight_checker(self, action: str) -> list[dict[str, Any]]:
        """vLLM's per-shard checksums (``dp0:pp0:pcp0:tp{rank}:<param>``) of every worker's
        parameters under vLLM's names (the experts are not covered)."""
        assert action == "checksum"
        sums = {}
        for rank, model in enumerate(self.models):
            for name, param in model.named_parameters():
                if name in VLLM_NAMES:
                    data = param.detach().contiguous().numpy().tobytes()
                    key = f"dp0:pp0:pcp0:tp{rank}:{VLLM_NAMES[name]}"
                    sums[key] = hashlib.sha256(data).hexdigest()
        return [{"checksums": sums}]

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
        self._pool.shutdown(wait=False)

    def params(self, index: int) -> dict[str, torch.Tensor]:
        """The parameters of the ``index``-th hosted worker, on the CPU."""
        return {n: p.detach().cpu().clone() for n, p in self.models[index].named_parameters()}
