"""NCCL data plane on two GPUs: a torch-free JAX sender (GPU0) and a torch receiver (GPU1).

Each rank is a separate process (``nccl_peer.py``) seeing one GPU. Run on the 2-GPU
host with ``pytest -m gpu tests/gpu`` (skipped where fewer than 2 GPUs are visible).
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

from weightwire.shared.framing import plan_packed
from weightwire.shared.meta import ParamMeta

pytestmark = pytest.mark.gpu(count=2)

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("nccl_peer.py")

# Every wire dtype, odd sizes (so packed offsets are misaligned), a scalar; between
# four 256 MiB bf16 tensors, >= 1 GiB in all.
SMALL = [
    ("a.int8", "int8", [1001]),
    ("b.bf16", "bfloat16", [33, 7]),
    ("c.bool", "bool", [17, 3]),
    ("d.f32", "float32", [3, 5, 7]),
    ("e.fp8", "float8_e4m3fn", [255]),
    ("f.f64", "float64", []),
    ("g.fp8", "float8_e5m2", [33, 2]),
    ("h.f16", "float16", [7, 9]),
    ("i.i32", "int32", [13]),
    ("j.i64", "int64", [5, 5]),
    ("k.u8", "uint8", [999]),
]
BIG_SPEC = [
    *SMALL[0:3],
    ("model.layers.0.mlp.weight", "bfloat16", [8192, 16384]),
    *SMALL[3:6],
    ("model.layers.1.mlp.weight", "bfloat16", [8192, 16384]),
    *SMALL[6:9],
    ("model.layers.2.mlp.weight", "bfloat16", [8192, 16384]),
    *SMALL[9:],
    ("model.layers.3.mlp.weight", "bfloat16", [8192, 16384]),
    ("z.bf16", "bfloat16", [4097]),
]
EDGE_SPEC = [
    ("s.f32", "float32", []),
    ("z0.f32", "float32", [0, 4]),
    ("t.i8", "int8", [3]),
    ("z1.bf16", "bfloat16", [0]),
    ("u.bf16", "bfloat16", [5]),
    ("v.bool", "bool", [1]),
    ("w.fp8", "float8_e4m3fn", [2, 3]),
]


def _env(gpu: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES=str(gpu), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def run_peers(
    tmp_path: Path, peers: list[tuple[int, dict[str, Any]]], timeout: float
) -> list[dict[str, Any]]:
    """Start every peer at once; return their JSON reports (in order), never hanging."""
    procs: list[subprocess.Popen] = []
    try:
        for gpu, cfg in peers:
            path = tmp_path / f"{cfg['role']}.json"
            path.write_text(json.dumps(cfg))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(PEER), str(path)],
                    env=_env(gpu),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        reports = []
        for proc, (_, cfg) in zip(procs, peers, strict=True):
            try:
                out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{cfg['role']} did not finish within {timeout} s") from None
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, (
                f"{cfg['role']} printed no report (rc={proc.returncode}); stderr tail:\n"
                f"{err[-4000:]}"
            )
            report = json.loads(lines[-1])
            report["stderr_tail"] = err[-4000:]
            reports.append(report)
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def base_config(tmp_path: Path, role: str, spec: list, **extra: Any) -> dict[str, Any]:
    return {
        "role": role,
        "uid_path": str(tmp_path / "uid.bin"),
        "spec": spec,
        "seed": 1234,
        "modes": ["packed", "unpacked"],
        "buffer_bytes": 256 << 20,
        "join_timeout": 120.0,
        "transfer_timeout": 120.0,
        **extra,
    }


def no_error(report: dict[str, Any]) -> None:
    assert "error" not in report, (
        f"{report['role']}: {report.get('traceback')}\n{report['stderr_tail']}"
    )


def check_bit_exact(sender: dict[str, Any], receiver: dict[str, Any], spec: list) -> None:
    no_error(sender)
    no_error(receiver)
    for mode in ("packed", "unpacked"):
        got = receiver["received"][mode]
        wrong = [
            name
            for name, dtype, shape in spec
            if got.get(name) != [dtype, shape, sender["hashes"][name]]
        ]
        assert not wrong, (
            f"{mode}: {len(wrong)} tensors differ, first {wrong[:5]}: "
            f"{[got.get(n) for n in wrong[:2]]}"
        )


def test_jax_sender_torch_receiver_mixed_dtypes_over_1gib_bit_exact(tmp_path: Path) -> None:
    metas = [ParamMeta(n, d, tuple(s)) for n, d, s in BIG_SPEC]
    assert sum(m.nbytes for m in metas) >= 1 << 30
    assert len(plan_packed(metas, 256 << 20)) >= 4  # really several chunks
    sender, receiver = run_peers(
        tmp_path,
        [
            (0, base_config(tmp_path, "jax-sender", BIG_SPEC)),
            (1, base_config(tmp_path, "torch-receiver", BIG_SPEC)),
        ],
        timeout=900,
    )
    check_bit_exact(sender, receiver, BIG_SPEC)
    assert sender["nbytes"] >= 1 << 30 and sender["chunks"] >= 4
    print(
        f"\nNCCL {sender['nccl']}: sender seconds {sender['seconds']}, receiver seconds "
        f"{receiver['seconds']}"
    )


def test_zero_size_and_scalar_tensors_packed_and_unpacked(tmp_path: Path) -> None:
    sender, receiver = run_peers(
        tmp_path,
        [
            (0, base_config(tmp_path, "jax-sender", EDGE_SPEC, buffer_bytes=8)),
            (1, base_config(tmp_path, "torch-receiver", EDGE_SPEC, buffer_bytes=8)),
        ],
        timeout=600,
    )
    check_bit_exact(sender, receiver, EDGE_SPEC)


def test_sender_init_times_out_when_receiver_never_joins(tmp_path: Path) -> None:
    start = time.monotonic()
    (sender,) = run_peers(
        tmp_path, [(0, base_config(tmp_path, "jax-sender", SMALL, join_timeout=20.0))], timeout=300
    )
    assert sender.get("error_type") == "TransferTimeout", sender.get("traceback") or sender
    assert "rank 0 of world size 2" in sender["error"] and "never joined" in sender["error"]
    assert 19.5 <= sender["join_s"] < 40, sender["join_s"]
    assert time.monotonic() - start < 240, (
        "the process must exit despite the init thread parked in NCCL"
    )


def test_receiver_watchdog_turns_a_silent_sender_into_transfer_timeout(tmp_path: Path) -> None:
    sender, receiver = run_peers(
        tmp_path,
        [
            (0, base_config(tmp_path, "jax-idle-sender", SMALL, idle_s=40.0)),
            (
                1,
                base_config(
                    tmp_path,
                    "torch-stalled-receiver",
                    SMALL,
                    transfer_timeout=10.0,
                    expect_stall=True,
                ),
            ),
        ],
        timeout=600,
    )
    no_error(sender)
    no_error(receiver)
    assert receiver.get("stall_error_type") == "TransferTimeout", receiver
    assert (
        "rank 1 of world size 2" in receiver["stall_error"] and "aborted" in receiver["stall_error"]
    )
    assert 9.5 <= receiver["stall_s"] < 30, receiver["stall_s"]
    assert (
        receiver["after_stall"].startswith("TransferError") and "aborted" in receiver["after_stall"]
    )
