"""The harness of the fault cases against a real vLLM (``test_round_faults.py``, which says
what states (a) and (b) are): ``Served`` is what the server must be serving now (the Hugging
Face twin of its weights, its version), with the check of state (b) and a fresh round that
must reach state (a)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from tests.interop.helpers import VLLMServer, assert_same_greedy
from tests.interop.launcher import Launcher
from tests.interop.models import hf_model, jax_params, load_into_hf, perturbed
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.trainer.config import TrainerInitInfo

PACKED_16K = 16 << 10


@dataclass
class Served:
    """What the server must be serving now: the HF twin of its weights and its version."""

    server: VLLMServer
    hf: torch.nn.Module
    version: str
    seed: int = 100

    def checksums(self) -> dict:
        reply = httpx.post(
            f"{self.server.url}/weight_checker", json={"action": "checksum"}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        return reply.json()

    def assert_state_b(self, what: str, before: dict) -> None:
        """The previous weights exactly, under the previous version."""
        assert self.server.weight_version() == self.version, f"{what}: version moved"
        assert_same_greedy(self.server, self.hf, f"{what}: previous weights")
        assert self.checksums() == before, f"{what}: weight checksums changed"

    def fresh_round(self, what: str) -> list[list[int]]:
        """A new JAX trainer's round (no manual finish first): state (a)."""
        self.seed += 1
        previous, _ = self.server.greedy()
        params, naming = jax_params(self.server.model_dir)
        params = perturbed(params, self.seed)
        source = PytreeSource(lambda: params, naming)
        version = f"fresh-{self.seed}"
        with HTTPWeightSyncClient(self.server.url, timeout=120) as client:
            engine = JAXTrainerEngine.trainer_init(trainer_info(), client=client, source=source)
            try:
                engine.send_weights(weight_version=version)
            finally:
                engine.shutdown()
        assert self.server.weight_version() == version
        load_into_hf(self.hf, source)
        self.version = version
        tokens = assert_same_greedy(self.server, self.hf, f"{what}: fresh round")
        assert tokens != previous, f"{what}: the fresh round did not change the output"
        return tokens


def trainer_info(**kw: object) -> TrainerInitInfo:
    """A small packed buffer: a tiny model's round still spans several chunks."""
    return TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=PACKED_16K, **kw)  # type: ignore[arg-type]


def jax_engine(
    served: Served, seed: int, client: HTTPWeightSyncClient
) -> tuple[JAXTrainerEngine, PytreeSource]:
    params, naming = jax_params(served.server.model_dir)
    params = perturbed(params, seed)
    source = PytreeSource(lambda: params, naming)
    return JAXTrainerEngine.trainer_init(trainer_info(), client=client, source=source), source


def serve_tiny_llama(
    launcher: Launcher, model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """The module fixture's body: the tiny Llama's vLLM, checked to serve the checkpoint first
    and given the checkpoint back at the end (the tests that run next on it expect it)."""
    from tests.interop.conftest import serve

    server = serve(launcher, model_dirs, "tiny-llama", tmp_path_factory.getbasetemp() / "models")
    state = Served(server, hf_model(server.model_dir), server.weight_version())
    assert_same_greedy(server, state.hf, "before the fault cases")  # the checkpoint's weights
    yield state
    # Leave the checkpoint's weights for the tests that run next on this server.
    pristine = hf_model(server.model_dir)
    with HTTPWeightSyncClient(server.url, timeout=120) as client:
        engine = TorchTrainerEngine.trainer_init(
            TrainerInitInfo(backend="weightwire_tcp"), client=client, source=ModuleSource(pristine)
        )
        try:
            engine.send_weights(weight_version="checkpoint")
        finally:
            engine.shutdown()
    assert_same_greedy(server, pristine, "checkpoint restored after the fault cases")


REPO = Path(__file__).resolve().parents[2]


@contextmanager
def dying_trainer(url: str, model_dir: str, phase: str, *args: str) -> Iterator[subprocess.Popen]:
    """``dying_trainer.py`` against the server, read until it reports ``phase`` (asserted);
    the body kills it as its test needs, and it is killed on the way out if still alive."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, str(REPO / "tests/interop/dying_trainer.py"), url, model_dir, phase,
         *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )  # fmt: skip
    try:
        lines = []
        assert child.stdout is not None
        for line in child.stdout:  # blocks until the child reports its phase (or dies)
            lines.append(line)
            if line.startswith("PHASE"):
                break
        assert lines and lines[-1].strip() == f"PHASE {phase}", "".join(lines[-30:])
        yield child
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
