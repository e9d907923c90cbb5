"""``bench_ipc.py``'s probes: trace marks around the calls of a round
(``WEIGHTWIRE_IPC_TRACE``, read back by ``ipc_timeline.py``), a cProfile wrapper, and the
copy ceilings measured beside the rounds."""

from __future__ import annotations

import statistics
import sys
from typing import Any

from weightwire._trace import trace


def marked(fn: Any, name: str) -> Any:
    def marked(*a: Any, **k: Any) -> Any:
        trace(f"{name}>")
        try:
            return fn(*a, **k)
        finally:
            trace(f"{name}<")

    return marked


def trace_worker(engine: Any, sink: Any) -> None:
    """``WEIGHTWIRE_IPC_TRACE``: marks around the worker's plan lookup, unpack and load (private
    access)."""
    from weightwire.torch_side.worker.receive import UnpackPlan

    plans = engine._core._plans
    plans.resolve = marked(plans.resolve, "resolve")
    sink.load_weights = marked(sink.load_weights, "load")
    if not hasattr(UnpackPlan, "_untraced"):
        UnpackPlan._untraced = UnpackPlan.unpack
        UnpackPlan.unpack = lambda self, buf: marked(UnpackPlan._untraced, "unpack")(self, buf)


class TracedClient:
    """The trainer's client with a mark around every call (``WEIGHTWIRE_IPC_TRACE``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._inner, name)
        return marked(fn, name) if callable(fn) else fn


def profiled(what: str, fn: Any) -> Any:
    """Run ``fn`` under cProfile and print the top functions by own time (to stderr)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        print(f"--- profile: {what}\n{text.getvalue()}", file=sys.stderr, flush=True)


def ceilings_s(engine: Any, params: dict[str, Any], nbytes: int, reps: int) -> tuple[float, float]:
    """Two device copies of the round's bytes (tensors -> A, one copy each, then A -> B:
    what push does) and one (tensors -> A: what pull does); CUDA events, medians."""
    import cupy as cp

    pipe = engine.session.sender
    stream = pipe._stream
    regions = pipe._packer.regions(list(params.values()), stream)
    a, b = cp.cuda.runtime.malloc(nbytes), cp.cuda.runtime.malloc(nbytes)
    try:
        sptr = int(getattr(stream, "ptr", 0))
        two, one = [], []
        for _ in range(reps + 1):
            start, mid, end = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
            start.record(cp.cuda.ExternalStream(sptr))
            off = 0
            for r in regions:
                cp.cuda.runtime.memcpyAsync(a + off, r.ptr, r.nbytes, 3, sptr)
                off += r.nbytes
            mid.record(cp.cuda.ExternalStream(sptr))
            cp.cuda.runtime.memcpyAsync(b, a, nbytes, 3, sptr)
            end.record(cp.cuda.ExternalStream(sptr))
            end.synchronize()
            two.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
            one.append(cp.cuda.get_elapsed_time(start, mid) / 1e3)
        return statistics.median(two[1:]), statistics.median(one[1:])
    finally:
        cp.cuda.runtime.free(a)
        cp.cuda.runtime.free(b)
