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
  ``patch_all`` applies a round's patches, those of tensors that land whole in one
  parameter (``plain_target``, cached) as one scatter per parameter storage
  (``fused_patch``), the others one by one;
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import torch_dtype
from weightwire.torch_side.worker.fused_patch import FusedPatch, PatchTarget, apply_fused
from weightwire.torch_side.worker.landing_rules import (
    Bindings,
    check_coverage,
    covers,
    nested,
    post_load_refusal,
)
from weightwire.torch_side.worker.landing_trace import (
    Copy,
    LoaderMapRefused,
    Recorder,
    Tracer,
    View,
)
from weightwire.torch_side.worker.load import Model


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
    _plain: dict[str, PatchTarget | None] = field(default_factory=dict, repr=False)

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

    def patch(
        self, name: str, flat_index: torch.Tensor, values: torch.Tensor, *, in_range: bool = False
    ) -> None:
        """Write ``values`` at the checkpoint's flat (row-major) ``flat_index``; indices that no
        landing of this rank covers (another rank's slice, or outside the tensor) are ignored.
        Duplicate indices leave one of their values (unspecified which).

        ``in_range``: the caller checked that every index is within the tensor. A landing that
        takes the whole tensor in its own row-major layout (a plain or fused parameter) then
        writes at ``index + offset``: two kernels, not the translation's dozen per tensor.
        An index outside the tensor with ``in_range`` writes outside it."""
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
                flat = self._flat_of(ld.param)
                if in_range and _whole(ld, tl.shape):
                    flat.index_put_((idx + ld.dst_offset,), vals.to(flat.dtype))
                    continue
                keep, dst = _translate(ld, idx)
                _scatter_kept(flat, keep, dst, vals)

    def plain_target(self, name: str) -> PatchTarget | None:
        """Where the checkpoint tensor's flat index ``i`` lands when it lands whole, in its
        row-major layout, in one parameter (flat storage index ``offset + i``); None for a
        tensor-parallel slice, a transposed or scattered landing, several landings or a
        constant fill. Worked out once per tensor (the landings never change)."""
        if name not in self._plain:
            tl = self._of(name)
            (ld, *more) = tl.landings or (None,)
            plain = ld is not None and not more and not tl.fills and _whole(ld, tl.shape)
            self._plain[name] = PatchTarget(ld.param, ld.dst_offset) if plain and ld else None
        return self._plain[name]

    def patch_all(
        self,
        patches: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
        *,
        concat: bool = False,
    ) -> int:
        """A round's ``(name, flat index, values)`` patches, every index already checked to
        be within its tensor (``delta.check_indices``). Those of tensors with a
        ``plain_target`` go as one scatter per parameter storage (``fused_patch``); the others
        through ``patch``, one by one, after them. Returns the number of scatters the fused
        part launched (``concat``: ``fused_patch.apply_fused``'s). Bit-identical to
        ``patch(name, index, values)`` for each in turn."""
        fused: list[FusedPatch] = []
        rest: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for name, index, values in patches:
            target = self.plain_target(name)
            if target is None or index.dim() != 1:
                rest.append((name, index, values))
            else:
                fused.append(FusedPatch(target, index, values, name))
        with torch.no_grad():
            flats = {t: self._flat_of(t) for t in _storages(fused)}
            launched = apply_fused(flats, fused, concat=concat)
        for name, index, values in rest:
            self.patch(name, index, values, in_range=True)
        return launched

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


def _storages(patches: Sequence[FusedPatch]) -> set[str]:
    return {p.target.storage for p in patches}


def _scatter_kept(
    flat: torch.Tensor, keep: torch.Tensor, dst: torch.Tensor, vals: torch.Tensor
) -> None:
    """``flat[dst[keep]] = vals[keep]`` without a device sync (no ``nonzero``): the entries
    not kept repeat the first kept entry (same place, same value), or, when none is kept,
    write back what is already there."""
    if dst.numel() == 0:
        return
    first = keep.to(torch.uint8).argmax()
    target = torch.where(keep, dst, dst[first]).clamp_(0, flat.numel() - 1)
    new = torch.where(keep, vals, vals[first]).to(flat.dtype)
    flat.index_put_((target,), torch.where(keep[first], new, flat[target]))


def _landing_bytes(ld: Landing) -> int:
    return sys.getsizeof(ld) + sum(
        sys.getsizeof(t) for t in (ld.shape, ld.src_strides, ld.dst_strides)
    )


def _order(ld: Landing) -> list[int]:
    """The landing's dims of size > 1, by source stride, largest first."""
    dims = [d for d, n in enumerate(ld.shape) if n > 1]
    return sorted(dims, key=lambda d: ld.src_strides[d], reverse=True)


def _whole(ld: Landing, shape: tuple[int, ...]) -> bool:
    """The landing copies the whole checkpoint tensor, in its row-major layout, to one
    contiguous range of the parameter's storage (flat index ``i`` lands at ``dst_offset + i``)."""
    if ld.src_offset != 0 or ld.shape != shape:
        return False
    stride = 1
    for d in reversed(range(len(shape))):
        if shape[d] > 1 and not ld.src_strides[d] == ld.dst_strides[d] == stride:
            return False
        stride *= shape[d]
    return True


def _translate(ld: Landing, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(in this landing?, parameter storage index) per checkpoint flat index. The source
    strides are nested (``landing_rules.nested``, checked at recording): the digits are unique."""
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
MapRecorder = Callable[[Any, Sequence[ParamMeta]], LoaderMap]
"""``record_loader_map``'s shape: ``(model, checkpoint metas) -> LoaderMap``, raising
``LoaderMapRefused`` where the model's loading is not a set of plain copies."""
MapLookup = Callable[[Sequence[ParamMeta]], LoaderMap | None]
"""The core's cached map of its target model (``TargetCaches.loader_map``); None: refused."""


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
    check_coverage(recorder, params)
    tensors: dict[str, TensorLandings] = {}
    for m in metas:
        landings = tuple(
            Landing(c.param, c.src.shape, c.src.offset, c.src.strides, c.dst.offset, c.dst.strides)
            for c in by_source[m.name]
        )
        for ld in landings:
            if not nested(View(ld.shape, ld.src_offset, ld.src_strides)):
                raise LoaderMapRefused(f"{m.name}: the loader reads it through an overlapping view")
        fills = tuple(
            ConstantFill(f.param, f.dst.shape, f.dst.offset, f.dst.strides, f.value)
            for f in recorder.fills
            if f.source == m.name
        )
        complete = covers(
            [View(ld.shape, ld.src_offset, ld.src_strides) for ld in landings], math.prod(m.shape)
        )
        tensors[m.name] = TensorLandings(m.name, tuple(m.shape), m.dtype, landings, complete, fills)
    _alias_tied(model, tensors, params)
    return LoaderMap(tensors, params)


def _run_loader(
    model: torch.nn.Module, metas: Sequence[ParamMeta], params: dict[str, torch.Tensor]
) -> Recorder:
    device = next(iter(params.values())).device if params else torch.device("cpu")

    recorder = Recorder(params)
    # Made before the recorder is entered: a factory call inside it costs torch's lazy
    # imports (seconds, once per process) and would be recorded as the loader's.
    made = [
        Tracer(
            torch.empty(tuple(m.shape), dtype=torch_dtype(m.dtype), device="meta"),
            m.name,
            device,
            torch_dtype(m.dtype),
            recorder,
        )
        for m in metas
    ]

    def tracers() -> Iterator[tuple[str, torch.Tensor]]:
        for t in made:
            recorder.current = t.source
            yield t.source, t

    if not isinstance(model, Model):
        raise LoaderMapRefused(f"{type(model).__name__} has no load_weights")
    load = model.load_weights
    bindings = Bindings.of(model)
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
    finally:
        rebound = bindings.restore()
    if recorder.refusal is not None:
        raise LoaderMapRefused(recorder.refusal)
    if rebound:
        raise LoaderMapRefused(
            f"parameter {rebound[0]}: the loader rebinds or replaces it (param.data = ..., "
            "a new Parameter), not a copy into it"
        )
    return recorder


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{alias: canonical}`` for parameters shared between modules (a tied head's
    ``lm_head.weight`` -> ``model.embed_tokens.weight``), first name in module order
    canonical, as vLLM's loader resolves them."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        if canonical != name:
            aliases[name] = canonical
    return aliases


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


__all__: list[str] = [
    "ConstantFill",
    "Landing",
    "LoaderMap",
    "LoaderMapRefused",
    "TensorLandings",
    "post_load_refusal",
    "record_loader_map",
]
