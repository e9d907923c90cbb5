"""What an overlapped round sends: the weights fixed when ``send_weights(wait=False)`` was
called (``Snapshot``, ``FrozenSource``), read on the round thread through a source that a
``shutdown(in_flight="abort")`` stops at its next tensor (``cancellable``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from weightwire.shared.errors import RoundError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource

__all__ = ["FrozenSource", "RoundCancelled", "Snapshot", "cancellable"]

SNAPSHOT_MODES = ("copy", "none")


class RoundCancelled(RoundError, RuntimeError):
    """``shutdown(in_flight="abort")`` stopped a running overlapped round before its last
    tensor: the servers keep their previous weights."""


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Snapshot:
    """The weights one overlapped round sends, fixed when ``send_weights`` was called.

    ``ready`` runs on the round's thread before the first read (torch: waits for the copy
    into the buffers); ``release`` runs once the round ended, whatever its outcome (torch:
    the buffers go back to the pool)."""

    source: WeightSource
    ready: Callable[[], None] = _nothing
    release: Callable[[], None] = _nothing


class FrozenSource(WeightSource):
    """A source whose metadata and tensors were taken once: every pass yields the same
    ``pairs``, checked against ``metas`` by the round like any source's."""

    def __init__(self, metas: list[ParamMeta], pairs: list[tuple[str, Any]]) -> None:
        self._metas = list(metas)
        self._pairs = pairs

    def __repr__(self) -> str:
        return f"FrozenSource({len(self._pairs)} tensors)"

    def metadata(self) -> list[ParamMeta]:
        return list(self._metas)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._pairs)


class _Cancellable(WeightSource):
    """``inner`` whose passes stop with ``RoundCancelled`` once ``stop`` is set."""

    def __init__(self, inner: WeightSource, stop: threading.Event) -> None:
        self.inner, self._stop = inner, stop

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def held_names(self) -> set[str] | None:
        return self.inner.held_names()

    def checks_own_stream(self, metas: Any) -> bool:
        return self.inner.checks_own_stream(metas)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for pair in self.inner:
            self._check()
            yield pair

    def _check(self) -> None:
        if self._stop.is_set():
            raise RoundCancelled("shutdown(in_flight='abort') stopped this round mid-transfer")


class _CancellableGroups(_Cancellable):
    """The same for a source with its own grouped passes (``PytreeSource``: one device call
    per layer group), which the round then drives per group as it would the source itself."""

    def iter_groups(self) -> Iterator[list[tuple[str, Any]]]:
        for group in self.inner.iter_groups():
            self._check()
            yield group


def cancellable(inner: WeightSource, stop: threading.Event) -> WeightSource:
    """``inner``, its passes stopped with ``RoundCancelled`` once ``stop`` is set."""
    if type(inner).iter_groups is WeightSource.iter_groups:
        return _Cancellable(inner, stop)
    return _CancellableGroups(inner, stop)
