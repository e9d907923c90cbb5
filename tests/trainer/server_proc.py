"""Start the weightwire reference server as a subprocess (always bounded, always killed)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

READY = "weightwire server ready on "


@contextmanager
def reference_server(*args: str, timeout: float = 180.0) -> Iterator[str]:
    """``python -m weightwire.torch_side.server ARGS --port 0``; yields its base URL."""
    cmd = [sys.executable, "-m", "weightwire.torch_side.server", *args, "--port", "0"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    url: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # keeps draining so the server never blocks on its pipe
            lines.append(line)
            if line.startswith(READY) and not url:
                url.append(line[len(READY):].strip())

    threading.Thread(target=pump, daemon=True).start()
    try:
        deadline = time.monotonic() + timeout
        while not url and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not url:
            raise RuntimeError(f"reference server did not become ready (rc={proc.poll()}):\n{''.join(lines)[-4000:]}")
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
