"""The CPU-capable examples, run as scripts against reference servers with short flags.

Each example checks its own result (server vs trainer log-probabilities, checksums)
and prints it; these tests assert on that output and the exit code.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightwire.tools.demo.server import EmbeddedServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def servers(launch_server: object, tiny_dir: str) -> Iterator[tuple[str, str]]:
    """Two reference servers on the tiny Llama (the second with two worker ranks)."""
    one: EmbeddedServer = launch_server(tiny_dir)  # type: ignore[operator]
    two: EmbeddedServer = launch_server(tiny_dir, replicas=2)  # type: ignore[operator]
    yield one.wait_ready(), two.wait_ready()


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, (
        f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def _diffs(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"max \|dlogp\|[^0-9]*([0-9.e+-]+)", out)]


def test_every_example_is_covered() -> None:
    # The pytree-kind examples (and their shared _send.py) run in
    # tests/jax_side/test_examples_kinds.py.
    kinds = [
        "_send.py",
        "add_a_family.py",
        "equinox_module_source.py",
        "linen_params_source.py",
        "maxtext_moe_scanned.py",
        "nnx_module_source.py",
    ]
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(
        [
            "_score.py",
            "jax_flax_to_vllm_gpu.py",
            "maxtext_style_scanned_layers.py",
            "multi_replica_ray.py",
            "torch_trainer_to_vllm.py",
            *kinds,
        ]
    )  # _score.py: the JAX-vs-server check of the two decoder examples


def _two_scored_steps(script: str, server: str, tiny_dir: str, *extra: str) -> str:
    """A decoder example's two training steps over TCP; each step's logprobs (``_score.py``)
    match the server's."""
    out = _run(
        script,
        "--server",
        server,
        "--model-dir",
        tiny_dir,
        "--backend",
        "weightwire_tcp",
        *extra,
        "--steps",
        "2",
        "--lr",
        "3e-3",
    )
    diffs = _diffs(out)
    assert len(diffs) == 2 and max(diffs) < 1e-3, out
    return out


def test_jax_flax_example_over_tcp(servers: tuple[str, str], tiny_dir: str) -> None:
    _two_scored_steps("jax_flax_to_vllm_gpu.py", servers[0], tiny_dir, "--dtype", "float32")


def test_torch_trainer_example_over_tcp(servers: tuple[str, str], tiny_dir: str) -> None:
    out = _two_scored_steps("torch_trainer_to_vllm.py", servers[0], tiny_dir)
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert losses[1] < losses[0], out


def test_maxtext_example_maps_and_lands_every_tensor(
    servers: tuple[str, str], tiny_dir: str
) -> None:
    out = _run("maxtext_style_scanned_layers.py", "--server", servers[0], "--model-dir", tiny_dir)
    assert "mapping ok: 21 HF tensors reproduce the checkpoint bit for bit" in out
    assert "server checksums match all 21 tensors sent" in out


def test_multi_replica_example_over_http(servers: tuple[str, str], tiny_dir: str) -> None:
    out = _run(
        "multi_replica_ray.py",
        "--urls",
        *servers,
        "--model-dir",
        tiny_dir,
        "--backend",
        "weightwire_tcp",
        "--steps",
        "2",
    )
    assert "one group: trainer + 3 inference ranks" in out
    assert out.count(" ok\n") == 2 and "versions ['step-2', 'step-2']" in out, out
