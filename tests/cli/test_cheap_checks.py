"""Mistakes a command can see cheaply fail before its slow start-up (importing JAX, compiling,
loading workers), as one line with the fix and the documented exit code, never a traceback.
Process-level: the real entry point in a fresh interpreter."""

from __future__ import annotations

import importlib.util
import socket

import pytest

from tests.cli.conftest import run_cli


def _dead_port() -> int:
    with socket.socket() as s:  # bound, closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line]
    return lines[-1]


@pytest.mark.parametrize("scheme", ["", "http://"])
def test_demo_probes_the_server_before_starting_jax(scheme: str, tiny_dir: str) -> None:
    # A bare HOST:PORT means http:// (as for every server weightwire talks to); nothing listens
    # there.
    url = f"{scheme}127.0.0.1:{_dead_port()}"
    done = run_cli("demo", "--server", url, "--model-dir", tiny_dir, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert line.startswith(
        f"weightwire demo: error: cannot reach a server at http://{url.removeprefix('http://')} "
    )
    assert "weightwire serve --model tiny-llama" in line and "fix --server" in line
    assert "importing JAX" not in done.stdout  # it stopped before the slow start-up


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--server", "ftp://127.0.0.1:8000"],
            "the scheme must be http:// or https://, not ftp://",
        ),
        (["--server", "http://127.0.0.1:99999"], "its port is not a number in [0, 65535]"),
        (
            ["--server", "http://127.0.0.1:8000", "--model-dir", "/no/such/dir"],
            "--model-dir '/no/such/dir' is not a Hugging Face model directory (no config.json)",
        ),
    ],
)
def test_demo_refuses_a_bad_server_or_model_dir_as_usage(argv: list[str], message: str) -> None:
    done = run_cli("demo", *argv, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in _one_line(done.stderr) and "importing JAX" not in done.stdout


def test_serve_on_cuda_without_a_gpu_says_so_in_one_line() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA GPU")
    done = run_cli("serve", "--model", "tiny-llama", "--device", "cuda", "--port", "0", timeout=120)
    assert done.returncode == 2, done.stderr
    assert _one_line(done.stderr) == (
        "weightwire serve: error: --device cuda: torch sees no CUDA GPU on this host "
        "(torch.cuda.is_available() is False); use --device cpu, or check CUDA_VISIBLE_DEVICES "
        "and the driver"
    )
    assert "loading" not in done.stdout  # no worker was started


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_bench_nccl_without_cupy_names_the_extra() -> None:
    done = run_cli(
        "bench", "--backend", "nccl", "--total-mib", "8", "--buffer-mib", "4", timeout=120
    )
    assert done.returncode == 3, done.stderr
    line = _one_line(done.stderr)
    assert line.startswith(
        "weightwire bench: error: weightwire bench --backend nccl (NCCL on two GPUs) needs 'cupy': "
    )
    assert '[cuda12]" (or [cuda13], matching your CUDA)' in line
    assert len(done.stderr.strip().splitlines()) == 1
