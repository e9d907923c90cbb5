"""``TrainerGroup``: the trainer's own processes, as a tiny key-value exchange.

Several broadcasting ranks must agree before anything is sent (the same metadata, the
broadcasters' TCP endpoints, whether the round committed). That agreement travels over
the store the trainer already has (``jax.distributed``'s coordination service, torch's
c10d store), never over the data plane, and every read is bounded by a timeout, so a
rank that died or diverged turns into an error naming it instead of a hang.

Liveness: each rank's engine beats while it lives (``Beat``: a thread of its own rewrites one
key of the engine's exchange every ``BEAT_S``), and a reader waiting longer than a beat for a
rank's part checks that rank's beat between slices of its wait (``Watch``): a rank whose beat
stopped changing for ``STOPPED_AFTER_S`` (SIGKILL, OOM, its host gone) or that ended it at
shutdown fails the wait at once, naming it; a rank merely slow between rounds keeps beating.

Implementations (each a ``StoreGroup``): ``weightwire.jax_side.multiprocess.JaxProcessGroup``
and ``weightwire.torch_side.sender.group.TorchStoreGroup``; tests may use ``DictGroup``.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from weightwire.shared.errors import ConfigError, RoundError

logger = logging.getLogger(__name__)

_EARLY_SLACK_S = 0.5
"""A store error this much before 90% of the timeout is a failure, not the timeout (stores
round their timeouts; a loaded machine wakes late)."""

BEAT_S = 1.0
"""How often a rank's beat thread rewrites its beat, and the slice of a reader's wait between
two looks at the awaited rank's beat."""

_POLL_S = 0.1
"""How often a wait longer than a beat looks whether the part was posted (one non-blocking
read; at most this much later than a blocking read would have returned)."""

STOPPED_AFTER_S = 6.0
"""A beat that did not change for this long, as the reader saw it, is a rank that stopped: a
few beats, so a beat thread held up a while (a loaded host, a GC pause) is not taken for a
dead rank, yet far below ``http_s``."""


class GroupTimeout(RoundError, TimeoutError):
    """A trainer rank did not publish its part within the timeout (it died, hung or diverged),
    or the store failed before the timeout (``after_s``: seconds until it did; the store,
    or the rank hosting it, is gone)."""

    def __init__(self, message: str, *, after_s: float | None = None) -> None:
        super().__init__(message)
        self.after_s = after_s


@runtime_checkable
class TrainerGroup(Protocol):
    """``rank`` / ``size`` of this process; ``publish`` once per key, ``read`` any rank's key."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def publish(self, key: str, value: str) -> None: ...

    def read(self, key: str, timeout: float) -> str:
        """The value published under ``key``; ``GroupTimeout`` if none within ``timeout`` s."""


_namespaces: dict[tuple[int, int], tuple[Any, itertools.count]] = {}
_namespaces_lock = threading.Lock()


def _namespace(group: TrainerGroup) -> int:
    """The next exchange namespace over ``group``'s store.

    Keyed by (store, rank), not by the group object: two group objects over one store
    (a ``TorchStoreGroup()`` built per engine) would otherwise both start at 0 and read
    each other's keys; the rank keeps ranks that share a process (threads in tests)
    apart. Strong references: stores live as long as the process anyway, and an ``id``
    must not be reused while its counter is kept.
    """
    identity = getattr(group, "store", None)
    if identity is None:
        identity = group
    with _namespaces_lock:
        entry = _namespaces.setdefault((id(identity), group.rank), (identity, itertools.count()))
        return next(entry[1])


class Beat:
    """This rank's heartbeat for one exchange: a daemon thread rewrites ``key`` every ``BEAT_S``
    with a counter and its wall time, beside the rank's main thread (which may compute for
    minutes between rounds), until ``stop``, which writes the beat's end (``left``).

    Hand-written: torch's ``TCPStore`` tells no client whether another is connected, and
    ``jax.distributed``'s ``get_live_nodes`` is a collective every live process must enter
    (it blocks until they do), so neither answers "is rank r alive" without waiting on r.
    """

    def __init__(self, group: StoreGroup, key: str) -> None:
        self._group, self._key = group, key
        self._stop = threading.Event()
        self._why = ""
        self._count = 0
        self._thread: threading.Thread | None = None

    def _write(self, **extra: Any) -> None:
        self._count += 1
        beat = {"n": self._count, "at": time.time(), **extra}
        self._group.beat(self._key, json.dumps(beat))

    def start(self) -> None:
        try:
            self._write()  # before any agreement: a rank killed after this is known stopped
        except Exception as exc:  # the others' waits on this rank keep their own bounds
            logger.warning(
                "trainer rank %d cannot beat over its group's store (%s: %s): another rank "
                "learns that this one died only at its own timeout",
                self._group.rank,
                type(exc).__name__,
                exc,
            )
            self._stop.set()
            return
        self._thread = threading.Thread(
            target=self._run, name=f"weightwire-beat-{self._group.rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._write()
            except Exception as exc:  # the store is gone: the readers' own bounds hold
                logger.debug("trainer rank %d could not beat: %s", self._group.rank, exc)
        try:  # the last word on this thread too: a store that hangs holds no shutdown
            self._write(left=self._why)
        except Exception as exc:  # the readers see the beat stop instead
            logger.debug("trainer rank %d could not end its beat: %s", self._group.rank, exc)

    def stop(self, why: str) -> None:
        """Ends the beat with ``why`` (a reader waiting on this rank names it), waiting at most
        two beats for the thread."""
        if self._stop.is_set():
            return
        self._why = why
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BEAT_S)


class Watch:
    """The other ranks' beats as this rank saw them while it waited on them: each beat's last
    value and when (this host's monotonic clock) it last changed, so the verdict "stopped"
    never compares two hosts' clocks."""

    def __init__(self, group: StoreGroup, key_of: Callable[[int], str]) -> None:
        self._group, self._key_of = group, key_of
        self._seen: dict[int, tuple[str, float]] = {}

    def stopped(self, rank: int) -> str | None:
        """Why ``rank`` will never post (it ended its beat, or its beat stopped), else None
        (alive, or no beat yet: a rank not started is waited for as before)."""
        raw = self._group.peek(self._key_of(rank))
        if raw is None:
            return None
        now = time.monotonic()
        beat = json.loads(raw)
        at = time.strftime("%H:%M:%S UTC", time.gmtime(beat.get("at", 0)))
        if beat.get("left"):
            return f"trainer rank {rank} {beat['left']} at {at} (its clock)"
        seen = self._seen.get(rank)
        if seen is None or seen[0] != raw:
            self._seen[rank] = (raw, now)
            return None
        if now - seen[1] < STOPPED_AFTER_S:
            return None
        return (
            f"trainer rank {rank} stopped beating: its last beat, at {at} (its clock), has not "
            f"changed for {now - seen[1]:.1f} s (its process died: killed, out of memory, or "
            "its host is gone)"
        )


class Exchange:
    """Lockstep exchanges over a ``TrainerGroup``: every rank calls the same sequence of
    ``allgather`` / ``post`` / ``get``, so the n-th call on each rank uses the same key."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group
        # Engines are built over a group in the same order on every rank, so the n-th
        # exchange over each rank's store gets the same namespace.
        self._ns = _namespace(group)
        self._seq = 0
        self._beat: Beat | None = None
        # a group that cannot rewrite or peek at a key (a user's own TrainerGroup) has no
        # liveness: its reads are bounded by their timeouts alone
        self._watch = (
            Watch(group, self._alive_key) if isinstance(group, StoreGroup) and group.beats else None
        )

    def _key(self, name: str, rank: int) -> str:
        return f"weightwire/{self._ns}/{self._seq}/{name}/{rank}"

    def _alive_key(self, rank: int) -> str:
        return f"weightwire/{self._ns}/alive/{rank}"

    def start_beat(self) -> None:
        """This rank beats under this exchange's namespace until ``stop_beat`` (its engine's
        shutdown): the other ranks' waits on it see it alive, or stopped."""
        if self._watch is None or self._beat is not None:
            return
        assert isinstance(self.group, StoreGroup)
        self._beat = Beat(self.group, self._alive_key(self.group.rank))
        self._beat.start()

    def stop_beat(self, why: str = "shut down its engine") -> None:
        if self._beat is not None:
            self._beat.stop(why)

    def step(self) -> None:
        self._seq += 1

    def post(self, name: str, value: Any) -> None:
        self.group.publish(self._key(name, self.group.rank), json.dumps(value))

    def get(self, name: str, rank: int, timeout: float, bound: float | None = None) -> Any:
        """Rank ``rank``'s ``name``, waiting at most ``timeout`` s; ``bound``: the timeout
        the caller was given, named in the error (``timeout`` is what is left of it). The
        first ``BEAT_S`` of the wait is one blocking read (a part posted already, or soon, costs
        what it did); a longer wait then looks for the part every ``_POLL_S`` and at ``rank``'s
        beat every ``BEAT_S``, and fails at once where the rank stopped (``Watch``). Polled,
        not more blocking reads: a TCPStore wait that times out logs two warnings each time."""
        bound = timeout if bound is None else bound
        key = self._key(name, rank)
        start = time.monotonic()
        deadline = start + timeout
        whole = self._watch is None or timeout <= 1.5 * BEAT_S
        try:
            return json.loads(self.group.read(key, timeout if whole else BEAT_S))
        except GroupTimeout as exc:
            if exc.after_s is not None:
                raise self._lost(name, rank, bound, start, exc) from None
            if whole:
                raise self._unpublished(name, rank, bound) from None
        assert isinstance(self.group, StoreGroup)
        look = time.monotonic()  # the first look at the beat: now, then every BEAT_S
        while True:
            try:
                raw = self.group.peek(key)
            except Exception as exc:  # the store itself failed (a lost connection)
                lost = GroupTimeout(f"{type(exc).__name__}: {str(exc)[:200]}", after_s=0.0)
                raise self._lost(name, rank, bound, start, lost) from None
            if raw is not None:
                return json.loads(raw)
            now = time.monotonic()
            if now >= deadline:
                raise self._unpublished(name, rank, bound)
            if now >= look:
                self._check_alive(name, rank, start)
                look = now + BEAT_S
            time.sleep(min(_POLL_S, max(0.0, deadline - now)))

    @staticmethod
    def _unpublished(name: str, rank: int, bound: float) -> GroupTimeout:
        return GroupTimeout(
            f"trainer rank {rank} did not publish {name!r} within {bound:g} s "
            "(it died, hung, or is running a different step)"
        )

    @staticmethod
    def _lost(name: str, rank: int, bound: float, start: float, exc: GroupTimeout) -> GroupTimeout:
        after = time.monotonic() - start
        return GroupTimeout(
            f"reading trainer rank {rank}'s {name!r} failed after {after:.1f} s, before its "
            f"{bound:g} s timeout: {exc} (is the group's store, or the rank hosting it, gone?)",
            after_s=after,
        )

    def _check_alive(self, name: str, rank: int, start: float) -> None:
        assert self._watch is not None and isinstance(self.group, StoreGroup)
        try:
            why = self._watch.stopped(rank)
        except Exception as exc:  # the store failed: the next look at the part tells it
            logger.debug("could not read trainer rank %d's beat: %s", rank, exc)
            return
        if why is None:
            return
        if self.group.peek(self._key(name, rank)) is not None:
            return  # posted in the instant before it left (leave() posts, then ends the beat)
        raise GroupTimeout(
            f"{why}, while trainer rank {self.group.rank} waited {time.monotonic() - start:.1f} s "
            f"for its {name!r}: it will not post it. Call shutdown() and trainer_init() again "
            "on every rank (a rank restarted alone is out of step)"
        )

    def allgather(self, name: str, value: Any, timeout: float) -> list[Any]:
        self.post(name, value)
        deadline = time.monotonic() + timeout
        return [
            value
            if r == self.group.rank
            else self.get(name, r, max(0.001, deadline - time.monotonic()), bound=timeout)
            for r in range(self.group.size)
        ]


class StoreGroup:
    """The shared part of a ``TrainerGroup`` over a key-value store: ``rank`` / ``size`` and
    a bounded read that turns the store's own timeout error (whatever its type) into a
    ``GroupTimeout`` naming the key. Subclasses implement ``_set`` and ``_get``."""

    def __init__(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ConfigError(f"rank {rank} is not in a group of size {size}")
        self._rank, self._size = rank, size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def store(self) -> object:
        """The underlying store: ``Exchange`` numbers its namespaces per (store, rank), so
        every group object over one store must return the same object here."""
        return self

    def _set(self, key: str, value: str) -> None:
        raise NotImplementedError

    def _get(self, key: str, timeout: float) -> str:
        """The value under ``key``, waiting at most ``timeout`` s; raise anything on timeout."""
        raise NotImplementedError

    def _put(self, key: str, value: str) -> None:
        """Set ``key``, overwriting its value (a beat); a store that cannot: no liveness."""
        raise NotImplementedError

    def _peek(self, key: str) -> str | None:
        """The value under ``key`` now, None if none, without waiting."""
        raise NotImplementedError

    @property
    def beats(self) -> bool:
        """Whether this store takes beats (``_put`` and ``_peek`` implemented)."""
        cls = type(self)
        return cls._put is not StoreGroup._put and cls._peek is not StoreGroup._peek

    def beat(self, key: str, value: str) -> None:
        self._put(key, value)

    def peek(self, key: str) -> str | None:
        return self._peek(key)

    def publish(self, key: str, value: str) -> None:
        self._set(key, value)

    def read(self, key: str, timeout: float) -> str:
        start = time.monotonic()
        try:
            return self._get(key, timeout)
        except GroupTimeout:
            raise
        except (
            Exception
        ) as exc:  # each store raises its own type on timeout (DistStoreError, XLA's, ...)
            elapsed = time.monotonic() - start
            if (
                elapsed < 0.9 * timeout - _EARLY_SLACK_S
            ):  # no timeout: the store itself failed (a lost connection)
                raise GroupTimeout(
                    f"{type(exc).__name__}: {str(exc)[:200]}", after_s=elapsed
                ) from None
            raise GroupTimeout(f"{key}: {type(exc).__name__}") from None


class DictGroup(StoreGroup):
    """In-process group over a shared dict (tests, threads standing in for ranks)."""

    def __init__(
        self, rank: int, size: int, shared: dict[str, str], cv: threading.Condition
    ) -> None:
        super().__init__(rank, size)
        self._shared, self._cv = shared, cv

    @property
    def store(self) -> object:
        return self._shared

    @classmethod
    def make(cls, size: int) -> list[DictGroup]:
        shared: dict[str, str] = {}
        cv = threading.Condition()
        return [cls(r, size, shared, cv) for r in range(size)]

    def _set(self, key: str, value: str) -> None:
        with self._cv:
            self._shared[key] = value
            self._cv.notify_all()

    def _put(self, key: str, value: str) -> None:
        self._set(key, value)

    def _peek(self, key: str) -> str | None:
        with self._cv:
            return self._shared.get(key)

    def _get(self, key: str, timeout: float) -> str:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._shared, timeout=timeout):
                raise GroupTimeout(key)
            return self._shared[key]
