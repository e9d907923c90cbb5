"""In-process reference server for fuzzing: the real FastAPI app over one real worker process.

``create_app`` is driven through ``httpx.ASGITransport`` on an event loop this
fixture owns, so thousands of requests cost milliseconds each while every weight
operation still reaches a real ``worker_proc`` (model, ``HFModelHost``, engine) over
its JSON-lines pipe. Two apps share the worker pool: one open, one with ``--api-key``.

Every fuzz request goes through ``FuzzServer.send``, which counts it per route and
records any 5xx or exception escaping the app as a server error.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any

import httpx

API_KEY = "fuzz-key-0123456789abcdef"
REQUEST_TIMEOUT_S = 60.0


@dataclass
class FuzzServer:
    loop: asyncio.AbstractEventLoop
    pool: Any
    clients: dict[str, httpx.AsyncClient]
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: list[str] = field(default_factory=list)

    @property
    def worker_pid(self) -> int:
        return int(self.pool.replicas[0].proc.pid)

    def request(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        params: Any = None,
        headers: dict[str, str] | None = None,
        app: str = "open",
    ) -> httpx.Response:
        """One request, bounded; an exception escaping the app is re-raised here."""
        call = self.clients[app].request(
            method, path, content=content, params=params, headers=headers
        )
        return self.loop.run_until_complete(asyncio.wait_for(call, REQUEST_TIMEOUT_S))

    def send(self, route: str, method: str, path: str, **kw: Any) -> httpx.Response | None:
        """A fuzz payload: counted under ``route``; 5xx / crashes are recorded, not raised
        (the test asserts at its end, with every failure listed)."""
        self.counts[route] += 1
        try:
            resp = self.request(method, path, **kw)
        except Exception as exc:  # the app itself raised: the worst outcome
            self.errors.append(
                f"{route} {method} {path} {kw!r:.300}: raised {type(exc).__name__}: {exc!s:.300}"
            )
            return None
        if resp.status_code >= 500:
            self.errors.append(
                f"{route} {method} {path} {kw!r:.300}: {resp.status_code} {resp.text[:300]}"
            )
        elif resp.status_code >= 400:
            body = resp.json()  # every refusal is the documented JSON error shape
            assert body["error"]["code"] == resp.status_code and isinstance(
                body["error"]["message"], str
            ), body
        return resp


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
