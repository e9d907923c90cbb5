"""Expert naming at scale: a 128-expert, 48-layer MoE (Qwen3-30B-A3B geometry) on CPU.

    python benchmarks/bench_moe.py [--repeats 5] [--rounds 3] [--json out.json]

Three measurements:

1. **Metadata**: ``PytreeSource(layout, preset("qwen3_moe", ...)).metadata()`` for the
   real geometry (18,867 HF tensors, abstract leaves: no memory), scanned and unrolled
   layouts; cold (first in the process, JAX shape evaluation included) and warm (a fresh
   source each repeat, median).
2. **Dispatch**: the same tensor count with tiny dimensions and real arrays; one
   ``iter_groups()`` pass counts the jitted calls the source makes (one per layer group,
   not per expert) and times the pass.
3. **Round per-tensor overhead**: ``JAXTrainerEngine.send_weights()`` over
   ``weightwire_tcp`` to a loopback receiver process (the torch worker engine), for the
   tiny MoE (18,867 tensors) and for the same bytes in 50 tensors; the difference over the
   tensor-count difference is what one more tensor costs a round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import weightwire.jax_side.source as source_mod
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.layouts import preset_for_hf, preset_layout
from weightwire.jax_side.naming import Naming
from weightwire.jax_side.rules import Rule
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.timeouts import Timeouts
from weightwire.testing.loopback import spawn_loopback
from weightwire.trainer.config import TrainerInitInfo

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "tie_word_embeddings": False,
}
TINY_DIMS = {
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "moe_intermediate_size": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
}


def time_metadata(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for scan in (True, False):
        layout = preset_layout("qwen3_moe", QWEN3_30B_A3B, scan_layers=scan, dtype=jnp.bfloat16)
        naming = preset_for_hf("qwen3_moe", QWEN3_30B_A3B, scan_layers=scan)
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            metas = PytreeSource(layout, naming).metadata()
            times.append(time.perf_counter() - t)
        rows.append(
            {
                "layout": "scanned" if scan else "unrolled",
                "tensors": len(metas),
                "cold_s": times[0],
                "warm_median_s": statistics.median(times[1:]),
            }
        )
    return rows


def materialize(layout: Any) -> Any:
    keys = iter(jax.random.split(jax.random.key(0), len(jax.tree_util.tree_leaves(layout))))
    return jax.tree_util.tree_map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype), layout)


def time_dispatch(params: Any, naming: Naming) -> dict[str, Any]:
    source = PytreeSource(params, naming)
    calls = []
    real = source_mod._compiled

    def counting(signature):
        fn = real(signature)

        def wrapped(*a, **kw):
            calls.append(len(signature))
            return fn(*a, **kw)

        return wrapped

    source_mod._compiled = counting
    try:
        for _ in source.iter_groups():  # warm: compiles once per distinct group shape
            pass
        calls.clear()
        t = time.perf_counter()
        n = 0
        for group in source.iter_groups():
            jax.block_until_ready([a for _, a in group])
            n += len(group)
        seconds = time.perf_counter() - t
    finally:
        source_mod._compiled = real
    return {
        "tensors": n,
        "groups": len(source.groups()),
        "jit_calls": len(calls),
        "pass_s": seconds,
        "us_per_tensor": seconds / n * 1e6,
    }


def flat_same_bytes(params: Any, parts: int) -> tuple[dict[str, jax.Array], Naming]:
    """The same total bytes as ``params`` in ``parts`` tensors (one per layer-ish group)."""
    total = sum(x.size for x in jax.tree_util.tree_leaves(params))
    per = -(-total // parts)
    tree = {f"layers_{i}": {"w": jnp.zeros((per,), jnp.float32) + i} for i in range(parts)}
    return tree, Naming([Rule("layers_{i:\\d+}/w", "model.layers.{i}.w")])


def time_rounds(sources: dict[str, PytreeSource], rounds: int) -> dict[str, dict[str, Any]]:
    proc, client = spawn_loopback("weightwire_tcp", "cpu", timeout=180)
    out = {}
    try:
        for label, source in sources.items():
            info = TrainerInitInfo(
                backend="weightwire_tcp", timeouts=Timeouts(http_s=300, transfer_s=300)
            )
            engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
            try:
                engine.send_weights()  # warm-up: first metadata, connections, compiles
                ms = [engine.send_weights() for _ in range(rounds)]
            finally:
                engine.shutdown()
            out[label] = {
                "tensors": ms[0].tensors,
                "nbytes": ms[0].nbytes,
                "round_median_s": statistics.median(m.total_seconds for m in ms),
                "phases_median_s": {
                    k: statistics.median(m.seconds.get(k, 0.0) for m in ms) for k in ms[0].seconds
                },
            }
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--no-rounds", action="store_true", help="skip the loopback rounds (no torch needed)"
    )
    ap.add_argument("--json", help="write all rows here")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"metadata": time_metadata(args.repeats)}
    for row in report["metadata"]:
        print(
            f"metadata {row['layout']:8s} {row['tensors']} tensors: cold {row['cold_s']:.3f} s, "
            f"warm {row['warm_median_s']:.3f} s"
        )
    tiny = {**QWEN3_30B_A3B, **TINY_DIMS}
    params = materialize(preset_layout("qwen3_moe", tiny, scan_layers=True))
    naming = preset_for_hf("qwen3_moe", tiny, scan_layers=True)
    report["dispatch"] = d = time_dispatch(params, naming)
    print(
        f"iter_groups {d['tensors']} tensors in {d['groups']} groups: {d['jit_calls']} jitted "
        f"calls, {d['pass_s']:.3f} s ({d['us_per_tensor']:.1f} us/tensor)"
    )
    if not args.no_rounds:
        flat, flat_naming = flat_same_bytes(params, 50)
        rounds = time_rounds(
            {"moe": PytreeSource(params, naming), "flat": PytreeSource(flat, flat_naming)},
            args.rounds,
        )
        moe, few = rounds["moe"], rounds["flat"]
        per = (moe["round_median_s"] - few["round_median_s"]) / (moe["tensors"] - few["tensors"])
        report["rounds"] = {**rounds, "per_tensor_overhead_us": per * 1e6}
        for label, r in rounds.items():
            phases = " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in r["phases_median_s"].items())
            print(
                f"round {label:4s} {r['tensors']} tensors, {r['nbytes'] / 1e6:.1f} MB: "
                f"{r['round_median_s']:.3f} s ({phases})"
            )
        print(f"per-tensor round overhead: {per * 1e6:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    raise SystemExit(main())
