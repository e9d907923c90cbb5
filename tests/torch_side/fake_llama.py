"""vLLM's Llama parameter layout in plain torch, for tests that need vLLM's loading without vLLM.

``FakeLlama`` fuses ``qkv_proj`` and ``gate_up_proj`` as vLLM does, and its ``load_weights``
maps Hugging Face names onto shards and narrows and copies like vLLM's loaders; ``digest`` and
``trainer_tensors`` are the two sides of a round's byte-for-byte check.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from weightwire.tools.server.scaled import llama_shapes

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, head dim, vocab
    "llama3-8b": (4096, 14336, 32, 32, 8, 128, 128256),
    "qwen2-0.5b": (896, 4864, 24, 14, 2, 64, 151936),
    "small": (256, 688, 4, 8, 2, 32, 4096),  # benchmarks/bench_delta.py's CPU shape
    "tiny": (64, 160, 3, 4, 2, 16, 96),
    # Llama-3-8B's 291 tensors at tiny sizes: a round's per-tensor host cost on a CPU
    "tiny32": (64, 160, 32, 4, 2, 16, 96),
}


def hf_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama names and shapes, in checkpoint order (layer by layer)."""
    hidden, inter, layers, heads, kv, hd, vocab = SHAPES[shape]
    config = {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
    }
    return llama_shapes(vocab, config)


# HF suffix -> (fused parameter suffix, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class _Linear(torch.nn.Module):
    """One parameter with a vLLM-style loader: ``shards`` maps a shard id to its rows."""

    def __init__(
        self,
        rows: int,
        cols: int | None,
        shards: dict[Any, tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (rows,) if cols is None else (rows, cols)
        self.weight = torch.nn.Parameter(
            torch.zeros(shape, dtype=dtype, device=device), requires_grad=False
        )
        self.shards = shards
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if shard is None:
            if param.shape != loaded.shape:
                raise ValueError(
                    f"shape mismatch: parameter {list(param.shape)}, loaded {list(loaded.shape)}"
                )
            param.data.copy_(loaded)
            return
        start, size = self.shards[shard]
        if loaded.shape[0] != size:
            raise ValueError(f"shard {shard!r} expects {size} rows, got {loaded.shape[0]}")
        param.data.narrow(0, start, size).copy_(loaded)


class FakeLlama(torch.nn.Module):
    """vLLM's Llama parameter layout: ``model.layers.i.self_attn.qkv_proj.weight`` and so on."""

    def __init__(
        self, shape: str, dtype: torch.dtype, device: torch.device, tied: bool = False
    ) -> None:
        super().__init__()
        self.shape, self.tied = shape, tied
        hidden, inter, layers, heads, kv, hd, vocab = SHAPES[shape]
        q, k = heads * hd, kv * hd
        self.params: dict[str, _Linear] = {}
        mods: dict[str, _Linear] = {"model.embed_tokens": _Linear(vocab, hidden, {}, dtype, device)}
        for i in range(layers):
            p = f"model.layers.{i}."
            mods[p + "self_attn.qkv_proj"] = _Linear(
                q + 2 * k, hidden, {"q": (0, q), "k": (q, k), "v": (q + k, k)}, dtype, device
            )
            mods[p + "self_attn.o_proj"] = _Linear(hidden, q, {}, dtype, device)
            mods[p + "mlp.gate_up_proj"] = _Linear(
                2 * inter, hidden, {0: (0, inter), 1: (inter, inter)}, dtype, device
            )
            mods[p + "mlp.down_proj"] = _Linear(hidden, inter, {}, dtype, device)
            mods[p + "input_layernorm"] = _Linear(hidden, None, {}, dtype, device)
            mods[p + "post_attention_layernorm"] = _Linear(hidden, None, {}, dtype, device)
        mods["model.norm"] = _Linear(hidden, None, {}, dtype, device)
        mods["lm_head"] = _Linear(vocab, hidden, {}, dtype, device)
        if tied:  # one parameter under two names, as vLLM ties a head to its embedding
            mods["lm_head"].weight = mods["model.embed_tokens"].weight
        self.layers = torch.nn.ModuleList(mods.values())
        self.params = {name + ".weight": mod for name, mod in mods.items()}

    def locate(self, hf_name: str) -> tuple[_Linear, Any]:
        """The module holding ``hf_name`` and its shard id (``None``: the whole parameter)."""
        prefix, _, leaf = hf_name.rpartition(".")  # leaf: "weight"
        owner, _, kind = prefix.rpartition(".")
        if kind in _STACKED:
            fused, shard = _STACKED[kind]
            return self.params[f"{owner}.{fused}.{leaf}"], shard
        if hf_name not in self.params:
            raise ValueError(f"unknown weight name {hf_name!r}")
        return self.params[hf_name], None

    def hf_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The checkpoint's tensors (a tied checkpoint has no ``lm_head.weight``)."""
        shapes = hf_shapes(self.shape)
        if self.tied:
            del shapes["lm_head.weight"]
        return {n: (s, "bfloat16") for n, s in shapes.items()}

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if self.tied and name == "lm_head.weight":
                continue  # vLLM's tied models skip it: the embedding is the head
            mod, shard = self.locate(name)
            mod.weight.weight_loader(mod.weight, tensor, *(() if shard is None else (shard,)))  # type: ignore[attr-defined]
            loaded.add(name)
        return loaded

    def hf_view(self, hf_name: str) -> torch.Tensor:
        mod, shard = self.locate(hf_name)
        if shard is None:
            return mod.weight.data
        start, size = mod.shards[shard]
        return mod.weight.data.narrow(0, start, size)


def digest(t: torch.Tensor) -> list[int]:
    """Two sums over a tensor's 16-bit words (plain and position-weighted), on its device, in
    blocks: equal digests on both sides of a round mean every byte landed in its place."""
    words = t.detach().contiguous().view(-1).view(torch.int16)
    plain = weighted = 0
    block = 1 << 26
    for start in range(0, words.numel(), block):
        w = words[start : start + block].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        plain += int(w.sum())
        weighted += int((w * pos).sum())
    return [plain, weighted]


def trainer_tensors(
    shape: str, device: torch.device, seed: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """A round's bf16 tensors (fresh values per ``seed``), in checkpoint order."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, dims in hf_shapes(shape).items():
        yield (
            name,
            torch.randn(dims, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16),
        )


def copy_floor_s(
    model: FakeLlama, shape: str, device: torch.device, reps: int, batched: bool = False
) -> float:
    """Seconds for one device copy of a round's bytes into the serving parameters: every
    Hugging Face tensor, from one contiguous source buffer, into its slice of the fused
    parameters (CUDA events, median of ``reps`` after one warm-up). What no transfer can
    beat: the bytes have to land there once. ``batched``: the contiguous slices as one
    gather launch (``backends.ipc.gather``: tensors under 64 MiB in one kernel, larger ones
    a memcpy each), as the write-through round copies them, instead of a ``copy_`` each
    (a launch per tensor: on a 0.5B set most of the floor is launch overhead)."""
    views = [model.hf_view(name) for name in model.hf_specs()]
    total = sum(v.numel() for v in views)
    src = torch.empty(total, dtype=torch.bfloat16, device=device)
    times = []
    cuda = device.type == "cuda"
    if batched and cuda:
        return _batched_floor_s(views, src, device, reps)
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            if cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            off = 0
            for v in views:
                v.copy_(src[off : off + v.numel()].view(v.shape))
                off += v.numel()
            if cuda:
                end.record()
                end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 if cuda else time.perf_counter() - t0)
    finally:
        del src
        if cuda:
            torch.cuda.empty_cache()
    return sorted(times[1:])[len(times[1:]) // 2]


def _batched_floor_s(
    views: list[torch.Tensor], src: torch.Tensor, device: torch.device, reps: int
) -> float:
    import cupy as cp

    from weightwire.backends.ipc.gather import GatherCopy

    stream = torch.cuda.current_stream(device)
    gather = GatherCopy(cp, device.index or 0, stream.cuda_stream)
    item = src.element_size()
    rows: tuple[list[int], list[int], list[int]] = ([], [], [])
    alone = []  # a slice that is not contiguous: its own copy_
    off = 0
    for v in views:
        if v.is_contiguous():
            rows[0].append(src.data_ptr() + off * item)
            rows[1].append(v.data_ptr())
            rows[2].append(v.numel() * item)
        else:
            alone.append((v, off))
        off += v.numel()
    times = []
    try:
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gather.copy_rows(*rows, deadline=time.monotonic() + 60, alive=lambda: None)
            for v, at in alone:
                v.copy_(src[at : at + v.numel()].view(v.shape))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    finally:
        stream.synchronize()
        gather.close()
        del src
        torch.cuda.empty_cache()
    return sorted(times[1:])[len(times[1:]) // 2]
