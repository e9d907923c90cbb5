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
from typing import Any

from weightwire.shared.groups import batch_by_layer, layerwise_groups
from weightwire.shared.meta import ParamMeta

Describe = Callable[[Any], tuple[str, tuple[int, ...]]]
"""Maps a yielded tensor to its ``(wire dtype name, shape)``."""


class SourceMismatch(ValueError):
    """Iteration disagreed with ``metadata()``; raised before the bad tensor is sent."""


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
        return [g for g in layerwise_groups(self.metadata()) if held is None or any(m.name in held for m in g)]

    def iter_groups(self) -> Iterator[list[tuple[str, Any]]]:
        """The same stream as iteration, batched one layer group at a time."""
        return batch_by_layer(self)


def checked_iter(
    pairs: Iterable[tuple[str, Any]], metas: Sequence[ParamMeta], describe: Describe
) -> Iterator[tuple[str, Any]]:
    """Yield ``pairs`` while checking each against ``metas``; raise ``SourceMismatch``
    naming the first divergent name, dtype or shape, an extra tensor, or a missing one."""
    i = 0
    for name, tensor in pairs:
        if i >= len(metas):
            raise SourceMismatch(f"source yielded more tensors than metadata declared ({len(metas)}); first extra is {name!r}")
        want = metas[i]
        dtype, shape = describe(tensor)
        if name != want.name or dtype != want.dtype or tuple(shape) != want.shape:
            raise SourceMismatch(
                f"source metadata and iteration disagree at index {i}: declared {want.name!r} "
                f"{want.dtype} {list(want.shape)}, got {name!r} {dtype} {list(shape)}"
            )
        i += 1
        yield name, tensor
    if i != len(metas):
        raise SourceMismatch(f"source yielded {i} tensors but metadata declared {len(metas)}; first missing is {metas[i].name!r}")
