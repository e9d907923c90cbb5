"""``control.fanout``: side threads that are reused but never make a call wait."""

from __future__ import annotations

import threading
import time

import pytest

from weightwire.control import fanout
from weightwire.control.fanout import _Helpers, fan_out, spawn


def test_spawn_hands_back_results_and_exceptions() -> None:
    assert spawn(lambda: 41 + 1, name="t").result(10) == 42

    def boom() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError, match="nope"):
        spawn(boom, name="t").result(10)


def test_an_idle_helper_is_reused_and_named_after_its_call() -> None:
    helpers = _Helpers()
    seen: list[tuple[int, str]] = []
    for i in range(5):
        done = threading.Event()

        def task(i: int = i, done: threading.Event = done) -> None:
            seen.append((threading.get_ident(), threading.current_thread().name))
            done.set()

        helpers.run(task, f"call-{i}")
        assert done.wait(10)
        _wait_idle(helpers, 1)
    assert len({ident for ident, _ in seen}) == 1  # one thread served every call
    assert [name for _, name in seen] == [f"call-{i}" for i in range(5)]


def test_a_blocked_helper_never_delays_the_next_call() -> None:
    helpers = _Helpers()
    release, started = threading.Event(), threading.Event()

    def straggler() -> None:
        started.set()
        release.wait(10)

    helpers.run(straggler, "straggler")
    assert started.wait(10)
    ran = threading.Event()
    helpers.run(ran.set, "next")  # no idle helper: a new thread, at once
    assert ran.wait(10)
    release.set()


def test_no_more_than_max_idle_helpers_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "MAX_IDLE", 2)
    helpers = _Helpers()
    release = threading.Event()
    started = [threading.Event() for _ in range(4)]
    threads: list[threading.Thread] = []
    for ev in started:

        def task(ev: threading.Event = ev) -> None:
            threads.append(threading.current_thread())
            ev.set()
            release.wait(10)

        helpers.run(task, "busy")
    assert all(ev.wait(10) for ev in started)
    release.set()
    # the two beyond MAX_IDLE exit, however slowly; the others wait for work (daemon, idle)
    deadline = time.monotonic() + 10  # was: 0.5 s of join per thread
    while sum(t.is_alive() for t in threads) > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sum(t.is_alive() for t in threads) == 2
    _wait_idle(helpers, 2)


def test_fan_out_still_returns_in_order() -> None:
    assert fan_out([lambda i=i: i * i for i in range(6)], timeout=10, name="sq") == [
        0,
        1,
        4,
        9,
        16,
        25,
    ]


def _wait_idle(helpers: _Helpers, n: int) -> None:
    """Until ``n`` helpers are idle (a helper counts itself idle just after its call returns)."""
    ok = threading.Event()
    for _ in range(10000):
        with helpers._lock:
            if helpers._idle == n:
                ok.set()
                break
        threading.Event().wait(0.001)
    assert ok.is_set(), f"expected {n} idle helpers, have {helpers._idle}"
