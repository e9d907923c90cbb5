"""More vLLM-shaped models for the stub worker (``vllm_stub --model``), beside ``FakeLlama``.

- ``FakeMoE``: fused experts laid out as vLLM's ``FusedMoE`` (``w13_weight``
  ``[experts, 2 * inter, hidden]`` with gate and up stacked per expert, ``w2_weight``
  ``[experts, hidden, inter]``), loaded per expert and shard by a ``weight_loader(param,
  loaded, shard, expert)``, plus a router and a norm.
- ``DTypeModel``: one parameter per wire dtype (odd sizes: unaligned bytes), a float32
  tensor cast into a bfloat16 parameter, one loaded transposed and two loaded into the
  column halves of one parameter (strided copies).

Each has ``hf_specs()`` (Hugging Face name -> shape, dtype), ``load_weights``, and
``hf_view(name)`` (where the tensor's values sit in the parameters, for digests), and
``hf_tensors(model, device, seed)`` makes a round's tensors for the trainer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

MOE = {"layers": 2, "experts": 4, "hidden": 64, "inter": 48}
DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int8",
    "uint8",
    "int32",
    "int64",
    "float8_e4m3fn",
    "float8_e5m2",
    "bool",
)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    return torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


def _plain(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


class _Holder(torch.nn.Module):
    """One module per parameter (the fake layerwise reload works per module)."""

    def __init__(self, param: torch.nn.Parameter, loader: Any = _plain) -> None:
        super().__init__()
        self.weight = param
        param.weight_loader = loader  # type: ignore[attr-defined]


class FakeMoE(torch.nn.Module):
    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        n, e, h, i = MOE["layers"], MOE["experts"], MOE["hidden"], MOE["inter"]
        mods: dict[str, torch.nn.Module] = {}
        for layer in range(n):
            p = f"model.layers.{layer}.mlp."
            mods[p + "experts.w13"] = _Holder(_param((e, 2 * i, h), dtype, device), self._w13)
            mods[p + "experts.w2"] = _Holder(_param((e, h, i), dtype, device), self._w2)
            mods[p + "gate"] = _Holder(_param((e, h), dtype, device))
        mods["model.norm"] = _Holder(_param((h,), dtype, device))
        self.mods = mods
        self.layers = torch.nn.ModuleList(mods.values())

    @staticmethod
    def _w13(param: torch.Tensor, loaded: torch.Tensor, shard: str, expert: int) -> None:
        inter = loaded.shape[0]
        start = 0 if shard == "w1" else inter
        param.data[expert].narrow(0, start, inter).copy_(loaded)

    @staticmethod
    def _w2(param: torch.Tensor, loaded: torch.Tensor, shard: str, expert: int) -> None:
        param.data[expert].copy_(loaded)

    def hf_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        n, e, h, i = MOE["layers"], MOE["experts"], MOE["hidden"], MOE["inter"]
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for layer in range(n):
            p = f"model.layers.{layer}.mlp."
            for x in range(e):
                out[p + f"experts.{x}.gate_proj.weight"] = ((i, h), "bfloat16")
                out[p + f"experts.{x}.up_proj.weight"] = ((i, h), "bfloat16")
                out[p + f"experts.{x}.down_proj.weight"] = ((h, i), "bfloat16")
            out[p + "gate.weight"] = ((e, h), "bfloat16")
        out["model.norm.weight"] = ((h,), "bfloat16")
        return out

    def _locate(self, name: str) -> tuple[torch.nn.Parameter, tuple[Any, ...], Any]:
        parts = name.split(".")
        if ".experts." in name:
            layer, expert, proj = parts[2], int(parts[5]), parts[6]
            p = f"model.layers.{layer}.mlp.experts."
            if proj == "down_proj":
                w = self.mods[p + "w2"].weight
                return w, ("w2", expert), lambda v: w.data[expert]
            w = self.mods[p + "w13"].weight
            inter = MOE["inter"]
            start = 0 if proj == "gate_proj" else inter
            shard = "w1" if proj == "gate_proj" else "w3"
            return w, (shard, expert), lambda v: w.data[expert].narrow(0, start, inter)
        w = self.mods[name.removesuffix(".weight")].weight
        return w, (), lambda v: w.data

    def load_weights(self, weights: Any) -> set[str]:
        done = set()
        for name, tensor in weights:
            w, extra, _ = self._locate(name)
            w.weight_loader(w, tensor, *extra)  # type: ignore[attr-defined]
            done.add(name)
        return done

    def hf_view(self, name: str) -> torch.Tensor:
        _, _, view = self._locate(name)
        return view(None)


class DTypeModel(torch.nn.Module):
    ROWS, COLS = 5, 33

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        mods: dict[str, torch.nn.Module] = {}
        for name in DTYPES:
            mods[f"d.{name}"] = _Holder(
                _param((self.ROWS, self.COLS), getattr(torch, name), device)
            )
        mods["cast"] = _Holder(_param((self.ROWS, self.COLS), torch.bfloat16, device))
        mods["transposed"] = _Holder(_param((8, 6), torch.bfloat16, device), self._transposed)
        mods["halves"] = _Holder(_param((4, 16), torch.float32, device), self._half)
        self.mods = mods
        self.layers = torch.nn.ModuleList(mods.values())

    @staticmethod
    def _transposed(param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.t())

    @staticmethod
    def _half(param: torch.Tensor, loaded: torch.Tensor, half: int) -> None:
        param.data.narrow(1, 8 * half, 8).copy_(loaded)

    def hf_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        out = {f"d.{n}.weight": ((self.ROWS, self.COLS), n) for n in DTYPES}
        out["cast.weight"] = ((self.ROWS, self.COLS), "float32")
        out["transposed.weight"] = ((6, 8), "bfloat16")
        out["halves.0.weight"] = ((4, 8), "float32")
        out["halves.1.weight"] = ((4, 8), "float32")
        return out

    def load_weights(self, weights: Any) -> set[str]:
        done = set()
        for name, tensor in weights:
            if name.startswith("halves."):
                w = self.mods["halves"].weight
                w.weight_loader(w, tensor, int(name.split(".")[1]))  # type: ignore[attr-defined]
            else:
                w = self.mods[name.removesuffix(".weight")].weight
                w.weight_loader(w, tensor)  # type: ignore[attr-defined]
            done.add(name)
        return done

    def hf_view(self, name: str) -> torch.Tensor:
        if name.startswith("halves."):
            return self.mods["halves"].weight.data.narrow(1, 8 * int(name.split(".")[1]), 8)
        w = self.mods[name.removesuffix(".weight")].weight.data
        return w.t() if name == "transposed.weight" else w


MODELS = {"moe": FakeMoE, "dtypes": DTypeModel}


def host_tensor(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """Seeded values of ``dtype`` as a numpy array (ml_dtypes for bfloat16 / float8)."""
    from weightwire.shared.dtypes import wire_dtype

    rng = np.random.default_rng(seed)
    np_dtype = wire_dtype(dtype).numpy
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=np_dtype, endpoint=True)
    # floats (float8 too): normal values, no NaN payloads (those differ in a cast)
    return rng.standard_normal(size=shape).astype(np.float32).astype(np_dtype)


def to_torch(a: np.ndarray, dtype: str, device: torch.device) -> torch.Tensor:
    raw = torch.from_numpy(np.ascontiguousarray(a).view(np.uint8).reshape(-1).copy())
    return raw.to(device).view(getattr(torch, dtype)).reshape(a.shape)


def hf_tensors(model: Any, seed: int) -> Iterator[tuple[str, np.ndarray, str]]:
    """A round's tensors for ``model`` (fresh values per ``seed``), on the host."""
    for k, (name, (shape, dtype)) in enumerate(model.hf_specs().items()):
        yield name, host_tensor(shape, dtype, seed * 100_003 + k), dtype


def byte_digest(t: torch.Tensor) -> list[int]:
    """Sums over a tensor's bytes (plain and position-weighted), for every dtype."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).to(torch.int64)
    pos = torch.arange(raw.numel(), device=raw.device, dtype=torch.int64) % 65521 + 1
    return [int(raw.sum()), int((raw * pos).sum())]
