"""The one launcher of reference-server processes the server and fault suites build on:
``python -m weightwire.tools.server --port 0 ARGS``, its stderr to a log file, waited on
(bounded) until it prints its ready line."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from weightwire.tools.demo.server import ReadyLine


def start_server(
    args: Sequence[str],
    log_path: Path,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    own_group: bool = False,
) -> tuple[subprocess.Popen[str], str, list[str]]:
    """The started server, its URL and the stdout lines up to its ready line. ``env`` is laid over
    this process's environment; ``own_group`` starts it in its own session, so that a test can
    signal the server and all its workers at once. A server not ready within ``timeout`` is
    killed (its whole group with ``own_group``) and the error carries its output."""
    log = open(log_path, "w")  # noqa: SIM115  (the child writes to it for its whole life)
    proc = subprocess.Popen(
        [sys.executable, "-m", "weightwire.tools.server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=own_group,
        env={**os.environ, **(env or {})},
    )
    ready = ReadyLine(proc)
    if not ready.wait(timeout) or ready.url is None:
        if own_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(10)
        raise RuntimeError(
            f"server did not print its ready line within {timeout:.0f} s; "
            f"stdout={ready.lines!r}\n{log_path.read_text(errors='replace')[-4000:]}"
        )
    return proc, ready.url, ready.lines
