"""Device packing rate on one GPU: how fast the JAX sender turns a chunk's tensors into
one contiguous buffer, against a plain device-to-device copy of the same bytes.

    python benchmarks/bench_pack.py [--chunk-mib 1024] [--repeats 20]

The packer must outrun NVLink (~370 GB/s) by a wide margin, or packing, not the wire,
bounds a round. Prints GB/s for: byte-wise concatenate (the first packer), word-wise
concatenate (``weightwire.jax_side.packer.pack_words``), the engine's packer
(``JaxDevicePacker.pack``: one device-to-device copy per tensor into a reused slot
buffer) and ``jnp.copy`` of one buffer of the same size (the copy-bandwidth ceiling).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from weightwire.jax_side.packer import JaxDevicePacker, pack_words


@jax.jit
def _byte_concat(*xs: jax.Array) -> jax.Array:
    return jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in xs])


def _time(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    # A Llama-3-8B decoder layer's tensors (bf16), repeated until the chunk is full.
    layer = [
        (4096, 4096),
        (1024, 4096),
        (1024, 4096),
        (4096, 4096),
        (14336, 4096),
        (14336, 4096),
        (4096, 14336),
        (4096,),
        (4096,),
    ]
    shapes, total = [], 0
    while total < args.chunk_mib << 20:
        for s in layer:
            shapes.append(s)
            n = 2
            for d in s:
                n *= d
            total += n
    key = jax.random.PRNGKey(0)
    xs = [jax.random.normal(key, s, dtype=jnp.bfloat16) for s in shapes]
    flat = jnp.zeros(total, jnp.uint8)
    packer = JaxDevicePacker(None)
    stream = packer.new_stream()

    def slot_pack() -> None:
        packer.pack(xs, total, stream, 0)
        stream.synchronize()

    rows = {
        "byte-wise concatenate": _time(lambda: _byte_concat(*xs), args.repeats),
        "word-wise concatenate (pack_words)": _time(lambda: pack_words(xs), args.repeats),
        "engine packer: memcpy per tensor into a slot buffer": _time(slot_pack, args.repeats),
        "jnp.copy of one buffer": _time(lambda: jnp.copy(flat), args.repeats),
    }
    print(
        f"device {jax.devices()[0]}, chunk {total / 2**20:.0f} MiB in {len(xs)} bf16 tensors, "
        f"median of {args.repeats}"
    )
    print("| packer | ms | GB/s |\n|---|---:|---:|")
    for name, sec in rows.items():
        print(f"| {name} | {sec * 1e3:.2f} | {total / sec / 1e9:.0f} |")


if __name__ == "__main__":
    main()
