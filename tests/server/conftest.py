"""Fixtures for the reference-server tests: a tiny model built once per session and a
server launcher (one real ``python -m weightwire.tools.server`` per test module)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server_launch import start_server

START_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An isolated $WEIGHTWIRE_CACHE for the session (servers inherit it)."""
    root = tmp_path_factory.mktemp("weightwire-cache")
    old = os.environ.get("WEIGHTWIRE_CACHE")
    os.environ["WEIGHTWIRE_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("WEIGHTWIRE_CACHE", None)
    else:
        os.environ["WEIGHTWIRE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_llama(tiny_cache: Path) -> str:
    from weightwire.tools.server.tiny import tiny_model_dir

    return tiny_model_dir("tiny-llama")


@dataclass
class ServerProc:
    proc: subprocess.Popen[str]
    url: str
    log_path: Path
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


def launch_server(
    args: list[str], log_path: Path, *, env: dict[str, str] | None = None
) -> ServerProc:
    """Start a server with ``--port 0`` and wait (bounded) for its ready line."""
    proc, url, lines = start_server(args, log_path, timeout=START_TIMEOUT_S, env=env)
    return ServerProc(proc, url, log_path, lines)


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """``server_factory(args) -> ServerProc``; every server started is stopped at module end."""
    started: list[ServerProc] = []

    def make(args: list[str], env: dict[str, str] | None = None) -> ServerProc:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = launch_server(args, log_path, env=env)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def http(server: ServerProc) -> Iterator[httpx.Client]:
    """A client of the module's ``server`` fixture (a module with an API key defines its own)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def base_weights(tiny_llama: str) -> dict[str, np.ndarray]:
    """The tiny Llama's checkpoint, as the server loaded it (a module's own copy to perturb)."""
    from safetensors.numpy import load_file

    return load_file(str(Path(tiny_llama) / "model.safetensors"))
