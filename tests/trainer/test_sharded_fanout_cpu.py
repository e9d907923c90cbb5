"""The four-GPU flow of issue 11 on CPU: params sharded FSDP-style over 4 (forced host)
devices, materialized whole on one device by ``PytreeSource``, fanned out by
``JAXTrainerEngine`` to two receivers (world size 3, ranks 1 and 2) over TCP.

Both receivers must hold exactly the bytes of the *unsharded* model after each round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightwire.control import HTTPWeightSyncClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sharded_source_fans_out_to_two_receivers_bit_exact(server_url: str) -> None:
    from weightwire.tools.server.tiny import resolve_model

    config = os.path.join(resolve_model("tiny-llama"), "config.json")
    client = HTTPWeightSyncClient(server_url, timeout=60)
    assert client.get_world_size() == 2
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("_sharded_sender.py")), server_url, config],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sharded_leaves"] > 0  # the source really read sharded arrays
    (reply,) = client.weight_checker("checksum")
    replicas = reply["replica_checksums"]
    assert len(replicas) == 2
    last = result["rounds"][-1]
    assert [r["version"] for r in result["rounds"]] == ["1", "2"]
    for replica in replicas:
        assert {n: replica.get(n) for n in last["expected"]} == last["expected"]
    assert client.weight_info()[0]["weight_version"] == "2"
