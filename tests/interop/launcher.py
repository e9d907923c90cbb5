"""Starts and stops real vLLM servers for the interop lane, one model at a time.

Each model gets one vLLM (``python -m vllm.entrypoints.openai.api_server`` from the
interop venv, dev-mode weight-sync routes, the plugin's ``weightwire_tcp`` backend,
offline, float32, caches in a scratch dir), shared by every test of that model and
stopped (its whole process group) when a test asks for another model or the session
ends. A server that dies is reported with the tail of its log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.interop.helpers import VLLMServer

STARTUP_TIMEOUT_S = float(os.environ.get("WEIGHTWIRE_INTEROP_STARTUP_TIMEOUT", "300"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningVLLM:
    name: str
    server: VLLMServer
    proc: subprocess.Popen[bytes]
    log: Path
    startup_s: float

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)


@dataclass
class Launcher:
    """At most one vLLM alive; ``get(name, model_dir)`` reuses it or replaces it."""

    venv: Path
    scratch: Path
    current: RunningVLLM | None = None
    startups: dict[str, float] = field(default_factory=dict)

    def get(self, name: str, model_dir: str) -> RunningVLLM:
        if self.current is not None and self.current.name == name:
            if not self.current.alive():
                raise RuntimeError(f"vLLM for {name} died; log tail:\n{self.current.log_tail()}")
            return self.current
        self.close()
        self.current = self._start(name, model_dir)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None

    def _start(self, name: str, model_dir: str) -> RunningVLLM:
        port = _free_port()
        root = self.scratch / name
        for sub in ("tmp", "vllm-cache", "xdg", "inductor"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "TMPDIR": str(root / "tmp"), "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
            "XDG_CACHE_HOME": str(root / "xdg"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        }
        env.pop("PYTHONPATH", None)  # the venv's editable install is the code under test
        log = root / "vllm.log"
        cmd = [
            str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model_dir, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
            "--dtype", "float32", "--max-model-len", "256",
            "--weight-transfer-config", '{"backend": "weightwire_tcp"}',
        ]
        started = time.monotonic()
        with log.open("wb") as out:
            # New session: the API server, engine core and workers form one process group.
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        running = RunningVLLM(name, VLLMServer(url, model_dir), proc, log, 0.0)
        deadline = started + STARTUP_TIMEOUT_S
        while True:
            if not running.alive():
                raise RuntimeError(f"vLLM for {name} exited before it was ready; log tail:\n{running.log_tail()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                running.stop()
                raise RuntimeError(f"vLLM for {name} not ready within {STARTUP_TIMEOUT_S:.0f} s; log tail:\n"
                                   f"{running.log_tail()}")
            time.sleep(1)
        running.startup_s = time.monotonic() - started
        self.startups[name] = running.startup_s
        return running
