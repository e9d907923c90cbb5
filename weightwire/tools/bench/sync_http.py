"""HTTP control plane for ``bench_sync.py --control http``: the reference server's routes
(``weightwire.tools.server.app.create_app``: validation, session rules, fan-out)
served by uvicorn in their own process, as in the reference server and in vLLM (API
server and GPU workers are separate processes: the worker's receive loop never
competes with the HTTP stack for one interpreter).

The server's replicas normally are worker processes holding an HF model; here the one
"replica" is the benchmark's receiver process (``WeightwireNCCLEngine`` loading into a
``Sink``), reached over the shim's local socket, so an 8B-shaped synthetic set needs no
16 GB checkpoint on disk. What a trainer's round trip pays on loopback is all here:
``HTTPWeightSyncClient`` (httpx), uvicorn, FastAPI routing, body validation, the
session lock, the fan-out and one local hop to the worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from weightwire.tools.server.replicas import ReplicaPool

from weightwire.backends.nccl.spec import WEIGHTWIRE_NCCL


@dataclass
class _Replica:
    """The one replica, as the routes that ask a replica alone see it (``Replica.call``)."""

    receiver: Any
    index: int = 0
    info: dict[str, Any] = field(default_factory=lambda: {"device": "cuda:0"})
    alive: bool = True

    async def call(self, op: str, args: dict[str, Any] | None = None, *, timeout: float) -> Any:
        from weightwire.tools.server.replica import ReplicaError

        try:
            async with asyncio.timeout(timeout):
                return await self.receiver.call(op, args or {})
        except Exception as exc:  # what a worker's failed call is to the routes
            raise ReplicaError(self.index, "error", f"{type(exc).__name__}: {exc}") from None


class ShimReceiver:
    """The receiver process's worker operations over one kept-open shim connection
    (like the reference server's pipe to a worker: no connect, no thread hop per call);
    an abort goes over a fresh connection so it can overtake an update in flight."""

    def __init__(self, port: int, timeout: float) -> None:
        self.port, self.timeout = port, timeout
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock: asyncio.Lock | None = None

    async def call(self, op: str, args: dict[str, Any]) -> Any:
        import json

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is None:
                self._conn = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 26)
            reader, writer = self._conn
            writer.write((json.dumps({"call": f"op:{op}", "args": args}) + "\n").encode())
            await writer.drain()
            line = await reader.readline()
        if not line:
            self._conn = None
            raise ConnectionError(f"receiver closed the connection during {op}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply.get("result")

    def abort(self) -> None:
        from weightwire.tools.bench.sync_shim import rpc

        rpc(self.port, "abort", self.timeout)


class InProcessPool:
    """The part of ``ReplicaPool`` the weight routes use, over one receiver."""

    def __init__(self, receiver: Any) -> None:
        self._receiver = receiver
        self.replicas = [_Replica(receiver)]

    def __len__(self) -> int:
        return 1

    def health(self) -> list[dict[str, Any]]:
        return [{"replica": 0, "alive": True, "generations_in_flight": 0, "error": None}]

    async def fan_out(
        self, op: str, args: Any = None, *, timeout: float, abort_on_failure: bool = False
    ) -> list[Any]:
        from weightwire.tools.server.replica import ReplicaError
        from weightwire.tools.server.replicas import FanOutError

        one = (args[0] if isinstance(args, list) else args) or {}
        try:
            async with asyncio.timeout(timeout):  # not wait_for: no task per call
                result = await self._receiver.call(op, one)
        except Exception as exc:
            if abort_on_failure:
                await self.abort_all()
            raise FanOutError(
                op, [ReplicaError(0, "error", f"{type(exc).__name__}: {exc}")]
            ) from None
        return [result]

    def post(self, op: str) -> None:
        """A request nobody awaits: only a start's cancel, and the receiver runs no
        generation to cancel (a worker answers it on arrival), so nothing is sent."""

    async def abort_all(self, timeout: float = 30.0) -> None:
        await asyncio.to_thread(self._receiver.abort)


def serve_http(
    receiver: Any, *, timeout: float = 60.0, backend: str = WEIGHTWIRE_NCCL.name
) -> tuple[str, Any]:
    """Start the reference server's app for ``receiver`` on a loopback port; returns
    ``(url, uvicorn.Server)``."""
    import uvicorn

    from weightwire.tools.server import _bind  # the server's own socket set-up: TCP_NODELAY
    from weightwire.tools.server.app import ServerOptions, ServerState, create_app

    # InProcessPool has the part of ReplicaPool the weight routes use (duck-typed stand-in).
    pool = cast("ReplicaPool", InProcessPool(receiver))
    app = create_app(ServerState(pool=pool, options=ServerOptions(backend=backend)))
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", server_header=False
        )
    )
    threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="bench-http"
    ).start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start within the timeout")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server


def api_main(cfg: dict[str, Any]) -> None:
    """The API-server process: serve the routes until the deadline, forwarding to the receiver."""
    import json
    import os
    from pathlib import Path

    url, _ = serve_http(
        ShimReceiver(cfg["port"], cfg["timeout"]),
        backend=cfg.get("backend", WEIGHTWIRE_NCCL.name),
    )
    Path(cfg["url_file"] + ".tmp").write_text(json.dumps({"url": url}))
    os.replace(cfg["url_file"] + ".tmp", cfg["url_file"])
    time.sleep(max(0.0, cfg["deadline"] - time.time()))
    os._exit(0)
