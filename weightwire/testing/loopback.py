"""Loopback control shim: drive a standalone worker engine without HTTP.

For GPU tests and benchmarks on machines without fastapi/uvicorn: a receiver process
hosts one weightwire worker engine (``WeightwireNCCLEngine`` / ``WeightwireTCPEngine``)
loading into a ``TensorStoreHost``, and answers the weight-sync calls over a local
socket; ``LoopbackClient`` speaks the same calls as ``HTTPWeightSyncClient``, so a
trainer engine cannot tell the difference.

Protocol: one JSON line each way per request (no pickle), one request at a time on a
connection; the client keeps its connections open across calls (a fresh connection per call
would add a connect and a server thread to every call of a round):
``{"op": "<route name>", "body": {...}}`` -> ``{"ok": true, "result": ...}`` or
``{"ok": false, "status": 400|500, "error": "..."}``.

Run a receiver::

    python -m weightwire.testing.loopback --backend weightwire_nccl --device cuda:0

It prints ``weightwire loopback ready on HOST:PORT``; ``spawn_loopback`` starts one
and waits for that line. Only this module's ``serve`` imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from weightwire import backends
from weightwire.shared.errors import WeightSyncError

READY = "weightwire loopback ready on "
LOOPBACK_VERSION = "0.33.0+weightwire.loopback"
_MAX_LINE = 256 << 20  # an update info for a very large model is a few MB of JSON


def _send_line(sock: socket.socket, obj: Any) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_line(sock: socket.socket) -> Any:
    with sock.makefile("rb") as f:
        line = f.readline(_MAX_LINE + 1)
    if not line.endswith(b"\n"):
        raise ValueError("loopback peer closed the connection or sent an over-long line")
    return json.loads(line)


class LoopbackClient:
    """Client half: the ``HTTPWeightSyncClient`` call set over the loopback socket."""

    def __init__(self, address: str, *, timeout: float = 300.0) -> None:
        host, _, port = address.rpartition(":")
        self.address, self._host, self._port, self.timeout = address, host, int(port), timeout
        self._idle: list[socket.socket] = []  # kept-alive connections, one call at a time each
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LoopbackClient({self.address!r})"

    def _connection(self) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.create_connection((self._host, self._port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def call(self, op: str, body: Mapping[str, Any] | None = None) -> Any:
        try:
            sock = self._connection()
        except OSError as exc:
            raise WeightSyncError(op, None, f"{type(exc).__name__}: {exc}", self.address) from None
        try:
            _send_line(sock, {"op": op, "body": dict(body or {})})
            reply = _recv_line(sock)
        except (OSError, ValueError) as exc:
            sock.close()  # its state is unknown: never reused
            raise WeightSyncError(op, None, f"{type(exc).__name__}: {exc}", self.address) from None
        with self._lock:
            self._idle.append(sock)
        if not reply.get("ok"):
            raise WeightSyncError(
                op, reply.get("status", 500), str(reply.get("error")), self.address
            )
        return reply.get("result")

    def close(self) -> None:
        """Close the kept-alive connections (a later call opens a new one)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def version(self) -> str:
        return self.call("version")["version"]

    def get_world_size(self) -> int:
        return int(self.call("get_world_size")["world_size"])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call(
            "finish_weight_update",
            {} if weight_version is None else {"weight_version": weight_version},
        )

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")

    def weight_info(self) -> list[dict[str, Any]]:
        return [self.call("weight_info")]

    def weight_checker(
        self, action: str, baseline: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        return [self.call("weight_checker", {"action": action, "baseline": baseline})]

    def pause(self, mode: str = "keep") -> None:
        self.call("pause", {"mode": mode})

    def resume(self) -> None:
        self.call("resume")

    def reset_prefix_cache(self) -> list[bool]:
        """The receiver loads into a tensor store: no KV is ever computed, nothing to reset."""
        return [True]

    def stats(self) -> dict[str, Any] | None:
        """The receiver's last ``update_weights`` statistics (tensors, bytes, seconds)."""
        return self.call("stats")

    def exit(self) -> None:
        self.call("exit")


def spawn_loopback(
    backend: str, device: str, *, env: Mapping[str, str] | None = None, timeout: float = 120.0
) -> tuple[subprocess.Popen, LoopbackClient]:
    """Start a receiver process and return it with a connected client (kill it when done)."""
    return spawn_loopback_cmd(
        ["-m", "weightwire.testing.loopback", "--backend", backend, "--device", device],
        env=env,
        timeout=timeout,
    )


def spawn_loopback_cmd(
    args: list[str], *, env: Mapping[str, str] | None = None, timeout: float = 120.0
) -> tuple[subprocess.Popen, LoopbackClient]:
    """``spawn_loopback`` for any receiver that speaks this protocol: ``python *args``, which
    must print the ready line."""
    cmd = [sys.executable, *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    found: list[str] = []
    seen: list[str] = []

    def scan() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(READY) and not found:
                found.append(line[len(READY) :].strip())
        # keep draining so the child never blocks on a full pipe

    threading.Thread(target=scan, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if not found:
        proc.kill()
        raise RuntimeError(
            f"loopback receiver did not start within {timeout} s:\n{''.join(seen)[-4000:]}"
        )
    return proc, LoopbackClient(found[0])


# ----------------------------------------------------------------------------- receiver


class TensorStoreHost:
    """A model stand-in: keeps every received tensor (a copy) by name, per round.

    Staged per round (``begin_round`` / ``commit_round`` / ``abort_round``) like the
    reference server's host, so a failed round leaves the previous weights intact.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}
        self._staged: dict[str, Any] | None = None
        self._patches: list[Any] = []

    def begin_round(self) -> None:
        self._staged = {}
        self._patches = []

    def check_patches(self, patches: Any) -> None:
        """Refuse (before any byte) a patch of a tensor this store never received."""
        unknown = [p.name for p in patches if p.name not in self.tensors]
        if unknown:
            raise ValueError(f"TensorStoreHost: no tensor {unknown[0]!r} to patch")

    def patch_weights(self, patches: Any) -> None:
        """A delta round's patches (``torch_side.worker.delta.StagedPatch``): applied at
        ``commit_round``, after the round's dense tensors."""
        self._patches = list(patches)

    def load_weights(self, weights: Any) -> set[str]:
        target = self.tensors if self._staged is None else self._staged
        names = set()
        for name, tensor in weights:
            target[name] = tensor.detach().clone()  # the engine may reuse its receive buffer
            names.add(name)
        return names

    def commit_round(self) -> int:
        from weightwire.torch_side.worker.delta import patch_tensor

        staged, self._staged = self._staged or {}, None
        patches, self._patches = self._patches, []
        self.tensors.update(staged)
        for p in patches:
            patch_tensor(self.tensors[p.name], p.index, p.values)  # a tensor of its own
        return len(staged) + len(patches)

    def abort_round(self) -> None:
        self._staged = None
        self._patches = []

    def state_checksums(self) -> dict[str, str]:
        from weightwire.torch_side.worker.hf_host import tensor_sha256

        return {name: tensor_sha256(t) for name, t in self.tensors.items()}


def serve(backend: str, device: str, *, host: str = "127.0.0.1", port: int = 0) -> None:
    import torch

    # Stock nccl is received by the weightwire_nccl engine here (the registry says so).
    engine_cls = backends.worker_engine(backend)
    store = TensorStoreHost()
    engine = engine_cls.standalone(model=store, device=torch.device(device))
    state: dict[str, Any] = {"version": "default", "paused": False}
    lock, done = threading.Lock(), threading.Event()

    def run(op: str, body: dict[str, Any]) -> Any:
        if op == "version":
            return {"version": LOOPBACK_VERSION}
        if op == "get_world_size":
            return {"world_size": 1}
        if op in ("pause", "resume"):
            state["paused"] = op == "pause"
            return {"status": op}
        if op == "weight_info":
            return {"weight_version": state["version"]}
        if op == "exit":
            done.set()
            return None
        with lock:  # session calls are serialized, as a worker's RPC queue would
            if op == "init_weight_transfer_engine":
                engine.init_transfer_engine(engine.parse_init_info(body["init_info"]))
            elif op == "start_weight_update":
                engine.start_weight_update()
            elif op == "update_weights":
                engine.update_weights(body["update_info"])
            elif op == "finish_weight_update":
                engine.finish_weight_update()
                if body.get("weight_version") is not None:
                    state["version"] = body["weight_version"]
            elif op == "shutdown_weight_transfer_engine":
                engine.shutdown()
            elif op == "weight_checker":
                return {"checksums": store.state_checksums()}
            elif (
                op == "memory"
            ):  # worker-side device memory: what a colocated budget must leave free
                dev = torch.device(device)
                if dev.type != "cuda":
                    return None
                return {
                    "allocated": torch.cuda.memory_allocated(dev),
                    "peak": torch.cuda.max_memory_allocated(dev),
                }
            elif op == "stats":
                stats = engine.last_stats
                return (
                    None
                    if stats is None
                    else {k: v for k, v in vars(stats).items() if isinstance(v, (int, float, str))}
                )
            else:
                raise ValueError(f"unknown op {op!r}")
        return None

    serve_ops(run, done, host=host, port=port)
    engine.shutdown()


def serve_ops(
    run: Callable[[str, dict[str, Any]], Any],
    done: threading.Event,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
) -> None:
    """Answer each JSON line of a connection with ``run(op, body)`` until ``done`` is set;
    prints ``READY host:port`` first (what ``spawn_loopback_cmd`` waits for)."""

    def handle(conn: socket.socket) -> None:
        with conn:  # one request at a time until the client closes the connection
            while not done.is_set():
                try:
                    with conn.makefile("rb") as f:
                        line = f.readline(_MAX_LINE + 1)
                except OSError:
                    return
                if not line:  # the client closed the connection
                    return
                try:
                    if not line.endswith(b"\n"):
                        raise ValueError("over-long or unterminated request line")
                    request = json.loads(line)
                    result = run(str(request["op"]), request.get("body") or {})
                    reply = {"ok": True, "result": result}
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "status": 400, "error": f"{type(exc).__name__}: {exc}"}
                except Exception as exc:
                    reply = {"ok": False, "status": 500, "error": f"{type(exc).__name__}: {exc}"}
                try:
                    _send_line(conn, reply)
                except OSError:  # the client gave up; nothing to tell it
                    return

    listener = socket.create_server((host, port))
    listener.settimeout(0.2)
    print(f"{READY}{host}:{listener.getsockname()[1]}", flush=True)
    with listener:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=backends.BACKEND_NAMES, required=True)
    parser.add_argument("--device", default="cpu", help="torch device of the receiver, e.g. cuda:0")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    serve(args.backend, args.device, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
