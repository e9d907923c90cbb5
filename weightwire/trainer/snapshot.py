"""What an overlapped round sends: the weights fixed when ``send_weights(wait=False)`` was
called (``Snapshot``, ``FrozenSource``), read on the round thread through a source that a
``shutdown`` stops at its next tensor (``cancellable``), and the round's ``RoundStop``: once
stopped, the round can no longer commit. ``FailedFirst``: whether a blocking round that
another thread's ``shutdown`` stopped had failed on its own before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

from weightwire.shared.errors import RoundError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource

__all__ = [
    "FailedFirst",
    "FrozenSource",
    "RoundCancelled",
    "RoundStop",
    "Snapshot",
    "SnapshotChanged",
    "cancellable",
    "rewrapped",
]

SNAPSHOT_MODES = ("copy", "none", "cow")


class RoundCancelled(RoundError, RuntimeError):
    """``shutdown`` stopped a running overlapped round (``in_flight="abort"``, or a drain
    that ran out of its timeout) before its last tensor or before its commit: the servers
    keep their previous weights."""


class SnapshotChanged(RoundError, RuntimeError):
    """An overlapped round's weights were written in place after ``send_weights(wait=False)``
    and before the round had read them, by a write its snapshot could not see coming
    (``snapshot="cow"``: not a torch optimizer's ``step`` nor after ``before_update``). The
    round is not committed: the servers keep their previous weights."""


class RoundStop:
    """How ``shutdown`` stops one overlapped round, and whether it still could.

    ``stop`` stops the round's source at its next tensor and closes its commit: the round
    driver asks ``before_commit`` right before the finish goes out, and from then on no
    stop can withdraw it. The lock makes "stopped" and "finish sent" exclusive, so the
    caller of ``stop`` is told the truth about the servers."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._committing = False

    def stop(self) -> bool:
        """Stop the round. ``True``: it can no longer commit; ``False``: its finish was
        already sent (the servers may commit it)."""
        with self._lock:
            self.event.set()
            return not self._committing

    def before_commit(self) -> None:
        """The round's last chance to be stopped: ``RoundCancelled`` once stopped, else the
        finish may go out."""
        with self._lock:
            if self.event.is_set():
                raise RoundCancelled(
                    "shutdown stopped this round before its commit: its finish was never sent, "
                    "the servers keep their previous weights"
                )
            self._committing = True


class FailedFirst:
    """A blocking ``send_weights`` / ``send_patches`` that ``shutdown`` (from another thread)
    stopped: had its round failed on its own before the stop?

    The round's failure points report their error (``failed``) as soon as they catch it;
    ``shutdown`` calls ``stopping`` before it closes anything, so an error reported before
    that cannot be the closed link's (the lock orders the two). The caller then raises the
    round's own error, not the stop (``came_first``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopping = False
        self._own: BaseException | None = None

    def begin(self) -> None:
        """A new call: nothing failed yet (a failure an earlier call handled is not this one's)."""
        with self._lock:
            self._own = None

    def failed(self, exc: BaseException) -> None:
        """A round's failure point caught ``exc``: its own if no stop came before it."""
        with self._lock:
            if not self._stopping and self._own is None:
                self._own = exc

    def stopping(self) -> None:
        """``shutdown``, before it closes the link: errors from now on may be the stop's."""
        with self._lock:
            self._stopping = True

    def came_first(self, exc: BaseException) -> bool:
        """Whether ``exc`` (what the call raises) is the round's own failure, reported before
        the stop: that error itself, or one it led to (its cause or context chain, as the
        server's verdict raised for a failed data plane). An error the round recovered from
        (a delta round retried dense) is in no chain of the one it raises."""
        with self._lock:
            own = self._own
        seen: set[int] = set()
        link: BaseException | None = exc
        while own is not None and link is not None and id(link) not in seen:
            if link is own:
                return True
            seen.add(id(link))
            link = link.__cause__ or link.__context__
        return False


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Snapshot:
    """The weights one overlapped round sends, fixed when ``send_weights`` was called.

    ``context`` is entered on the round's thread around everything below and exited before
    ``release`` (torch: the round's own CUDA streams, so that its device work is ordered
    after the snapshot and never queues behind the trainer's next step); ``ready`` runs on
    the round's thread before the first read (torch: waits for the copy into the buffers);
    ``before_commit`` right before the round's finish goes out, once its data plane has read
    every tensor (torch ``cow``: the last check that nothing it read was written meanwhile;
    raising keeps the round from committing); ``release`` runs once the round ended,
    whatever its outcome (torch: the buffers go back to the pool)."""

    source: WeightSource
    ready: Callable[[], None] = _nothing
    release: Callable[[], None] = _nothing
    before_commit: Callable[[], None] = _nothing
    context: Callable[[], AbstractContextManager[Any]] = nullcontext


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


class Stop(Protocol):
    """What stops a ``cancellable`` source: ``is_set`` asked before each tensor it yields
    (a ``threading.Event``; rank 0's look at the other ranks' own passes,
    ``multi_source.OwnPasses``)."""

    def is_set(self) -> bool: ...


def _shutdown_stopped() -> BaseException:
    return RoundCancelled("shutdown stopped this round mid-transfer, before its last tensor")


class _Cancellable(WeightSource):
    """``inner`` whose passes stop with ``why()`` (default: ``RoundCancelled``) once
    ``stop`` is set."""

    def __init__(
        self,
        inner: WeightSource,
        stop: Stop,
        why: Callable[[], BaseException] = _shutdown_stopped,
    ) -> None:
        self.inner, self._stop, self._why = inner, stop, why

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
            raise self._why()


class _CancellableGroups(_Cancellable):
    """The same for a source with its own grouped passes (``PytreeSource``: one device call
    per layer group), which the round then drives per group as it would the source itself."""

    def iter_groups(self) -> Iterator[list[tuple[str, Any]]]:
        for group in self.inner.iter_groups():
            self._check()
            yield group


def cancellable(
    inner: WeightSource, stop: Stop, why: Callable[[], BaseException] = _shutdown_stopped
) -> WeightSource:
    """``inner``, its passes stopped with ``why()`` once ``stop`` is set (default: a
    shutdown's ``RoundCancelled``)."""
    if type(inner).iter_groups is WeightSource.iter_groups:
        return _Cancellable(inner, stop, why)
    return _CancellableGroups(inner, stop, why)


def rewrapped(source: WeightSource, change: Callable[[WeightSource], WeightSource]) -> WeightSource:
    """``change`` applied to the source a round reads, under its ``cancellable`` wrappers,
    which stay (an overlapped round's, rank 0's look at the other ranks' passes): a
    framework's own view of its source (a sliced round's ``sliced_source``) must see the
    snapshot, not the wrappers it does not know."""
    if isinstance(source, _Cancellable):
        return cancellable(rewrapped(source.inner, change), source._stop, source._why)
    return change(source)
