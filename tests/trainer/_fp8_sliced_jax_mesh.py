"""Subprocess body of test_fp8_combos' sharded JAX case: a JAX trainer on 2 forced host
devices (a TP 2 mesh: each linear sharded as the workers split it) sends FP8 sliced rounds
from a ``PytreeSource`` (the second overlapped: ``wait=False``) to in-process TCP workers
hosting ``Fp8SlicedTP`` ranks. XLA_FLAGS must precede the jax import, hence a process of its
own.

``python _fp8_sliced_jax_mesh.py INTER`` prints one JSON line: per round and e4m3 weight
shape, whether the quantized weight the round read its pieces from stayed sharded over both
devices. During the
rounds every gather entry point of ``jax_side.placement`` raises. Any mismatch of a worker's
parameters against ``load_weights`` of the whole quantized checkpoint fails the process.
"""

from __future__ import annotations

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import json
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.getcwd())
from tests.trainer._sliced_mesh import forbidden
from tests.trainer._sliced_session import info
from tests.trainer.test_fp8_combos import (
    NORM,
    assert_serves,
    fp8_client,
    spec_of,
    weights,
)
from weightwire.jax_side import placement
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.naming import Naming
from weightwire.jax_side.quant import fp8_source
from weightwire.jax_side.rules import Rule
from weightwire.jax_side.source import PytreeSource


def spec_for(name: str) -> P:
    """Column-parallel linears split their rows, row-parallel ones their columns (the TP
    split of the workers); the norm replicated."""
    if name == NORM:
        return P()
    return P(None, "tp") if ("o_proj" in name or "down_proj" in name) else P("tp", None)


def main() -> None:
    inter = int(sys.argv[1])
    mesh = Mesh(np.array(jax.devices()).reshape(2), ("tp",))
    arrays: dict[str, Any] = {}

    def fill(step: int) -> dict[str, np.ndarray]:
        full = weights(step, inter)
        arrays.clear()
        for name, value in full.items():
            arrays[name] = jax.device_put(value, NamedSharding(mesh, spec_for(name)))
        return full

    fill(0)
    client = fp8_client(inter)
    source = PytreeSource(lambda: dict(arrays), Naming([Rule("{x}", "{x}")]))
    engine = JAXTrainerEngine.trainer_init(
        info(), client=client, source=fp8_source(source, spec_of(inter))
    )
    spread: list[dict[str, bool]] = []
    read_box = engine.read_box

    def watched(tensor: Any, box: Any) -> Any:
        if str(tensor.dtype) == "float8_e4m3fn":
            kept = not tensor.is_fully_replicated and len(tensor.sharding.device_set) == 2
            spread[-1][str(tuple(tensor.shape))] = kept
        return read_box(tensor, box)

    engine.read_box = watched  # type: ignore[method-assign]
    try:
        for step in (1, 2):
            full = fill(step)
            spread.append({})
            saved = (placement.Target.move, placement._replicate_on)
            placement.Target.move = forbidden("Target.move")  # type: ignore[method-assign]
            placement._replicate_on = forbidden("_replicate_on")  # type: ignore[assignment]
            try:
                if step == 1:
                    engine.send_weights()
                else:  # overlapped: its snapshot stays sharded, quantized on the round thread
                    handle = engine.send_weights(wait=False)
                    fill(3)  # the trainer moves on: the round sends step 2's weights
                    handle.result(timeout=120)
            finally:
                placement.Target.move, placement._replicate_on = saved
            assert client.last_update.get("sliced") is True
            assert_serves(client, full)
    finally:
        engine.shutdown()
        client.close()
    print(json.dumps({"spread": spread}))


if __name__ == "__main__":
    main()
