"""Session fixture: the reference server's app in process over one real worker (see ``inproc``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import httpx
import pytest

from tests.fuzz.inproc import API_KEY, FuzzServer


@pytest.fixture(scope="session")
def fuzz_server() -> Iterator[FuzzServer]:
    from weightwire.tools.server.app import ServerOptions, ServerState, create_app
    from weightwire.tools.server.replica import WorkerSpec
    from weightwire.tools.server.replicas import ReplicaPool
    from weightwire.tools.server.tiny import tiny_model_dir

    loop = asyncio.new_event_loop()
    spec = WorkerSpec(
        model_dir=tiny_model_dir("tiny-llama"),
        backend="weightwire_tcp",
        device="cpu",
        replicas=1,
        threads=1,
    )
    pool = loop.run_until_complete(ReplicaPool.start(spec, startup_timeout=180))
    clients: dict[str, httpx.AsyncClient] = {}
    try:
        for name, key in (("open", None), ("keyed", API_KEY)):
            # Short op timeouts: a fuzz case that reached a worker must come back fast.
            options = ServerOptions(
                api_key=key,
                max_body_bytes=1 << 20,
                op_timeout_s=30.0,
                round_timeout_s=30.0,
                generate_timeout_s=30.0,
            )
            app = create_app(ServerState(pool=pool, options=options))
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
            clients[name] = httpx.AsyncClient(transport=transport, base_url="http://fuzz")
        yield FuzzServer(loop, pool, clients)
    finally:
        for client in clients.values():
            with contextlib.suppress(Exception):
                loop.run_until_complete(client.aclose())
        loop.run_until_complete(pool.close())
        loop.close()
