"""The landing map: where each checkpoint tensor lands in the serving parameters.

``record_loader_map`` learns it from the model's OWN loader: it runs
``model.load_weights`` once on tracers (``landing_trace``: tensors without data, whose
views the loader takes are replayed on the meta device) and records every copy the
loader makes, without writing any parameter. What it records is a list of view-to-view
copies per checkpoint tensor (``Landing``), so ``LoaderMap`` can then

- ``write`` a dense tensor: one ``copy_`` per landing, exactly what ``load_weights``
  would copy, with no loader call and no temporary;
- ``patch`` a few elements: checkpoint flat indices are translated into parameter
  storage indices with tensor ops per landing (no per-element Python, no full-size
  tensor); indices another tensor-parallel rank holds fall out of every landing;
- ``read`` the checkpoint tensor back from the parameters (checksums, verify).

The map is only valid when loading IS a set of plain copies: any loader that computes,
concatenates, transposes into a new tensor, reads values, assigns by ``__setitem__``,
writes an element twice or a parameter only partly, and any post-load processing
(``quant_method.process_weights_after_loading``) that changes the served parameters,
refuses with ``LoaderMapRefused`` naming the tensor or module and why; the caller then
keeps loading through ``load_weights``. On a CPU vLLM the unquantized linear, embedding
and MoE methods repack their weights for the CPU kernels after loading ("CPU prepack"),
so a served CPU model always refuses.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import torch_dtype
from weightwire.torch_side.worker.landing_trace import (
    Copy,
    LoaderMapRefused,
    Recorder,
    Tracer,
    View,
)

POST_LOAD_NO_OPS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
"""Quant methods whose post-load processing leaves the parameters as loaded (on CUDA)."""
MOE_METHOD = "UnquantizedFusedMoEMethod"
MOE_PLAIN_BACKENDS = ("TRITON", "BATCHED_TRITON")
"""Unquantized MoE kernels that run on the loaded layout (others shuffle the experts)."""


@dataclass(frozen=True)
class Landing:
    """One copy the model's own loader makes from a checkpoint tensor into a parameter.
    Both views have ``shape``; offsets and strides are in elements."""

    param: str
    """The parameter's name in ``model.named_parameters()``."""
    shape: tuple[int, ...]
    src_offset: int
    """Into the checkpoint tensor (contiguous, in its own shape)."""
    src_strides: tuple[int, ...]
    dst_offset: int
    """Into the parameter's storage (``param.data``, ``as_strided``)."""
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ConstantFill:
    """A constant the loader writes into part of a parameter whenever it loads the tensor
    (vocab-parallel padding rows): ``write`` repeats it."""

    param: str
    shape: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]
    value: float


@dataclass(frozen=True)
class TensorLandings:
    name: str
    """Checkpoint (Hugging Face) name."""
    shape: tuple[int, ...]
    dtype: str
    """Wire dtype name (``shared.dtypes``)."""
    landings: tuple[Landing, ...]
    """Empty: nothing of it lives on this rank (another tensor-parallel rank's slice)."""
    complete: bool = True
    """Every element lands on this rank (``LoaderMap.read`` needs it)."""
    fills: tuple[ConstantFill, ...] = ()


@dataclass
class LoaderMap:
    """The recorded landings of a model (see the module docstring)."""

    tensors: dict[str, TensorLandings]
    params: dict[str, torch.Tensor]
    """Name -> the serving parameter's data (the live storage)."""
    _flat: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def _of(self, name: str) -> TensorLandings:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a checkpoint tensor of this landing map") from None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` (checkpoint shape, any device, a dtype the parameters cast from) lands
        in every parameter view: one copy per landing."""
        tl = self._of(name)
        if tuple(tensor.shape) != tl.shape:
            raise ValueError(f"{name}: shape {list(tensor.shape)}, the map has {list(tl.shape)}")
        src = tensor if tensor.is_contiguous() else tensor.contiguous()
        base = src.storage_offset()
        with torch.no_grad():
            for ld in tl.landings:
                dst = self.params[ld.param].as_strided(ld.shape, ld.dst_strides, ld.dst_offset)
                dst.copy_(src.as_strided(ld.shape, ld.src_strides, base + ld.src_offset))
            for f in tl.fills:
                self.params[f.param].as_strided(f.shape, f.dst_strides, f.dst_offset).fill_(f.value)

    def patch(self, name: str, flat_index: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` at the checkpoint's flat (row-major) ``flat_index``; indices that no
        landing of this rank covers (another rank's slice, or outside the tensor) are ignored.
        Duplicate indices leave one of their values (unspecified which)."""
        tl = self._of(name)
        if flat_index.dtype not in (torch.int32, torch.int64) or flat_index.dim() != 1:
            raise ValueError(
                f"{name}: flat_index must be a 1-D int32/int64 tensor, got "
                f"{flat_index.dtype} of shape {list(flat_index.shape)}"
            )
        if tuple(values.shape) != tuple(flat_index.shape):
            raise ValueError(
                f"{name}: {values.numel()} values for {flat_index.numel()} indices"
                f" (shape {list(values.shape)})"
            )
        moved: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for ld in tl.landings:
                param = self.params[ld.param]
                if param.device not in moved:
                    moved[param.device] = (
                        flat_index.to(param.device, torch.int64),
                        values.to(param.device),
                    )
                idx, vals = moved[param.device]
                keep, dst = _translate(ld, idx)
                sel = keep.nonzero().squeeze(1)
                flat = self._flat_of(ld.param)
                flat.index_put_(
                    (dst.index_select(0, sel),), vals.index_select(0, sel).to(flat.dtype)
                )

    def read(self, name: str) -> torch.Tensor:
        """The checkpoint tensor as the parameters hold it now (wire dtype, parameter device)."""
        tl = self._of(name)
        if not tl.complete:
            raise ValueError(f"{name}: only part of it lives on this rank; read needs all of it")
        device = self.params[tl.landings[0].param].device if tl.landings else None
        out = torch.empty(tl.shape, dtype=torch_dtype(tl.dtype), device=device)
        with torch.no_grad():
            for ld in tl.landings:
                src = self.params[ld.param].as_strided(ld.shape, ld.dst_strides, ld.dst_offset)
                out.as_strided(ld.shape, ld.src_strides, ld.src_offset).copy_(src)
        return out

    def is_live(self, model: torch.nn.Module) -> bool:
        """Whether the model's parameters still live where the map writes (none was
        reallocated or replaced since recording)."""
        now = dict(model.named_parameters())
        return all(
            name in now and now[name].data_ptr() == p.data_ptr() and now[name].shape == p.shape
            for name, p in self.params.items()
        )

    def nbytes(self) -> int:
        """Host memory the map itself holds (its records; the parameters are the model's)."""
        total = sys.getsizeof(self.tensors)
        for tl in self.tensors.values():
            total += sys.getsizeof(tl) + sys.getsizeof(tl.landings)
            total += sum(_landing_bytes(ld) for ld in tl.landings)
        return total

    def _flat_of(self, param: str) -> torch.Tensor:
        """The parameter's whole storage as one flat tensor (a view; allocates nothing)."""
        flat = self._flat.get(param)
        if flat is None:
            p = self.params[param]
            elems = p.untyped_storage().nbytes() // p.element_size()
            flat = self._flat[param] = p.as_strided((elems,), (1,), 0)
        return flat


def _landing_bytes(ld: Landing) -> int:
    return sys.getsizeof(ld) + sum(
        sys.getsizeof(t) for t in (ld.shape, ld.src_strides, ld.dst_strides)
    )


def _order(ld: Landing) -> list[int]:
    """The landing's dims of size > 1, by source stride, largest first."""
    dims = [d for d, n in enumerate(ld.shape) if n > 1]
    return sorted(dims, key=lambda d: ld.src_strides[d], reverse=True)


def _translate(ld: Landing, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(in this landing?, parameter storage index) per checkpoint flat index. The source
    strides are nested (checked at recording), so the digits are unique."""
    rest = idx - ld.src_offset
    keep = rest >= 0
    dst = torch.full_like(idx, ld.dst_offset)
    for d in _order(ld):
        digit = torch.div(rest, ld.src_strides[d], rounding_mode="floor")
        rest = rest - digit * ld.src_strides[d]
        keep &= digit < ld.shape[d]
        dst += digit * ld.dst_strides[d]
    keep &= rest == 0
    return keep, dst


# ---------------------------------------------------------------------- recording
def record_loader_map(
    model: torch.nn.Module, metas: Sequence[ParamMeta], *, check_post_load: bool = True
) -> LoaderMap:
    """Run ``model.load_weights`` once on tracers for ``metas`` (no parameter is written)
    and record each copy. Raises ``LoaderMapRefused`` naming the first tensor or module
    whose loading or post-load processing is not a plain copy.

    ``check_post_load=False`` skips the post-load check: only for a model whose
    parameters are served exactly as loaded (a fresh instance never post-processed)."""
    if check_post_load:
        reason = post_load_refusal(model)
        if reason is not None:
            raise LoaderMapRefused(reason)
    params = {name: p.data for name, p in model.named_parameters()}
    recorder = _run_loader(model, metas, params)
    by_source: dict[str, list[Copy]] = {m.name: [] for m in metas}
    for c in recorder.copies:
        by_source[c.source].append(c)
    _check_coverage(recorder, params)
    tensors: dict[str, TensorLandings] = {}
    for m in metas:
        landings = tuple(
            Landing(c.param, c.src.shape, c.src.offset, c.src.strides, c.dst.offset, c.dst.strides)
            for c in by_source[m.name]
        )
        for ld in landings:
            if not _nested(ld):
                raise LoaderMapRefused(f"{m.name}: the loader reads it through an overlapping view")
        fills = tuple(
            ConstantFill(f.param, f.dst.shape, f.dst.offset, f.dst.strides, f.value)
            for f in recorder.fills
            if f.source == m.name
        )
        complete = _covers(landings, math.prod(m.shape))
        tensors[m.name] = TensorLandings(m.name, tuple(m.shape), m.dtype, landings, complete, fills)
    _alias_tied(model, tensors, params)
    return LoaderMap(tensors, params)


def _run_loader(
    model: torch.nn.Module, metas: Sequence[ParamMeta], params: dict[str, torch.Tensor]
) -> Recorder:
    device = next(iter(params.values())).device if params else torch.device("cpu")

    def tracers() -> Iterator[tuple[str, torch.Tensor]]:
        for m in metas:
            dtype = torch_dtype(m.dtype)
            base = torch.empty(tuple(m.shape), dtype=dtype, device="meta")
            recorder.current = m.name
            yield m.name, Tracer(base, m.name, device, dtype, recorder)

    recorder = Recorder(params)
    load = getattr(model, "load_weights", None)
    if load is None:
        raise LoaderMapRefused(f"{type(model).__name__} has no load_weights")
    try:
        with torch.no_grad(), recorder:
            load(tracers())
    except LoaderMapRefused:
        pass
    except Exception as exc:  # the loader itself failed on a tracer
        if recorder.refusal is None:
            raise LoaderMapRefused(
                f"the loader failed on tracer tensors ({type(exc).__name__}: {exc})"
            ) from exc
    if recorder.refusal is not None:
        raise LoaderMapRefused(recorder.refusal)
    return recorder


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


def _check_coverage(recorder: Recorder, params: dict[str, torch.Tensor]) -> None:
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


def _covers(landings: Sequence[Landing], numel: int) -> bool:
    """Whether the landings' source views together cover all ``numel`` elements."""
    if numel == 0:
        return True
    starts, ends = _intervals([View(ld.shape, ld.src_offset, ld.src_strides) for ld in landings])
    if starts.numel() == 0 or int(starts[0]) != 0:
        return False
    reach = torch.cummax(ends, 0).values
    return not bool((starts[1:] > reach[:-1]).any()) and int(reach[-1]) >= numel


def _nested(ld: Landing) -> bool:
    """Each source stride exceeds the span of the smaller ones: the view is one-to-one and
    ``_translate``'s digits are unique."""
    span = 0
    for d in reversed(_order(ld)):
        if ld.src_strides[d] <= span:
            return False
        span += ld.src_strides[d] * (ld.shape[d] - 1)
    return True


def _alias_tied(
    model: torch.nn.Module, tensors: dict[str, TensorLandings], params: dict[str, torch.Tensor]
) -> None:
    """A checkpoint tensor the loader skipped whose name is a second name of a parameter
    (a tied head: ``lm_head.weight`` is ``embed_tokens.weight``) lands where the one tensor
    of its shape that fills that parameter (and nothing else) lands."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    second = dict(model.named_parameters(remove_duplicate=False))
    for name, tl in list(tensors.items()):
        p = second.get(name)
        owner = canonical.get(id(p)) if p is not None else None
        if tl.landings or owner is None or owner == name:
            continue
        fillers = [t for t in tensors.values() if any(ld.param == owner for ld in t.landings)]
        if (
            len(fillers) == 1
            and fillers[0].shape == tl.shape
            and all(ld.param == owner for ld in fillers[0].landings)
        ):
            t = fillers[0]
            tensors[name] = TensorLandings(
                name, tl.shape, tl.dtype, t.landings, t.complete, t.fills
            )


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


__all__: list[str] = [
    "ConstantFill",
    "Landing",
    "LoaderMap",
    "LoaderMapRefused",
    "TensorLandings",
    "post_load_refusal",
    "record_loader_map",
]
