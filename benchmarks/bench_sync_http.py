"""HTTP control plane for ``bench_sync.py --control http``: the reference server's routes
(``weightwire.torch_side.server.app.create_app``: validation, session rules, fan-out)
served by uvicorn inside the benchmark's receiver process.

The server's replicas normally are worker processes holding an HF model; here one
in-process "replica" drives the receiver's ``WeightwireNCCLEngine`` (loading into the
benchmark's ``Sink``), so an 8B-shaped synthetic set needs no 16 GB checkpoint on
disk. What is measured is everything a trainer's round trip pays on loopback:
``HTTPWeightSyncClient`` (httpx), uvicorn, FastAPI routing, body validation, the
session lock and the fan-out; not the reference server's JSON pipe to its worker
processes (a vLLM server has its own, different hop there).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Replica:
    index: int = 0
    info: dict[str, Any] = field(default_factory=lambda: {"device": "cuda:0"})
    alive: bool = True


class InProcessPool:
    """The part of ``ReplicaPool`` the weight routes use, over one in-process engine."""

    def __init__(self, receiver: Any) -> None:
        self._receiver = receiver
        self.replicas = [_Replica()]

    def __len__(self) -> int:
        return 1

    def health(self) -> list[dict[str, Any]]:
        return [{"replica": 0, "alive": True, "generations_in_flight": 0, "error": None}]

    async def fan_out(self, op: str, args: Any = None, *, timeout: float, abort_on_failure: bool = False) -> list[Any]:
        from weightwire.torch_side.server.replicas import FanOutError, ReplicaError  # noqa: PLC0415

        one = (args[0] if isinstance(args, list) else args) or {}
        try:
            result = await asyncio.wait_for(asyncio.to_thread(self._receiver.op, op, one), timeout)
        except Exception as exc:
            if abort_on_failure:
                await self.abort_all()
            raise FanOutError(op, [ReplicaError(0, "error", f"{type(exc).__name__}: {exc}")]) from None
        return [result]

    async def abort_all(self, timeout: float = 30.0) -> None:
        await asyncio.to_thread(self._receiver.abort)


def serve_http(receiver: Any, *, timeout: float = 60.0) -> tuple[str, Any]:
    """Start the reference server's app for ``receiver`` on a loopback port; returns
    ``(url, uvicorn.Server)``."""
    import uvicorn  # noqa: PLC0415

    from weightwire.torch_side.server import _bind  # noqa: PLC0415  (the server's own socket set-up: TCP_NODELAY)
    from weightwire.torch_side.server.app import ServerOptions, ServerState, create_app  # noqa: PLC0415

    app = create_app(ServerState(pool=InProcessPool(receiver), options=ServerOptions(backend="weightwire_nccl")))
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                           server_header=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="bench-http").start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start within the timeout")
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server
