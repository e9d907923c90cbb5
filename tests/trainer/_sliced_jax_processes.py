"""Subprocess body of test_sliced_tcp's 2-process JAX case: one of 2 ``jax.distributed``
processes (4 forced host devices each), an FSDP 4 x TP 2 mesh over the 8 devices (FSDP
across the processes), sending 3 sliced rounds to in-process TCP workers hosting
``SlicedTP`` ranks (TP 2, one KV head, tied head) that live in process 0.

``python _sliced_jax_processes.py PROCESS PORT [KIND]`` (KIND ``dict``: a dict of the sharded
arrays; ``pytree``: a ``PytreeSource`` over them, ``o_proj`` kept transposed as a Flax kernel
and transposed back by a jitted rule on its shards) prints one JSON line: each round's bytes this
process sent, what its plan gives each rank, the pieces it read (each inside one of its own
addressable shards: checked) and (process 0) each worker's received bytes. During the rounds
every gather entry point (``jax_side.placement``: ``Target.move``, ``_replicate_on``; the
engine's whole-tensor ``host_bytes``) raises, and every host copy is exactly one piece's.
Process 0 checks every worker's parameters against ``load_weights`` of the full tensors.
"""

from __future__ import annotations

import os
import sys

PROCESS, PORT = int(sys.argv[1]), int(sys.argv[2])
KIND = sys.argv[3] if len(sys.argv) > 3 else "dict"  # "pytree": a PytreeSource over the arrays
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import json  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

sys.path.insert(0, os.getcwd())
from tests.trainer._sliced_mesh import gathers_refused, mesh_source, spec_for  # noqa: E402
from tests.trainer._sliced_session import (  # noqa: E402
    TP2,
    NoCalls,
    full_tensors,
    info,
    round_row,
    rounds_then_failure,
)
from tests.trainer._sliced_workers import TPClient, shapes_of  # noqa: E402
from weightwire.jax_side.engine import JAXTrainerEngine  # noqa: E402
from weightwire.jax_side.holdings import index_box  # noqa: E402
from weightwire.jax_side.multiprocess import JaxProcessGroup  # noqa: E402


def main() -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{PORT}",
        num_processes=2,
        process_id=PROCESS,
        initialization_timeout=60,
    )
    shapes = shapes_of(TP2)
    devices = jax.devices()
    assert len(devices) == 8 and len(jax.local_devices()) == 4, devices
    mesh = Mesh(np.array(devices).reshape(4, 2), ("fsdp", "tp"))
    arrays: dict[str, Any] = {}

    def fill(step: int) -> dict[str, np.ndarray]:
        """The round's full tensors (the same on both processes), each process putting only
        its own shards on its devices."""
        full = full_tensors(TP2, step)
        arrays.clear()
        for name, value in full.items():
            sharding = NamedSharding(mesh, spec_for(name, value.shape))
            arrays[name] = jax.make_array_from_callback(
                value.shape, sharding, lambda index, v=value: v[index]
            )
        assert any(not a.is_fully_addressable for a in arrays.values())
        return full

    fill(0)
    client: Any = TPClient(TP2) if PROCESS == 0 else NoCalls("process 1")
    source = mesh_source(arrays, KIND)
    engine = JAXTrainerEngine.trainer_init(
        info(rank=PROCESS), client=client, source=source, group=JaxProcessGroup()
    )
    host_copies: list[list[int]] = []
    device_get = jax.device_get

    def recorded(x: Any) -> Any:
        host_copies.append(list(x.shape))
        return device_get(x)

    reads: list[int] = []  # bytes of each piece this process read
    outside: list[str] = []  # a piece read that none of this process's shards holds
    whole: list[str] = []  # a read of a whole array that is not fully replicated
    read_box = engine.read_box

    def watched(tensor: Any, box: Any) -> Any:
        if box.shape == tuple(tensor.shape) and not tensor.is_fully_replicated:
            whole.append(str(tensor.shape))
        shape = tuple(tensor.shape)
        if not any(index_box(s.index, shape).contains(box) for s in tensor.addressable_shards):
            outside.append(f"{list(shape)} {box.describe()}")
        copies = len(host_copies)
        out = read_box(tensor, box)
        assert [list(box.shape)] == host_copies[copies:], "one host copy: the piece's"
        reads.append(out.nbytes)
        return out

    engine.read_box = watched  # type: ignore[method-assign]

    mark = [0]  # where this round's reads start

    def send() -> Any:
        """A round with every gather entry point raising and every host copy recorded."""
        mark[0] = len(reads)
        with gathers_refused(recorded):
            return engine.send_weights()

    def row(engine: Any, metrics: Any) -> dict[str, Any]:
        return {**round_row(engine, metrics), "read": sum(reads[mark[0] :])}

    # A 4th round in which process 1 fails after its first pieces went out: every worker
    # refuses the round (nothing commits), every process raises, none hangs.
    def failing(tensor: Any, box: Any) -> Any:
        if len(reads) >= mark[0] + 3:
            raise RuntimeError("process 1 lost its shard")
        return watched(tensor, box)

    def lose_a_shard() -> None:
        if PROCESS == 1:
            engine.read_box = failing  # type: ignore[method-assign]

    try:
        rounds, failure = rounds_then_failure(
            engine, client, PROCESS == 0, fill, lose_a_shard, send=send, row=row
        )
    finally:
        engine.shutdown()
        if PROCESS == 0:
            client.close()
    dense = sum(int(np.prod(s)) * 4 for s in shapes.values())
    print(
        json.dumps(
            {
                "process": PROCESS,
                "rounds": rounds,
                "dense": dense,
                "copies": len(host_copies),
                "whole": whole,
                "outside": outside,
                "failure": failure,
            }
        ),
        flush=True,
    )
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
