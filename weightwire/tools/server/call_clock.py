"""``CallClock``: how long the server spent on one round call, told in its reply.

The round's routes (start, update, finish) answer with a ``Server-Timing`` header (the W3C
header browsers and proxies read): ``app;dur=<ms>`` from the handler's entry to its reply
(the body read, the checks, the pause a start does, the fan-out) and ``worker;dur=<ms>``,
the part spent waiting for the replicas' workers. A trainer (``benchmarks/
bench_round_control.py``) subtracts it from its own time of the call to tell the HTTP
path (client, socket, uvicorn, FastAPI) from the server's work. Two clock reads per part:
the header costs well under a microsecond of a call's hundreds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

HEADER = "server-timing"


class CallClock:
    """Started at the handler's entry; ``part`` times a stretch of it (see the module)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._parts: dict[str, float] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._parts[name] = self._parts.get(name, 0.0) + time.perf_counter() - t0

    def headers(self) -> dict[str, str]:
        """The reply's ``Server-Timing`` header, in milliseconds."""
        total = time.perf_counter() - self._t0
        items = [("app", total), *self._parts.items()]
        return {HEADER: ", ".join(f"{name};dur={s * 1e3:.3f}" for name, s in items)}


def parse_server_timing(value: str) -> dict[str, float]:
    """A ``Server-Timing`` header's ``name;dur=ms`` entries, in seconds (others skipped)."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, _, rest = entry.strip().partition(";")
        for param in rest.split(";"):
            key, _, raw = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(raw) / 1e3
                except ValueError:
                    continue
    return out
