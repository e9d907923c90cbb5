"""The engine's side of overlapped rounds: ``send_weights(wait=False)`` and what waits for it.

``OverlappedRounds`` belongs to one ``TrainerEngine``. It takes the framework engine's snapshot
on the trainer's thread and hands the engine's own blocking round to a ``RoundRunner``
(``trainer.overlap``), which runs it on the round thread over the snapshot. A blocking
``send_weights()`` first ``settle``-s the rounds in flight; ``shutdown`` ``stop``-s them.
"""

from __future__ import annotations

from collections.abc import Callable

from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.trainer.metrics import RoundMetrics
from weightwire.trainer.overlap import IN_FLIGHT_MODES, RoundHandle, RoundRunner
from weightwire.trainer.session import Session
from weightwire.trainer.snapshot import Snapshot

Blocking = Callable[[WeightSource, str | None, bool, bool, Callable[[], None] | None], RoundMetrics]
"""The engine's blocking round: ``(source, weight_version, draft, dense, before_commit)``."""


class OverlappedRounds:
    """One engine's overlapped rounds (the runner is made at the first one)."""

    def __init__(
        self,
        session: Session,
        blocking: Blocking,
        snapshot: Callable[[list[ParamMeta] | None], Snapshot],
        usable: Callable[[], None],
    ) -> None:
        self._s = session
        self._blocking = blocking
        self._snapshot = snapshot
        self._usable = usable  # raises when the engine can send no round (a broken link)
        self._runner: RoundRunner | None = None
        self.aborted_link = False
        """``stop`` aborted the link under a running round: a closed link is this trainer's
        doing then, not a server that dropped it (``shutdown`` still tells the servers)."""

    def send(
        self,
        weight_version: str | None,
        draft: bool,
        dense: bool = False,
        metas: list[ParamMeta] | None = None,
    ) -> RoundHandle:
        """Wait for a free slot, take the snapshot, queue the round; its handle. ``metas``:
        the source's ``metadata()`` if the caller just read it (the snapshot's, then)."""
        s = self._s
        if weight_version is not None:
            s.next_version(weight_version)  # a bad version fails here, not on the round thread
        if not s.info.is_sender:  # other ranks only iterate (their gathers): done now
            return RoundHandle.completed(
                self._blocking(s.source, weight_version, draft, dense, None)
            )
        runner = self._runner
        if runner is None:
            runner = self._runner = RoundRunner(
                self._blocking,  # over the snapshot, asking before_commit before its finish
                s.next_version,
                limit=s.info.max_rounds_in_flight,
                wait_s=s.info.timeouts.round_s,
                abort_link=self._abort_link,
            )
        runner.wait_slot()  # raises an earlier round's failure instead, if nothing raised it yet
        try:
            self._usable()
        except BaseException:
            runner.raise_unseen()  # a round that failed meanwhile broke the engine: its own error
            raise
        return runner.submit(self._snapshot(metas), weight_version, draft, dense)

    def settle(self) -> None:
        """Before a blocking round: the rounds in flight end first (their failure is raised).
        A no-op on the round thread itself (the blocking round it runs is one of them)."""
        runner = self._runner
        if runner is not None and not runner.on_round_thread():
            runner.settle()

    def stop(self, in_flight: str, timeout: float | None) -> BaseException | None:
        """``shutdown``'s part: drain or abort; returns a failure still to be raised."""
        if in_flight not in IN_FLIGHT_MODES:
            raise ConfigError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
        runner, self._runner = self._runner, None
        if runner is None:
            return None
        try:
            return runner.stop(in_flight, timeout)
        finally:
            runner.close()

    def _abort_link(self) -> None:
        link = self._s.link
        if link is not None:
            self.aborted_link = True
            link.abort()
