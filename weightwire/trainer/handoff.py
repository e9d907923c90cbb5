"""Quick GIL handoffs while a round runs (``WEIGHTWIRE_SWITCH_INTERVAL_US``).

A round runs the control plane (start, the update POST) on helper threads while the
trainer's main thread walks the round's tensors. Each time a helper's socket call
returns, the helper needs the GIL back, and CPython hands it over only when the holder
blocks or its switch interval (5 ms by default) expires. The main thread's walk over a
small model takes about a millisecond of pure Python, so the start call stood still
for that long: on one H200 a 0.5B round's start reached the worker 1.1 ms after it was
issued, of which ~0.9 ms was this wait (``benchmarks/ipc_timeline.py``).

``quick_handoffs()`` lowers the interpreter's switch interval for the duration of a
round and puts the previous value back after the last concurrent round ended (rounds
of several engines may overlap in one process). The interval is process-wide: every
thread of the process switches more often during a round, which costs a few percent
of CPU-bound throughput for the round's milliseconds, and nothing after it.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from weightwire.shared.errors import ConfigError

ENV = "WEIGHTWIRE_SWITCH_INTERVAL_US"
DEFAULT_US = 100.0

_lock = threading.Lock()
_active = 0
_saved = 0.0


def round_interval_s() -> float | None:
    """The switch interval a round runs with, in seconds; ``None`` leaves it alone
    (``WEIGHTWIRE_SWITCH_INTERVAL_US=0``). Anything but 0 or a finite number >= 1 (the
    interpreter counts the interval in whole microseconds) raises ``ConfigError``."""
    raw = os.environ.get(ENV)
    if raw is None or not raw.strip():
        return DEFAULT_US * 1e-6
    try:
        us = float(raw)
    except ValueError:
        us = math.nan
    if us == 0:
        return None
    if not 1 <= us < math.inf:
        raise ConfigError(
            f"{ENV}={raw[:40]!r}: expected microseconds, 0 (leave the interval alone) or a number "
            ">= 1 (the interpreter's resolution)"
        )
    return us * 1e-6


@contextmanager
def quick_handoffs() -> Iterator[None]:
    """Run the block with the round's switch interval (never one longer than the current)."""
    global _active, _saved
    interval = round_interval_s()
    if interval is None:
        yield
        return
    with _lock:
        if _active == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(interval, _saved))
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                sys.setswitchinterval(_saved)
