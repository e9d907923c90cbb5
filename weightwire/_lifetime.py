"""Child processes that never outlive their parent, and commands that stop cleanly on SIGTERM.

Why: ``timeout``, CI cancellation, ``systemd`` and a plain ``kill`` send SIGTERM (a closed
terminal sends SIGHUP), and Python's default action for both is to die at once, running no
``finally`` block: a command's children (the demo's embedded server, the server's workers)
would keep running and keep their ports. So a command turns these signals into the same
unwinding as Ctrl-C (``stop_on_signals``), and every child additionally asks the kernel to
signal it when its parent dies (``die_with_parent``), which also covers a SIGKILLed parent.

The kernel call is ``prctl(PR_SET_PDEATHSIG)`` through ctypes: the standard library has no
wrapper, and a ``preexec_fn`` doing it in the launcher is unsafe with threads. The kernel
sends the signal when the *thread* that forked the child exits, so launchers ask for it only
from the main thread (``PDEATHSIG_ENV``); a parent-pid watch thread covers the rest (and
non-Linux hosts), with a second of latency.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from types import FrameType

PARENT_ENV = "WEIGHTWIRE_PARENT_PID"
"""Set by a launcher to its pid: the child exits when its parent is no longer that process."""
PDEATHSIG_ENV = "WEIGHTWIRE_PDEATHSIG"
"""Set to ``1`` by a launcher forking from its main thread: the child may use the kernel's
parent-death signal."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_received: list[int] = []


def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) plus what tells a child to die with this process."""
    env = dict(os.environ if environ is None else environ)
    env[PARENT_ENV] = str(os.getpid())
    if threading.current_thread() is threading.main_thread():
        env[PDEATHSIG_ENV] = "1"
    else:
        env.pop(PDEATHSIG_ENV, None)
    return env


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1  # <linux/prctl.h>
        return libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, sig: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)
            time.sleep(
                5.0
            )  # a handler that unwinds gets that long, then the process goes regardless
            os._exit(128 + sig)


def die_with_parent(
    sig: int = signal.SIGTERM, *, parent: int | None = None, kernel: bool | None = None
) -> None:
    """Receive ``sig`` when the parent process dies; no-op when no parent is known.

    ``parent``: the launcher's pid; default ``$WEIGHTWIRE_PARENT_PID`` (unset: nothing
    to do). ``kernel``: use ``PR_SET_PDEATHSIG``; default ``$WEIGHTWIRE_PDEATHSIG == "1"``.
    A parent already gone by the time this runs is caught at once (the kernel would not).
    """
    if parent is None:
        raw = os.environ.get(PARENT_ENV, "")
        if not raw.isdigit():
            return
        parent = int(raw)
    if kernel is None:
        kernel = os.environ.get(PDEATHSIG_ENV) == "1"
    if kernel:
        _set_pdeathsig(sig)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
        return
    threading.Thread(
        target=_watch, args=(parent, sig), daemon=True, name="weightwire-parent-watch"
    ).start()


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP unwind the main thread like Ctrl-C (``KeyboardInterrupt``), so every
    ``finally`` and context manager runs and children are stopped in order; ``received()``
    then names the signal. A repeat while unwinding is ignored (the clean-up is bounded)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        first = not _received
        _received.append(signum)
        if first:
            raise KeyboardInterrupt

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def received() -> int | None:
    """The first stop signal ``stop_on_signals`` caught, if any."""
    return _received[0] if _received else None


def raise_if_stopped() -> None:
    """Raise ``KeyboardInterrupt`` again if a stop signal arrived: a ``KeyboardInterrupt`` raised
    inside a garbage-collection callback (JAX has some) is printed and dropped by Python."""
    if _received:
        raise KeyboardInterrupt


def signal_name(sig: int) -> str:
    """``SIGTERM``; ``Ctrl-C (SIGINT)``."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
    return "Ctrl-C (SIGINT)" if sig == signal.SIGINT else name
