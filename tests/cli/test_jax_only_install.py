"""``pip install "weightwire[jax]"`` is enough for a JAX trainer host, and never brings torch.

One fresh virtual environment, the package installed from this checkout as a wheel
(not editable: what a user gets) with the ``[jax]`` extra only. In it: torch is absent;
``load_decoder`` reads a tiny HF checkpoint and a verified round reaches a reference
server started from the test environment, without importing torch; the demo runs against
that server; ``weightwire bench`` runs from the wheel; ``serve`` and the embedded demo say
in one line which extra they need. About a minute on a 2-core host (pip's cache holds the
wheels after the first run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    # No PYTHONPATH: the venv must run its installed wheel, not this checkout.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, launch_server: Any, tiny_dir: str
) -> tuple[Path, str]:
    """``(venv, url)``: the reference server (test environment) loads while the venv is built."""
    server = launch_server(tiny_dir)
    venv = tmp_path_factory.mktemp("jax-only") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{ROOT}[jax]"],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
        cwd=venv,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv, server.wait_ready()


@pytest.fixture(scope="module")
def jax_venv(setup: tuple[Path, str]) -> Path:
    return setup[0]


def _run(venv: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=venv.parent,
        check=False,
    )


def test_the_jax_extra_installs_no_torch(jax_venv: Path) -> None:
    listed = _run(jax_venv, "python", "-m", "pip", "list", "--format=json")
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"jax", "flax", "safetensors", "tokenizers", "weightwire"} <= names
    assert not {n for n in names if n == "torch" or n.startswith(("torch", "nvidia-"))}, sorted(
        names
    )
    probe = (
        "import importlib.metadata as md, pathlib, weightwire; d = "
        "md.distribution('weightwire'); print(weightwire.__file__); print(d.version == "
        "weightwire.__version__); print(d.metadata['License-Expression']); "
        "print(sorted(str(f) for f in d.files if f.name in ('py.typed', 'LICENSE')))"
    )
    where = _run(jax_venv, "python", "-c", probe)
    lines = where.stdout.splitlines()
    assert len(lines) == 4, where.stdout + where.stderr
    assert "site-packages" in lines[0]  # the wheel, not the checkout
    assert (
        lines[1] == "True" and lines[2] == "Apache-2.0"
    )  # one version source; the license it ships
    assert "weightwire/py.typed" in lines[3] and "LICENSE" in lines[3]
    # The README's JAX example imports only what [jax] installs (tokenizers, optax, ...).
    example = _run(jax_venv, "python", str(ROOT / "examples" / "jax_flax_to_vllm_gpu.py"), "--help")
    assert example.returncode == 0 and "--model-dir" in example.stdout, example.stderr[-2000:]


def test_load_decoder_and_a_verified_round_without_torch(
    setup: tuple[Path, str], tiny_dir: str
) -> None:
    jax_venv, url = setup
    before = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
    done = _run(
        jax_venv, "python", str(ROOT / "tests" / "cli" / "_jax_only_round.py"), url, tiny_dir
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["torch_modules"] == []
    assert report["version"] == "jax-only-1" and report["tensors"] == len(before)
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "jax-only-1"
    after = httpx.post(f"{url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert set(after) == set(before) and all(after[k] != before[k] for k in before)


def test_demo_against_a_server_and_bench_run_from_the_wheel(
    setup: tuple[Path, str], tiny_dir: str
) -> None:
    jax_venv, url = setup
    # --resync: an earlier test may have changed the server's weights; the demo pushes its own
    # first.
    demo = _run(
        jax_venv,
        "weightwire",
        "demo",
        "--server",
        url,
        "--model-dir",
        tiny_dir,
        "--steps",
        "2",
        "--batch",
        "8",
        "--max-tokens",
        "8",
        "--resync",
    )
    assert demo.returncode in (0, 1), (
        demo.stdout + demo.stderr
    )  # 1: the reward may not rise in 2 steps
    assert "agree" in demo.stdout and "trainer process imported torch: no" in demo.stdout
    assert "[1/3] importing JAX" in demo.stdout  # start-up progress as plain lines in a pipe
    assert "check failed" not in demo.stdout and "Traceback" not in demo.stderr
    bench = _run(
        jax_venv, "weightwire", "bench", "--total-mib", "8", "--buffer-mib", "4", "--repeats", "1"
    )
    assert bench.returncode == 0, bench.stderr
    assert "weightwire TCPCommunicator" in bench.stdout


def test_what_needs_torch_says_which_extra(jax_venv: Path) -> None:
    serve = _run(jax_venv, "weightwire", "serve", "--model", "tiny-llama", "--port", "0")
    assert serve.returncode == 3, serve.stderr
    # Installed from this checkout (a directory, not an index): the hint installs from there again.
    hint = f'{jax_venv.name}/bin/pip install "{ROOT}[torch]"'
    assert (
        serve.stderr.strip() == f"weightwire serve: error: weightwire serve needs 'torch': {hint}"
    )
    demo = _run(jax_venv, "weightwire", "demo")
    assert demo.returncode == 3, demo.stderr
    assert demo.stderr.strip().endswith(
        "weightwire demo: error: the embedded reference server (or pass --server URL "
        f"--model-dir DIR) needs 'torch': {hint}"
    )
    assert "Traceback" not in serve.stderr + demo.stderr
