"""Test doubles: a vLLM-like HTTP server (httpx.MockTransport), a recording / blocking
communicator registered as a backend, and ``DictSource`` (``weightwire.testing.sources``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import httpx
import numpy as np

from weightwire.backends import register_backend
from weightwire.backends.base import Backend, Rendezvous, RoundSender, SenderCaps, SenderParts
from weightwire.backends.pipelines import host_sender
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.shared.errors import TransferError
from weightwire.shared.timeouts import Timeouts
from weightwire.testing.sources import DictSource as DictSource  # the tests import it from here

FAST = Timeouts(http_s=10, connect_s=5, warmup_s=5, transfer_s=5)
"""The timeouts of a round against these fakes: nothing real is waited on, so short bounds."""


class FakeServer:
    """Answers vLLM's weight-sync routes and records every call.

    ``fail[route] = (status, message)`` makes a route fail; ``hooks[route]`` runs
    inside the request (e.g. to block until the trainer's broadcasts arrive).
    """

    def __init__(self, version: str = "0.33.0", world_size: int = 1) -> None:
        self.version = version
        self.world_size = world_size
        self.calls: list[tuple[str, Any]] = []
        self.fail: dict[str, tuple[int, str]] = {}
        self.hooks: dict[str, Callable[[Any], None]] = {}
        self.weight_version = "default"
        self.checksums: dict[str, str] = {}
        self.guard = False
        """Serve the round guard's status route (``weightwire.vllm_guard``)."""
        self.rpc: list[Any] = []
        """The ``/collective_rpc`` bodies (trainer_init's question to the workers)."""
        self.served: dict[str, Any] | None = None
        """Tell this served model in the init reply, as the reference server does."""
        self.lock = threading.Lock()

    def routes(self) -> list[str]:
        return [r for r, _ in self.calls]

    def bodies(self, route: str) -> list[Any]:
        return [b for r, b in self.calls if r == route]

    def handler(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path.lstrip("/")
        body = json.loads(request.content) if request.content else None
        if request.url.query:
            body = dict(request.url.params)
        if route == "collective_rpc":
            # trainer_init asks a plugin backend's workers what they serve; kept out of ``calls``
            # (the routes a round makes): a vLLM without the plugin's worker method says no
            self.rpc.append(body)
            return httpx.Response(400, json={"error": "no such worker method"})
        with self.lock:
            self.calls.append((route, body))
        if route in self.hooks:
            self.hooks[route](body)
        if route in self.fail:
            status, message = self.fail[route]
            return httpx.Response(status, json={"error": message})
        if route == "version":
            return httpx.Response(200, json={"version": self.version})
        if route == "get_world_size":
            return httpx.Response(200, json={"world_size": self.world_size})
        if route == "finish_weight_update" and body:
            self.weight_version = body["weight_version"]
        if route == "weight_info":
            return httpx.Response(200, json={"weight_version": self.weight_version})
        if route == "weight_checker":
            return httpx.Response(200, json={"checksums": self.checksums})
        if route == "weightwire/round_guard":
            if not self.guard:
                return httpx.Response(404, json={"detail": "Not Found"})
            return httpx.Response(200, json={"guard": "weightwire", "covers": True})
        if route == "reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        if route == "init_weight_transfer_engine" and self.served is not None:
            return httpx.Response(
                200, json={"features": ["served_model"], "served_model": self.served}
            )
        return httpx.Response(200, json={"message": "ok"})

    def client(self, url: str = "http://fake:8000") -> HTTPWeightSyncClient:
        return HTTPWeightSyncClient(url, timeout=10, transport=httpx.MockTransport(self.handler))


class FakeComm:
    """Records each broadcast's bytes; with ``block=True`` every broadcast waits until
    ``abort()`` (like a broadcast to a worker that stopped receiving)."""

    def __init__(self, *, block: bool = False, world_size: int = 2) -> None:
        self.block = block
        self.broadcasts: list[bytes] = []
        self.aborted = threading.Event()
        self.closed = False
        self.warmed = False
        self.world_size, self.rank = world_size, 0

    def warmup(self, *, timeout: float | None = None) -> None:
        self.warmed = True

    def broadcast(
        self, buffer: Any, *, root: int = 0, timeout: float | None = None, stream: Any = None
    ) -> None:
        if self.aborted.is_set():
            raise TransferError("fake communicator is aborted")
        if self.block:
            if not self.aborted.wait(timeout):
                raise TransferError("fake broadcast timed out")
            raise TransferError("fake broadcast interrupted by abort")
        parts = buffer if isinstance(buffer, list) else [buffer]
        self.broadcasts.append(b"".join(bytes(memoryview(p)) for p in parts))

    def abort(self) -> None:
        self.aborted.set()

    def close(self) -> None:
        self.closed = True


class FakeBackend(Backend):
    """Host-packing backend whose rendezvous hands out ``comm``."""

    name: ClassVar[str] = "fake_host"
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=False)

    def __init__(self) -> None:
        self.comm = FakeComm()
        self.opened: list[int] = []

    def open(self, info: Any, *, world_size: int) -> Rendezvous:
        self.opened.append(world_size)
        backend = self

        class _Rdv(Rendezvous):
            def join(self, *, timeout: float) -> Any:
                return backend.comm

        return _Rdv(
            {
                "fake": True,
                "world_size": world_size,
                "packed": info.packed,
                "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
            }
        )

    def sender(self, link: Any, settings: Any, parts: SenderParts) -> RoundSender:
        return host_sender(link, settings, parts)


FAKE = FakeBackend()
register_backend(FAKE, replace=True)


def numpy_weights(seed: int = 0) -> dict[str, np.ndarray]:
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(
            ml_dtypes.bfloat16
        ),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((12, 8)).astype(np.float16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal((8,)).astype(np.float32),
        "model.norm.weight": np.array(1.5, dtype=np.float32),
        "lm_head.weight": rng.integers(-5, 5, (4, 3)).astype(np.int32),
    }
