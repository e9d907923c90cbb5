"""Subprocess body of test_sliced_tcp's JAX case: a JAX trainer on 8 forced host devices
(an FSDP 4 x TP 2 mesh) sends 3 sliced rounds (the third overlapped: ``wait=False``) to
in-process TCP workers hosting ``SlicedTP`` ranks. XLA_FLAGS must precede the jax import,
hence a process of its own.

``python _sliced_jax_trainer.py WORLD HEADS KV_HEADS TIED SOURCE [BACKEND]`` (SOURCE ``dict``:
a dict of the sharded arrays; ``pytree``: a ``PytreeSource`` over them, ``o_proj`` kept
transposed in the tree as a Flax kernel and transposed back by a jitted rule, on its shards;
BACKEND ``tcp`` (default) or ``nccl``: the in-process NCCL world of
``tests.backends.fake_nccl_p2p``, the pieces cut on their shards' devices) prints one JSON
line: each round's trainer bytes, each worker's received bytes, the dense bytes, how many
host copies the trainer made (each exactly one piece: checked; over NCCL none) and any read
of a whole sharded array.
During the rounds every gather entry point (``jax_side.placement``: ``Target.move``,
``_replicate_on``; the engine's whole-tensor ``host_bytes``) raises: nothing may assemble a
whole sharded array. Any mismatch of a worker's parameters against ``load_weights`` of the
full tensors fails the process.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

sys.path.insert(0, os.getcwd())
from tests.trainer._sliced_mesh import gathers_refused, mesh_source, spec_for
from tests.trainer._sliced_session import assert_loaded, full_tensors, info
from tests.trainer._sliced_workers import TPClient, shapes_of
from weightwire.jax_side.engine import JAXTrainerEngine


def main() -> None:
    world, heads, kv, tied = (int(a) for a in sys.argv[1:5])
    kind = sys.argv[5]
    backend = sys.argv[6] if len(sys.argv) > 6 else "tcp"
    config = (world, heads, kv, False, bool(tied))
    if backend == "nccl":
        import pytest

        from tests.backends.fake_nccl_p2p import in_process_nccl
        from weightwire.torch_side.worker.engines import WeightwireNCCLEngine

        with in_process_nccl(pytest.MonkeyPatch(), world + 1):
            run(config, kind, backend, TPClient(config, engine=WeightwireNCCLEngine))
    else:
        run(config, kind, backend, TPClient(config))


def run(config: Any, kind: str, backend: str, client: TPClient) -> None:
    shapes = shapes_of(config)
    devices = jax.devices()
    assert len(devices) == 8, devices
    mesh = Mesh(np.array(devices).reshape(4, 2), ("fsdp", "tp"))
    arrays: dict[str, Any] = {}

    def fill(step: int) -> dict[str, np.ndarray]:
        """The round's full tensors, put on the mesh shard by shard (the trainer's arrays)."""
        full = full_tensors(config, step)
        arrays.clear()
        for name, value in full.items():
            arrays[name] = jax.device_put(value, NamedSharding(mesh, spec_for(name, value.shape)))
        assert any(not a.is_fully_replicated for a in arrays.values())
        return full

    fill(0)
    source = mesh_source(arrays, kind)
    # the TCP lane's settings whichever the backend (one buffer size, the 30 s timeouts)
    settings = info(backend=f"weightwire_{backend}")
    engine = JAXTrainerEngine.trainer_init(settings, client=client, source=source)
    host_copies: list[list[int]] = []
    device_get = jax.device_get

    def recorded(x: Any) -> Any:
        host_copies.append(list(x.shape))
        return device_get(x)

    whole: list[str] = []  # a read of a whole sharded array (must stay empty)
    read_box, cut_box = engine.read_box, engine.cut_box

    def watched(tensor: Any, box: Any) -> Any:
        if box.shape == tuple(tensor.shape) and not tensor.is_fully_replicated:
            whole.append(str(tensor.shape))
        copies = len(host_copies)
        out = read_box(tensor, box)
        assert [list(box.shape)] == host_copies[copies:], "one host copy: the piece's"
        return out

    def cut(tensor: Any, box: Any) -> Any:  # NCCL: the piece stays on its shard's device
        if box.shape == tuple(tensor.shape) and not tensor.is_fully_replicated:
            whole.append(str(tensor.shape))
        out = cut_box(tensor, box)
        assert tuple(out.shape) == box.shape and len(out.devices()) == 1
        return out

    engine.read_box = watched  # type: ignore[method-assign]
    engine.cut_box = cut  # type: ignore[method-assign]
    rounds = []
    try:
        for step in (1, 2, 3):
            full = fill(step)
            with gathers_refused(recorded):
                # round 3 overlapped: its snapshot is read where it is held too
                metrics = (
                    engine.send_weights()
                    if step < 3
                    else engine.send_weights(wait=False).result(timeout=60)
                )
            assert client.last_update.get("sliced") is True
            assert_loaded(client, full, f"round {step} ")
            rounds.append({"sent": metrics.nbytes, "received": list(client.received)})
    finally:
        engine.shutdown()
        client.close()
    dense = sum(int(np.prod(s)) * 4 for s in shapes.values())
    print(
        json.dumps({"rounds": rounds, "dense": dense, "copies": len(host_copies), "whole": whole})
    )


if __name__ == "__main__":
    main()
