"""The rules ``landing.record_loader_map`` checks besides the recorder's own.

- coverage: each parameter a copy lands in is written exactly once, all of it;
- bindings: a loader that rebinds a parameter (``param.data = tensor``, a new Parameter)
  is put back and refused (such a rebinding never reaches the dispatch recorder);
- post-load processing: which ``quant_method`` leaves the served parameters as loaded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightwire.torch_side.worker.landing_trace import LoaderMapRefused, Recorder, View

POST_LOAD_NO_OPS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""Quant methods whose post-load processing leaves the parameters as loaded (on CUDA)."""
MOE_METHOD = "UnquantizedFusedMoEMethod"
MOE_PLAIN_BACKENDS = ("TRITON", "BATCHED_TRITON")
"""Unquantized MoE kernels that run on the loaded layout (others shuffle the experts)."""


@dataclass(frozen=True)
class _Bound:
    module: torch.nn.Module
    leaf: str
    param: torch.Tensor
    data: torch.Tensor


@dataclass(frozen=True)
class Bindings:
    """Every parameter's module slot and data before the loader ran, to put back whatever a
    loader rebinds (``param.data = tensor`` or a new Parameter never reaches the recorder)."""

    bound: tuple[_Bound, ...]
    names: dict[int, str]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Bindings:
        bound = tuple(
            _Bound(mod, leaf, p, p.data)
            for mod in model.modules()
            for leaf, p in mod._parameters.items()
            if p is not None
        )
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        return cls(bound, names)

    def restore(self) -> list[str]:
        """Put every binding back; the names of those the loader had changed."""
        changed = []
        for b in self.bound:
            now, data = b.module._parameters.get(b.leaf), b.param.data
            moved = (data.data_ptr(), data.shape, data.dtype) != (
                b.data.data_ptr(),
                b.data.shape,
                b.data.dtype,
            )
            if now is not b.param or moved:
                changed.append(self.names.get(id(b.param), b.leaf))
                b.module._parameters[b.leaf] = b.param  # type: ignore[assignment]
                if moved:
                    b.param.data = b.data
        return changed


def _runs(v: View) -> tuple[torch.Tensor, int]:
    """The view's elements as runs of consecutive storage elements: (starts, run length)."""
    dims = sorted(((s, n) for n, s in zip(v.shape, v.strides, strict=True) if n > 1), reverse=True)
    run = 1
    while dims and dims[-1][0] == run:
        run *= dims.pop()[1]
    starts = torch.tensor([v.offset], dtype=torch.int64)
    for s, n in dims:
        starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
    return starts, run


def _intervals(views: Sequence[View]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (starts, ends) of the runs of ``views`` (empty views skipped)."""
    starts, ends = [torch.empty(0, dtype=torch.int64)], [torch.empty(0, dtype=torch.int64)]
    for v in views:
        if math.prod(v.shape) == 0:
            continue
        s, run = _runs(v)
        starts.append(s)
        ends.append(s + run)
    s, e = torch.cat(starts), torch.cat(ends)
    order = torch.argsort(s)
    return s[order], e[order]


def check_coverage(recorder: Recorder, params: dict[str, torch.Tensor]) -> None:
    """Each parameter a copy lands in is written exactly once, all of it (copies + fills)."""
    regions: dict[str, list[tuple[str, View]]] = {}
    for c in recorder.copies:
        regions.setdefault(c.param, []).append((c.source, c.dst))
    for f in recorder.fills:
        if f.param in regions:
            regions[f.param].append(("a constant fill", f.dst))
    for name, parts in regions.items():
        p = params[name]
        if not p.is_contiguous():
            raise LoaderMapRefused(f"parameter {name}: not contiguous, the map cannot hold it")
        starts, ends = _intervals([v for _, v in parts])
        lo, hi = p.storage_offset(), p.storage_offset() + p.numel()
        sources = sorted({s for s, _ in parts})
        if bool((ends[:-1] > starts[1:]).any()):
            raise LoaderMapRefused(
                f"parameter {name}: the loader writes some elements twice (from {sources})"
            )
        written = int((ends - starts).sum())
        if int(starts[0]) < lo or int(ends[-1]) > hi:
            raise LoaderMapRefused(f"parameter {name}: the loader writes outside it")
        if written != p.numel():
            raise LoaderMapRefused(
                f"parameter {name}: the loader writes {written} of its {p.numel()} elements "
                f"(from {sources}); the rest is never written"
            )


def covers(views: Sequence[View], numel: int) -> bool:
    """Whether ``views`` (into a contiguous tensor of ``numel`` elements) cover all of it."""
    if numel == 0:
        return True
    starts, ends = _intervals(views)
    if starts.numel() == 0 or int(starts[0]) != 0:
        return False
    reach = torch.cummax(ends, 0).values
    return not bool((starts[1:] > reach[:-1]).any()) and int(reach[-1]) >= numel


def nested(v: View) -> bool:
    """Each stride (of a dim of size > 1) exceeds the span of the smaller ones: the view is
    one-to-one and an element's index decomposes greedily, largest stride first."""
    span = 0
    for n, st in sorted(
        ((n, st) for n, st in zip(v.shape, v.strides, strict=True) if n > 1), key=lambda d: d[1]
    ):
        if st <= span:
            return False
        span += st * (n - 1)
    return True


# ---------------------------------------------------------------------- post-load
def post_load_refusal(model: torch.nn.Module) -> str | None:
    """Why post-load processing may change a served parameter, or None when it leaves them
    as loaded: every module's ``quant_method`` is an unquantized one on CUDA (MoE with a
    kernel that runs on the loaded layout); modules without one are plain."""
    for mname, mod in model.named_modules():
        method = getattr(mod, "quant_method", None)
        if method is None:
            continue
        cls = type(method).__name__
        where = mname or type(model).__name__
        if cls not in (*POST_LOAD_NO_OPS, MOE_METHOD):
            return f"{where}: {cls} processes the weights after loading (not a plain copy)"
        device = _device_of(mod, model)
        if device.type == "cpu":
            return (
                f"{where}: {cls} repacks the weights for the CPU kernels after loading "
                "(CPU prepack)"
            )
        if device.type != "cuda" or torch.version.hip is not None:
            return f"{where}: {cls} processes the weights after loading on {device.type}"
        backend = getattr(method, "unquantized_backend", None)
        if (
            cls == MOE_METHOD
            and backend is not None
            and getattr(backend, "name", str(backend)) not in MOE_PLAIN_BACKENDS
        ):
            return f"{where}: the {backend} MoE kernel shuffles the expert weights after loading"
    return None


def _device_of(mod: torch.nn.Module, model: torch.nn.Module) -> torch.device:
    for p in mod.parameters(recurse=False):
        return p.device
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
