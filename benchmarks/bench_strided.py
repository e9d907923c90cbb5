"""The write-through's strided / casting copies on one GPU: one launch per landing vs one
launch per chunk (``weightwire.backends.ipc.through.kernels``), same bytes.

    python benchmarks/bench_strided.py [--model qwen2-0.5b|llama3-8b] [--reps 20]

Every Hugging Face tensor of a Llama-shaped set (``SHAPES`` below), float32 on the
trainer's side, lands cast into a bfloat16 parameter: ``cast`` whole (every landing a
casting copy), ``cast-tp2`` the part a TP-2 rank serves (q / k / v / gate / up and the
embedding and head by rows, o_proj and down_proj by columns: a row-parallel weight's
column half). The landings are planned as the pipeline plans them (``plan_copies``) and
launched as one chunk on one stream: per case, ``WEIGHTWIRE_IPC_STRIDED_BATCH=0`` (one
launch per landing, the fallback) and ``1`` (one launch per dtype pair, the default),
timed with CUDA events (device ms) and on the host (enqueue ms), median of ``--reps``
after two warm-ups; the two destinations are compared byte for byte. GB/s counts the
bytes read and written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from weightwire.backends.ipc.through.table import (
    Alloc,
    Land,
    LandingTable,
    ParamSlot,
    TensorLands,
    plan_copies,
)
from weightwire.shared.meta import ParamMeta
from weightwire.tools.server.scaled import llama_shapes

SHAPES = {
    # hidden, intermediate, layers, heads, kv heads, head dim, vocab
    "llama3-8b": (4096, 14336, 32, 32, 8, 128, 128256),
    "qwen2-0.5b": (896, 4864, 24, 14, 2, 64, 151936),
}
_COLUMNS = ("o_proj", "down_proj")


def landings(model: str, tp: int) -> tuple[list[ParamMeta], LandingTable]:
    """Every tensor float32, rank 0's 1/``tp`` of it into its own bfloat16 parameter."""
    hidden, inter, layers, heads, kv, hd, vocab = SHAPES[model]
    shapes = llama_shapes(
        vocab,
        {
            "hidden_size": hidden,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": hd,
        },
    )
    metas, params, tensors, at = [], [], [], 0
    for i, (name, shape) in enumerate(shapes.items()):
        metas.append(ParamMeta(name, "float32", shape))
        if len(shape) == 1 or tp == 1:
            part, src_offset = shape, 0
        elif any(c in name for c in _COLUMNS):
            part, src_offset = (shape[0], shape[1] // tp), 0
        else:
            part, src_offset = (shape[0] // tp, shape[1]), 0
        n = 1
        for d in part:
            n *= d
        params.append(ParamSlot(name, 0, at, 2 * n, "bfloat16"))
        src_strides = (shape[1], 1) if len(shape) == 2 else (1,)
        dst_strides = (part[1], 1) if len(part) == 2 else (1,)
        land = Land(i, part, src_offset, src_strides, 0, dst_strides)
        tensors.append(TensorLands(name, (land,)))
        at += -(-2 * n // 256) * 256
    return metas, LandingTable((Alloc(bytes(64), at),), tuple(params), tuple(tensors))


def run_case(model: str, tp: int, reps: int) -> list[dict[str, Any]]:
    import cupy as cp

    from weightwire.backends.device import StreamRef
    from weightwire.backends.ipc.through.kernels import StridedCopy

    metas, table = landings(model, tp)
    offsets, total = [], 0
    for m in metas:
        offsets.append(total)
        total += -(-m.numel * 4 // 256) * 256
    src = cp.random.standard_normal(total // 4, dtype=cp.float32)
    copies = plan_copies(table, metas)
    moved = sum(j.numel * 6 for c in copies for j in c.strided)  # 4 read + 2 written each
    stream = cp.cuda.Stream(non_blocking=True)
    out: list[dict[str, Any]] = []
    results = {}
    for batch in ("0", "1"):
        os.environ["WEIGHTWIRE_IPC_STRIDED_BATCH"] = batch
        dst = cp.zeros(table.allocs[0].nbytes, dtype=cp.uint8)
        copier = StridedCopy(cp, 0, stream.ptr)
        jobs = [
            (copier.prepare(j), src.data.ptr + at, dst.data.ptr)
            for at, c in zip(offsets, copies, strict=True)
            for j in c.strided
        ]
        ref = StreamRef(stream.ptr)
        device, host = [], []
        for _ in range(reps + 2):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            t0 = time.perf_counter()
            copier.launch_all(jobs, ref, deadline=time.monotonic() + 60, alive=lambda: None)
            host.append(time.perf_counter() - t0)
            end.record(stream)
            end.synchronize()
            device.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        results[batch] = cp.asnumpy(dst)
        copier.close()
        ms = statistics.median(device[2:]) * 1e3
        out.append(
            {
                "model": model,
                "case": "cast" if tp == 1 else f"cast-tp{tp}",
                "landings": len(jobs),
                "path": "one launch per landing" if batch == "0" else "one launch per chunk",
                "device_ms": ms,
                "host_ms": statistics.median(host[2:]) * 1e3,
                "gbps": moved / ms / 1e6,
            }
        )
    same = bool((results["0"] == results["1"]).all())
    for row in out:
        row["bytes"] = "ok" if same else "MISMATCH"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    rows = []
    for tp in (1, 2):
        rows.extend(run_case(args.model, tp, args.reps))
    print("| model | case | landings | path | device ms | host ms | GB/s | bytes |")
    print("|---|---|---:|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['case']} | {r['landings']} | {r['path']} | "
            f"{r['device_ms']:.3f} | {r['host_ms']:.3f} | {r['gbps']:.0f} | {r['bytes']} |"
        )
    return 0 if all(r["bytes"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
