"""Subprocess body of test_slice_holdings: one JAX trainer process of a sliced round.

``python _sliced_rank.py MODE PROCESS PORT SESSION OUT``. MODE ``devices``: one process,
8 forced host devices, each device a rank. MODE ``processes``: one of 2
``jax.distributed`` processes with 4 devices each, each process a rank. Either way the
mesh is FSDP 4 x TP 2 over 8 devices. SESSION is a JSON file with the tensors' shapes
and the workers' wants. Each process builds its arrays shard by shard (no process ever
has a whole tensor's values), builds the slice plan from their shardings, reads each of
its transfers from its addressable shards and saves it under OUT, with a report of every
host copy it made.
"""

from __future__ import annotations

import os
import sys

MODE, PROCESS, PORT, SESSION, OUT = sys.argv[1:6]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 if MODE == 'devices' else 4}"

import gc  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.getcwd())
from tests.jax_side._slice_values import slice_values  # noqa: E402
from weightwire.jax_side.holdings import holdings_of, index_box, read_box  # noqa: E402
from weightwire.shared.meta import ParamMeta  # noqa: E402
from weightwire.shared.slices import Wants  # noqa: E402
from weightwire.trainer.slice_plan import build_plan  # noqa: E402

if MODE == "processes":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{PORT}",
        num_processes=2,
        process_id=int(PROCESS),
        initialization_timeout=60,
    )


def spec_for(name: str, shape: tuple[int, ...]) -> P:
    """FSDP on the rows, TP on the columns where they divide; k/v replicated over FSDP,
    norm and router over everything: every kind of holding."""
    if "norm" in name or "mlp.gate." in name or not shape:
        return P()
    if "k_proj" in name or "v_proj" in name:
        return P("tp", *([None] * (len(shape) - 1))) if shape[0] % 2 == 0 else P()
    axes: list[str | None] = [None] * len(shape)
    if shape[0] % 4 == 0:
        axes[0] = "fsdp"
    if len(shape) > 1 and shape[-1] % 2 == 0:
        axes[-1] = "tp"
    elif len(shape) == 1 and axes[0] is None and shape[0] % 2 == 0:
        axes[0] = "tp"
    return P(*axes)


def main() -> None:
    with open(SESSION) as f:
        session = json.load(f)
    shapes = {n: tuple(s) for n, s in session["shapes"].items()}
    metas = [ParamMeta(n, "float32", s) for n, s in shapes.items()]
    wants = [Wants.from_json(w, shapes) for w in session["wants"]]
    devices = jax.devices()
    assert len(devices) == 8, devices
    mesh = Mesh(np.array(devices).reshape(4, 2), ("fsdp", "tp"))
    arrays = {}
    for i, (name, shape) in enumerate(shapes.items()):
        sharding = NamedSharding(mesh, spec_for(name, shape))
        arrays[name] = jax.make_array_from_callback(
            shape,
            sharding,
            lambda index, i=i, shape=shape: slice_values(i, shape, index_box(index, shape)),
        )

    # Every host copy read_box makes goes through jax.device_get: recorded, so the test can
    # check that only the transfers' slices reach the host.
    host_copies: list[tuple[int, ...]] = []
    device_get = jax.device_get

    def recorded(x: Any) -> Any:
        host_copies.append(tuple(x.shape))
        return device_get(x)

    jax.device_get = recorded
    originals = {id(a) for a in arrays.values()}

    if MODE == "devices":

        def rank_of(d: jax.Device) -> int:
            return int(d.id)

        mine = {d.id for d in devices}
    else:

        def rank_of(d: jax.Device) -> int:
            return int(d.process_index)

        mine = {jax.process_index()}
    holdings = holdings_of(arrays, rank_of=rank_of)
    plan = build_plan(metas, holdings, wants)
    sent = []
    for (rank, worker), transfers in plan.pieces.items():
        if rank not in mine:
            continue
        for k, t in enumerate(transfers):
            got = read_box(arrays[t.tensor], t.box, rank=rank, rank_of=rank_of)
            assert got.shape == t.box.shape and got.nbytes == t.nbytes
            file = f"{worker}_{rank}_{k}.npy"
            np.save(os.path.join(OUT, file), got)
            sent.append([worker, rank, t.tensor, [list(r) for r in t.box.ranges], file])
    del got
    gc.collect()
    # Nothing lives on a device but the arrays and per-device views of their shards (jax
    # keeps those): nothing was gathered.
    shard_shapes = {s.data.shape for a in arrays.values() for s in a.addressable_shards}
    left = [
        list(a.shape)
        for a in jax.live_arrays()
        if id(a) not in originals and a.shape not in shard_shapes
    ]
    whole_on_a_device = {
        n for n, a in arrays.items() if any(s.data.shape == a.shape for s in a.addressable_shards)
    }
    report = {
        "process": jax.process_index(),
        "sent": sent,
        "host_copies": [list(s) for s in host_copies],
        "left_on_devices": left,
        "whole_on_a_device": sorted(whole_on_a_device),
        "rank_bytes": {str(r): n for r, n in plan.rank_bytes.items()},
        "worker_bytes": {str(w): n for w, n in plan.worker_bytes.items()},
        "transfers": [
            [r, w, t.tensor, [list(x) for x in t.box.ranges]]
            for (r, w), ts in plan.pieces.items()
            for t in ts
        ],
    }
    with open(os.path.join(OUT, f"report_{jax.process_index()}.json"), "w") as f:
        json.dump(report, f)
    if MODE == "processes":
        jax.distributed.shutdown()


main()
