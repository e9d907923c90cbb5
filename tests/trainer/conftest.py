"""Receivers the trainer tests send to, one per module that asks (module scope: a module's
cases share one, and no module starts one it does not use)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from weightwire.control import HTTPWeightSyncClient
from weightwire.testing.loopback import spawn_loopback
from weightwire.tools.demo.server import EmbeddedServer


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """The reference server on tiny-llama with two worker replicas (separate processes)."""
    with EmbeddedServer(
        "tiny-llama", extra_args=["--replicas", "2"], startup_timeout=180
    ) as server:
        assert server.url is not None
        yield server.url


@pytest.fixture(scope="module")
def loopback() -> Iterator[HTTPWeightSyncClient]:
    """A loopback receiver (weightwire_tcp, CPU) in its own process, and its client."""
    proc, client = spawn_loopback("weightwire_tcp", "cpu", timeout=120)
    try:
        yield client
    finally:
        proc.kill()
        proc.wait(timeout=10)
