"""Debug aid for a round's timeline (``WEIGHTWIRE_IPC_TRACE=/path/prefix``): a host timestamp
per step, from every process a round crosses (trainer, API server, worker), merged by
``benchmarks/ipc_timeline.py``. Off (one ``None`` check per mark) unless the variable is set."""

from __future__ import annotations

import json
import os
import time

_TRACE_TO = os.environ.get("WEIGHTWIRE_IPC_TRACE") or None  # set and empty: off
_trace: list[tuple[float, str]] = []

tracing = _TRACE_TO is not None
"""Whether marks are recorded (a benchmark adds its own probes only then)."""


def trace(event: str) -> None:
    """Record ``event`` now; one clock (``perf_counter``, the host's monotonic clock) for every
    process."""
    if _TRACE_TO is not None:
        _trace.append((time.perf_counter(), event))


def dump_trace(side: str) -> None:
    """Append the marks recorded since the last dump to ``<prefix>.<side>.<pid>.jsonl``."""
    if _TRACE_TO is not None and _trace:
        with open(f"{_TRACE_TO}.{side}.{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps(_trace) + "\n")
        _trace.clear()
