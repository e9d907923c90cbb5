"""``WeightSource``: the trainer-side adapter that says *what* weights to send.

Framework-neutral (tensors are opaque here); ``jax_side.PytreeSource`` and
``torch_side.ModuleSource`` implement it. Two channels that must agree element for
element: ``metadata()`` (no transfer) and iteration (full tensors, metadata order,
a fresh pass each time). ``checked_iter`` enforces that agreement on the sender,
because a worker cuts its receive buffers from the metadata: a disagreement would
otherwise hang a collective or load garbage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from weightwire.shared.errors import ConfigError, SourceMismatch, WrongType
from weightwire.shared.groups import batch_by_layer, layerwise_groups
from weightwire.shared.meta import ParamMeta

Describe = Callable[[Any], tuple[str, tuple[int, ...]]]
"""Maps a yielded tensor to its ``(wire dtype name, shape)``."""


class WeightSource(ABC):
    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Every parameter's name, wire dtype and full shape, without moving data."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """A fresh pass of ``(hf_name, full tensor)`` in metadata order."""

    def held_names(self) -> set[str] | None:
        """Names this rank can produce; ``None`` means all of them."""
        return None

    def groups(self) -> list[list[ParamMeta]]:
        """This rank's layer groups (``layerwise_groups``), skipping groups it holds none of."""
        held = self.held_names()
        return [
            g
            for g in layerwise_groups(self.metadata())
            if held is None or any(m.name in held for m in g)
        ]

    def iter_groups(self) -> Iterator[list[tuple[str, Any]]]:
        """The same stream as iteration, batched one layer group at a time."""
        return batch_by_layer(self)

    def checks_own_stream(self, metas: Sequence[ParamMeta]) -> bool:
        """Whether every pass (iteration and ``iter_groups``) already raises ``SourceMismatch``
        against exactly ``metas`` (each name, dtype and shape, extra and missing tensors).
        The engine then skips its own ``checked_iter``: one check per tensor, not two."""
        return False


# What a source-shaped object may offer besides ``metadata`` (vLLM's sources: ``iter_full``).
@runtime_checkable
class _IteratesFull(Protocol):
    def iter_full(self) -> Iterable[tuple[str, Any]]: ...


@runtime_checkable
class _HoldsNames(Protocol):
    def held_names(self) -> Iterable[str] | None: ...


def as_source(obj: Any) -> WeightSource:
    """``obj`` as a ``WeightSource``: ours as is, or any object shaped like one.

    Duck typing, so vLLM's own trainer-side sources plug in unchanged: ``metadata``
    may be a method (vLLM <= 0.32, ours) or a property (vLLM 0.33's cached
    property); its items need ``name``, ``dtype`` (a wire name, or a framework
    dtype whose ``str`` is ``torch.<name>`` / ``<name>``) and ``shape``; tensors come
    from ``__iter__`` or, failing that, ``iter_full()``. Anything else is refused
    here, naming what is missing, before any rendezvous.
    """
    if isinstance(obj, WeightSource):
        return obj
    has_meta = hasattr(type(obj), "metadata") or hasattr(obj, "metadata")
    has_iter = isinstance(obj, (Iterable, _IteratesFull))
    if not (has_meta and has_iter):
        missing = [
            w for w, ok in (("metadata", has_meta), ("__iter__ or iter_full()", has_iter)) if not ok
        ]
        raise WrongType(
            "a weight source needs metadata and iteration; "
            f"{type(obj).__name__} lacks {' and '.join(missing)}"
        )
    return _DuckSource(obj)


class _DuckSource(WeightSource):
    """Adapts a source-shaped object (e.g. vLLM's ``ModuleSource``) to ``WeightSource``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._raw: Any = None
        self._metas: list[ParamMeta] = []

    def __repr__(self) -> str:
        return f"as_source({self.inner!r})"

    def metadata(self) -> list[ParamMeta]:
        raw = self.inner.metadata
        raw = raw() if callable(raw) else raw
        if raw is not self._raw:  # vLLM caches its list: convert it once, not every round
            self._metas = [_to_meta(m) for m in raw]
            self._raw = raw
        return list(self._metas)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if isinstance(self.inner, Iterable):
            return iter(self.inner)
        return iter(self.inner.iter_full())

    def held_names(self) -> set[str] | None:
        names = self.inner.held_names() if isinstance(self.inner, _HoldsNames) else None
        return None if names is None else set(names)


def _to_meta(item: Any) -> ParamMeta:
    if isinstance(item, ParamMeta):
        return item
    try:
        name, dtype, shape = item.name, item.dtype, item.shape
    except AttributeError:
        raise WrongType(
            f"metadata items need name, dtype and shape; got {type(item).__name__}"
        ) from None
    dtype_name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    owners = getattr(item, "owners", None)
    return ParamMeta(name, dtype_name, tuple(shape), None if owners is None else tuple(owners))


def checked_iter(
    pairs: Iterable[tuple[str, Any]], metas: Sequence[ParamMeta], describe: Describe
) -> Iterator[tuple[str, Any]]:
    """Yield ``pairs`` while checking each against ``metas``; raise ``SourceMismatch``
    naming the first divergent name, dtype or shape, an extra tensor, or a missing one."""
    i, count = 0, len(metas)
    for name, tensor in pairs:
        if i >= count:
            raise SourceMismatch(
                f"source yielded more tensors than metadata declared ({count}); "
                f"first extra is {name!r}"
            )
        want = metas[i]
        try:
            dtype, shape = describe(tensor)
        except ConfigError as exc:  # the framework's refusal of the tensor itself: name it
            exc.args = (f"tensor {name!r} (index {i}): {exc}", *exc.args[1:])
            raise
        # ``shape`` is usually a tuple already: compare first, convert only if that failed.
        if (
            name != want.name
            or dtype != want.dtype
            or (shape != want.shape and tuple(shape) != want.shape)
        ):
            raise SourceMismatch(
                f"source metadata and iteration disagree at index {i}: declared {want.name!r} "
                f"{want.dtype} {list(want.shape)}, got {name!r} {dtype} {list(shape)}"
            )
        i += 1
        yield name, tensor
    if i != len(metas):
        raise SourceMismatch(
            f"source yielded {i} tensors but metadata declared {len(metas)}; "
            f"first missing is {metas[i].name!r}"
        )
