"""Arrays sharded over 4 (forced host) devices come out whole, correct, on one device,
without a device-to-host copy. XLA_FLAGS must precede the jax import: a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from weightwire.jax_side import PytreeSource
    from weightwire.tools.models import llama

    devices = jax.devices()
    assert len(devices) == 4, devices
    mesh = Mesh(np.array(devices), ("x",))
    result = {}
    for scan, target in ((False, 2), (True, 0)):
        cfg = llama.config(hidden_size=32, intermediate_size=64, scan_layers=scan)
        params = llama.init(jax.random.key(0), cfg)
        reference = [(n, np.asarray(a)) for n, a in PytreeSource(
            jax.tree_util.tree_map(np.asarray, params), llama.naming(cfg), dtype="bfloat16")]

        def shard(x):  # shard the last axis 4 ways; the rest replicated
            spec = P(*([None] * (x.ndim - 1)), "x") if x.shape[-1] % 4 == 0 else P()
            return jax.device_put(x, NamedSharding(mesh, spec))

        sharded = jax.tree_util.tree_map(shard, params)
        n_sharded = sum(len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated
                        for x in jax.tree_util.tree_leaves(sharded))
        src = PytreeSource(sharded, llama.naming(cfg), dtype="bfloat16", device=target)
        with jax.transfer_guard_device_to_host("disallow"):
            got = list(src)
            groups = [pair for g in src.iter_groups() for pair in g]
        ok_place = all(a.sharding.device_set == {devices[target]} for _, a in got + groups)
        ok_values = all(n == rn and np.asarray(a).tobytes() == r.tobytes()
                        for (n, a), (rn, r) in zip(got, reference, strict=True))
        ok_groups = [n for n, _ in groups] == [n for n, _ in reference] and all(
            np.asarray(a).tobytes() == r.tobytes()
            for (_, a), (_, r) in zip(groups, reference, strict=True))
        result[f"scan={scan},target={target}"] = {
            "n": len(got), "sharded_leaves": n_sharded, "place": ok_place, "values": ok_values,
            "groups": ok_groups}
    print(json.dumps(result))
""")


def test_sharded_leaves_materialize_whole_on_one_device() -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result) == 2
    for case, r in result.items():
        assert r["n"] == 21, case
        assert r["sharded_leaves"] >= 10, case  # really sharded inputs, not replicated ones
        assert r["place"] and r["values"] and r["groups"], (case, r)
