"""Child processes the demo starts: the tiny model build and the embedded reference server.

Both run in subprocesses so the demo's own process (the JAX trainer) never imports
torch, as on a real torch-free trainer host. Every wait is bounded; a child that dies
is reported with the tail of its stderr.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from weightwire._lifetime import child_env
from weightwire.backends.tcp.spec import TCP
from weightwire.shared.errors import WeightwireError

READY_RE = re.compile(r"weightwire server ready on (http://\S+)")
"""The one line ``python -m weightwire.tools.server`` prints once it serves."""


class ChildError(WeightwireError, RuntimeError):
    """A child process failed or did not get ready in time."""


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def build_tiny_model(name: str = "tiny-llama", *, seed: int = 0, timeout: float = 600.0) -> str:
    """Path of the cached tiny model directory, built on first use (in a child: needs torch)."""
    code = (
        "import sys; from weightwire.tools.server.tiny import tiny_model_dir; "
        "print(tiny_model_dir(sys.argv[1], int(sys.argv[2])))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, name, str(seed)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ChildError(f"building {name} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        raise ChildError(f"building {name} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    path = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    if not (Path(path) / "config.json").is_file():
        raise ChildError(f"building {name} printed {path!r}, not a model directory")
    return path


class ReadyLine:
    """Reads a server child's stdout for the child's whole life (a full pipe would block
    it), keeps every line in ``lines`` and notes the URL of the first ready line.

    Every launcher of the reference server (the demo's, the tests', the soak's) waits on
    this, so the ready line is parsed in one place.
    """

    def __init__(
        self, proc: subprocess.Popen[str], *, name: str = "weightwire-server-stdout"
    ) -> None:
        self.lines: list[str] = []
        self.url: str | None = None
        self._done = threading.Event()  # the ready line came, or stdout closed
        threading.Thread(target=self._pump, args=(proc,), name=name, daemon=True).start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = READY_RE.search(line) if self.url is None else None
            if m:
                self.url = m.group(1)
                self._done.set()
        self._done.set()

    def wait(self, timeout: float) -> bool:
        """True once the ready line came or stdout closed within ``timeout`` (then read ``url``)."""
        return self._done.wait(timeout)


class EmbeddedServer:
    """``python -m weightwire.tools.server`` in a child process, on a free port.

    Use as a context manager; ``url`` is set once the server printed its ready line.
    """

    def __init__(
        self,
        model: str,
        *,
        backend: str = TCP.name,
        device: str = "cpu",
        cuda_visible_devices: str | None = None,
        threads: int | None = 1,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 300.0,
    ) -> None:
        self.model = model
        """A model directory or a tiny model name (the server resolves it)."""
        self.backend = backend
        self.device = device
        self.cuda_visible_devices = cuda_visible_devices
        self.threads = threads
        self.extra_args = list(extra_args)
        """torch threads per worker. One by default: a tiny model gains nothing from more, and on a
        small host extra OpenMP threads contend with the trainer (measured: 16 prompts x 16 tokens
        took 2-3 s with 2 threads under load, 0.15 s with 1)."""
        self.startup_timeout = startup_timeout
        self.url: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._ready: ReadyLine | None = None
        self._deadline = 0.0
        self._log = Path(tempfile.mkstemp(prefix="weightwire-demo-server-", suffix=".log")[1])

    @property
    def log_path(self) -> Path:
        return self._log

    def start(self) -> str:
        """Launch and wait until ready (``launch`` + ``wait_ready``)."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> None:
        """Start the child and return at once (the caller may work while it loads)."""
        cmd = [
            sys.executable,
            "-m",
            "weightwire.tools.server",
            "--model",
            self.model,
            "--port",
            "0",
            "--backend",
            self.backend,
            "--device",
            self.device,
        ]
        if self.threads is not None:
            cmd += ["--threads", str(self.threads)]
        cmd += self.extra_args
        env = (
            child_env()
        )  # the server goes when this process goes, even SIGKILLed (weightwire._lifetime)
        if self.cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True
            )
        self._deadline = time.monotonic() + self.startup_timeout
        self._ready = ReadyLine(self._proc, name="weightwire-demo-server-stdout")

    def wait_ready(self) -> str:
        """Block until the ready line (bounded by ``startup_timeout`` from ``launch``)."""
        if self._proc is None or self._ready is None:
            raise ChildError("the reference server was not launched")
        while not self._ready.wait(0.1):
            if time.monotonic() > self._deadline:
                self.stop()
                raise ChildError(
                    f"the reference server did not get ready within {self.startup_timeout:.0f} s; "
                    f"its log:\n{_tail(self._log)}"
                )
        if self._ready.url is None:
            code = self._proc.wait(timeout=10)
            raise ChildError(
                f"the reference server exited (code {code}) before it was ready; its log:\n"
                f"{_tail(self._log)}"
            )
        self.url = self._ready.url
        return self.url

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # the server stops its workers on SIGTERM
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Its own session (start_new_session): the group holds only the server and its workers.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if exc[0] is None:
            self._log.unlink(missing_ok=True)
