"""A vLLM-shaped model for one tensor-parallel rank, for the wants tests.

``SlicedTP(rank, world, heads, kv_heads, tied, expert_parallel)`` lays out and loads its
parameters as vLLM's layers do: a vocab-parallel embedding and head (rows padded to a
multiple of ``world``, the padding zero-filled), a fused ``qkv_proj`` (q heads split over
the ranks; KV heads split too, or, when fewer than ranks, each replicated on
``world // kv_heads`` ranks), a row-parallel ``o_proj``, a fused ``gate_up_proj`` and
row-parallel ``down_proj``, FusedMoE-style stacked experts (either each expert's
matrices split over the ranks, or whole experts split over the ranks: expert
parallelism), a replicated router and norm, and a head tied to the embedding or not.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

HIDDEN, HEAD_DIM, INTER, EXPERTS, VOCAB = 8, 2, 8, 4, 11


def _param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape), requires_grad=False)


class SlicedTP(torch.nn.Module):
    def __init__(
        self,
        *,
        rank: int,
        world: int,
        heads: int = 8,
        kv_heads: int = 2,
        tied: bool = False,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.rank, self.world, self.tied, self.ep = rank, world, tied, expert_parallel
        self.vocab_rows = -(-VOCAB // world)
        self.q_rows = heads * HEAD_DIM // world
        if kv_heads >= world:
            self.kv_rows, self.kv_start = kv_heads * HEAD_DIM // world, rank
        else:  # fewer KV heads than ranks: each head replicated on world // kv_heads ranks
            self.kv_rows, self.kv_start = HEAD_DIM, rank // (world // kv_heads)
        self.inter = INTER // world
        self.embed = torch.nn.Module()
        self.embed.weight = _param(self.vocab_rows, HIDDEN)
        self.qkv_proj = torch.nn.Module()
        self.qkv_proj.weight = _param(self.q_rows + 2 * self.kv_rows, HIDDEN)
        self.qkv_proj.bias = _param(self.q_rows + 2 * self.kv_rows)
        self.o_proj = torch.nn.Module()
        self.o_proj.weight = _param(HIDDEN, self.q_rows)
        self.gate_up_proj = torch.nn.Module()
        self.gate_up_proj.weight = _param(2 * self.inter, HIDDEN)
        self.down_proj = torch.nn.Module()
        self.down_proj.weight = _param(HIDDEN, self.inter)
        self.experts = torch.nn.Module()
        if expert_parallel:
            local = EXPERTS // world
            self.experts.w13_weight = _param(local, 2 * INTER, HIDDEN)
            self.experts.w2_weight = _param(local, HIDDEN, INTER)
        else:
            self.experts.w13_weight = _param(EXPERTS, 2 * self.inter, HIDDEN)
            self.experts.w2_weight = _param(EXPERTS, HIDDEN, self.inter)
        self.router = torch.nn.Module()
        self.router.weight = _param(EXPERTS, HIDDEN)
        self.norm = torch.nn.Module()
        self.norm.weight = _param(HIDDEN)
        self.lm_head = torch.nn.Module()
        if tied:
            self.lm_head.weight = self.embed.weight
        else:
            self.lm_head.weight = _param(self.vocab_rows, HIDDEN)

    # ------------------------------------------------------------ loaders (vLLM-like)
    def _vocab(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        start = self.rank * self.vocab_rows
        n = max(0, min(VOCAB - start, self.vocab_rows))
        if n:
            param.data[:n].copy_(loaded.narrow(0, start, n))
        if n < self.vocab_rows:
            param.data[n:].fill_(0)

    def _qkv(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        if shard == "q":
            at, size, index = 0, self.q_rows, self.rank
        else:
            at = self.q_rows + (0 if shard == "k" else self.kv_rows)
            size, index = self.kv_rows, self.kv_start
        param.data.narrow(0, at, size).copy_(loaded.narrow(0, index * size, size))

    def _gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        rows = param.shape[0] // 2
        param.data.narrow(0, shard * rows, rows).copy_(loaded.narrow(0, self.rank * rows, rows))

    def _row(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        cols = param.shape[-1]
        param.data.copy_(loaded.narrow(1, self.rank * cols, cols))

    def _expert(self, loaded: torch.Tensor, proj: str, expert: int) -> None:
        w13, w2 = self.experts.w13_weight.data, self.experts.w2_weight.data
        if self.ep:
            local = EXPERTS // self.world
            if expert // local != self.rank:
                return  # another rank's expert
            e = expert % local
            if proj == "down_proj":
                w2[e].copy_(loaded)
            else:
                w13[e].narrow(0, 0 if proj == "gate_proj" else INTER, INTER).copy_(loaded)
            return
        if proj == "down_proj":
            self._row(w2[expert], loaded)
        else:
            half = 0 if proj == "gate_proj" else 1
            w13[expert].narrow(0, half * self.inter, self.inter).copy_(
                loaded.narrow(0, self.rank * self.inter, self.inter)
            )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, t in weights:
            if name == "lm_head.weight" and self.tied:
                continue  # vLLM: the tied head is the embedding
            done.add(name)
            parts = name.split(".")
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                self._vocab(self.embed.weight if "embed" in name else self.lm_head.weight, t)
            elif parts[-2] in ("q_proj", "k_proj", "v_proj"):
                self._qkv(getattr(self.qkv_proj, parts[-1]), t, parts[-2][0])
            elif parts[-2] == "o_proj":
                self._row(self.o_proj.weight, t)
            elif ".experts." in name:
                self._expert(t, parts[-2], int(parts[-3]))
            elif parts[-2] in ("gate_proj", "up_proj"):
                self._gate_up(self.gate_up_proj.weight, t, 0 if parts[-2] == "gate_proj" else 1)
            elif parts[-2] == "down_proj":
                self._row(self.down_proj.weight, t)
            elif name == "model.layers.1.mlp.gate.weight":
                self.router.weight.data.copy_(t)
            elif name == "model.norm.weight":
                self.norm.weight.data.copy_(t)
            else:
                raise ValueError(f"unknown weight {name}")
        return done


def sliced_shapes(heads: int = 8, kv_heads: int = 2) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of ``SlicedTP``'s checkpoint."""
    attn = "model.layers.0.self_attn."
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        attn + "q_proj.weight": (heads * HEAD_DIM, HIDDEN),
        attn + "k_proj.weight": (kv_heads * HEAD_DIM, HIDDEN),
        attn + "v_proj.weight": (kv_heads * HEAD_DIM, HIDDEN),
        attn + "q_proj.bias": (heads * HEAD_DIM,),
        attn + "k_proj.bias": (kv_heads * HEAD_DIM,),
        attn + "v_proj.bias": (kv_heads * HEAD_DIM,),
        attn + "o_proj.weight": (HIDDEN, heads * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": (INTER, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (INTER, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, INTER),
        "model.layers.1.mlp.gate.weight": (EXPERTS, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for e in range(EXPERTS):
        p = f"model.layers.1.mlp.experts.{e}."
        out[p + "gate_proj.weight"] = (INTER, HIDDEN)
        out[p + "up_proj.weight"] = (INTER, HIDDEN)
        out[p + "down_proj.weight"] = (HIDDEN, INTER)
    return out


# ------------------------------------------------------------------ the FP8 sibling
FP8_HIDDEN, FP8_BLOCK = 256, 128


def _fp8_param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(*shape).to(torch.float8_e4m3fn), requires_grad=False)


def _covering(start: int, stop: int, block: int) -> tuple[int, int]:
    """The block rows (or columns) rows ``[start, stop)`` touch: ``(first, count)``."""
    first = start // block
    return first, -(-stop // block) - first


class Fp8SlicedTP(torch.nn.Module):
    """One TP rank of a block-FP8 decoder layer as vLLM's FP8 linears hold it: each linear's
    ``weight`` in e4m3 beside ``weight_scale_inv`` (float32, one per 128 x 128 block), both
    narrowed along the same dim by the layer's loader (a fused ``qkv_proj``, a row-parallel
    ``o_proj``, column-parallel ``gate_proj`` / ``up_proj``, a row-parallel ``down_proj``),
    and a replicated float32 norm that is not quantized.

    ``inter``: the MLP width. A multiple of ``128 * world`` splits on block boundaries
    (what vLLM's ``validate_fp8_block_shape`` asks); otherwise a rank's rows (or columns)
    cut a block, and its scale holds every block its rows touch: the block at the cut is
    read by both ranks (a loader that reads what its own rows were scaled by).

    ``layers=2``: a second decoder layer of an MLP alone (``gate_proj_1`` ...), what a
    partial round can leave out whole."""

    def __init__(self, *, rank: int, world: int, inter: int = 512, layers: int = 1) -> None:
        super().__init__()
        self.rank, self.world, self.inter, self.layers = rank, world, inter, layers
        part = FP8_HIDDEN // world  # q, k, v each FP8_HIDDEN rows: split on blocks
        self.part = part
        self.mlp = inter // world
        self.qkv_proj = torch.nn.Module()
        self.qkv_proj.weight = _fp8_param(3 * part, FP8_HIDDEN)
        self.qkv_proj.weight_scale_inv = _param(3 * part // FP8_BLOCK, FP8_HIDDEN // FP8_BLOCK)
        self.o_proj = torch.nn.Module()
        self.o_proj.weight = _fp8_param(FP8_HIDDEN, part)
        self.o_proj.weight_scale_inv = _param(FP8_HIDDEN // FP8_BLOCK, part // FP8_BLOCK)
        _, blocks = _covering(rank * self.mlp, (rank + 1) * self.mlp, FP8_BLOCK)
        for suffix in ["", *(f"_{i}" for i in range(1, layers))]:
            for proj in ("gate_proj", "up_proj"):
                module = torch.nn.Module()
                module.weight = _fp8_param(self.mlp, FP8_HIDDEN)
                module.weight_scale_inv = _param(blocks, FP8_HIDDEN // FP8_BLOCK)
                setattr(self, proj + suffix, module)
            down = torch.nn.Module()
            down.weight = _fp8_param(FP8_HIDDEN, self.mlp)
            down.weight_scale_inv = _param(FP8_HIDDEN // FP8_BLOCK, blocks)
            setattr(self, "down_proj" + suffix, down)
        self.norm = torch.nn.Module()
        self.norm.weight = _param(FP8_HIDDEN)

    def _split(self, param: torch.Tensor, loaded: torch.Tensor, dim: int, size: int) -> None:
        """Rows (dim 0) or columns (dim 1) ``[rank * size, (rank + 1) * size)`` of a weight,
        or, for its scale, the blocks those touch."""
        start = self.rank * size
        if loaded.dtype == torch.float32:  # the scale
            start, size = _covering(start, start + size, FP8_BLOCK)
        param.data.copy_(loaded.narrow(dim, start, size))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, t in weights:
            done.add(name)
            parts = name.split(".")
            proj, leaf = parts[-2], parts[-1]
            if parts[1] == "layers" and parts[2] != "0":
                proj += f"_{parts[2]}"  # a later layer's MLP
            if name == "model.norm.weight":
                self.norm.weight.data.copy_(t)
            elif proj in ("q_proj", "k_proj", "v_proj"):
                param = getattr(self.qkv_proj, leaf)
                shard = "qkv".index(proj[0])
                rows = self.part if leaf == "weight" else self.part // FP8_BLOCK
                at = param.data.narrow(0, shard * rows, rows)
                at.copy_(t.narrow(0, self.rank * rows, rows))
            elif proj == "o_proj":
                self._split(getattr(self.o_proj, leaf), t, 1, self.part)
            elif proj.startswith(("gate_proj", "up_proj")):
                self._split(getattr(getattr(self, proj), leaf), t, 0, self.mlp)
            elif proj.startswith("down_proj"):
                self._split(getattr(getattr(self, proj), leaf), t, 1, self.mlp)
            else:
                raise ValueError(f"unknown weight {name}")
        return done


def fp8_sliced_shapes(inter: int = 512, layers: int = 1) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of ``Fp8SlicedTP``'s bf16 weights (the trainer's: each
    ``X.weight`` but the norm goes as its e4m3 weight and ``weight_scale_inv``)."""
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    later = {}
    for i in range(1, layers):
        p = f"model.layers.{i}.mlp."
        later[p + "gate_proj.weight"] = (inter, FP8_HIDDEN)
        later[p + "up_proj.weight"] = (inter, FP8_HIDDEN)
        later[p + "down_proj.weight"] = (FP8_HIDDEN, inter)
    return {
        attn + "q_proj.weight": (FP8_HIDDEN, FP8_HIDDEN),
        attn + "k_proj.weight": (FP8_HIDDEN, FP8_HIDDEN),
        attn + "v_proj.weight": (FP8_HIDDEN, FP8_HIDDEN),
        attn + "o_proj.weight": (FP8_HIDDEN, FP8_HIDDEN),
        mlp + "gate_proj.weight": (inter, FP8_HIDDEN),
        mlp + "up_proj.weight": (inter, FP8_HIDDEN),
        mlp + "down_proj.weight": (FP8_HIDDEN, inter),
        **later,
        "model.norm.weight": (FP8_HIDDEN,),
    }
