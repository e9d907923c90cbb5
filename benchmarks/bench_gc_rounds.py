"""What a steady-state round gives Python's garbage collector, per round (issue #49).

    python benchmarks/bench_gc_rounds.py                      # torch + jax, tiny32, tcp
    python benchmarks/bench_gc_rounds.py --engine torch --rounds 100 --show 12
    python benchmarks/bench_gc_rounds.py --worker-process --rounds 100  # each process's own

A trainer (``delta="auto"``) and vLLM's plugin engine class (``tests/torch_side/vllm_stub.py``'s
fake vLLM, a ``FakeLlama`` of ``--shape``, default ``tiny32``: Llama-3-8B's 291 tensors at
tiny sizes) run in ONE process over ``weightwire_tcp`` on loopback, so both sides' objects
are counted (the worker's calls come through the loopback shim's socket threads, as its
RPCs would). Per kind (dense rounds, then delta rounds through weight sets one
Adam-like step apart: ``--sets`` of them, each one step on from the last, so every
round's changed elements and patch sizes differ, as a training run's do), after
``--warmup`` rounds:

- cycles: with the collector disabled, ``gc.collect()`` after each round returns the
  objects that only reference cycles kept (what a full collection would have to find);
- survivors: the GC-tracked objects the round made that are still alive after it (the heap
  frozen before the round, ``gc.freeze``, so only the round's own are counted): what a round
  adds to the long-lived heap, or swaps into it (a cache entry replacing last round's), which
  the collections it meets promote towards the full one;
- growth: the tracked objects after the round less before it;
- peak: the most GC-tracked objects the round's own made were alive at once (the heap frozen
  before the round, a young collection every ``PEAK_STEP`` net allocations, counting what
  is alive after it: ``gc.callbacks``; the stub's ``RoundPeak``), split with ``--show`` by
  side (``sides``: trainer, worker, other) at the peak;
- promoted: with the collector as a user's process runs it, the objects per round that
  generation-1 collections moved into generation 2 (alive then, even if freed right
  after the round): Python 3.11 runs a full collection once generation 1 was collected 10
  times AND the promotions since the last full one exceed a quarter of the long-lived heap
  (``long-lived``: generation 2 after a full collection), so ``long-lived / 4 / promoted``
  is the rounds between full collections;
- collections per 100 rounds, per generation, with the collector enabled as a user's
  process runs it (``gc.get_stats()``); generation 2 is the ~100 ms pause of issue #49.

``--worker-process`` runs the worker in its own process instead (``spawn_stub``), as a
deployment does: the passes above count the trainer's process, and the worker's peak,
promotions and collections are asked of its ``gc`` op; each process's collections then see
only its own side's objects against its own long-lived heap.

``--show N`` prints the most common types among a round's cyclic garbage (``gc.DEBUG_SAVEALL``)
and, for functions and frames, their code's place: where to look; and the commonest kinds of
the objects alive at the round's peak, per side, and of those the generation-1 collections
promoted. Those walks hold every young object from inside a collection (and read running
frames' locals): now and then one breaks a round (``SystemError`` from a tuple being built
as the collection landed). ``--show`` is for looking; take the numbers from a run without it.
"""

from __future__ import annotations

import argparse
import collections
import gc
import socket
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.torch_side.vllm_stub import PEAK_STEP, tracked  # noqa: E402

TCP = "weightwire_tcp"
WORKER_CODE = (
    "/torch_side/worker/",
    "vllm_stub",
    "/tcp/worker.py",
    "worker_base.py",
    "receiving.py",
)
"""A thread whose stack runs any of these files is the worker's (its RPCs, its links)."""
LOOPBACK_SERVER = ("handle", "serve", "serve_ops")
""" ``testing/loopback.py``'s functions that answer the trainer's calls (the worker's side)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(shape: str) -> tuple[Any, Any]:
    """The stub worker's ``serve`` on a thread of this process; its client and exit."""
    import weightwire.testing.loopback as loopback
    from tests.torch_side import vllm_stub
    from weightwire.shared.errors import WeightSyncError

    port = _free_port()
    plain = loopback.serve_ops
    loopback.serve_ops = lambda run, done, **_: plain(run, done, port=port)
    thread = threading.Thread(target=vllm_stub.serve, args=(TCP, "cpu", shape), daemon=True)
    thread.start()
    client = None
    for _ in range(600):
        try:
            client = loopback.LoopbackClient(f"127.0.0.1:{port}")
            client.version()
            break
        except (OSError, WeightSyncError):  # not listening yet
            client = None
            threading.Event().wait(0.05)
    loopback.serve_ops = plain
    assert client is not None
    return client, thread


def weight_sets(shape: str, engine: str, count: int) -> list[dict[str, Any]]:
    from benchmarks.delta_frameworks import Torch
    from tests.torch_side.vllm_stub import hf_shapes

    fw = Torch("static")
    sets = [fw.weights(hf_shapes(shape))]
    while len(sets) < count:
        sets.append(fw.step(sets[-1], 1e-6))
    if engine != "jax":
        return sets
    import jax.numpy as jnp
    import ml_dtypes
    import torch

    def to_jax(w: dict[str, Any]) -> dict[str, Any]:
        bf16 = ml_dtypes.bfloat16
        return {n: jnp.asarray(t.view(torch.int16).numpy().view(bf16)) for n, t in w.items()}

    return [to_jax(w) for w in sets]


def trainer(engine: str, client: Any, params: dict[str, Any]) -> Any:
    from weightwire.tools.bench.sync_models import make_source
    from weightwire.trainer import TrainerInitInfo

    cls: Any
    if engine == "jax":
        from weightwire.jax_side.engine import JAXTrainerEngine as cls
    else:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as cls
    info = TrainerInitInfo(backend=TCP, delta="auto")
    return cls.trainer_init(info, client=client, source=make_source(params))


def garbage_report(garbage: list[Any], show: int) -> list[str]:
    kinds: collections.Counter[str] = collections.Counter()
    for obj in garbage:
        name = type(obj).__name__
        code = getattr(obj, "__code__", None) or getattr(obj, "f_code", None)
        if code is not None:
            name += f" {code.co_name} {Path(code.co_filename).name}:{code.co_firstlineno}"
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            name = f"{type(obj).__module__}.{type(obj).__qualname__}"
        kinds[name] += 1
    return [f"      {n:5d} {k}" for k, n in kinds.most_common(show)]


def kind(obj: Any) -> str:
    """A tag for an object of a round: its type, a container's size (a per-tensor record
    shows as many of one size), a weightwire class's module."""
    t = type(obj)
    if t in (list, tuple, set, dict):
        n = len(obj)
        size = str(n) if n <= 8 else ">8"
        if t is dict and 0 < n <= 8:
            size = ",".join(str(k)[:12] for k in obj)
        return f"{t.__name__}[{size}]"
    code = getattr(obj, "__code__", None) or getattr(obj, "f_code", None)
    if code is not None:
        return f"{t.__name__} {code.co_name} {Path(code.co_filename).name}:{code.co_firstlineno}"
    if t.__module__ == "builtins":
        return t.__name__
    if t.__module__ == "torch" and t.__name__ == "Tensor":  # a view, or its own storage
        return (
            f"torch.Tensor {obj.dtype} {obj.dim()}-D {'view' if obj._base is not None else 'own'}"
        )
    return f"{t.__module__}.{t.__qualname__}"


def thread_side(frame: Any) -> str:
    """``worker`` for a thread that runs the worker's code (``WORKER_CODE``, the loopback
    shim's server), else ``trainer``."""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename
        if any(m in path for m in WORKER_CODE):
            return "worker"
        if path.endswith("loopback.py") and code.co_name in LOOPBACK_SERVER:
            return "worker"
        frame = frame.f_back
    return "trainer"


def sides(young: list[Any]) -> collections.Counter[tuple[str, str]]:
    """``young`` by (side, kind): an object belongs to the side of the first thread whose
    stack reaches it (through young objects, or at most two old ones: an old object's
    ``__dict__`` holding a new value); one no stack reaches is ``other``. A running frame's
    locals are read through ``f_locals``, which keeps them until the frame returns: take
    the numbers from a run without ``--show``."""
    ids = {id(o) for o in young}
    owner: dict[int, str] = {}
    seen: set[int] = set()
    frames = sorted(sys._current_frames().items(), key=lambda kv: thread_side(kv[1]))
    for _, top in frames:
        side = thread_side(top)
        todo: list[tuple[Any, int]] = []
        frame = top
        while frame is not None:
            todo.append((frame, 0))
            frame = frame.f_back
        while todo:
            obj, hops = todo.pop()
            # a running frame's locals only through f_locals (its traversal skips them)
            refs = obj.f_locals.values() if isinstance(obj, types.FrameType) else ()
            for ref in [*refs, *gc.get_referents(obj)]:
                i = id(ref)
                if i in seen:
                    continue
                seen.add(i)
                if i in ids:
                    owner[i] = side
                    todo.append((ref, hops))
                elif (
                    hops < 2
                    and gc.is_tracked(ref)
                    and not isinstance(ref, (type, types.ModuleType))
                ):
                    todo.append((ref, hops + 1))
    return collections.Counter((owner.get(id(o), "other"), kind(o)) for o in young)


@contextmanager
def no_switch() -> Iterator[None]:
    """``--show``'s walks hold lists of the young objects: other threads wait meanwhile
    (a switch already asked for may still happen: ``--show`` is for looking, not counting)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def young_objects() -> list[Any]:
    return [o for g in (0, 1) for o in gc.get_objects(g)]


class Peak:
    """A ``gc.callbacks`` hook for the peak pass: at each young collection, the round's
    objects alive (the heap was frozen before it), the most seen, and (``show``) their
    sides and kinds at the highest point."""

    def __init__(self, show: int) -> None:
        self.show, self.most = show, 0
        self.at: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop":  # after it: the tuples of atoms it untracked are not counted
            return
        alive = tracked(0, 1, 2)
        if alive <= self.most:
            return
        self.most = alive
        if self.show:
            with no_switch():
                self.at = sides([o for g in range(3) for o in gc.get_objects(g)])


class Promotions:
    """A ``gc.callbacks`` hook: the objects generation-1 collections move into generation 2
    (those alive as it runs, less the tuples of atoms it untracks: generation 2's size
    before and after), and (``show``) the sides and kinds of the young objects then."""

    def __init__(self, show: int) -> None:
        self.show, self.promoted, self._old = show, 0, 0
        self.kinds: collections.Counter[tuple[str, str]] = collections.Counter()

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 1:
            return
        if phase == "start":
            self._old = tracked(2)
            if self.show:
                with no_switch():
                    self.kinds.update(sides(young_objects()))
        else:
            self.promoted += tracked(2) - self._old


@contextmanager
def hooked(hook: Any) -> Iterator[None]:
    gc.callbacks.append(hook)
    try:
        yield
    finally:
        gc.callbacks.remove(hook)


def by_side(kinds: collections.Counter[tuple[str, str]], show: int, per: float) -> list[str]:
    out = []
    for side in ("trainer", "worker", "other"):
        mine = collections.Counter({k: n for (s, k), n in kinds.items() if s == side})
        total = sum(mine.values())
        out.append(f"      {side}: {total / per:.0f}")
        out += [f"        {n / per:7.1f} {k}" for k, n in mine.most_common(show)]
    return out


def peak_pass(
    one: Any, rounds: int, show: int, worker: Any = None
) -> tuple[list[int], Peak, list[int]]:
    """Per round, the most of its own objects alive at once (collector on, heap frozen
    before it, a young collection every ``PEAK_STEP`` net allocations); ``worker``: a
    worker process's client, whose own are counted the same (the stub's ``gc`` op)."""
    peaks, last, theirs = [], Peak(show), []
    thresholds = gc.get_threshold()
    try:
        for i in range(rounds):
            if worker is not None:
                worker.call("gc", {"peak": True})
            gc.collect()
            gc.freeze()
            peak = Peak(show if i == rounds - 1 else 0)
            gc.set_threshold(PEAK_STEP, 10**6, 10**6)
            with hooked(peak):
                gc.enable()
                one(i)
                gc.disable()
            gc.unfreeze()
            peaks.append(peak.most)
            last = peak
            if worker is not None:
                theirs.append(worker.call("gc", {"peak": False})["peak"])
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        gc.enable()
    return peaks, last, theirs


def measure(
    label: str,
    send: Any,
    sets: list[dict[str, Any]],
    params: dict[str, Any],
    args: Any,
    worker: Any = None,
) -> dict[str, float]:
    """Cycles and survivors per round (collector off), then collections per 100 rounds;
    ``worker``: the worker process's client (``--worker-process``), whose peak, promotions
    and collections are asked of it beside this process's."""
    cycle = [0] if label == "dense" else [*range(1, len(sets)), 0]

    def one(i: int) -> None:
        params.update(sets[cycle[i % len(cycle)]])
        send(dense=label == "dense")

    for i in range(args.warmup):
        one(i)
    gc.disable()
    try:
        gc.collect()
        cycles, survivors, growth = [], [], []
        shown: list[str] = []
        for i in range(args.rounds):
            before = tracked(0, 1, 2)
            gc.freeze()
            one(i)
            if args.show and i == args.rounds - 1:
                gc.set_debug(gc.DEBUG_SAVEALL)
            cycles.append(gc.collect())
            if gc.garbage:
                shown = garbage_report(gc.garbage, args.show)
                gc.set_debug(0)
                gc.garbage.clear()
                gc.collect()
            survivors.append(tracked(0, 1, 2))
            if args.show and i == args.rounds - 1:
                shown += ["    survivors:", *garbage_report(gc.get_objects(), args.show)]
            gc.unfreeze()
            growth.append(tracked(0, 1, 2) - before)
    finally:
        gc.unfreeze()
        gc.set_debug(0)
        gc.enable()
    gc.disable()
    peaks, peak, worker_peaks = peak_pass(one, args.rounds, args.show, worker)
    if worker is not None:
        worker.call("gc", {"promotions": True})
    gc.collect()
    long_lived = tracked(2)
    counts = [s["collections"] for s in gc.get_stats()]
    promotions = Promotions(args.show)
    with hooked(promotions):
        for i in range(args.rounds):
            one(i)
    after = [s["collections"] for s in gc.get_stats()]
    theirs = None if worker is None else worker.call("gc", {"promotions": False})
    per100 = [(a - b) * 100 / args.rounds for a, b in zip(after, counts, strict=True)]
    out = {
        "cycles": sum(cycles) / len(cycles),
        "cycles_max": max(cycles),
        "survivors": sum(survivors) / len(survivors),
        "growth": sum(growth) / len(growth),
        "gen0": per100[0],
        "gen1": per100[1],
        "gen2": per100[2],
        "peak": sum(peaks) / len(peaks),
        "promoted": promotions.promoted / args.rounds,
        "long_lived": long_lived,
    }
    at_peak = {
        s: sum(n for (side, _), n in peak.at.items() if side == s)
        for s in ("trainer", "worker", "other")
    }
    print(
        f"  {label}: cycles/round {out['cycles']:.1f} (max {out['cycles_max']}), "
        f"survivors/round {out['survivors']:.1f} (first {survivors[:3]}), "
        f"growth/round {out['growth']:.1f}, "
        "collections per 100 rounds "
        f"gen0 {per100[0]:.0f} gen1 {per100[1]:.0f} gen2 {per100[2]:.0f}",
        f"\n    peak tracked objects/round {out['peak']:.0f} (max {max(peaks)}"
        + (
            f"; at the last round's: trainer {at_peak['trainer']}, worker {at_peak['worker']}, "
            f"other {at_peak['other']}"
            if args.show
            else ""
        )
        + f"), promoted to gen2/round {out['promoted']:.0f} "
        f"(long-lived {long_lived}: a full collection needs {long_lived // 4} promoted)",
        flush=True,
    )
    if theirs is not None:
        n, lived = args.rounds, theirs["long_lived"]
        gens = " ".join(f"gen{g} {c * 100 / n:.0f}" for g, c in enumerate(theirs["collections"]))
        print(
            f"    worker process: peak tracked objects/round "
            f"{sum(worker_peaks) / len(worker_peaks):.0f} (max {max(worker_peaks)}), "
            f"promoted to gen2/round {theirs['promoted'] / n:.0f} (long-lived {lived}: a "
            f"full collection needs {lived // 4} promoted), collections per 100 rounds {gens}",
            flush=True,
        )
    for line in shown:
        print(line)
    if args.show:
        print("    alive at the last round's peak, per side:")
        print("\n".join(by_side(peak.at, args.show, 1)))
        print("    promoted to gen2, per round, per side:")
        print("\n".join(by_side(promotions.kinds, args.show, args.rounds)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("torch", "jax", "both"), default="both")
    parser.add_argument("--shape", default="tiny32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--show", type=int, default=0, help="the N commonest garbage types")
    parser.add_argument("--sets", type=int, default=6, help="weight sets the delta rounds visit")
    parser.add_argument(
        "--worker-process",
        action="store_true",
        help="the worker in its own process, as deployed: each process's own counts",
    )
    args = parser.parse_args(argv)
    proc = None
    if args.worker_process:
        from tests.torch_side._procs import spawn_stub

        proc, client = spawn_stub(TCP, "cpu", args.shape, timeout=300)
    else:
        client, _ = start_worker(args.shape)
    for engine in ("torch", "jax") if args.engine == "both" else (args.engine,):
        sets = weight_sets(args.shape, engine, args.sets)
        params = dict(sets[0])
        t = trainer(engine, client, params)
        print(f"{engine} trainer, {TCP}, {args.shape} ({len(params)} tensors):", flush=True)
        try:
            for kind in ("dense", "delta"):
                measure(kind, t.send_weights, sets, params, args, proc and client)
        finally:
            t.shutdown()
    client.exit()
    if proc is not None:
        proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
