"""A command in miniature for tests/cli/test_signals.py: ``guarded`` + ``stop_on_signals`` around
a child started with ``child_env`` that calls ``die_with_parent`` (as the demo's server does).

Prints the child's pid, then ``ready``, then waits. A SIGKILLed parent runs no clean-up: the
child must then go through the parent-death signal alone."""

from __future__ import annotations

import subprocess
import sys
import time

from weightwire._lifetime import child_env, stop_on_signals
from weightwire.tools._cli import guarded

CHILD = (
    "import time; from weightwire._lifetime import die_with_parent; die_with_parent(); "
    "print('child up', flush=True); time.sleep(600)"
)


def body() -> int:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()
        print(child.pid, flush=True)
        print("ready", flush=True)
        time.sleep(600)
    finally:
        child.terminate()
        child.wait(timeout=30)
    return 0


if __name__ == "__main__":
    stop_on_signals()
    sys.exit(guarded("weightwire stoppable", body))
