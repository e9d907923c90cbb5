"""Reference-server processes for the fault suite: start (own process group, loopback,
``--api-key``, short worker-side timeouts), signal, find workers, read listening sockets."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults.harness import API_KEY, FAULT_TIMEOUTS
from tests.server_launch import start_server

START_TIMEOUT_S = 180.0
LAUNCHED: list[Server] = []
"""Every server this test session started (the security checks read all their logs)."""


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    return kids


@dataclass
class Server:
    """One ``python -m weightwire.tools.server`` in its own session/process group."""

    proc: subprocess.Popen[str]
    url: str
    log_path: Path
    stdout: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def worker_pids(self) -> dict[int, int]:
        """Replica index -> pid, read from each worker's command line (its JSON spec)."""
        out: dict[int, int] = {}
        for pid in _children(self.pid):
            with contextlib.suppress(OSError, ValueError, KeyError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if b"weightwire.tools.server.worker_proc" in argv:
                    out[
                        json.loads(argv[argv.index(b"weightwire.tools.server.worker_proc") + 1])[
                            "index"
                        ]
                    ] = pid
        return out

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the API process and every worker at once (a crashed host)."""
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal_group(signal.SIGCONT)  # a stopped group cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.signal_group(signal.SIGKILL)  # workers, should any remain

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def launch(
    model: str | Path,
    log_path: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    api_key: str | None = API_KEY,
) -> Server:
    """Start a server on a free port (loopback unless ``--host`` is in ``extra``; the API key in
    ``$WEIGHTWIRE_API_KEY``, never on a command line); wait
    (bounded) for its ready line. Its stderr (logs of the API and every worker) goes to
    ``log_path``; its stdout is kept in ``Server.stdout``."""
    # The workers bound their own rendezvous and warm-up (Timeouts.from_env): short here too.
    short = {f"WEIGHTWIRE_TIMEOUT_{k.upper()}": str(v) for k, v in vars(FAULT_TIMEOUTS).items()}
    proc, url, lines = start_server(
        ["--model", str(model), "--backend", "weightwire_tcp", *extra],
        log_path,
        timeout=START_TIMEOUT_S,
        env={
            "TOKENIZERS_PARALLELISM": "false",
            **short,
            **({"WEIGHTWIRE_API_KEY": api_key} if api_key else {}),
            **(env or {}),
        },
        own_group=True,
    )
    server = Server(proc, url, log_path, lines)
    LAUNCHED.append(server)
    return server


@contextlib.contextmanager
def serving(
    model: str | Path,
    log_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """A fixture's own server (``launch`` with ``extra``, its log in ``log_dir``), stopped when
    the fixture is torn down."""
    server = launch(model, log_dir / "server.log", *extra, env=env)
    yield server
    server.stop()


def listening_sockets(pid: int | str = "self") -> set[str]:
    """``host:port`` of every TCP socket in LISTEN state owned by ``pid`` (from /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: TCP_LISTEN
                    addr, port = cols[1].split(":")
                    host = _proc_addr(addr, width)
                    out.add(f"{host if width == 8 else f'[{host}]'}:{int(port, 16)}")
    return out


def _proc_addr(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    # /proc prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)) if width == 8 else str(ipaddress.IPv6Address(raw))
