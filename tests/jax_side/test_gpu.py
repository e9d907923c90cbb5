"""PytreeSource on real GPUs (run on the H200 host with ``pytest -m gpu tests/jax_side``)."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from weightwire.jax_side import PytreeSource
from weightwire.tools.models import llama


def _gpus() -> list[jax.Device]:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.gpu
def test_transforms_run_on_gpu_without_host_round_trip() -> None:
    gpus = _gpus()
    if not gpus:
        pytest.skip("jax sees no GPU")
    cfg = llama.config(scan_layers=True)
    params = jax.device_put(llama.init(jax.random.key(0), cfg), gpus[0])
    reference = [
        (n, np.asarray(a))
        for n, a in PytreeSource(
            jax.tree_util.tree_map(np.asarray, params),
            llama.naming(cfg),
            dtype="bfloat16",
            device=jax.devices("cpu")[0],
        )
    ]
    src = PytreeSource(params, llama.naming(cfg), dtype="bfloat16")
    assert src.device == gpus[0]
    with jax.transfer_guard("disallow"):
        got = list(src)
    assert all(a.sharding.device_set == {gpus[0]} for _, a in got)
    for (n, a), (rn, r) in zip(got, reference, strict=True):
        assert n == rn and np.asarray(a).tobytes() == r.tobytes(), n


@pytest.mark.gpu(count=2)
def test_sharded_over_two_gpus_lands_whole_on_the_chosen_one() -> None:
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    gpus = _gpus()
    if len(gpus) < 2:
        pytest.skip("jax sees fewer than 2 GPUs")
    mesh = Mesh(np.array(gpus[:2]), ("x",))
    # ~0.5 GB bf16 on the wire: large enough to time, small enough for any CI GPU
    cfg = llama.config(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        scan_layers=True,
    )
    params = jax.jit(lambda k: llama.init(k, cfg))(jax.random.key(0))
    sharded = jax.tree_util.tree_map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "x"))), params
    )
    src = PytreeSource(sharded, llama.naming(cfg), dtype="bfloat16", device=gpus[1])
    nbytes = sum(m.nbytes for m in src.metadata())
    for _ in range(2):  # second pass is warm (compiled)
        t0 = time.perf_counter()
        with jax.transfer_guard_device_to_host("disallow"):
            groups = list(src.iter_groups())
            jax.block_until_ready([a for g in groups for _, a in g])
        seconds = time.perf_counter() - t0
    print(
        f"\nPytreeSource sharded x2 -> gpu1: {nbytes / 1e9:.2f} GB in {seconds * 1e3:.1f} ms "
        f"= {nbytes / seconds / 1e9:.1f} GB/s"
    )
    flat = [(n, a) for g in groups for n, a in g]
    assert all(a.sharding.device_set == {gpus[1]} for _, a in flat)
    q = dict(flat)["model.layers.3.self_attn.q_proj.weight"]
    want = np.asarray(params["params"]["model"]["layers"]["self_attn"]["q_proj"]["kernel"][3]).T
    np.testing.assert_array_equal(
        np.asarray(q).astype(np.float32), want.astype(np.float32).astype(q.dtype).astype(np.float32)
    )
