"""ModuleSource over FSDP2 (fully_shard) on two CPU ranks with gloo, as separate processes.

metadata() must declare full shapes without any collective; iteration must yield the
full, correct tensors on every rank (gathered with full_tensor() in lockstep).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(150)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fsdp_rank.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_metadata_is_collective_free_and_iteration_is_full_and_exact():
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    r0, r1 = results
    assert r0["metas"] == r1["metas"], "metadata must be identical on every rank"
    shapes = {m["name"]: m["shape"] for m in r0["metas"]}
    assert shapes["embed.weight"] == [11, 6] and shapes["layers.0.weight"] == [5, 6]
    assert {tuple(r["local_shapes"]["embed.weight"]) for r in results} == {(6, 6), (5, 6)}, (
        "params really sharded"
    )
    assert all("owners" not in m for m in r0["metas"])  # the mesh is the whole world
    for r in results:
        assert r["held"] is None
        assert r["meta_counts"] == {"ops": 0, "full_tensor": 0, "dist": 0}, (
            "metadata() ran a collective"
        )
        assert r["iter_counts"]["full_tensor"] == len(r0["metas"])
        assert r["iter_counts"]["ops"] > 0, (
            "the collective counter saw nothing: it would not catch one in metadata()"
        )
        assert r["got"] == r["reference"], "iteration yielded wrong bytes"
    assert r0["got"] == r1["got"]
