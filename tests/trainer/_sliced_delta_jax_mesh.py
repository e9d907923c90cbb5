"""Subprocess body of test_sliced_delta's mesh case: a JAX trainer on 8 forced host devices
(an FSDP 4 x TP 2 mesh, the shardings of ``_sliced_mesh``) with ``delta="auto"`` sends a
dense round, then 3 delta rounds at a 2 % change rate, the last one overlapped (the arrays
themselves, or with ``pytree`` a ``PytreeSource`` over them, ``o_proj`` held transposed and
transposed back on its shards), to in-process TCP workers hosting
``SlicedTP`` ranks (TP 2, one KV head, tied head; tensors whose rows do not split 4 ways keep
them replicated). XLA_FLAGS must precede the jax import, hence a process of its own. Every
round runs under ``_no_gather``'s guard: the gather entry points raise, and no step of the
extraction leaves a whole copy of a sharded array alive; the base stays sharded as the
arrays are. Any mismatch of a worker's parameters against ``load_weights`` of the full
tensors fails the process; prints one JSON line: per round whether it carried patches,
each worker's received bytes, the trainer's bytes, the base's device bytes (this process's
shards, replicas each) beside the addressable shards' bytes and the dense model's.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from tests.jax_side._no_gather import guarded, no_whole_copies
from tests.trainer._sliced_mesh import mesh_source, spec_for
from tests.trainer._sliced_session import TP2, assert_loaded, changed, full_tensors, info
from tests.trainer._sliced_workers import TPClient
from weightwire.jax_side.engine import JAXTrainerEngine


def main() -> None:
    config = TP2
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    client = TPClient(config)
    arrays: dict[str, Any] = {}
    full = full_tensors(config, 1)

    def put(full: dict[str, np.ndarray]) -> None:
        arrays.clear()
        arrays.update(
            {
                n: jax.device_put(v, NamedSharding(mesh, spec_for(n, v.shape)))
                for n, v in full.items()
            }
        )

    put(full)  # a PytreeSource resolves its names at once
    source = mesh_source(arrays, sys.argv[1] if len(sys.argv) > 1 else "dict")
    engine = JAXTrainerEngine.trainer_init(info(delta="auto"), client=client, source=source)
    rounds = []
    try:
        for step in (1, 2, 3, 4):
            if step > 1:
                full = changed(full, step)
                put(full)
            with no_whole_copies(guarded(arrays.values())):
                if step == 4:  # overlapped: its snapshot is read sharded too
                    metrics = engine.send_weights(wait=False).result(timeout=120)
                else:
                    metrics = engine.send_weights()
            tracker = engine._delta.tracker
            for name, base in tracker.bases.items():
                assert not base.is_fully_replicated or arrays[name].is_fully_replicated, name
                assert base.sharding.is_equivalent_to(arrays[name].sharding, base.ndim), name
            assert client.last_update.get("sliced") is True
            assert_loaded(client, full, f"round {step} ")
            rounds.append(
                {
                    "patches": bool(client.last_update.get("patches")),
                    "received": list(client.received),
                    "sent": metrics.nbytes,
                    "broadcast": sum(4 * int(np.prod(s)) for s in client.last_update["shapes"]),
                    "base": tracker.memory_bytes(),
                    "shards": sum(
                        s.data.nbytes for a in arrays.values() for s in a.addressable_shards
                    ),
                    "dense": sum(a.nbytes for a in full.values()),
                }
            )
    finally:
        engine.shutdown()
        client.close()
    print(json.dumps({"rounds": rounds}))


if __name__ == "__main__":
    main()
