"""Run ``_sender.py`` as a separate process and read its JSON lines with timeouts; start the
stub vLLM worker (``vllm_stub``) as a loopback process."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from typing import Any

from weightwire.testing.loopback import LoopbackClient, spawn_loopback_cmd

SENDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sender.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn_stub(
    backend: str,
    device: str,
    shape: str,
    *extra: str,
    env: dict[str, str] | None = None,
    timeout: float,
) -> tuple[subprocess.Popen, LoopbackClient]:
    """The stub vLLM worker receiving over ``backend`` on ``device`` into a model of ``shape``
    (``extra``: its other flags), this tree first on its path; its process and client."""
    args = ["-m", "tests.torch_side.vllm_stub", "--backend", backend, "--device", device]
    path = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return spawn_loopback_cmd(
        [*args, "--shape", shape, *extra], env={**path, **(env or {})}, timeout=timeout
    )


class SenderProcess:
    """A trainer stand-in process; every read is bounded, and it is always killed."""

    def __init__(self, config: dict[str, Any]) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, SENDER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def read(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"sender said nothing for {timeout}s") from None
        if line is None:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"sender exited (rc={self.proc.poll()}): {err[-2000:]}")
        return json.loads(line)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
