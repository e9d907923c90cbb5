"""GPU end to end over NCCL: a trainer engine (JAX or torch) on GPU 0 -> a
``WeightwireNCCLEngine`` receiver on GPU 1, each in its own process, driven through
the loopback control shim. A ~1.1 GiB Llama-shaped set, packed and unpacked, two
rounds of fresh values; the receiver's bytes must equal the sender's after each.

Run on the 2-GPU machine: ``python -m pytest tests/trainer/test_engine_nccl_gpu.py -m gpu -s``
(``-s`` shows the measured GB/s per round).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from weightwire.testing.loopback import spawn_loopback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENDER = os.path.join(ROOT, "tests", "trainer", "gpu_sender.py")
CASES = [
    ("jax", "weightwire_nccl", 1),
    ("jax", "nccl", 0),  # stock-vLLM payload, per-tensor typed broadcasts
    ("torch", "weightwire_nccl", 1),
    ("torch", "weightwire_nccl", 0),
]


@pytest.mark.gpu(count=2)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("framework", "backend", "packed"),
    CASES,
    ids=[f"{f}-{b}-{'packed' if p else 'unpacked'}" for f, b, p in CASES],
)
def test_gpu_rounds_arrive_bit_exact(framework: str, backend: str, packed: int) -> None:
    base = {
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    proc, client = spawn_loopback(
        backend, "cuda:0", env={**base, "CUDA_VISIBLE_DEVICES": "1"}, timeout=180
    )
    try:
        out = subprocess.run(
            [
                sys.executable,
                SENDER,
                "--address",
                client.address,
                "--framework",
                framework,
                "--backend",
                backend,
                "--packed",
                str(packed),
                "--mib",
                "1100",
                "--rounds",
                "2",
            ],
            env={**os.environ, **base, "CUDA_VISIBLE_DEVICES": "0"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, f"sender failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rounds = result["rounds"]
        assert len(rounds) == 2
        for i, r in enumerate(rounds):
            assert r["mismatched"] == [], (
                f"round {i + 1}: receiver bytes differ for {r['mismatched'][:5]}"
            )
            assert r["nbytes"] >= 1 << 30
            assert (
                r["receiver"]["nbytes"] == r["nbytes"]
                and r["receiver"]["tensors"] == result["tensors"]
            )
            assert r["weight_version"] == str(i + 1)
            assert r["reused_metadata"] == (i > 0)
            print(
                f"{framework}/{backend}/{'packed' if packed else 'unpacked'} round {i + 1}: "
                f"{r['nbytes'] / 1e9:.2f} GB in {r['chunks']} broadcasts, "
                f"transfer {r['gbps']:.1f} GB/s, "
                f"phases {json.dumps({k: round(v * 1e3, 1) for k, v in r['seconds'].items()})} ms"
            )
        assert (
            rounds[0]["digests"] != rounds[1]["digests"]
        )  # the second round really sent new values
        # Independent of the sender's own check: what the receiver holds now is the last round.
        (reply,) = client.weight_checker("checksum")
        assert reply["checksums"] == rounds[-1]["digests"]
    finally:
        proc.kill()
        proc.wait(timeout=30)
