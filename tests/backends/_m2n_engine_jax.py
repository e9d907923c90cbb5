"""Subprocess body of test_m2n_engine's JAX case: 8 forced host devices as an FSDP 4 x TP 2
mesh are the 8 trainer ranks of a ``JAXTrainerEngine`` with ``backend="nccl_m2n"``; three
rounds through ``trainer_init`` / ``send_weights`` into 2 emulated TP workers
(``test_stock_m2n.EmulatedWorkers``) over the data-moving fake of ``nccl.m2n``. Every reshard's
parts are recorded: one single-device array per rank, of its own shard's shape (no rank is
handed a gathered tensor). Prints one JSON line; any mismatch fails the process.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.getcwd())
from tests.backends.test_m2n_engine import TIMEOUTS, Server
from tests.shared import fake_m2n
from weightwire.backends.nccl import m2n_data
from weightwire.backends.nccl.stock_m2n import M2NLayout
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.testing.sources import DictSource
from weightwire.trainer.config import TrainerInitInfo

fake_m2n.install()
fake_m2n.reset()
m2n_data.array_module = lambda: fake_m2n.FakeXP()  # type: ignore[assignment]
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
T, W = 8, 2
SPECS = {
    "rows.weight": ((16, 8), P("fsdp", None)),  # rows over fsdp, whole on each tp rank
    "cols.weight": ((8, 16), P(None, "tp")),
    "flat.bias": ((16,), P(("fsdp", "tp"))),  # one dim over both axes: (8, 1)
    "norm.weight": ((8,), P()),
}
DST: list[tuple[int, int] | None] = [(-1, 0), (-1, 1), None, None]


def arrays(seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        n: jax.device_put(
            jnp.asarray(rng.standard_normal(shape), jnp.float32), NamedSharding(mesh, spec)
        )
        for n, (shape, spec) in SPECS.items()
    }


handed: list[tuple[int, list[tuple[tuple[int, ...], int]]]] = []
reshard = m2n_data.NcclM2NDataPlane.reshard


def recording(self: Any, shards: Any, src: Any, dst: Any, first_worker: int) -> None:
    handed.append((len(shards), [(tuple(s.shape), len(s.devices())) for s in shards]))
    reshard(self, shards, src, dst, first_worker)


m2n_data.NcclM2NDataPlane.reshard = recording  # type: ignore[method-assign]

server = Server(DST, tp=W)
source = DictSource(arrays(0), describe)
info = TrainerInitInfo(
    backend="nccl_m2n",
    inference_tensor_parallel_size=W,
    reset_prefix_cache=False,
    pause_mode=None,
    timeouts=TIMEOUTS,
)
engine = JAXTrainerEngine.trainer_init(info, client=server, source=source)
rounds = []
try:
    layouts = {p["name"]: [p["src_mesh_dims"], p["src_placements"]] for p in server.info["params"]}
    for seed in (1, 2, 3):
        full = arrays(seed)
        source.tensors = full
        rounds.append(engine.send_weights().version)
        for w in range(W):
            for (name, array), place in zip(full.items(), DST, strict=True):
                dst = M2NLayout((1, W), place) if place else M2NLayout((W, 1), None)
                want = np.asarray(array)[dst.box(array.shape, w).slices()]  # the check's gather
                np.testing.assert_array_equal(server.bufs[w][name], want, err_msg=name)
finally:
    engine.shutdown()

assert len(handed) == 3 * len(SPECS), len(handed)  # one reshard per tensor and round
whole_handed = []
for i, (_n, parts) in enumerate(handed):  # in the rounds' order: SPECS' order each round
    name = list(SPECS)[i % len(SPECS)]
    shape, spec = SPECS[name]
    assert all(ndev == 1 for _, ndev in parts), (name, parts)  # a rank's own device array
    if spec != P() and any(s == shape for s, _ in parts):
        whole_handed.append(name)  # a split tensor handed whole to some rank
print(
    json.dumps(
        {
            "layouts": layouts,
            "rounds": rounds,
            "whole_handed": whole_handed,
            "parts_per_reshard": sorted({n for n, _ in handed}),
        }
    )
)
