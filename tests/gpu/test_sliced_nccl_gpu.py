"""Sliced rounds over ``weightwire_nccl`` on real NCCL between processes: a trainer process
on GPU 0 (torch, or torch-free JAX) and a workers' process hosting ``SlicedTP`` TP ranks, one
per GPU (both TP ranks with 3 GPUs or more, TP rank 1 alone with 2). Three rounds: every
hosted rank's parameters equal ``load_weights`` of the full tensors bit for bit, each
worker received about half the model plus the replicated tensors (counted by the worker),
and the trainer sent what the workers received. The same round as
``tests/trainer/test_sliced_nccl.py`` runs on CPU over an in-process NCCL world.

Run on a host with 2+ GPUs: ``pytest -m gpu tests/gpu/test_sliced_nccl_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu(count=2)

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("sliced_nccl_peer.py")
TIMEOUT_S = 300.0


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _env(devices: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES=devices, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run(tmp_path: Path, engine: str) -> list[dict[str, Any]]:
    """The workers' process and the trainer's at once; their JSON reports, never hanging."""
    ranks = [0, 1] if _gpus() >= 3 else [1]
    worker_gpus = ",".join(str(1 + i) for i in range(len(ranks)))
    common = {"address": str(tmp_path / "address.json"), "ranks": ranks, "timeout": TIMEOUT_S}
    procs = []
    try:
        for role, gpus in (("workers", worker_gpus), ("trainer", "0")):
            path = tmp_path / f"{role}.json"
            path.write_text(json.dumps({**common, "role": role, "engine": engine}))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(PEER), str(path)],
                    env=_env(gpus),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + TIMEOUT_S + 30
        reports = []
        for proc in reversed(procs):  # the trainer's end stops the workers
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a peer did not finish within {TIMEOUT_S} s") from None
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, f"no report (rc={proc.returncode}); stderr tail:\n{err[-4000:]}"
            report = json.loads(lines[-1])
            assert "error" not in report, f"{report.get('traceback')}\n{err[-4000:]}"
            reports.append(report)
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_sliced_rounds_over_real_nccl_land_bit_exact_with_half_the_bytes(
    tmp_path: Path, engine: str
) -> None:
    if engine == "jax":
        pytest.importorskip("jax")
    trainer, _ = run(tmp_path, engine)
    assert trainer["sliced"], "the rounds went as broadcasts"
    dense, rounds = trainer["dense"], trainer["rounds"]
    from tests.trainer._sliced_session import TP2, assert_shares

    assert len(rounds) == 3
    for r in rounds:
        assert r["wrong"] == [], r["wrong"][:5]
        assert sum(r["received"]) == r["sent"]
        assert_shares(r["received"], TP2, dense)
