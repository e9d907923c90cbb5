"""A packed chunk's tensor copies on one GPU: one memcpy per tensor vs ``GatherCopy`` (issue 19).

    python benchmarks/bench_gather.py [--models qwen2-0.5b,llama3-8b] [--reps 30]

For each model (HF shapes, bf16), every tensor is copied back to back into one buffer,
as the pull path fills a chunk: (a) one ``cudaMemcpyAsync`` per tensor, (b)
``GatherCopy`` (tensors under ``SMALL_BYTES`` tiled into one kernel launch, larger ones a
memcpy each). Baseline in the same run: one ``cudaMemcpyAsync`` of the same total bytes
(the device-copy ceiling). Reported: host ms to enqueue, device ms (CUDA events around
the enqueue), and the device time's ratio to the ceiling; bytes are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from weightwire.backends.device import DeviceBytes
from weightwire.backends.ipc.gather import GatherCopy
from weightwire.tools.bench.sync_models import MODELS, hf_shapes


def _time(cp: Any, stream: Any, fn: Any, reps: int) -> tuple[float, float]:
    host, dev = [], []
    for i in range(reps + 3):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        stream.synchronize()
        e0.record(stream)
        t = time.perf_counter()
        fn()
        h = time.perf_counter() - t
        e1.record(stream)
        e1.synchronize()
        if i >= 3:
            host.append(h)
            dev.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return statistics.median(host) * 1e3, statistics.median(dev) * 1e3


def run(model: str, reps: int) -> list[str]:
    import cupy as cp
    import numpy as np

    shapes = hf_shapes(MODELS[model])
    srcs = [cp.random.randint(0, 1 << 16, int(np.prod(s)), dtype=cp.uint16) for _, s in shapes]
    regions = [DeviceBytes(a.data.ptr, a.nbytes, 0, a) for a in srcs]
    total = sum(r.nbytes for r in regions)
    dst, ref = cp.empty(total, dtype=cp.uint8), cp.empty(total, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime

    def loop() -> None:
        off = 0
        for r in regions:
            rt.memcpyAsync(ref.data.ptr + off, r.ptr, r.nbytes, 3, stream.ptr)
            off += r.nbytes

    gather = GatherCopy(cp, 0, stream.ptr)
    deadline = time.monotonic() + 600
    rows = []
    ceiling = _time(
        cp, stream, lambda: rt.memcpyAsync(dst.data.ptr, ref.data.ptr, total, 3, stream.ptr), reps
    )
    for name, fn in (
        ("memcpy per tensor", loop),
        (
            "GatherCopy",
            lambda: gather.copy(dst.data.ptr, regions, deadline=deadline, alive=lambda: None),
        ),
    ):
        host, dev = _time(cp, stream, fn, reps)
        rows.append(
            f"| {model} | {len(regions)} | {total / 1e9:.2f} | {name} | {host:.3f} | {dev:.3f} | "
            f"{ceiling[1]:.3f} | {ceiling[1] / dev:.2f} |"
        )
    stream.synchronize()
    assert bool((dst == ref).all()), "GatherCopy bytes differ from the per-tensor copies"
    gather.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2-0.5b,llama3-8b")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    print(
        "| model | tensors | GB | copies | host ms | device ms | 1-memcpy ceiling ms | ceiling / "
        "device |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for row in run(model, args.reps):
            print(row, flush=True)


if __name__ == "__main__":
    main()
