"""What a steady-state round gives Python's garbage collector, per round (issue #49).

    python benchmarks/bench_gc_rounds.py                      # torch + jax, tiny32, tcp
    python benchmarks/bench_gc_rounds.py --engine torch --rounds 100 --show 12

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
- collections per 100 rounds, per generation, with the collector enabled as a user's
  process runs it (``gc.get_stats()``); generation 2 is the ~100 ms pause of issue #49.

``--show N`` prints the most common types among a round's cyclic garbage (``gc.DEBUG_SAVEALL``)
and, for functions and frames, their code's place: where to look.
"""

from __future__ import annotations

import argparse
import collections
import gc
import socket
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TCP = "weightwire_tcp"


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


def measure(
    label: str, send: Any, sets: list[dict[str, Any]], params: dict[str, Any], args: Any
) -> dict[str, float]:
    """Cycles and survivors per round (collector off), then collections per 100 rounds."""
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
            before = len(gc.get_objects())
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
            survivors.append(len(gc.get_objects()))
            if args.show and i == args.rounds - 1:
                shown += ["    survivors:", *garbage_report(gc.get_objects(), args.show)]
            gc.unfreeze()
            growth.append(len(gc.get_objects()) - before)
    finally:
        gc.unfreeze()
        gc.set_debug(0)
        gc.enable()
    gc.collect()
    counts = [s["collections"] for s in gc.get_stats()]
    for i in range(args.rounds):
        one(i)
    after = [s["collections"] for s in gc.get_stats()]
    per100 = [(a - b) * 100 / args.rounds for a, b in zip(after, counts, strict=True)]
    out = {
        "cycles": sum(cycles) / len(cycles),
        "cycles_max": max(cycles),
        "survivors": sum(survivors) / len(survivors),
        "growth": sum(growth) / len(growth),
        "gen0": per100[0],
        "gen1": per100[1],
        "gen2": per100[2],
    }
    print(
        f"  {label}: cycles/round {out['cycles']:.1f} (max {out['cycles_max']}), "
        f"survivors/round {out['survivors']:.1f} (first {survivors[:3]}), "
        f"growth/round {out['growth']:.1f}, "
        "collections per 100 rounds "
        f"gen0 {per100[0]:.0f} gen1 {per100[1]:.0f} gen2 {per100[2]:.0f}",
        flush=True,
    )
    for line in shown:
        print(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("torch", "jax", "both"), default="both")
    parser.add_argument("--shape", default="tiny32")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--show", type=int, default=0, help="the N commonest garbage types")
    parser.add_argument("--sets", type=int, default=6, help="weight sets the delta rounds visit")
    args = parser.parse_args(argv)
    client, _ = start_worker(args.shape)
    for engine in ("torch", "jax") if args.engine == "both" else (args.engine,):
        sets = weight_sets(args.shape, engine, args.sets)
        params = dict(sets[0])
        t = trainer(engine, client, params)
        print(f"{engine} trainer, {TCP}, {args.shape} ({len(params)} tensors):", flush=True)
        try:
            for kind in ("dense", "delta"):
                measure(kind, t.send_weights, sets, params, args)
        finally:
            t.shutdown()
    client.exit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
