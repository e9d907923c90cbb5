"""Host (Python) cost of one warm round, both ends, on CPU (issue 19: "0.5B round <= 3 ms").

A round of 290 *tiny* tensors carrying Qwen2-0.5B's names (24 layers, q/k/v biases, tied
embeddings; shapes scaled down so the bytes are negligible): what remains is the fixed
per-round and per-tensor Python work of the trainer engine, the framing and the worker
engine, which on a GPU host sits on the critical path of every round.

    python benchmarks/bench_round_cpu.py [--engine jax|torch|both] [--rounds 300] [--profile]

Three parts:

1. ``round``: full warm rounds in ONE process: the trainer engine (``JAXTrainerEngine``
   over a ``PytreeSource`` of the Flax Qwen2, or ``TorchTrainerEngine`` over a
   ``ModuleSource`` of HF ``Qwen2ForCausalLM``) sends over ``weightwire_tcp`` (loopback
   socket) to a standalone ``WeightwireTCPEngine`` whose "model" drops what it loads, through
   an in-process client (no HTTP, no JSON over a socket; the sources, that worker and the
   client are ``round_cpu_setup.py``'s, beside this script). Both ends share the GIL, so a
   round's wall time is roughly the sum of both sides' host work plus the handoffs.
2. ``split``: each stage of the round alone, on the same data, timed with ``perf_counter``:
   trainer ``metadata`` (``source.metadata()``), ``iterate`` (a pass
   over the source), ``check`` (``checked_iter``), ``plan`` (plan + update info), ``pack``
   (``chunked`` + ``host_bytes`` + the chunk byte check: the TCP path), ``regions`` (the
   device path's ``JaxDevicePacker.regions``, JAX only); worker ``parse`` (update info +
   plan cache: a fresh cache, the same full metadata again, the reuse shorthand), ``unpack``
   (the cached ``UnpackPlan`` per chunk), ``load`` (``load_batches`` into the model).
3. ``unpack``: ``unpack_chunk`` alone for the 290 tensors, cold (no plan cached) and warm.

``--profile`` adds a cProfile of the full rounds (inflates small calls: confirm with part 2).

``round`` is the median of the rounds; every ``split`` / ``unpack`` figure is the *minimum* over
``--repeats`` runs (CPU-bound and deterministic, and the box this was written on is shared:
the minimum is the least-disturbed run). A stage measured in a hot loop runs with warm caches,
so inside a real round it costs somewhat more.

Numbers, ms, 290 tensors (2-core shared CPU box, torch 2.13 CPU, jax CPU; before = the tree
at c722201, after = issue 19's changes; same box, back to back;
``python benchmarks/bench_round_cpu.py --rounds 300 --repeats 400``):

  =======================  ======  =====  =======================================================
  stage                    before  after  what changed
  =======================  ======  =====  =======================================================
  unpack_chunk, warm        1.79   0.43   ``UnpackPlan``: an ``as_strided`` per tensor, planned once
  unpack_chunk, cold        1.83   0.92   (no plan cached: the first round of a metadata)
  w.unpack, jax source      1.76   0.55   (the same, per chunk from the worker's cached plan)
  w.unpack, torch source    1.86   0.63
  w.parse_repeat            1.10   0.46   full metadata again: not re-planned / re-checked
  w.parse_reuse             0.007  0.011  (the 0.33 reuse shorthand: nothing to do either way)
  t.metadata torch          1.60   0.68   stack walk of the modules, ``ParamMeta`` list kept
  t.plan torch (+metadata)  1.53   0.70   same objects: the engine's comparisons are identity checks
  t.iterate torch           1.57   0.95   the walk
  t.metadata jax            0.74   0.39   no per-leaf addressability query in one process
  t.iterate jax             4.44   3.77   (mostly one jitted dispatch per layer group: 26)
  t.regions jax             1.28   0.69   one sharding compare + cached sizes per array
  round jax (in-process)    28.0   19.9
  round torch (in-process)  22.8   14.6
  =======================  ======  =====  =======================================================

The in-process ``round`` is far above the sum of its stages: both ends, the TCP sender and
receiver threads share one GIL on two busy cores, so it mostly measures handoffs; on a GPU
host each end has its own process. ``t.pack`` (TCP host bytes, ~3 ms jax / ~1.4 ms torch) is
not on the IPC or NCCL path (``t.regions`` is).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from round_cpu_setup import DropHost, connect, jax_source, torch_source  # beside this script


def min_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples) * 1e3  # CPU-bound and deterministic: the least-disturbed run (a shared box)


# ------------------------------------------------------------------------------ parts


def bench_rounds(engine: Any, rounds: int, profile: bool) -> dict[str, Any]:
    for _ in range(20):
        engine.send_weights()
    walls, phases = [], []
    prof = cProfile.Profile() if profile else None
    if profile:
        engine.client.profile = cProfile.Profile()
    for _ in range(rounds):
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        metrics = engine.send_weights()
        walls.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
        phases.append(metrics.seconds)
    out = {
        "round_ms": statistics.median(walls) * 1e3,
        "phases_ms": {
            k: round(statistics.median(p[k] for p in phases) * 1e3, 3) for k in phases[0]
        },
    }
    if prof is not None:
        text = io.StringIO()
        for who, p in (("trainer", prof), ("worker", engine.client.profile)):
            text.write(f"---- {who} thread\n")
            pstats.Stats(p, stream=text).sort_stats("tottime").print_stats(25)
        engine.client.profile = None
        out["profile"] = text.getvalue()
    return out


def device_regions(engine: Any) -> Callable[[list[Any]], Any] | None:
    """The device path's per-tensor step (``DevicePacker.regions``, what the IPC and NCCL
    pipelines read a chunk's tensors with) where it runs on CPU: JAX only (torch's needs CUDA)."""
    from weightwire.jax_side.engine import JAXTrainerEngine

    if not isinstance(engine, JAXTrainerEngine):
        return None
    import jax

    from weightwire.jax_side.packer import JaxDevicePacker

    packer = object.__new__(JaxDevicePacker)  # no cupy here: only what regions reads
    device = jax.devices()[0]
    packer._device = device
    if hasattr(packer, "_bind"):
        packer._bind(device)
    return lambda tensors: packer.regions(tensors, None)


def bench_split(engine: Any, worker: Any, host: DropHost, repeats: int) -> dict[str, float]:
    import torch

    from weightwire.backends.base import check_chunk_bytes
    from weightwire.shared.source import checked_iter
    from weightwire.shared.update_info import UpdateInfo
    from weightwire.torch_side.worker.load import MetaCache, load_batches
    from weightwire.trainer.sole_round import sole_plan
    from weightwire.trainer.transfer import chunked, tensor_stream

    source = engine.source
    metas = source.metadata()
    chunks = sole_plan(engine.session, metas, None).chunks
    pairs = list(tensor_stream(source))
    out: dict[str, float] = {}
    out["t.metadata"] = min_ms(source.metadata, repeats)
    out["t.iterate"] = min_ms(lambda: list(tensor_stream(source)), repeats)
    out["t.check"] = min_ms(lambda: list(checked_iter(pairs, metas, engine.describe)), repeats)
    out["t.check_skipped"] = float(source.checks_own_stream(metas))

    def plan() -> None:
        sole_plan(engine.session, source.metadata(), None)
        UpdateInfo().to_dict()

    out["t.plan"] = min_ms(plan, repeats)

    def pack() -> None:
        for chunk, tensors in chunked(iter(pairs), chunks):
            engine.prefetch_host(tensors)
            parts = [engine.host_bytes(t) for t in tensors]
            check_chunk_bytes(chunk, sum(p.nbytes for p in parts))

    out["t.pack"] = min_ms(pack, repeats)
    regions = device_regions(engine)
    if regions is not None:
        tensors = [t for _, t in pairs]
        out["t.regions"] = min_ms(lambda: regions(tensors), repeats)

    payload = UpdateInfo.from_metas(metas).to_dict()
    cache = MetaCache("bench")
    model = object()
    cache.resolve(model, UpdateInfo.from_dict(payload), packed=True, buffer_size_bytes=1 << 30)
    reuse = UpdateInfo().to_dict()
    out["w.parse_full"] = min_ms(
        lambda: MetaCache("bench").resolve(
            model, UpdateInfo.from_dict(payload), packed=True, buffer_size_bytes=1 << 30
        ),
        repeats,
    )
    out["w.parse_repeat"] = min_ms(
        lambda: cache.resolve(
            model, UpdateInfo.from_dict(payload), packed=True, buffer_size_bytes=1 << 30
        ),
        repeats,
    )
    out["w.parse_reuse"] = min_ms(
        lambda: cache.resolve(
            model, UpdateInfo.from_dict(reuse), packed=True, buffer_size_bytes=1 << 30
        ),
        repeats,
    )
    resolved = cache.resolve(
        model, UpdateInfo.from_dict(reuse), packed=True, buffer_size_bytes=1 << 30
    )
    if isinstance(resolved, tuple):  # the tree before UnpackPlan (for before/after runs)
        wmetas, wchunks = resolved
        layouts: list[Any] = [_Unplanned(wmetas, c) for c in wchunks]
    else:
        wchunks, layouts = resolved.chunks, resolved.unpack
    buffers = [torch.zeros(c.nbytes, dtype=torch.uint8) for c in wchunks]
    pairs_of = list(zip(layouts, buffers, strict=True))
    out["w.unpack"] = min_ms(lambda: [p.unpack(b) for p, b in pairs_of], repeats)
    batches = [p.unpack(b) for p, b in pairs_of]
    out["w.load"] = min_ms(
        lambda: [host.load_weights(p) for p in load_batches(iter(batches), "chunk")], repeats
    )
    return {k: round(v, 4) for k, v in out.items()}


class _Unplanned:
    """``unpack_chunk`` with no plan: what a warm unpack was before ``UnpackPlan``."""

    def __init__(self, metas: Any, chunk: Any) -> None:
        self.metas, self.chunk = metas, chunk

    def unpack(self, buffer: Any) -> Any:
        from weightwire.torch_side.worker.receive import unpack_chunk

        return unpack_chunk(buffer, self.metas, self.chunk)


def bench_unpack(repeats: int) -> dict[str, float]:
    import torch

    from weightwire.shared.framing import plan
    from weightwire.torch_side.worker import receive

    _, source = jax_source()
    metas = source.metadata()
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 30)
    buf = torch.zeros(chunk.nbytes, dtype=torch.uint8)
    make = getattr(receive, "UnpackPlan", _Unplanned)
    warm = make(metas, chunk)
    return {
        "unpack_chunk_cold_ms": round(
            min_ms(lambda: receive.unpack_chunk(buf, metas, chunk), repeats), 4
        ),
        "unpack_warm_ms": round(min_ms(lambda: warm.unpack(buf), repeats), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("jax", "torch", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=300, help="runs per stage in the split")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (default: Python's 5 ms)",
    )
    args = ap.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    makers = {"jax": jax_source, "torch": torch_source}
    names = list(makers) if args.engine == "both" else [args.engine]
    print(json.dumps({"part": "unpack", **bench_unpack(args.repeats)}))
    for name in names:
        engine, worker, host = connect(makers[name])
        try:
            rounds = bench_rounds(engine, args.rounds, args.profile)
            profile = rounds.pop("profile", None)
            print(json.dumps({"part": "round", "engine": name, **rounds}))
            print(
                json.dumps(
                    {
                        "part": "split",
                        "engine": name,
                        **bench_split(engine, worker, host, args.repeats),
                    }
                )
            )
            if profile:
                print(profile)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
