"""The recorder behind ``landing.record_loader_map``: runs a model's own loader on tracers.

A tracer (``Tracer``) stands for one checkpoint tensor. It has the checkpoint's shape
and the parameters' device, but no storage: beside it lives a meta-device tensor that
views a meta "checkpoint" of the same shape, so every view the loader takes of it
(narrow, select, transpose, chunk, ...) is replayed on the meta tensor and its offset
and strides are those of the view in the checkpoint. While the loader runs, a dispatch
mode (``Recorder``) sees every aten call:

- a view of a tracer gives a tracer of that view;
- ``copy_`` from a tracer into a view of a parameter is recorded (``Copy``), not done;
- ``fill_`` / ``zero_`` into a parameter (vocab padding rows) is recorded as a constant
  region (``Fill``), not done, so recording never writes a parameter;
- a plain dtype cast of a tracer to its destination's dtype is kept as a view;
- anything else that touches a tracer (arithmetic, concatenation, ``clone`` /
  ``contiguous`` of a strided view, ``.item()``, a copy into a temporary), any other
  write into a parameter, and ``__setitem__`` with a tracer refuse (``LoaderMapRefused``).

The first refusal is kept even when a loader catches the exception it raised.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from weightwire.shared.errors import WeightwireError

aten = torch.ops.aten

_FILLS = (aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)
_DTYPE_VIEWS = (aten.view.dtype,)


class LoaderMapRefused(WeightwireError):
    """The model's loading is not a set of plain copies; the reason names tensor/module and why.

    ``landing`` exports it (``weightwire.torch_side.worker.landing.LoaderMapRefused``)."""


@dataclass(frozen=True)
class View:
    """A strided view in elements: what ``as_strided`` takes."""

    shape: tuple[int, ...]
    offset: int
    strides: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> View:
        return cls(tuple(t.shape), int(t.storage_offset()), tuple(t.stride()))


@dataclass(frozen=True)
class Copy:
    """One recorded ``dst.copy_(src)``: checkpoint ``source`` view ``src`` into ``param``."""

    source: str
    param: str
    src: View
    dst: View


@dataclass(frozen=True)
class Fill:
    """A constant the loader wrote into part of ``param`` (e.g. vocab padding rows) while it
    loaded checkpoint tensor ``source``."""

    source: str
    param: str
    dst: View
    value: float


class Tracer(torch.Tensor):
    """A checkpoint tensor without data (see the module docstring)."""

    meta: torch.Tensor
    source: str
    recorder: Recorder

    @staticmethod
    def __new__(
        cls,
        meta: torch.Tensor,
        source: str,
        device: torch.device,
        dtype: torch.dtype,
        recorder: Recorder,
    ) -> Tracer:
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=dtype,
            device=device,
            requires_grad=False,
        )
        t.meta = meta
        t.source = source
        t.recorder = recorder
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Tracer({self.source!r}, shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "__name__", None) == "__setitem__":
            tracer = next(a for a in tree_flatten(args)[0] if isinstance(a, Tracer))
            reason = f"{tracer.source}: the loader writes it by __setitem__ (not a view copy)"
            raise tracer.recorder.refuse(reason)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        raise LoaderMapRefused(f"{func} reached a tracer outside the recorder")


@dataclass
class _Storage:
    """The parameters that view one storage (usually exactly one)."""

    params: list[tuple[str, torch.Tensor]] = field(default_factory=list)


class Recorder(TorchDispatchMode):
    """Records the loader's copies (see the module docstring); use as a context manager."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.copies: list[Copy] = []
        self.fills: list[Fill] = []
        self.refusal: str | None = None
        self.current = ""
        """The checkpoint tensor the loader has in hand (the one it was last given)."""
        self._storages: dict[int, _Storage] = {}
        for name, p in params.items():
            if p.numel() > 0:
                key = p.untyped_storage().data_ptr()
                self._storages.setdefault(key, _Storage()).params.append((name, p))

    def refuse(self, reason: str) -> LoaderMapRefused:
        if self.refusal is None:
            self.refusal = reason
        return LoaderMapRefused(reason)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is aten.copy_.default:
            return self._copy(args[0], args[1])
        tracers = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tracer)]
        if tracers:
            return self._on_tracer(func, tracers[0], args, kwargs)
        written = self._written_param(func, args, kwargs)
        if written is not None:
            name, dst = written
            if func in _FILLS and isinstance(dst, torch.Tensor):
                if dst.numel() > 0:
                    value = 0.0 if func is aten.zero_.default else float(args[1])
                    self.fills.append(Fill(self.current, name, View.of(dst), value))
                return dst
            raise self.refuse(f"parameter {name}: the loader writes it with {func} (not a copy)")
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ tracers
    def _on_tracer(
        self, func: Any, tracer: Tracer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        source = tracer.source
        if func is aten._to_copy.default:
            return self._cast(tracer, args, kwargs)
        if func in _DTYPE_VIEWS:
            raise self.refuse(f"{source}: the loader reinterprets its bytes as another dtype")
        if func is aten._local_scalar_dense.default:
            raise self.refuse(f"{source}: the loader reads a value of it (.item())")
        if func is aten.clone.default:
            raise self.refuse(
                f"{source}: the loader copies it into a new tensor (.clone() or .contiguous() "
                "of a strided view) before loading it"
            )
        if getattr(func, "is_view", False):
            return self._view(func, args, kwargs)
        raise self.refuse(f"{source}: the loader computes on it ({func}), not a plain copy")

    def _view(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        outer: list[Tracer] = []

        def to_meta(a: Any) -> Any:
            if isinstance(a, Tracer):
                outer.append(a)
                return a.meta
            return a

        out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        first = outer[0]

        def wrap(m: Any) -> Any:
            if isinstance(m, torch.Tensor):
                return Tracer(m, first.source, first.device, first.dtype, self)
            return m

        return tree_map(wrap, out)

    def _cast(self, tracer: Tracer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tracer:
        extra = set(kwargs) - {"dtype", "device", "layout", "memory_format", "non_blocking"}
        device = kwargs.get("device")
        if (
            len(args) > 1
            or extra
            or (device is not None and torch.device(device) != tracer.device)
            or kwargs.get("layout") not in (None, torch.strided)
        ):
            raise self.refuse(
                f"{tracer.source}: the loader converts it ({kwargs}), not a plain dtype cast"
            )
        dtype = kwargs.get("dtype") or tracer.dtype
        # Checked at the copy: a cast is plain only when it casts to the parameter's dtype.
        return Tracer(tracer.meta, tracer.source, tracer.device, dtype, self)

    # ------------------------------------------------------------------ writes
    def _copy(self, dst: Any, src: Any) -> Any:
        if isinstance(dst, Tracer):
            raise self.refuse(f"{dst.source}: the loader writes into the checkpoint tensor")
        owner = self._param_of(dst)
        if not isinstance(src, Tracer):
            if owner is not None:
                raise self.refuse(
                    f"parameter {owner[0]}: the loader copies into it a tensor that is not a "
                    "checkpoint tensor (computed or cached)"
                )
            return dst.copy_(src)
        if owner is None:
            raise self.refuse(
                f"{src.source}: the loader copies it into a tensor that is not a parameter "
                "(a temporary, then something else)"
            )
        name, param = owner
        if src.dtype != src.meta.dtype and src.dtype != param.dtype:
            raise self.refuse(
                f"{src.source}: the loader casts it to {src.dtype} before copying it into "
                f"{name} ({param.dtype}): not a plain cast"
            )
        if dst.dtype != param.dtype:
            raise self.refuse(f"{src.source}: the loader writes {name} through a {dst.dtype} view")
        if tuple(dst.shape) != tuple(src.shape):
            raise self.refuse(
                f"{src.source}: the loader broadcasts a {list(src.shape)} view into a "
                f"{list(dst.shape)} view of {name}"
            )
        self.copies.append(Copy(src.source, name, View.of(src.meta), View.of(dst)))
        return dst

    def _param_of(self, t: Any) -> tuple[str, torch.Tensor] | None:
        if not isinstance(t, torch.Tensor) or isinstance(t, Tracer) or t.numel() == 0:
            return None
        entry = self._storages.get(t.untyped_storage().data_ptr())
        if entry is None:
            return None
        if len(entry.params) == 1:
            return entry.params[0]
        lo, hi = _span(View.of(t))
        for name, p in entry.params:
            plo, phi = _span(View.of(p))
            if plo <= lo and hi <= phi:
                return name, p
        raise self.refuse(
            f"the loader writes across parameters sharing one storage "
            f"({', '.join(n for n, _ in entry.params)})"
        )

    def _written_param(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, torch.Tensor] | None:
        """(name, written view) when ``func`` writes into a parameter's storage."""
        schema = getattr(func, "_schema", None)
        if schema is None:
            return None
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            owner = self._param_of(value)
            if owner is not None and isinstance(value, torch.Tensor):
                return owner[0], value
        return None


def _span(v: View) -> tuple[int, int]:
    """[first, last + 1) storage elements a non-empty view touches."""
    lo = v.offset + sum((n - 1) * s for n, s in zip(v.shape, v.strides, strict=True) if s < 0)
    hi = v.offset + sum((n - 1) * s for n, s in zip(v.shape, v.strides, strict=True) if s > 0)
    return lo, hi + 1
