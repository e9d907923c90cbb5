"""Adding a backend is one new package plus one registration line: the toy ``toy_files``
backend (tests/backends/toy_backend, a directory of chunk files for a wire) is registered
at run time, in the test and in a worker process, and carries real rounds from a JAX
trainer engine into a standalone worker engine."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.backends.toy_backend.trainer import FilesComm
from tests.trainer.fakes import DictSource
from weightwire import backends
from weightwire.backends.spec import BackendSpec
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.timeouts import Timeouts
from weightwire.testing.loopback import LoopbackClient, spawn_loopback_cmd
from weightwire.trainer import TrainerInitInfo

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tests.backends.toy_backend"
WORKER = f"""
from weightwire import backends
from weightwire.testing.loopback import serve
backends.register({PACKAGE!r})
serve("toy_files", "cpu")
"""


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> BackendSpec:
    """The registration line, undone after the test: other tests see only the built-ins."""
    monkeypatch.setattr(backends, "SPECS", dict(backends.SPECS))
    monkeypatch.setattr(backends, "ALIASES", dict(backends.ALIASES))
    monkeypatch.setattr(backends, "_MADE", dict(backends._MADE))
    (spec,) = backends.register(PACKAGE)
    return spec


@pytest.fixture
def worker(toy: BackendSpec) -> Iterator[LoopbackClient]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc, client = spawn_loopback_cmd(["-c", WORKER], env={"PYTHONPATH": path}, timeout=120)
    try:
        yield client
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _weights() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "model.embed_tokens.weight": rng.standard_normal((200, 64)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((64, 96)).astype(np.float32),
        "model.layers.0.mlp.scale": np.array(0.5, np.float16),
        "model.norm.weight": rng.standard_normal(64).astype(np.float32),
    }


def _checksums(weights: dict[str, Any]) -> dict[str, str]:
    return {
        n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in weights.items()
    }


def _engine(
    client: LoopbackClient, weights: dict[str, Any], *, transfer_s: float
) -> JAXTrainerEngine:
    info = TrainerInitInfo(
        backend="toy_files",
        packed_buffer_size_bytes=16 << 10,
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=transfer_s),
    )
    return JAXTrainerEngine.trainer_init(info, client=client, source=DictSource(weights, describe))


def test_registered_toy_backend_carries_rounds(worker: LoopbackClient) -> None:
    weights = _weights()
    engine = _engine(worker, weights, transfer_s=30)
    directory = None
    try:
        for step in range(2):
            weights["model.norm.weight"] = weights["model.norm.weight"] + np.float32(step + 1)
            engine.send_weights()
            (reply,) = worker.weight_checker("checksum")
            assert reply["checksums"] == _checksums(weights)
            stats = worker.stats()
            assert stats is not None and stats["nbytes"] == sum(a.nbytes for a in weights.values())
            assert (
                stats["chunks"] > 1
            )  # several files per round: the 16 KiB buffer splits the embedding
        directory = engine.session.link.directory  # rank 0's link is the toy's FilesComm
        assert any(name.endswith(".bin") for name in os.listdir(directory))
    finally:
        engine.shutdown()
    assert directory is not None and not os.path.exists(directory)  # rank 0 removed its wire


def test_missing_chunk_file_fails_the_round_within_the_timeout(
    worker: LoopbackClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = _weights()
    before = _checksums(weights)
    engine = _engine(worker, weights, transfer_s=2)
    try:
        engine.send_weights()
        publish = FilesComm._publish
        lost: list[int] = []

        def drop_first(self: FilesComm, seq: int, parts: list[np.ndarray]) -> None:
            if not lost:  # the next round's first chunk never reaches the directory
                lost.append(seq)
                return
            publish(self, seq, parts)

        monkeypatch.setattr(FilesComm, "_publish", drop_first)
        weights["model.norm.weight"] = weights["model.norm.weight"] + np.float32(1)
        with pytest.raises(
            WeightSyncError,
            match=r"status 500.*TransferTimeout: toy_files: chunk file "
            r"\S+/\d+\.bin did not appear within 2 s",
        ):
            engine.send_weights()
        (reply,) = worker.weight_checker("checksum")
        assert reply["checksums"] == before  # the failed round left the first round's weights
    finally:
        engine.shutdown()


def test_the_toy_engine_takes_its_name_and_init_info_from_the_registration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine class names no backend: what it receives is read from the spec naming it, so
    # its module may be imported before the registration line runs, and resolves after it.
    pytest.importorskip("torch")
    from tests.backends.toy_backend.engine import ToyFilesEngine
    from tests.backends.toy_backend.info import ToyFilesInitInfo

    monkeypatch.setattr(backends, "SPECS", dict(backends.SPECS))
    monkeypatch.setattr(backends, "ALIASES", dict(backends.ALIASES))
    if "toy_files" not in backends.SPECS:
        with pytest.raises(AttributeError, match="no backend's spec names this engine class"):
            _ = ToyFilesEngine.backend
        backends.register(PACKAGE)
    assert ToyFilesEngine.backend == "toy_files"
    assert ToyFilesEngine.init_info_cls is ToyFilesInitInfo
