"""Adapters for the tiny Llama and their Hugging Face + PEFT reference (shared by the
reference-server and the real-vLLM adapter tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import torch

from weightwire.shared.lora import parse_name
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource

RANK, ALPHA = 4, 8.0
HIDDEN, INTER, KV = 64, 128, 32  # the tiny Llama's sizes (tools/server/tiny.py)
SHAPES = {  # module -> (in, out)
    "self_attn/q_proj": (HIDDEN, HIDDEN),
    "self_attn/k_proj": (HIDDEN, KV),
    "self_attn/v_proj": (HIDDEN, KV),
    "self_attn/o_proj": (HIDDEN, HIDDEN),
    "mlp/gate_proj": (HIDDEN, INTER),
    "mlp/up_proj": (HIDDEN, INTER),
    "mlp/down_proj": (INTER, HIDDEN),
}
TARGETS = sorted(m.rsplit("/", 1)[1] for m in SHAPES)
LAYERS = 2


def base_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_model(model_dir: str, rank: int = RANK) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    return get_peft_model(base_model(model_dir), config).eval()


def jax_adapter(seed: int, rank: int = RANK) -> dict[str, Any]:
    """A random adapter tree for every projection of every layer (B is not zero: the
    adapter changes the model's output)."""
    key = jax.random.key(seed)
    layers = []
    for _ in range(LAYERS):
        layer: dict[str, dict[str, dict[str, jax.Array]]] = {"self_attn": {}, "mlp": {}}
        for path, (fin, fout) in SHAPES.items():
            block, proj = path.split("/")
            key, ka, kb = jax.random.split(key, 3)
            layer[block][proj] = {
                "lora_a": 0.2 * jax.random.normal(ka, (fin, rank)),
                "lora_b": 0.2 * jax.random.normal(kb, (rank, fout)),
            }
        layers.append(layer)
    return {"model": {"layers": layers}}


def into_peft(model: Any, source: WeightSource) -> None:
    """The PEFT reference gets exactly the tensors the source sends (every one of them)."""
    state = model.state_dict()
    loaded = 0
    for name, tensor in source:
        parsed = parse_name(name)
        assert parsed is not None
        key = f"base_model.model.{parsed.module}.lora_{parsed.ab}.default.weight"
        state[key].copy_(torch.from_numpy(np.array(tensor)))
        loaded += 1
    assert loaded == len(SHAPES) * 2 * LAYERS


def randomize_peft(model: Any, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


class Breaking(WeightSource):
    """The inner source's tensors, failing after ``after`` of them (a trainer dying
    mid-round)."""

    def __init__(self, inner: WeightSource, after: int) -> None:
        self.inner, self.after = inner, after

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, pair in enumerate(self.inner):
            if i == self.after:
                raise RuntimeError("trainer died mid-round")
            yield pair
