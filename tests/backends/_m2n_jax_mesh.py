"""Subprocess body of test_stock_m2n's JAX case: 8 forced host devices as an FSDP 4 x TP 2
mesh are 8 ``nccl_m2n`` trainer ranks (rank r on ``mesh.devices.flat[r]``); their plan and
each rank's shard come from the arrays' shardings (``params_of_arrays`` /
``shards_of_arrays``), and every reshard runs through ``NcclM2NDataPlane`` on the
data-moving fake of ``nccl.m2n`` into 2 receiving ranks (threads, as vLLM's TP workers
issue them). XLA_FLAGS precede the jax import, hence a process of its own. Prints one JSON
line; any mismatch fails the process.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.getcwd())
from tests.shared import fake_m2n
from weightwire.backends.base import StockRefusal
from weightwire.backends.nccl.m2n_data import NcclM2NDataPlane
from weightwire.backends.nccl.stock_m2n import M2NLayout, params_of_arrays, shards_of_arrays

fake_m2n.install()
fake_m2n.reset()
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
devices = list(mesh.devices.flat)
T, W = 8, 2


def put(shape: tuple[int, ...], spec: P, seed: int) -> jax.Array:
    x = jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
    return jax.device_put(x, NamedSharding(mesh, spec))


arrays = {
    "rows.weight": put((16, 8), P("fsdp", None), 1),  # rows over fsdp, whole on each tp rank
    "cols.weight": put((8, 16), P(None, "tp"), 2),
    "flat.bias": put((16,), P(("fsdp", "tp")), 3),  # one dim over both axes: (8, 1)
    "norm.weight": put((8,), P(), 4),
}
try:
    params_of_arrays({"both.weight": put((8, 8), P("fsdp", "tp"), 5)}, devices)
    raise SystemExit("a tensor split over two mesh axes was not refused")
except StockRefusal as exc:
    refused = str(exc)

params = params_of_arrays(arrays, devices)
layouts = {p.meta.name: (p.layout.dims, p.layout.placements) for p in params}
assert layouts == {
    "rows.weight": ((4, 2), (0, -1)),
    "cols.weight": ((4, 2), (-1, 1)),
    "flat.bias": ((8, 1), (0, -1)),
    "norm.weight": ((8, 1), None),
}, layouts
# the workers' side: rows and cols split over the TP axis, the rest whole
dst = [M2NLayout((1, W), (-1, 0)), M2NLayout((1, W), (-1, 1)), None, None]

uid = os.urandom(128)
received: dict[int, list[np.ndarray]] = {}


def worker(rank: int) -> None:
    comm = fake_m2n.Communicator.init(T + W, rank, fake_m2n.UniqueId.from_bytes(uid))
    handle = fake_m2n.Handle.create()
    bufs = []
    for p, d in zip(params, dst, strict=True):
        layout = d or M2NLayout((W, 1), None)
        box = layout.box(p.meta.shape, rank - T)
        buf = np.zeros(box.shape, np.float32)
        (src_dims, src_pl), (dst_dims, dst_pl) = p.layout.resolved(), layout.resolved()
        fake_m2n.reshard(
            None,
            buf,
            comm,
            src_mesh=fake_m2n.Mesh(src_dims, 0),
            src_placements=[fake_m2n.Replicate() if c < 0 else fake_m2n.Shard(c) for c in src_pl],
            dst_mesh=fake_m2n.Mesh(dst_dims, T),
            dst_placements=[fake_m2n.Replicate() if c < 0 else fake_m2n.Shard(c) for c in dst_pl],
            handle=handle,
        )
        bufs.append(buf)
    received[rank] = bufs


threads = [threading.Thread(target=worker, args=(T + w,)) for w in range(W)]
for t in threads:
    t.start()
data = NcclM2NDataPlane(list(range(T)), xp=fake_m2n.FakeXP())
data.prepare()
data.connect(T + W, uid, timeout_s=30)
shards = shards_of_arrays(arrays, devices)
whole_held = []
for p, parts in zip(params, shards, strict=True):
    for r, part in enumerate(parts):
        assert len(part.devices()) == 1 and tuple(part.shape) == p.local_shape(r), (p, r)
        if p.layout.placements is not None and part.size == np.prod(p.meta.shape):
            whole_held.append((p.meta.name, r))
for i, (p, d) in enumerate(zip(params, dst, strict=True)):
    data.reshard(shards[i], p.layout.resolved(), (d or M2NLayout((W, 1), None)).resolved(), T)
data.wait(timeout_s=30)
for t in threads:
    t.join(30)
data.close()
for w in range(W):
    for p, d, got in zip(params, dst, received[T + w], strict=True):
        full = np.asarray(arrays[p.meta.name])  # the check's own gather, after the fact
        want = full[(d or M2NLayout((W, 1), None)).box(p.meta.shape, w).slices()]
        np.testing.assert_array_equal(got, want, err_msg=p.meta.name)
world = next(iter(fake_m2n.World.worlds.values()))
print(
    json.dumps(
        {
            "refused": refused,
            "whole_held": whole_held,
            "received": [world.received[T + w] for w in range(W)],
        }
    )
)
