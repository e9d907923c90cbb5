"""Subprocess body of ``test_shard_delta``: patches extracted shard by shard from sharded
``jax.Array`` s on 8 forced host devices equal the patches extracted from the same values
held whole on one device (indices and values, bit for bit; the bases after it too), over
meshes (FSDP 4 x TP 2, 2 x 4), layouts (both axes, one, replicated, an axis that does not
divide the dimension left replicated, both axes on one dimension, 3-D) and change patterns
(none, every element, one element, a random subset, NaN-free random values); the one-element
patch of an unchanged round (``first``) from the shard holding element 0. Every gather
entry point refuses during the extraction, and no live array ever holds a whole copy of a
sharded one. XLA_FLAGS must precede the jax import, hence a process of its own. Prints one
JSON line: the cases checked."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc
import json
import sys
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.jax_side._no_gather import no_whole_copies
from weightwire.jax_side.delta import JaxDeltaKernel
from weightwire.trainer.delta import Extracted

LAYOUTS: list[tuple[tuple[int, ...], Any]] = [
    ((16, 12), P("fsdp", "tp")),
    ((16, 12), P("tp", "fsdp")),
    ((16, 12), P(None, "tp")),
    ((16, 12), P()),  # every device the whole array: extracted once
    ((10, 6), P(None, "tp")),  # 10 rows do not split 4 ways: rows replicated over fsdp
    ((12, 5), P("fsdp", None)),  # 5 columns do not split 2 ways
    ((16, 3), P(("fsdp", "tp"), None)),  # both axes on one dimension
    ((4, 8, 6), P("fsdp", None, "tp")),
    ((8,), P("fsdp")),
]
WIDE = [((16, 12), P("fsdp", "tp")), ((8, 12), P("tp", None))]
"""The 2 x 4 mesh's layouts (a NamedSharding must divide every dimension it splits)."""
DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8]


def cases(full: bool) -> list[tuple[tuple[int, int], tuple[int, ...], Any, Any]]:
    """FSDP 4 x TP 2: every layout in float32, the first in every dtype; ``full``: every
    layout in every dtype, and the 2 x 4 mesh."""
    out = [((4, 2), shape, spec, np.float32) for shape, spec in LAYOUTS]
    dtypes = DTYPES[1:]
    out += [((4, 2), *LAYOUTS[0], d) for d in dtypes]
    if full:
        out += [((4, 2), shape, spec, d) for shape, spec in LAYOUTS[1:] for d in dtypes]
        out += [((2, 4), shape, spec, d) for shape, spec in WIDE for d in DTYPES]
    return out


def pattern(kind: str, base: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    new = base.copy()
    flat = new.reshape(-1)
    if kind == "all":
        flat[:] = rng.standard_normal(flat.size).astype(new.dtype) + flat + 1
        flat[flat == base.reshape(-1)] += 1
    elif kind == "one":
        flat[rng.integers(flat.size)] += 1
    elif kind == "random":
        at = rng.choice(flat.size, max(1, flat.size // 7), replace=False)
        flat[at] = (flat[at] + rng.integers(1, 5, len(at))).astype(new.dtype)
    return new


def patch_of(kernel: JaxDeltaKernel, new: Any, base: Any) -> tuple[Any, ...]:
    """``(count, index, values, base after)`` on the host, through the kernel's own steps
    (the test may read a whole array: the guard wraps only the sharded side's call)."""
    scan = kernel.finish(kernel.start([new], [base], [new.size]))
    (count,) = scan.counts
    if not count:
        return 0, None, None, np.array(base)
    got: Extracted = kernel.extract(scan, 0, new, base)
    kernel.settle()
    # copies: a CPU array's host view would keep its device buffer alive
    return count, got.index.host().copy(), got.values.host().copy(), np.array(got.base)


def main() -> None:
    rng = np.random.default_rng(48)
    kernel = JaxDeltaKernel()
    one = jax.devices()[0]
    checked = 0
    for mesh_shape, shape, spec, dtype in cases("--full" in sys.argv):
        mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("fsdp", "tp"))
        sharding = NamedSharding(mesh, spec)
        guarded = set() if sharding.is_fully_replicated else {shape}
        before = (rng.standard_normal(shape) * 8).astype(dtype)
        for kind in ("none", "all", "one", "random"):
            after = pattern(kind, before, rng)
            whole = patch_of(
                kernel, jax.device_put(after, one), kernel.snapshot(jax.device_put(before, one))
            )
            gc.collect()  # the reference's arrays: gone before the guard looks
            new = jax.device_put(after, sharding)
            base = kernel.snapshot(jax.device_put(before, sharding))
            with no_whole_copies(guarded):
                if kind == "none":  # a round where nothing changed still names its base
                    first = kernel.first(base)
                    assert np.asarray(first.index).tolist() == [0]
                    assert np.asarray(first.values).tobytes() == before.reshape(-1)[:1].tobytes()
                count, index, values, patched = patch_of(kernel, new, base)
            what = f"{mesh_shape} {shape} {spec} {np.dtype(dtype).name} {kind}"
            assert count == whole[0], f"{what}: {count} != {whole[0]} changed"
            assert count == int((before != after).sum()), what
            if count:
                assert index.dtype == np.int32 and index.tobytes() == whole[1].tobytes(), what
                assert values.tobytes() == whole[2].tobytes(), what
                assert (np.diff(index.astype(np.int64)) > 0).all(), what
            assert patched.tobytes() == after.tobytes(), what
            checked += 1
    print(json.dumps({"checked": checked}))


if __name__ == "__main__":
    main()
