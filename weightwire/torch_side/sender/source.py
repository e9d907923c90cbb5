"""``ModuleSource``: a ``WeightSource`` over a torch module, plain or FSDP2-sharded.

Names are the module's own ``named_parameters()`` names, which for a Hugging Face
model are the checkpoint names a vLLM worker's ``load_weights`` expects.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightwire.shared.errors import ConfigError, WrongType
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.torch_side.dtypes import wire_name


def describe_tensor(tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """``(wire dtype, shape)`` of a tensor: the ``describe`` for ``shared.source.checked_iter``."""
    return wire_name(tensor.dtype), tuple(tensor.shape)


def _named_modules(
    root: torch.nn.Module, *, remove_duplicate: bool
) -> list[tuple[str, torch.nn.Module]]:
    """``list(root.named_modules(remove_duplicate=...))``, walked with a stack instead of
    one nested generator per depth level (which re-yields every module once per
    ancestor: that walk was most of ``metadata()``'s time, and a round walks twice).
    Same order and duplicate rule; a tree where some module overrides ``named_modules``
    is walked by torch's own."""
    standard = torch.nn.Module.named_modules
    out: list[tuple[str, torch.nn.Module]] = []
    memo: set[torch.nn.Module] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", root)]
    while stack:
        prefix, mod = stack.pop()
        if type(mod).named_modules is not standard:
            return list(root.named_modules(remove_duplicate=remove_duplicate))
        if mod in memo:
            continue
        if remove_duplicate:
            memo.add(mod)
        out.append((prefix, mod))
        children = [
            (f"{prefix}.{name}" if prefix else name, child)
            for name, child in mod._modules.items()
            if child is not None
        ]
        stack.extend(reversed(children))
    return out


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # Attribute probe instead of isinstance: importing torch.distributed.tensor pulls in
    # the whole DTensor stack even for plain single-process modules.
    return getattr(tensor, "device_mesh", None) is not None and callable(
        getattr(tensor, "full_tensor", None)
    )


def _mesh_ranks(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(r) for r in tensor.device_mesh.mesh.flatten().tolist())  # type: ignore[attr-defined]


class ModuleSource(WeightSource):
    """Every parameter (and optionally every persistent buffer) of ``module``.

    ``metadata()`` reads each tensor's *global* shape and dtype: for an FSDP2
    ``DTensor`` that is local information, so declaring a round runs no collective.
    Iteration materializes a ``DTensor`` with ``full_tensor()`` (an all-gather among
    its mesh), so every rank of the mesh must iterate, in the same order, in lockstep;
    a rank that skips iteration deadlocks the others.

    Options:

    - ``dtype``: cast floating-point tensors to this dtype on the wire (metadata
      declares the cast dtype); integer and bool tensors keep theirs.
    - ``include_buffers``: also send persistent buffers (those ``state_dict`` saves),
      for models whose checkpoints carry buffers that vLLM loads.
    - ``keep_tied``: a tensor shared by several modules (tied embeddings) is by
      default sent once, under its first name, matching Hugging Face checkpoints that
      omit ``lm_head.weight`` when tied. Set ``True`` to send it under every name, for
      receivers whose checkpoint format lists each alias.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        dtype: torch.dtype | None = None,
        include_buffers: bool = False,
        keep_tied: bool = False,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise WrongType(f"ModuleSource needs a torch.nn.Module, got {type(module).__name__}")
        if dtype is not None:
            wire_name(dtype)  # refuse a cast target that cannot cross the wire, now
            if not dtype.is_floating_point:
                raise ConfigError(f"ModuleSource dtype must be a floating-point dtype, got {dtype}")
        self._module = module
        self._dtype = dtype
        self._include_buffers = include_buffers
        self._keep_tied = keep_tied
        self._declared: list[ParamMeta] = []
        self._declared_key: list[Any] | None = None

    def _named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters then persistent buffers, module by module (``state_dict`` order).

        Hand-walked rather than ``named_parameters()`` + ``named_buffers()`` so that a
        layer's buffers stay adjacent to its parameters: layer groups must be contiguous.
        """
        seen: set[int] = set()
        for prefix, mod in _named_modules(self._module, remove_duplicate=not self._keep_tied):
            members: list[tuple[str, torch.Tensor | None]] = list(mod._parameters.items())
            if self._include_buffers:
                skip = mod._non_persistent_buffers_set
                members += [(k, b) for k, b in mod._buffers.items() if k not in skip]
            for key, tensor in members:
                if tensor is None:
                    continue
                if not self._keep_tied:
                    if id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                yield (f"{prefix}.{key}" if prefix else key), tensor

    def _wire_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        if self._dtype is not None and tensor.dtype.is_floating_point:
            return self._dtype
        return tensor.dtype

    def metadata(self) -> list[ParamMeta]:
        """The declaration, rebuilt only when a tensor's name, dtype, shape or owners changed:
        the same ``ParamMeta`` objects round after round, so the engine's per-round
        comparisons with the last round's metadata are identity checks, not 290 field ones."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        key: list[tuple[str, torch.dtype, torch.Size, tuple[int, ...] | None]] = []
        for name, tensor in self._named_tensors():
            owners = None
            if _is_dtensor(tensor):
                ranks = _mesh_ranks(tensor)
                if sorted(ranks) != list(range(world)):
                    owners = ranks
            key.append((name, self._wire_dtype(tensor), tensor.shape, owners))
        if key != self._declared_key:
            self._declared = [ParamMeta(n, wire_name(d), tuple(s), o) for n, d, s, o in key]
            self._declared_key = key
        return list(self._declared)

    def held_names(self) -> set[str] | None:
        """``None`` (all) unless some ``DTensor``'s mesh excludes this rank (pipeline stages)."""
        held: set[str] = set()
        partial = False
        for name, tensor in self._named_tensors():
            if _is_dtensor(tensor) and tensor.device_mesh.get_coordinate() is None:  # type: ignore[attr-defined]
                partial = True
            else:
                held.add(name)
        return held if partial else None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full, contiguous, detached tensors in metadata order (names this rank holds)."""
        for name, tensor in self._named_tensors():
            if _is_dtensor(tensor):
                if tensor.device_mesh.get_coordinate() is None:  # type: ignore[attr-defined]
                    continue
                full = tensor.full_tensor()  # type: ignore[attr-defined]
            else:
                full = tensor
            full = full.detach()
            target = self._wire_dtype(full)
            if full.dtype != target:
                full = full.to(target)
            yield name, full.contiguous()

    @staticmethod
    def describe(tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
        return describe_tensor(tensor)
