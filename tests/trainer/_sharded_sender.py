"""Subprocess body of test_sharded_fanout_cpu: a JAX trainer whose params are sharded
over 4 forced host devices pushes them to a server with 2 receiver replicas.

Prints one JSON line: the sha256 of every tensor as the *unsharded* model defines it
(computed from a host copy taken before sharding), per round.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import hashlib
import json

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from weightwire.control import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.timeouts import Timeouts
from weightwire.tools.models import llama
from weightwire.trainer import TrainerInitInfo


def main(url: str, config_path: str) -> None:
    assert len(jax.devices()) == 4, jax.devices()
    with open(config_path) as f:
        cfg = llama.LlamaConfig.from_hf_config(json.load(f))
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))

    def shard(
        x: jax.Array,
    ) -> jax.Array:  # FSDP-style: leading axis over 4 devices where it divides
        spec = PartitionSpec("fsdp") if x.ndim and x.shape[0] % 4 == 0 else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    host_params = jax.device_get(llama.init(jax.random.key(0), cfg))
    state = {"params": jax.tree.map(shard, host_params)}
    sharded = sum(
        len(x.sharding.device_set) == 4 and not x.is_fully_replicated
        for x in jax.tree.leaves(state["params"])
    )
    reference = PytreeSource(host_params, llama.naming(cfg))  # unsharded, for the expected bytes
    source = PytreeSource(lambda: state["params"], llama.naming(cfg), device=jax.devices()[0])
    timeouts = Timeouts(http_s=120, connect_s=60, warmup_s=60, transfer_s=60)
    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=32 << 10, verify=True, timeouts=timeouts
    )
    client = HTTPWeightSyncClient(url, timeout=120)
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    rounds = []
    try:
        for step in (1, 2):
            host_params = jax.tree.map(
                lambda x, s=step: x * np.asarray(1 + 0.01 * s, x.dtype), host_params
            )
            state["params"] = jax.tree.map(shard, host_params)
            reference = PytreeSource(host_params, llama.naming(cfg))
            metrics = engine.send_weights()
            expected = {
                n: hashlib.sha256(np.asarray(t).tobytes()).hexdigest() for n, t in reference
            }
            rounds.append({"version": metrics.version, "expected": expected})
    finally:
        engine.shutdown()
    print(json.dumps({"sharded_leaves": sharded, "rounds": rounds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
