"""Delta-round extraction on the device: time to find what one RL step changed, against one
dense device copy of the same weights, and the payload against (changed elements x 6 bytes).

    python benchmarks/bench_delta.py                    # GPU: Llama-3-8B shapes, bf16
    python benchmarks/bench_delta.py --shape small      # CPU: a small model, same report
    python benchmarks/bench_delta.py --framework torch --lrs 1e-6 --repeats 5
    python benchmarks/bench_delta.py --lrs 1e-6 --jax-expand search cuda \
        --torch-compaction static cuda         # the fused CUDA kernel beside the others
    python benchmarks/bench_delta.py --framework torch --torch-compaction cuda --lrs 1e-6 \
        --group-mib 0,1024,2048,4096 --ahead 1,2   # sweep the launch batching (one row each)
    python benchmarks/bench_delta.py --framework torch --torch-compaction cuda --lrs 1e-6 \
        --tilings 256x4,256x8,512x8x2         # sweep the kernel's tiling (threads x vec [x blocks])

One Adam-like step: ``new = bf16(w - lr * sign(g))`` (Adam's first step is ``lr`` times a
unit-magnitude update per element) on weights drawn like an initialized model's
(``N(0, 0.02)``), so the changed fraction is what bf16 rounding lets through at that
learning rate. Extraction is ``trainer.delta.DeltaTracker.build`` with the framework's
kernel (compare, count, compaction, the patch written into the base), timed until the
device finished (``host``: the build's own time less its waits for counts and for the
device; ``device``: timed events around every fused launch and pack, what the round costs
the device with no host in the way); the dense copy is one device-to-device copy of every
tensor. ``scratch peak``: the fused kernel's scratch of the launches in flight at once;
``allocator``: the peak device memory the first build allocated beyond the weights and the
base (torch: the caching allocator's peak, the patches included; JAX with the fused kernel:
CuPy's pool, the scratch only).
A JSON report goes to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightwire.shared.meta import ParamMeta
from weightwire.trainer import delta_cuda
from weightwire.trainer.delta import DEFAULT_AHEAD, DEFAULT_GROUP_BYTES, DeltaTracker

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root
from benchmarks.delta_frameworks import Jax, Torch

# hidden, intermediate, layers, heads, kv heads, head dim, vocab
SHAPES = {
    "8b": (4096, 14336, 32, 32, 8, 128, 128256),  # Llama-3-8B
    "small": (256, 688, 4, 8, 2, 32, 4096),
}


def llama_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    hidden, inter, layers, heads, kv, hd, vocab = SHAPES[shape]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (heads * hd, hidden),
                p + "self_attn.k_proj.weight": (kv * hd, hidden),
                p + "self_attn.v_proj.weight": (kv * hd, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * hd),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
            }
        )
    out.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return out


def timed(fw: Any, fn: Callable[[], Any], repeats: int, prepare: Callable[[], Any]) -> list[float]:
    samples = []
    for _ in range(repeats):
        arg = prepare()
        fw.sync(arg)
        t0 = time.perf_counter()
        fw.sync(fn(arg) if arg is not None else fn())
        samples.append(time.perf_counter() - t0)
    return samples


def check(fw: Any, base: dict, new: dict, bases: dict, built: Any, patches: int = 3) -> bool:
    """The base after the build holds the new bytes, and the first ``patches`` patches,
    applied to the old weights with numpy, give the new weights exactly."""
    import numpy as np

    from weightwire.shared.delta import apply_patch

    if not all(fw.same(bases[n], new[n]) for n in new):
        return False
    wire = dict(built.pairs)
    for p in built.patches[:patches]:
        index = fw.host(wire[p.index_name]).view(np.int32)
        values = fw.host(wire[p.values_name])
        old = fw.host(base[p.name]).reshape(-1)
        if apply_patch(old, index, values).tobytes() != fw.host(new[p.name]).tobytes():
            return False
    return True


def encodings(fw: Any, built: Any, metas: list[ParamMeta]) -> dict[str, float]:
    """Index bytes of the round's patches under other encodings, per changed element, and
    zlib (level 1) of the flat int32 indices with its host speed: what the flat_i32 wire
    encoding leaves on the table."""
    import zlib

    import numpy as np

    wire = dict(built.pairs)
    numel = {m.name: m.numel for m in metas}
    sizes = {"flat_i32": 0, "gap_u16": 0, "gap_varint": 0, "bitmap": 0, "best_flat_bitmap": 0}
    zipped, raw, seconds = 0, 0, 0.0
    for p in built.patches:
        index = fw.host(wire[p.index_name]).view(np.int32).astype(np.int64)
        gaps = np.diff(index, prepend=-1)
        bitmap = -(-numel[p.name] // 8)
        sizes["flat_i32"] += 4 * index.size
        sizes["gap_u16"] += int(2 * gaps.size + 4 * np.count_nonzero(gaps >= 65535))
        sizes["gap_varint"] += int(
            gaps.size + sum(np.count_nonzero(gaps >= 1 << (7 * k)) for k in range(1, 5))
        )
        sizes["bitmap"] += bitmap
        sizes["best_flat_bitmap"] += min(4 * index.size, bitmap)
        data = index.astype(np.int32).tobytes()
        t0 = time.perf_counter()
        zipped += len(zlib.compress(data, 1))
        seconds += time.perf_counter() - t0
        raw += len(data)
    changed = max(built.changed, 1)
    out = {f"index_bytes_per_changed_{k}": v / changed for k, v in sizes.items()}
    out["index_bytes_per_changed_zlib1"] = zipped / changed
    out["zlib1_host_mb_s"] = raw / seconds / 1e6 if seconds else 0.0
    return out


def _fused() -> list[Any]:
    """The fused CUDA kernels compiled so far (their wait, scratch and timing counters)."""
    from weightwire.trainer import delta_cuda

    return list(delta_cuda._COMPILED.values())


def measure(fw: Any, tracker: DeltaTracker, new: dict, metas: list, bases: dict) -> dict:
    """One build on ``bases`` (a snapshot of the old weights, ready): wall time to the
    device's end, and the host's part (the build's own time less its waits for counts and
    for ``settle``)."""
    settled = [0.0]
    kernel = tracker.kernel

    inner = kernel.settle

    def settle() -> None:
        t0 = time.perf_counter()
        inner()
        settled[0] += time.perf_counter() - t0

    tracker.bases = bases
    waited = sum(k.waited for k in _fused())
    kernel.settle = settle  # the instance's: timed
    try:
        t0 = time.perf_counter()
        built = tracker.build(list(new.items()), metas)
        t1 = time.perf_counter()
        fw.sync([[p for _, p in built.pairs], tracker.bases])
        t2 = time.perf_counter()
    finally:
        del kernel.settle
    waited = sum(k.waited for k in _fused()) - waited
    return {"wall": t2 - t0, "host": t1 - t0 - waited - settled[0], "built": built}


def run(
    fw: Any, shape: str, lrs: list[float], repeats: int, density: float,
    configs: list[tuple[int, int, Any]], encode: bool = False,
) -> list[dict]:  # fmt: skip
    from weightwire.shared.groups import batch_by_layer
    from weightwire.trainer.delta import batch_by_bytes

    shapes = llama_shapes(shape)
    metas = [ParamMeta(n, "bfloat16", s) for n, s in shapes.items()]
    by_name = {m.name: m for m in metas}
    base = fw.weights(shapes)
    dense_bytes = sum(m.nbytes for m in metas)
    copy = fw.copy_all(base)
    copy_s = statistics.median(timed(fw, copy, repeats + 1, lambda: None)[1:])
    rows = []
    for lr in lrs:
        new = fw.step(base, lr)
        for group_bytes, ahead, tiling in configs:
            delta_cuda.TILING = tiling
            tracker = DeltaTracker(
                fw.kernel, density=density, anchor_every=0, group_bytes=group_bytes, ahead=ahead
            )
            launches = len(list(batch_by_bytes(batch_by_layer(new.items()), by_name, group_bytes)))
            bases = fw.snapshot(base)
            fw.sync(bases)
            fw.forget_scratch()
            fw.mark()
            for k in _fused():
                k.scratch_peak = k.scratch_live
            first = measure(fw, tracker, new, metas, bases)
            del bases
            scratch = fw.scratch()
            peak = max((k.scratch_peak for k in _fused()), default=0)
            built = first["built"]
            exact = check(fw, base, new, tracker.bases, built)
            samples = []
            for _ in range(repeats):
                bases = fw.snapshot(base)
                fw.sync(bases)
                got = measure(fw, tracker, new, metas, bases)
                del got["built"], bases  # one round's base alive at a time (16 GB for 8B)
                samples.append(got)
            device_ms = None
            if _fused():
                for k in _fused():
                    k.device_seconds()
                    k.timing = True
                bases = fw.snapshot(base)
                fw.sync(bases)
                measure(fw, tracker, new, metas, bases)
                del bases
                for k in _fused():
                    k.timing = False
                device_ms = 1e3 * sum(k.device_seconds() for k in _fused())
            extract_ms = 1e3 * statistics.median(s["wall"] for s in samples)
            r = {
                "framework": fw.name, "device": fw.device, "shape": shape, "lr": lr,
                "group_mib": group_bytes / 2**20, "ahead": ahead, "launches": launches,
                "tiling": f"{tiling.threads}x{tiling.vec}x{tiling.min_blocks}",
                "tensors": len(metas), "density": built.density, "changed": built.changed,
                "patches": len(built.patches),
                "dense_tensors": len(built.metas) - 2 * len(built.patches),
                "dense_bytes": dense_bytes, "wire_bytes": sum(m.nbytes for m in built.metas),
                "changed_x6_bytes": 6 * built.changed, "extract_ms": extract_ms,
                "first_extract_ms": 1e3 * first["wall"], "dense_copy_ms": 1e3 * copy_s,
                "ratio": extract_ms / (1e3 * copy_s),
                "host_ms": 1e3 * statistics.median(s["host"] for s in samples),
                "device_ms": device_ms, "exact": exact, "scratch_bytes": scratch,
                "scratch_peak_bytes": peak,
            }  # fmt: skip
            rows.append(r)
            dev = f"{device_ms:.2f}" if device_ms is not None else "-"
            print(
                f"{fw.name:11} {shape} lr={lr:g} group={r['group_mib']:.0f}MiB ahead={ahead} "
                f"tiling={r['tiling']} "
                f"launches={launches}: extract {extract_ms:.2f} ms vs copy "
                f"{r['dense_copy_ms']:.2f} ms = {r['ratio']:.2f}x | host {r['host_ms']:.2f} "
                f"ms, device {dev} ms | scratch peak {peak / 1e9:.2f} GB (allocator "
                f"{scratch / 1e9:.2f} GB) | density {r['density']:.3%}, {r['patches']} "
                f"patches, {r['dense_tensors']} dense, wire {r['wire_bytes'] / 1e6:.1f} MB, "
                f"first {r['first_extract_ms']:.0f} ms, exact={exact}",
                flush=True,
            )
            if encode:
                r.update(encodings(fw, built, metas))
                shown = ", ".join(
                    f"{k.removeprefix('index_bytes_per_changed_')} {v:.2f}"
                    for k, v in r.items()
                    if k.startswith("index_bytes")
                )
                print(f"  index bytes per changed element: {shown}", flush=True)
            del first, built, samples, tracker
        del new
    return rows


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _tilings(text: str) -> list[Any]:
    """``threads x vec [x min_blocks]``, comma-separated."""
    return [delta_cuda.Tiling(*(int(v) for v in t.split("x"))) for t in text.split(",") if t]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--framework", choices=["jax", "torch", "both"], default="both")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-6, 1e-5])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--density", type=float, default=0.25, help="TrainerInitInfo.delta_density")
    ap.add_argument(
        "--jax-expand", nargs="+", default=["search"], help="auto, cuda, search, scatter"
    )
    ap.add_argument(
        "--torch-compaction", nargs="+", default=["static"], help="auto, cuda, static, nonzero"
    )
    ap.add_argument(
        "--group-mib", type=_ints, default=[DEFAULT_GROUP_BYTES >> 20],
        help="DeltaTracker.group_bytes to sweep, in MiB, comma-separated (0: a launch per layer)",
    )  # fmt: skip
    ap.add_argument(
        "--ahead", type=_ints, default=[DEFAULT_AHEAD],
        help="DeltaTracker.ahead to sweep, comma-separated (launches in flight past the oldest)",
    )  # fmt: skip
    ap.add_argument(
        "--tilings", type=_tilings, default=[delta_cuda.TILING],
        help="the fused kernel's tilings to sweep: threads x vec [x min blocks], comma-separated",
    )  # fmt: skip
    ap.add_argument("--encodings", action="store_true", help="index sizes of other encodings")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows: list[dict] = []
    kinds: list[tuple[Any, str]] = []
    if args.framework in ("jax", "both"):
        kinds += [(Jax, v) for v in args.jax_expand]
    if args.framework in ("torch", "both"):
        kinds += [(Torch, v) for v in args.torch_compaction]
    for make, variant in kinds:
        fw = make(variant)
        shape = args.shape or ("8b" if fw.device in ("gpu", "cuda") else "small")
        configs = [
            (g << 20, a, t) for t in args.tilings for g in args.group_mib for a in args.ahead
        ]
        rows += run(fw, shape, args.lrs, args.repeats, args.density, configs, args.encodings)
        del fw
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
