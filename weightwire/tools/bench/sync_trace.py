"""Where one round's time goes, for ``bench_sync.py --timeline``.

Wraps a ready engine's communicator and client for one ``send_weights()``: host
timestamps of every control call and broadcast enqueue, and CUDA events around every
broadcast on its stream. A reference event recorded on an idle stream at the round's
start puts GPU times on the same clock as the host's (ms since the round began).
Benchmark aid only: it reaches into the engine's private ``_pipeline``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any


class _Comm:
    def __init__(self, inner: Any, cp: Any, log: list[tuple[float, Any, Any]]) -> None:
        self._inner, self._cp, self._log = inner, cp, log

    def broadcast(
        self, buf: Any, *, root: int = 0, timeout: float | None = None, stream: Any = None
    ) -> None:
        before = self._cp.cuda.Event()
        before.record(stream)
        self._inner.broadcast(buf, root=root, timeout=timeout, stream=stream)
        after = self._cp.cuda.Event()
        after.record(stream)
        self._log.append((time.perf_counter(), before, after))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Client:
    def __init__(self, inner: Any, log: list[tuple[str, float, float]]) -> None:
        self._inner, self._log = inner, log

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        if not callable(fn):
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._log.append((name, start, time.perf_counter()))

        return timed


def trace_round(engine: Any, receiver_trace: Any = None) -> dict[str, Any]:
    """Run one traced round; returns the timeline (ms since the round began).

    ``receiver_trace()`` (optional) returns the receiver's marks for the round, in
    ``time.perf_counter()`` seconds: one monotonic clock for every process on the host."""
    import cupy as cp

    session = engine.session
    pipeline = session.sender
    bcasts: list[tuple[float, Any, Any]] = []
    calls: list[tuple[str, float, float]] = []
    comm, client = pipeline._comm, session.client
    pipeline._comm, session.client = _Comm(comm, cp, bcasts), _Client(client, calls)
    ref_stream = cp.cuda.Stream(non_blocking=True)
    try:
        ref = cp.cuda.Event()
        t0 = time.perf_counter()
        ref.record(ref_stream)
        engine.send_weights()
        t_end = time.perf_counter()
    finally:
        pipeline._comm, session.client = comm, client

    def ms(t: float) -> float:
        return round((t - t0) * 1e3, 3)

    def gpu(event: Any) -> float:
        event.synchronize()
        return round(cp.cuda.get_elapsed_time(ref, event), 3)

    gpu_spans = [(gpu(b), gpu(a)) for _, b, a in bcasts]
    out: dict[str, Any] = {
        "round_ms": ms(t_end),
        "calls": {name: [ms(s), ms(e)] for name, s, e in calls},
        "first_enqueue_ms": ms(bcasts[0][0]) if bcasts else None,
        "last_enqueue_ms": ms(bcasts[-1][0]) if bcasts else None,
    }
    if receiver_trace is not None:
        rx = receiver_trace()
        out["receiver"] = {
            "update": [ms(rx["update_enter"]), ms(rx["update_exit"])],
            "first_post": ms(rx["posts"][0]) if rx["posts"] else None,
            # [entered post, entered the communicator's broadcast, post returned]
            "first_post_parts": [
                ms(rx[k][0]) for k in ("post_enter", "bcast_enter", "posts") if rx.get(k)
            ],
            "last_wait_done": ms(rx["waits"][-1]) if rx["waits"] else None,
        }
    if gpu_spans:
        out.update(
            gpu_first_bcast=list(
                gpu_spans[0]
            ),  # [ready to start, done]: includes waiting for the receiver
            gpu_last_bcast_done=gpu_spans[-1][1],
            gpu_wire_ms=round(gpu_spans[-1][1] - gpu_spans[0][1], 3),  # chunks 2..n, back to back?
            gpu_gaps_ms=round(
                sum(max(0.0, b - a_prev) for (_, a_prev), (b, _) in itertools.pairwise(gpu_spans)),
                3,
            ),
        )
    return out
