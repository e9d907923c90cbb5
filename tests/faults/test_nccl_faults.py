"""NCCL lane: a peer dies mid-broadcast on a 2-GPU host; the survivor's watchdog turns
NCCL's endless wait into an exception within the timeout, the communicator is dead
afterwards, and the survivor joins a fresh group with a new peer and moves every byte.

Each rank is its own process seeing one GPU (``_nccl_fault_peer.py``). Run on the GPU
host with ``pytest -m gpu tests/faults``; skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 10.0
GRACE_S = 5.0
CHUNK = dict(
    nbytes=16 << 20, nchunks=8
)  # 128 MiB per session: more than NCCL can buffer for a dead peer


def peer(gpu: int, tmp: Path, **cfg: Any) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": str(gpu),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    body = json.dumps({"dir": str(tmp), "timeout": TIMEOUT_S, **CHUNK, **cfg})
    return subprocess.Popen(
        [sys.executable, "-m", "tests.faults._nccl_fault_peer", body],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def report(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[dict[str, Any], str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"peer printed no report (rc={proc.returncode}):\n{err[-3000:]}"
    return json.loads(lines[-1]), out + err


def check_survivor(rep: dict[str, Any], output: str, tmp: Path) -> None:
    first, second = rep["sessions"]["s1"], rep["sessions"]["s2"]
    assert "fatal" not in first and "error_type" in first, first
    assert first["error_type"] in ("TransferTimeout", "PeerLost", "TransferError"), first
    assert first["seconds"] < TIMEOUT_S + GRACE_S, first
    assert "rank" in first["error"] and "world size 2" in first["error"], first  # names who waited
    assert first["after"] == "TransferError", first  # aborted: no silent reuse
    assert second == {"ok": CHUNK["nchunks"]}, second  # fresh init + round: every byte right
    for uid_file in tmp.glob("*.uid"):
        import base64

        assert base64.b64encode(uid_file.read_bytes()).decode()[:24] not in output  # never printed


def test_sender_dies_mid_broadcast(tmp_path: Path) -> None:
    survivor = peer(1, tmp_path, role="receiver", sessions=["s1", "s2"])
    doomed = peer(0, tmp_path, role="sender", sessions=["s1"], die_after=2)
    doomed.wait(120)
    assert doomed.returncode == -9, doomed.communicate()[1][-2000:]
    fresh = peer(0, tmp_path, role="sender", sessions=["s2"])
    rep, output = report(survivor)
    fresh_rep, _ = report(fresh)
    assert fresh_rep["sessions"]["s2"] == {"ok": CHUNK["nchunks"]}, fresh_rep
    check_survivor(rep, output, tmp_path)
    assert rep["sessions"]["s1"]["chunk"] == 2, rep  # it had received the two chunks that were sent


def test_receiver_dies_mid_broadcast(tmp_path: Path) -> None:
    survivor = peer(0, tmp_path, role="sender", sessions=["s1", "s2"])
    doomed = peer(1, tmp_path, role="receiver", sessions=["s1"], die_after=1)
    doomed.wait(120)
    assert doomed.returncode == -9, doomed.communicate()[1][-2000:]
    fresh = peer(1, tmp_path, role="receiver", sessions=["s2"])
    rep, output = report(survivor)
    fresh_rep, _ = report(fresh)
    assert fresh_rep["sessions"]["s2"] == {"ok": CHUNK["nchunks"]}, fresh_rep
    check_survivor(rep, output, tmp_path)
