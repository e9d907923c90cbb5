"""Stopping a command stops its children: SIGTERM and SIGHUP unwind like Ctrl-C (one line,
exit 128 + the signal, no traceback), and a child started by a command goes when its parent
dies, even a SIGKILLed one (``weightwire._lifetime``). Process-level: real signals, real pids."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.conftest import start_weightwire

ROOT = Path(__file__).resolve().parents[2]
STOPPABLE = [sys.executable, "-m", "tests.cli._stoppable"]


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux /proc)."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(kids - found)
            found |= kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    """The pids still alive after waiting up to ``seconds`` (a bound, not a timing claim)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _sigterm_once_ready(
    proc: subprocess.Popen[str], ready: str, *, timeout: float
) -> tuple[str, set[int], set[int]]:
    """Read ``proc``'s output up to a line starting with ``ready``, then SIGTERM it (what
    ``timeout``, ``kill`` and a CI cancellation send) and wait ``timeout`` for it to exit.
    Its stderr, the processes below it when it was signalled, and those of them still
    running 30 s later (killed now, so a failed case leaves none)."""
    children: set[int] = set()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the test timeout bounds this
            if line.startswith(ready):
                break
        children = _descendants(proc.pid)
        proc.terminate()
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    left = _gone_within(children, 30)
    _kill_all(left)
    return err, children, left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_unwinds_the_command_and_its_child(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        STOPPABLE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "ready" and _alive(child)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    left = _gone_within({child}, 30)
    _kill_all(left)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert (
        err.strip()
        == f"weightwire stoppable: stopped by {sig.name}; its child processes were stopped"
    ), err
    assert left == set()


def test_a_child_goes_when_its_parent_is_killed() -> None:
    # SIGKILL runs no clean-up in the parent: only the kernel's parent-death signal stops the child.
    proc = subprocess.Popen(
        STOPPABLE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait(timeout=30)
    left = _gone_within({child}, 30)
    _kill_all(left)
    assert left == set()


def test_sigterm_stops_the_demo_and_its_server_in_one_line() -> None:
    proc = start_weightwire("demo", "--steps", "50")
    # "step-0 weights": the server served the first check, so it and its worker run.
    err, children, left = _sigterm_once_ready(proc, "step-0 weights", timeout=120)
    assert len(children) >= 2, children  # the reference server and its worker
    assert proc.returncode == 143, (proc.returncode, err)
    assert (
        err.strip().splitlines()[-1]
        == "weightwire demo: stopped by SIGTERM; its child processes were stopped"
    )
    assert "Traceback" not in err, err
    assert left == set(), "the demo's server outlived it"


def test_sigterm_stops_serve_with_one_line(tiny_dir: str) -> None:
    proc = start_weightwire("serve", "--model", tiny_dir, "--port", "0")
    err, workers, left = _sigterm_once_ready(proc, "weightwire server ready on ", timeout=60)
    assert workers, "no worker process"
    assert proc.returncode == 0, err
    assert (
        err.strip().splitlines()[-1]
        == "weightwire serve: stopped by SIGTERM; the workers were closed"
    ), err
    assert "Traceback" not in err and left == set()
