"""Shared fixtures: the tiny model directory and reference-server launchers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import pytest

from weightwire.tools.demo.server import EmbeddedServer


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    from weightwire.tools.server.tiny import tiny_model_dir

    return tiny_model_dir("tiny-llama")


@pytest.fixture(scope="module")
def launch_server() -> Iterator[Callable[..., EmbeddedServer]]:
    """``launch_server(model, replicas=1, extra_args=())``: a launched (not yet ready) reference
    server (``extra_args``: more ``weightwire serve`` flags); call ``wait_ready()`` for its URL.
    Start several before waiting so their start-ups overlap. Every server is stopped at module
    end."""
    servers: list[EmbeddedServer] = []

    def launch(model: str, *, replicas: int = 1, extra_args: Sequence[str] = ()) -> EmbeddedServer:
        server = EmbeddedServer(
            model, startup_timeout=180, extra_args=["--replicas", str(replicas), *extra_args]
        )
        servers.append(server)
        server.launch()
        return server

    try:
        yield launch
    finally:
        for server in servers:
            server.stop()


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in a fresh interpreter (no state shared), run to its end."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``weightwire ARGS`` in a fresh interpreter (the real entry point, no state shared)."""
    return run_module("weightwire.tools.cli", *args, timeout=timeout)


def start_weightwire(*args: str) -> subprocess.Popen[str]:
    """``python -m weightwire ARGS`` started, not awaited, in its own session (what it starts is
    its process group; a test's signal reaches only it), with its output piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "weightwire", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
