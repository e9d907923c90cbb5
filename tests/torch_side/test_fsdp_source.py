"""ModuleSource over FSDP2 (fully_shard) on two CPU ranks with gloo, as separate processes.

metadata() must declare full shapes without any collective; iteration must yield the
full, correct tensors on every rank (gathered with full_tensor() in lockstep).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ranks import free_port, two_rank_reports

pytestmark = pytest.mark.timeout(150)

SCRIPT = Path(__file__).with_name("_fsdp_rank.py")


def test_fsdp2_metadata_is_collective_free_and_iteration_is_full_and_exact():
    results = two_rank_reports(SCRIPT, str(free_port()))
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
