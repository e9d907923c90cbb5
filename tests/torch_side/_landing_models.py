"""Tiny vLLM-like models for the landing-map tests, each with its own ``load_weights``.

``TinyTP`` lays its parameters out as vLLM does for one tensor-parallel rank: a fused,
column-parallel ``qkv_proj`` (with bias), a row-parallel ``o_proj``, a vocab-parallel
embedding whose rows are padded (the padding is zero-filled by the loader), FusedMoE-style
stacked experts loaded one expert and one half at a time, a replicated router and norm,
and a head that is either its own vocab-parallel parameter or the embedding itself
(tied: the loader skips ``lm_head.weight``, as vLLM's does). ``Refusing`` holds one
parameter whose loader is one of the patterns the map must refuse.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

HIDDEN, INTER, EXPERTS, VOCAB, HEADS, KV, HEAD_DIM = 16, 8, 3, 10, 2, 1, 4
PADDED = 8  # vocab rows per rank, padded (VOCAB / 2 = 5 real rows)


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape), requires_grad=False)


class TinyTP(torch.nn.Module):
    def __init__(self, *, rank: int = 0, world: int = 1, tied: bool = False) -> None:
        super().__init__()
        self.rank, self.world, self.tied = rank, world, tied
        q, kv = HEADS * HEAD_DIM // world, KV * HEAD_DIM  # kv replicated (fewer kv heads than tp)
        self.qkv_sizes = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Module()
        self.model.embed_tokens.weight = _param(PADDED if world > 1 else VOCAB, HIDDEN)
        attn = torch.nn.Module()
        attn.qkv_proj = torch.nn.Module()
        attn.qkv_proj.weight = _param(q + 2 * kv, HIDDEN)
        attn.qkv_proj.bias = _param(q + 2 * kv)
        attn.o_proj = torch.nn.Module()
        attn.o_proj.weight = _param(HIDDEN, HEADS * HEAD_DIM // world)
        experts = torch.nn.Module()
        experts.w13_weight = _param(EXPERTS, 2 * INTER // world, HIDDEN)
        experts.w2_weight = _param(EXPERTS, HIDDEN, INTER // world)
        gate, norm = torch.nn.Module(), torch.nn.Module()
        gate.weight, norm.weight = _param(EXPERTS, HIDDEN), _param(HIDDEN)
        self.model.attn, self.model.experts, self.model.gate, self.model.norm = (
            attn,
            experts,
            gate,
            norm,
        )
        self.lm_head = torch.nn.Module()
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head.weight = _param(PADDED if world > 1 else VOCAB, HIDDEN)

    # ------------------------------------------------------------ loaders (vLLM-like)
    def _vocab(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        rows = VOCAB // self.world
        loaded = loaded.narrow(0, self.rank * rows, rows)
        param[: loaded.shape[0]].data.copy_(loaded)
        param[loaded.shape[0] :].data.fill_(0)

    def _qkv(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        start, size = self.qkv_sizes[shard]
        rank = self.rank if shard == "q" else 0  # kv heads replicated across ranks
        loaded = loaded.narrow(0, rank * size, size)
        param.data.narrow(0, start, size).copy_(loaded)

    def _row(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        cols = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.rank * cols, cols))

    def _expert(self, param: torch.Tensor, loaded: torch.Tensor, shard: str, expert: int) -> None:
        data = param.data[expert]
        per = INTER // self.world
        if shard == "w2":
            data.copy_(loaded.narrow(1, self.rank * per, per))
            return
        loaded = loaded.narrow(0, self.rank * per, per)
        data.narrow(0, 0 if shard == "w1" else per, per).copy_(loaded)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        m = self.model
        for name, t in weights:
            if name == "lm_head.weight" and self.tied:
                continue  # vLLM: the tied head is the embedding
            done.add(name)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                self._vocab(m.embed_tokens.weight if "embed" in name else self.lm_head.weight, t)
            elif ".self_attn." in name and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
                shard = name.split(".")[-2][0]
                leaf = name.rsplit(".", 1)[1]
                self._qkv(getattr(m.attn.qkv_proj, leaf), t, shard)
            elif name.endswith("o_proj.weight"):
                self._row(m.attn.o_proj.weight, t)
            elif ".experts." in name:
                parts = name.split(".")
                expert, proj = int(parts[-3]), parts[-2]
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                target = m.experts.w2_weight if shard == "w2" else m.experts.w13_weight
                self._expert(target, t, shard, expert)
            elif name == "model.mlp.gate.weight":
                m.gate.weight.data.copy_(t)
            elif name == "model.norm.weight":
                m.norm.weight.data.copy_(t)
            else:
                raise ValueError(f"unknown weight {name}")
        return done


def tiny_tp_shapes() -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of ``TinyTP``'s checkpoint."""
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": (KV * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": (KV * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
        "model.layers.0.self_attn.k_proj.bias": (KV * HEAD_DIM,),
        "model.layers.0.self_attn.v_proj.bias": (KV * HEAD_DIM,),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        "model.mlp.gate.weight": (EXPERTS, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for e in range(EXPERTS):
        p = f"model.mlp.experts.{e}."
        out[p + "gate_proj.weight"] = (INTER, HIDDEN)
        out[p + "up_proj.weight"] = (INTER, HIDDEN)
        out[p + "down_proj.weight"] = (HIDDEN, INTER)
    return out


LOADERS: dict[str, Any] = {
    "computes": lambda p, t: p.data.copy_(t * 2),
    "setitem": lambda p, t: p.data.__setitem__(slice(None), t),
    "transposes": lambda p, t: p.data.copy_(t.t().contiguous()),
    "item": lambda p, t: p.data.fill_(t[0, 0].item()),
    "twice": lambda p, t: (p.data.copy_(t), p.data.narrow(0, 0, 1).copy_(t[:1])),
    "partly": lambda p, t: p.data.narrow(0, 0, 2).copy_(t[:2]),
    "temporary": lambda p, t: p.data.copy_(torch.empty_like(p).copy_(t)),
    "concatenates": lambda p, t: p.data.copy_(torch.cat([t[:2], t[2:]])),
    "casts": lambda p, t: p.data.copy_(t.to(torch.float16)),
    "rebinds": lambda p, t: setattr(p, "data", t),
    "swallows": lambda p, t: _swallowing(p, t),
}


def _swallowing(p: torch.Tensor, t: torch.Tensor) -> None:
    """A loader that catches what its arithmetic raised and loads anyway."""
    try:
        p.data.copy_(t + 1)
    except Exception:
        p.data.copy_(t)


class Refusing(torch.nn.Module):
    """One 4x4 ``w.weight`` loaded from ``w.weight`` by ``LOADERS[kind]`` (4x4 wire: 4 x 4,
    except ``transposes``, whose checkpoint is stored transposed)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.w = torch.nn.Module()
        self.w.weight = _param(4, 4)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            LOADERS[self.kind](self.w.weight, t)
