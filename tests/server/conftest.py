"""Fixtures for the reference-server tests: a tiny model built once per session and a
server launcher (one real ``python -m weightwire.torch_side.server`` per test module)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

READY = re.compile(r"^weightwire server ready on (http://\S+)$")
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
    from weightwire.torch_side.server.tiny import tiny_model_dir

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


def launch_server(args: list[str], log_path: Path, *, env: dict[str, str] | None = None) -> ServerProc:
    """Start a server with ``--port 0`` and wait (bounded) for its ready line."""
    log = open(log_path, "w")  # noqa: SIM115  (the child writes to it for its lifetime)
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightwire.torch_side.server", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = READY.match(lines[-1])
            if m and not url:
                url.append(m.group(1))
                found.set()
        found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(START_TIMEOUT_S) or not url:
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"server did not print its ready line; stdout={lines!r}\n{log_path.read_text()[-4000:]}")
    return ServerProc(proc, url[0], log_path, lines)


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
