"""Run blocking calls on side threads that can never hold the process hostage.

Every control-plane call that runs concurrently with a transfer (the update POST,
the init POST, one call per DP replica) goes through ``spawn``. The threads are
daemons and nobody joins them on an error path: a server blocked in a receive that
will never complete must not turn the trainer's error into a hang, neither in the
engine nor at interpreter exit (``ThreadPoolExecutor`` workers are joined at exit,
which is why it is not used here).

The daemon threads are kept for reuse (``_Helpers``): a round spawns two of them on
its critical path (the start call's and the update POST's), and starting a thread
costs ~0.1 ms where handing work to an idle one costs ~10 us.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")


MAX_IDLE = 8
"""Idle helper threads kept for reuse; a helper finishing while this many wait exits."""


class _Helpers:
    """Reusable daemon threads: work goes to an idle one, or to a new one when none is
    idle (a call never waits for a busy helper: a straggler blocked for minutes must not
    delay the next round's calls)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = 0  # helpers blocked on (or about to block on) ``_work``
        self._work: queue.SimpleQueue[tuple[Callable[[], None], str]] = queue.SimpleQueue()

    def run(self, task: Callable[[], None], name: str) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1  # exactly one idle helper takes exactly this item
                self._work.put((task, name))
                return
        threading.Thread(target=self._loop, args=(task,), name=name, daemon=True).start()

    def _loop(self, task: Callable[[], None]) -> None:
        me = threading.current_thread()
        while True:
            task()  # never raises: ``spawn`` hands every outcome to its future
            del task  # an idle helper keeps nothing of the last call alive
            with self._lock:
                if self._idle >= MAX_IDLE:
                    return
                self._idle += 1
            task, me.name = self._work.get()


_HELPERS = _Helpers()


def spawn(fn: Callable[[], T], *, name: str) -> Future[T]:
    """Run ``fn`` on a daemon thread; its result or exception lands in the future."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the waiter, never swallowed
            future.set_exception(exc)
        else:
            future.set_result(result)

    _HELPERS.run(run, name)
    return future


def fan_out(calls: Sequence[Callable[[], T]], *, timeout: float | None, name: str) -> list[T]:
    """Run every call concurrently; return all results in order, or fail fast.

    The first exception is raised as soon as it arrives, without waiting for the
    other calls: a replica still blocked in a receive would otherwise keep the
    caller from ever seeing why the round failed. ``timeout`` bounds the whole wait
    (``TimeoutError`` naming ``name``); the stragglers are left to their own
    timeouts on their daemon threads.
    """
    if len(calls) == 1:
        return [calls[0]()]
    futures = [spawn(call, name=f"{name}-{i}") for i, call in enumerate(calls)]
    done, pending = wait(futures, timeout=timeout, return_when=FIRST_EXCEPTION)
    for future in futures:
        if future in done and (exc := future.exception()) is not None:
            raise exc
    if pending:
        raise TimeoutError(
            f"{name}: {len(pending)} of {len(futures)} servers did not answer within {timeout} s"
        )
    try:
        return [f.result(timeout=0) for f in futures]
    except FutureTimeout:  # pragma: no cover - all futures are done here
        raise TimeoutError(f"{name}: no answer within {timeout} s") from None
