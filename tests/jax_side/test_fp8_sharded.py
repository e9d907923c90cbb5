"""A weight sharded over 4 (forced host) devices quantizes on those devices: the FP8 bytes
and scales equal the numpy reference's (row, column and 2-D shardings, and shards that cut
blocks), and where every shard holds whole blocks the weight keeps its sharding.
XLA_FLAGS must precede the jax import: a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, ml_dtypes, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from weightwire.jax_side.quant import quantize_fp8
    from weightwire.shared.quant import (
        Fp8Block, Fp8PerTensor, quantize_block_reference, quantize_tensor_reference)

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    rng = np.random.default_rng(4)
    result = []
    cases = [(spec, (512, 512)) for spec in (P("a", None), P(None, "b"), P("a", "b"))]
    cases.append((P("a", "b"), (384, 384)))  # shards of 192: blocks straddle two devices
    for spec, shape in cases:
        x = (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)
        sharding = NamedSharding(mesh, spec)
        xs = jax.device_put(jnp.asarray(x), sharding)
        for scheme in (Fp8Block(), Fp8Block(ue8m0=True), Fp8PerTensor()):
            got = quantize_fp8("w.weight", xs, scheme)
            if isinstance(scheme, Fp8PerTensor):
                want = quantize_tensor_reference("w.weight", x)
            else:
                want = quantize_block_reference("w.weight", x, scheme)
            result.append({
                "case": f"{spec} {shape} {scheme}",
                "whole_blocks": shape == (512, 512),
                "bytes": np.asarray(got.weight).tobytes() == want[0].tobytes(),
                "scale": np.asarray(got.scale).tobytes() == want[1].tobytes(),
                "kept": got.weight.sharding.is_equivalent_to(sharding, 2),
            })
    print(json.dumps(result))
""")


def test_a_sharded_weight_quantizes_in_place_to_the_reference_bytes() -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 12
    for row in result:
        assert row["bytes"] and row["scale"], row
        # where each device holds whole blocks, the FP8 arrays stay where the weight was
        assert row["kept"] or not row["whole_blocks"], row
