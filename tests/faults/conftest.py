"""Fixtures of the fault suite: one ~64 MB model per session, one shared server for the
cases that leave it alive (logging at DEBUG, so the security checks read real logs),
and a trainer-side source whose fault knobs are reset after every test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Probe, TensorSource, load_weights
from tests.faults.servers import Server, serving
from weightwire.tools.server.scaled import scaled_llama_dir

DEBUG_ENV = {"WEIGHTWIRE_LOG_LEVEL": "DEBUG"}  # the workers' log level


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scaled_llama_dir(tmp_path_factory.mktemp("fault-model"))


@pytest.fixture(scope="session")
def shared_server(fault_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(
        fault_model, tmp_path_factory.mktemp("shared-server"), "--log-level", "debug", env=DEBUG_ENV
    ) as server:
        yield server


@pytest.fixture(scope="session")
def probe(shared_server: Server) -> Iterator[Probe]:
    p = Probe(shared_server.url)
    yield p
    p.close()


@pytest.fixture(scope="session")
def _session_source(fault_model: Path) -> TensorSource:
    return TensorSource(load_weights(fault_model))


@pytest.fixture()
def source(_session_source: TensorSource) -> Iterator[TensorSource]:
    """The trainer's weights (carried across tests: 64 MB are not reloaded per case)."""
    yield _session_source
    _session_source.hook = None
    _session_source.mutate = None
