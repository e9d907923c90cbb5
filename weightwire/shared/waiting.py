"""One bounded poll for device work: spin first, then back off.

A GPU wait (an event, a stream) has no blocking call with a timeout, so it is polled.
The poll spins (``time.sleep(0)``, yielding the GIL) for ``spin_s``, since a sleep's
wake-up latency would cost a measurable share of a short wait; then it sleeps, doubling
from ``FIRST_SLEEP_S`` up to ``max_sleep_s``, so that a long or hung wait does not burn a
core until its deadline.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SPIN_S = 0.2
"""How long a wait spins before it sleeps: a whole large round on a fast link."""
FIRST_SLEEP_S = 2e-5
MAX_SLEEP_S = 1e-3


def poll_until(
    done: Callable[[], bool],
    *,
    deadline: float,
    expired: Callable[[], BaseException],
    check: Callable[[], None] | None = None,
    check_every_s: float = 0.0,
    spin_s: float = SPIN_S,
    max_sleep_s: float = MAX_SLEEP_S,
) -> None:
    """Return once ``done()``; raise ``expired()`` once ``time.monotonic()`` passed ``deadline``.

    ``check`` (it raises to end the wait: the peer is gone, the link was aborted) runs
    between polls, at most every ``check_every_s`` (0: every poll), and before the deadline
    is tested, so that a known failure wins over a timeout.
    """
    start = time.monotonic()
    last_check, pause = start, FIRST_SLEEP_S
    while not done():
        now = time.monotonic()
        if check is not None and now - last_check >= check_every_s:
            check()
            last_check = now
        if now >= deadline:
            raise expired()
        if now - start < spin_s:
            time.sleep(0)  # yields the GIL, returns within microseconds
        else:
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, max_sleep_s)
