"""``weightwire_ipc`` on ONE GPU: a trainer process (JAX, torch-free, or torch) and a
``WeightwireIPCEngine`` receiver process on the same device, driven through the
loopback control shim.

A ~1.1 GiB Llama-shaped set with a tensor of every wire dtype, packed (pull mode:
the trainer writes into the worker's buffers; push mode: the slot ring) and unpacked
(push only), two rounds of fresh values: the receiver's per-tensor sha256 must equal the
sender's after each. Then the knobs (one slot; release after round) and the two
faults: the trainer killed mid-round, the worker killed mid-round; both must end
in a named ``PeerLost`` (the peer's end of the channel closed), not a timeout.

Same-host-other-GPU uses the same code (``cudaIpcOpenMemHandle`` with lazy peer
access); it needs two GPUs and is not exercised here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from weightwire.testing.loopback import spawn_loopback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SENDER = os.path.join(ROOT, "tests", "trainer", "gpu_sender.py")
BASE = {
    "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
}
CASES = [
    ("jax", 1, "pull"),
    ("jax", 1, "push"),
    ("jax", 0, "push"),
    ("torch", 1, "pull"),
    ("torch", 1, "push"),
    ("torch", 0, "push"),
]
PIPELINE = {"pull": "IPCPullPipeline", "push": "IPCPipeline"}


def _sender(address: str, framework: str, *extra: str, **popen: object) -> list[str]:
    return [
        sys.executable,
        SENDER,
        "--address",
        address,
        "--framework",
        framework,
        "--backend",
        "weightwire_ipc",
        "--mib",
        "1100",
        *extra,
    ]


def _stopped_sender(address: str, mode: str, stop: str) -> list[str]:
    """One packed JAX round in ``mode`` whose sender stops (``kill``: dies by SIGKILL;
    ``pause``: waits) at the round's tensor 20."""
    return _sender(
        address,
        "jax",
        *("--packed", "1", "--buffer-mib", "128", "--rounds", "1"),
        *("--stop", stop, "--stop-at", "20", "--ipc-mode", mode),
    )


def _check_rounds(result: dict, n: int) -> list[dict]:
    rounds = result["rounds"]
    assert len(rounds) == n
    for i, r in enumerate(rounds):
        assert r["mismatched"] == [], (
            f"round {i + 1}: receiver bytes differ for {r['mismatched'][:5]}"
        )
        assert r["nbytes"] >= 1 << 30
        assert (
            r["receiver"]["nbytes"] == r["nbytes"] and r["receiver"]["tensors"] == result["tensors"]
        )
        assert r["weight_version"] == str(i + 1)
        assert r["reused_metadata"] == (i > 0)
    assert rounds[0]["digests"] != rounds[1]["digests"]  # the second round really sent new values
    return rounds


def _run(framework: str, *extra: str, rounds: int = 2) -> tuple[dict, object]:
    proc, client = spawn_loopback("weightwire_ipc", "cuda:0", env=BASE, timeout=180)
    try:
        out = subprocess.run(
            _sender(client.address, framework, "--rounds", str(rounds), *extra),
            env={**os.environ, **BASE},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, f"sender failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
        result = json.loads(out.stdout.strip().splitlines()[-1])
        (reply,) = client.weight_checker("checksum")
        memory = client.call("memory")
        return {**result, "final_checksums": reply["checksums"], "memory": memory}, client
    finally:
        client.exit()
        proc.wait(timeout=60)


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("framework", "packed", "mode"),
    CASES,
    ids=[f"{f}-{'packed' if p else 'unpacked'}-{m}" for f, p, m in CASES],
)
def test_ipc_rounds_arrive_bit_exact_on_one_gpu(framework: str, packed: int, mode: str) -> None:
    result, _ = _run(
        framework,
        "--packed",
        str(packed),
        "--buffer-mib",
        "256",
        "--num-buffers",
        "2",
        "--ipc-mode",
        mode,
    )
    rounds = _check_rounds(result, 2)
    # Independent of the sender's own check: what the receiver holds now is the last round.
    assert result["final_checksums"] == rounds[-1]["digests"]
    assert rounds[-1]["pipeline"] == PIPELINE[mode]  # unpacked sessions negotiate push
    # push: the slot ring, kept between rounds; pull: no slots (chunks land in the worker's buffers)
    assert rounds[-1]["trainer_extra"] == (2 * (256 << 20) if mode == "push" else 0)
    for i, r in enumerate(rounds):
        print(
            f"ipc {framework}/{'packed' if packed else 'unpacked'}/{mode} round {i + 1}: "
            f"{r['nbytes'] / 1e9:.2f} GB, {r['chunks']} pieces, {r['gbps']:.1f} GB/s, wall "
            f"{r['wall_s'] * 1e3:.1f} ms, worker memory {result['memory']}"
        )


OVERLAPPED = [("cow", "push"), ("cow", "pull"), ("copy", "push")]


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("snapshot", "mode"), OVERLAPPED, ids=[f"{s}-{m}" for s, m in OVERLAPPED])
def test_ipc_overlapped_torch_rounds_do_not_queue_behind_the_next_step(
    snapshot: str, mode: str
) -> None:
    """#49: ``send_weights(wait=False)``, then at once the next step writes every tensor in
    place and keeps the trainer's stream busy for ~3 s: the round sends the call's bytes
    (the receiver's checksums) and has ended while the step still runs (the round reads on
    its own stream; on the default stream its copies waited for the whole step)."""
    result, _ = _run("torch", "--packed", "1", "--ipc-mode", mode, "--overlap", snapshot)
    rounds = _check_rounds(result, 2)
    assert result["final_checksums"] == rounds[-1]["digests"]
    assert [r["step_running"] for r in rounds] == [True, True]


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_ipc_one_slot_and_release_after_round(mode: str) -> None:
    result, _ = _run(
        "torch",
        "--packed",
        "1",
        "--buffer-mib",
        "128",
        "--num-buffers",
        "1",
        "--release",
        "1",
        "--ipc-mode",
        mode,
    )
    rounds = _check_rounds(result, 2)
    assert result["final_checksums"] == rounds[-1]["digests"]
    assert [r["trainer_extra"] for r in rounds] == [
        0,
        0,
    ]  # slots freed after every round (pull: none at all)
    assert rounds[-1]["pipeline"] == PIPELINE[mode]
    print(
        f"ipc {mode} one buffer + release: {[round(r['wall_s'] * 1e3, 1) for r in rounds]} ms "
        "per round"
    )


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_ipc_trainer_killed_mid_round_fails_the_worker_with_peer_lost(mode: str) -> None:
    proc, client = spawn_loopback("weightwire_ipc", "cuda:0", env=BASE, timeout=180)
    try:
        out = subprocess.run(
            _stopped_sender(client.address, mode, "kill"),
            env={**os.environ, **BASE},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == -signal.SIGKILL, (
            f"sender was meant to die by SIGKILL:\n{out.stderr[-3000:]}"
        )
        # Session calls are serialized in the receiver: this answers once the dead
        # trainer's round has failed there.
        with pytest.raises(Exception) as err:
            client.start_weight_update()
        text = str(err.value)
        assert "aborted after a failed round" in text and "PeerLost" in text, text
        # The worker survived and a new session works (init + one full round).
        out = subprocess.run(
            _sender(client.address, "torch", "--packed", "1", "--rounds", "1", "--mib", "64"),
            env={**os.environ, **BASE},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["rounds"][0]["mismatched"] == []
    finally:
        client.exit()
        proc.wait(timeout=60)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_ipc_worker_killed_mid_round_fails_the_trainer_with_a_clear_error(mode: str) -> None:
    proc, client = spawn_loopback("weightwire_ipc", "cuda:0", env=BASE, timeout=180)
    sender = subprocess.Popen(
        _stopped_sender(client.address, mode, "pause"),
        env={**os.environ, **BASE},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sender.stdout is not None and sender.stdin is not None
        for line in sender.stdout:
            if line.strip() == "PAUSED":
                break
        else:
            pytest.fail(
                "sender never reached the pause point: "
                f"{sender.stderr.read()[-3000:] if sender.stderr else ''}"
            )
        proc.kill()
        proc.wait(timeout=60)
        sender.stdin.write("go\n")
        sender.stdin.flush()
        rest, err = sender.communicate(timeout=300)
        assert sender.returncode == 3, (
            f"sender should report the failed round:\n{rest[-2000:]}\n{err[-3000:]}"
        )
        error = json.loads(rest.strip().splitlines()[-1])["error"]
        # Either the data plane (the worker's channel closed) or the control plane (its
        # server connection dropped) names the lost peer; never a timeout.
        assert "Timeout" not in error.split(":")[0], error
        assert any(
            k in error
            for k in ("PeerLost", "closed the IPC control channel", "loopback", "Connection")
        ), error
    finally:
        if sender.poll() is None:
            sender.kill()
        if proc.poll() is None:
            proc.kill()
