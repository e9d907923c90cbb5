"""Delta rounds from sharded ``jax.Array`` s, shard by shard (``jax_side.shard_delta``): the
patches equal the whole-tensor extraction's bit for bit, and no whole copy of a sharded
array is made (``_shard_delta_cases``, on 8 forced host devices: XLA_FLAGS must precede the
jax import, hence a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")

SCRIPT = Path(__file__).with_name("_shard_delta_cases.py")


def run_cases(*args: str) -> int:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return int(json.loads(done.stdout.strip().splitlines()[-1])["checked"])


@pytest.mark.slow  # 31 s on 2 cores (subprocesses with several JAX devices)
def test_patches_from_shards_equal_patches_from_the_whole_tensor() -> None:
    """FSDP 4 x TP 2: every layout (both axes, one, replicated, an axis that does not divide
    its dimension, both axes on one dimension, 3-D, 1-D) in float32, the FSDP x TP layout in
    bfloat16 and int8; none, every, one and a random subset of the elements changed. Indices
    and values bit-identical and strictly increasing, the base after it the new array, every
    gather entry point refusing and no live whole copy at any step."""
    assert run_cases() == 44


@pytest.mark.slow
def test_patches_from_shards_equal_patches_from_the_whole_tensor_every_dtype() -> None:
    """The same over every layout in every dtype, and a 2 x 4 mesh."""
    assert run_cases("--full") == 132
