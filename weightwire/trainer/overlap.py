"""Overlapped rounds: ``send_weights(wait=False)`` hands the round to one worker thread.

The trainer's thread takes a consistent snapshot of the weights (the framework engine's
``snapshot``: JAX references its immutable arrays, torch copies into reusable buffers or
relies on the caller's promise not to write them), hands it to ``RoundRunner`` and returns
a ``RoundHandle`` at once. The runner's single thread runs the engine's ordinary blocking
round on each snapshot in call order, so versions, verification and the all-or-nothing
rules are the blocking round's own. What a round reads (``Snapshot``, its cancellable
source) is ``trainer.snapshot``.

Rules the runner enforces:

- at most ``limit`` rounds in flight (queued or running); ``send_weights`` waits for a slot,
  so with the default of one, a round starts only after the previous one ended;
- a failed round fails every round queued behind it with ``RoundSkipped`` (naming the
  failed round): nothing is applied on top of a round that did not land;
- a failure is never lost: it is raised by the failed round's ``result()`` and, until some
  ``result()`` raised it, by the next ``send_weights``, which then sends nothing. That call
  may be waiting for a slot when the round fails (the freed slot is not taken) or past its
  wait (``submit`` queues nothing): one rule, ``_take_unseen``, under the runner's lock;
- every wait is bounded (``Timeouts.round_s`` unless the caller gives a timeout);
- ``stop`` drains (every queued round runs) or aborts (queued rounds are skipped, the
  running one is stopped at its next tensor and before its commit, its link aborted). A
  drain that runs out of time aborts what is left the same way and says whether the
  running round could still commit (its finish was already sent) or not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from weightwire.shared.errors import RoundError
from weightwire.shared.source import WeightSource
from weightwire.trainer.metrics import RoundMetrics
from weightwire.trainer.snapshot import RoundStop, Snapshot, cancellable

logger = logging.getLogger(__name__)

__all__ = [
    "RoundHandle",
    "RoundRunner",
    "RoundSkipped",
    "RoundWaitTimeout",
]

MAX_ROUNDS_IN_FLIGHT = 8
"""Each round in flight holds a snapshot (torch ``copy``: a model's size of device memory)."""
DRAIN = "drain"
ABORT = "abort"
IN_FLIGHT_MODES = (DRAIN, ABORT)


class RoundSkipped(RoundError, RuntimeError):
    """An overlapped round was never sent: a round before it failed, or ``shutdown`` aborted
    the rounds in flight. The message names the round and why; ``__cause__`` is the earlier
    round's error."""


class RoundWaitTimeout(RoundError, TimeoutError):
    """A wait for an overlapped round ran out. After ``result(timeout)`` or a ``send_weights``
    waiting for a free slot, the round itself goes on and its handle still reports it; after
    ``shutdown``'s drain, what was left was abandoned and the message says what the servers
    hold."""


class RoundHandle:
    """One overlapped round, returned by ``send_weights(wait=False)``.

    ``result(timeout)`` returns the round's ``RoundMetrics`` once it committed, or raises
    its error: the same exception the blocking call would have raised (``PeerLost``,
    ``WeightSyncError``, ...), ``RoundSkipped`` for a round never sent. ``done()`` says
    whether it ended. ``call`` numbers this engine's overlapped rounds from 1.
    """

    def __init__(
        self, call: int, requested: str | None, wait_s: float, seen: Callable[[Any], None]
    ) -> None:
        self.call = call
        self.requested = requested
        """The ``weight_version`` passed to ``send_weights`` (``None``: the automatic one)."""
        self.version: str | None = requested
        """The round's weight version: the automatic one is known once the round started."""
        self._future: Future[RoundMetrics] = Future()
        self._wait_s = wait_s
        self._seen = seen

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"RoundHandle(call={self.call}, version={self.version!r}, {state})"

    @property
    def name(self) -> str:
        """How messages name the round: its version, once known, and its call number."""
        if self.version is None:
            return f"overlapped round #{self.call}"
        return f"round {self.version!r} (overlapped round #{self.call})"

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> RoundMetrics:
        """The round's metrics once it committed; its error if it failed. Waits at most
        ``timeout`` seconds (default: the engine's ``Timeouts.round_s``), then raises
        ``RoundWaitTimeout``; the round goes on."""
        bound = self._wait_s if timeout is None else timeout
        try:
            return self._future.result(timeout=bound)
        except FutureTimeout:
            if self._future.done():  # the round's own error was a TimeoutError
                self._seen(self._future.exception())
                raise
            raise RoundWaitTimeout(f"{self.name} is still in flight after {bound} s") from None
        except BaseException as exc:
            self._seen(exc)
            raise

    @classmethod
    def completed(cls, metrics: RoundMetrics) -> RoundHandle:
        """A handle for a round that already ended (a non-sending rank's part)."""
        handle = cls(0, metrics.version, 0.0, lambda exc: None)
        handle._settle(metrics, None)
        return handle

    # -- the runner's side
    def _settle(self, metrics: RoundMetrics | None, exc: BaseException | None) -> None:
        if exc is None:
            assert metrics is not None
            self.version = metrics.version
            self._future.set_result(metrics)
        else:
            self._future.set_exception(exc)


@dataclass
class Job:
    """One queued round: its snapshot, as ``send_weights`` was called."""

    handle: RoundHandle
    snapshot: Snapshot
    weight_version: str | None
    draft: bool
    dense: bool
    stop: RoundStop = field(default_factory=RoundStop)


RunRound = Callable[[WeightSource, str, bool, bool, Callable[[], None]], RoundMetrics]
"""The engine's blocking round over a given source: ``(source, weight_version, draft, dense,
before_commit)``; ``before_commit`` raises once ``shutdown`` stopped the round."""
NextVersion = Callable[[str | None], str]
"""The version a round about to start sends (the session's ``next_version``)."""


class RoundRunner:
    """The worker thread that runs an engine's overlapped rounds, in call order."""

    def __init__(
        self,
        run: RunRound,
        next_version: NextVersion,
        *,
        limit: int,
        wait_s: float,
        abort_link: Callable[[], None],
    ) -> None:
        self._run = run
        self._next_version = next_version
        self._limit = limit
        self._wait_s = wait_s
        self._abort_link = abort_link
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._running: Job | None = None
        self._calls = 0
        self._unseen: tuple[BaseException, str] | None = None
        """The last failure no ``result()`` or ``send_weights`` has raised yet, and its round."""
        self._aborting = False
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- the trainer's thread
    def on_round_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def in_flight(self) -> int:
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def raise_unseen(self) -> None:
        """Raise the failure of an earlier round that nothing has raised yet (once)."""
        with self._cond:
            self._take_unseen()

    def wait_slot(self) -> None:
        """Until fewer than ``limit`` rounds are in flight (``RoundWaitTimeout`` after
        ``wait_s``); raises instead an earlier round's failure nothing raised yet, also one
        that freed the slot this call was waiting for."""
        self._wait_until(
            lambda: (
                self._unseen is not None
                or len(self._queue) + (self._running is not None) < self._limit
            )
        )
        self.raise_unseen()

    def submit(
        self, snapshot: Snapshot, weight_version: str | None, draft: bool, dense: bool = False
    ) -> RoundHandle:
        """Queue a round on ``snapshot``; raises (the snapshot released, nothing queued) an
        earlier round's failure nothing raised yet, also one that came after ``wait_slot``."""
        with self._cond:
            try:
                self._take_unseen()
            except BaseException:
                _release(snapshot, "a round never queued")
                raise
            self._calls += 1
            handle = RoundHandle(self._calls, weight_version, self._wait_s, self._mark_seen)
            self._queue.append(Job(handle, snapshot, weight_version, draft, dense))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="weightwire-overlap", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        return handle

    def settle(self, timeout: float | None = None) -> None:
        """Wait until no round is in flight, then raise a failure nothing raised yet."""
        self._wait_until(lambda: not self._queue and self._running is None, timeout)
        self.raise_unseen()

    def stop(self, mode: str, timeout: float | None = None) -> BaseException | None:
        """End every round in flight; returns what the caller must still raise.

        ``drain``: wait for each to end. ``abort``: skip the queued rounds, stop the running
        one at its next tensor and before its commit, and abort its link.
        A drain that runs out of ``timeout`` (default ``wait_s``) aborts what is left and
        returns a ``RoundWaitTimeout`` that says what the servers may still hold; otherwise
        returns a failure nothing raised yet."""
        bound = self._wait_s if timeout is None else timeout
        if mode == DRAIN:
            try:
                self._wait_until(lambda: not self._queue and self._running is None, bound)
            except RoundWaitTimeout as exc:
                told = self._abort(_ABORT_WAIT_S)
                late = RoundWaitTimeout(f"shutdown: {exc}, so it was abandoned: {told}")
                late.__suppress_context__ = True
                return late
        else:
            self._abort(bound)
        with self._cond:
            unseen, self._unseen = self._unseen, None
        return None if unseen is None else unseen[0]

    def _abort(self, bound: float) -> str:
        """Skip the queued rounds, stop the running one; what the servers may hold now."""
        with self._cond:
            self._aborting = True
            skipped = list(self._queue)
            self._queue.clear()
            running = self._running
            self._cond.notify_all()
        told = []
        if running is not None:
            # Its commit closes first: from here the round cannot commit, unless its finish
            # already went out. The flag also stops it at its next tensor; a wire wait does not
            # see it, the link's abort ends that (the engine is being shut down: the link goes
            # anyway).
            stopped = running.stop.stop()
            self._abort_link()
            ended = self._idle_within(bound)
            if not ended:
                logger.error("%s did not end after its link was aborted", running.handle.name)
            told.append(_outcome(running.handle, stopped, ended))
        for job in skipped:
            never = RoundSkipped(f"{job.handle.name} was never sent: shutdown abandoned it")
            self._finish(job, None, never)
        if skipped:
            told.append(f"{len(skipped)} queued round(s) were never sent")
        return "; ".join(told) or "no round was left"

    def close(self) -> None:
        """No more rounds: the idle thread exits now."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- waiting
    def _wait_until(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        bound = self._wait_s if timeout is None else timeout
        deadline = time.monotonic() + bound
        with self._cond:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    ahead = self._running.handle.name if self._running else "a queued round"
                    raise RoundWaitTimeout(f"{ahead} is still in flight after {bound} s")
                self._cond.wait(left)

    def _idle_within(self, seconds: float) -> bool:
        try:
            self._wait_until(lambda: self._running is None, seconds)
        except RoundWaitTimeout:
            return False
        return True

    def _take_unseen(self) -> None:
        """Under the lock: raise (once) a failure nothing raised yet. Every round is admitted
        through here, so nothing is sent after a failed round until its error was raised."""
        unseen, self._unseen = self._unseen, None
        if unseen is not None:
            exc, name = unseen
            exc.add_note(f"{name} failed in flight; no round after it was sent")
            raise exc

    def _mark_seen(self, exc: Any) -> None:
        with self._cond:
            failed = None if self._unseen is None else self._unseen[0]
            if exc is not None and failed is not None and failed in (exc, exc.__cause__):
                self._unseen = None

    # -- the worker thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed or (not self._cond.wait(_IDLE_EXIT_S) and not self._queue):
                        self._thread = None  # idle: a later submit starts a new thread
                        return
                job = self._queue.popleft()
                self._running = job
            self._execute(job)

    def _execute(self, job: Job) -> None:
        metrics: RoundMetrics | None = None
        error: BaseException | None = None
        try:
            version = self._next_version(job.weight_version)
            job.handle.version = version
            with job.snapshot.context():
                job.snapshot.ready()
                source = cancellable(job.snapshot.source, job.stop.event)
                metrics = self._run(source, version, job.draft, job.dense, _before_commit(job))
        except BaseException as exc:  # handed to the handle: never lost, never raised here
            error = exc
        self._finish(job, metrics, error)

    def _finish(self, job: Job, metrics: RoundMetrics | None, error: BaseException | None) -> None:
        _release(job.snapshot, job.handle.name)
        skipped: list[Job] = []
        with self._cond:
            if self._running is job:
                self._running = None
            if error is not None and not isinstance(error, RoundSkipped) and not self._aborting:
                self._unseen = (error, job.handle.name)
                skipped = list(self._queue)  # nothing goes on top of a round that did not land
                self._queue.clear()
            self._cond.notify_all()
        job.handle._settle(metrics, error)
        for later in skipped:
            why = RoundSkipped(
                f"{later.handle.name} was not sent: {job.handle.name} failed before it "
                f"({type(error).__name__}: {error})"
            )
            why.__cause__ = error
            self._finish(later, None, why)


def _outcome(handle: RoundHandle, stopped: bool, ended: bool) -> str:
    """What the servers hold of an abandoned running round."""
    if stopped:
        return (
            f"{handle.name} was stopped before its commit (no finish sent): the servers keep "
            "their last committed weights"
        )
    if not ended:
        return (
            f"{handle.name} had already sent its finish and had not returned: the servers may "
            "still commit it (their /weight_info weight_version tells)"
        )
    try:  # ended: the handle is settled right after the round left the runner
        error = handle._future.exception(timeout=_ABORT_WAIT_S)
    except FutureTimeout:
        return f"{handle.name} had already sent its finish; its outcome is unknown"
    if error is None:
        return f"{handle.name} had already sent its finish and committed"
    return f"{handle.name} had already sent its finish, which failed ({type(error).__name__})"


def _before_commit(job: Job) -> Callable[[], None]:
    """The snapshot's last check, then the stop's last chance (a stopped round never commits)."""
    check = job.snapshot.before_commit

    def before_commit() -> None:
        check()
        job.stop.before_commit()

    return before_commit


def _release(snapshot: Snapshot, name: str) -> None:
    try:
        snapshot.release()
    except Exception as exc:  # a pool's bookkeeping must not replace the round's outcome
        logger.warning("releasing %s's snapshot failed: %s", name, exc)


_ABORT_WAIT_S = 10.0
"""After a drain ran out of time: how long the abort of what is left may take."""
_IDLE_EXIT_S = 30.0
"""An idle runner thread exits after this long; the next overlapped round starts another."""
