"""``TrainerGroup``: the trainer's own processes, as a tiny key-value exchange.

Several broadcasting ranks must agree before anything is sent (the same metadata, the
broadcasters' TCP endpoints, whether the round committed). That agreement travels over
the store the trainer already has (``jax.distributed``'s coordination service, torch's
c10d store), never over the data plane, and every read is bounded by a timeout, so a
rank that died or diverged turns into an error naming it instead of a hang.

Implementations (each a ``StoreGroup``): ``weightwire.jax_side.multiprocess.JaxProcessGroup``
and ``weightwire.torch_side.sender.group.TorchStoreGroup``; tests may use ``DictGroup``.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any, Protocol, runtime_checkable

from weightwire.shared.errors import ConfigError, RoundError

_EARLY_SLACK_S = 0.5
"""A store error this much before 90% of the timeout is a failure, not the timeout (stores
round their timeouts; a loaded machine wakes late)."""


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


class Exchange:
    """Lockstep exchanges over a ``TrainerGroup``: every rank calls the same sequence of
    ``allgather`` / ``post`` / ``get``, so the n-th call on each rank uses the same key."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group
        # Engines are built over a group in the same order on every rank, so the n-th
        # exchange over each rank's store gets the same namespace.
        self._ns = _namespace(group)
        self._seq = 0

    def _key(self, name: str, rank: int) -> str:
        return f"weightwire/{self._ns}/{self._seq}/{name}/{rank}"

    def step(self) -> None:
        self._seq += 1

    def post(self, name: str, value: Any) -> None:
        self.group.publish(self._key(name, self.group.rank), json.dumps(value))

    def get(self, name: str, rank: int, timeout: float, bound: float | None = None) -> Any:
        """Rank ``rank``'s ``name``, waiting at most ``timeout`` s; ``bound``: the timeout
        the caller was given, named in the error (``timeout`` is what is left of it)."""
        bound = timeout if bound is None else bound
        try:
            return json.loads(self.group.read(self._key(name, rank), timeout))
        except GroupTimeout as exc:
            if exc.after_s is not None:
                raise GroupTimeout(
                    f"reading trainer rank {rank}'s {name!r} failed after {exc.after_s:.1f} s, "
                    f"before its {bound:g} s timeout: {exc} (is the group's store, or the rank "
                    "hosting it, gone?)",
                    after_s=exc.after_s,
                ) from None
            raise GroupTimeout(
                f"trainer rank {rank} did not publish {name!r} within {bound:g} s "
                "(it died, hung, or is running a different step)"
            ) from None

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

    def _get(self, key: str, timeout: float) -> str:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._shared, timeout=timeout):
                raise GroupTimeout(key)
            return self._shared[key]
