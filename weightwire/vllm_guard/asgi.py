"""The ASGI plumbing the round guard runs on: the types, a request's body and a JSON reply,
and what it reads of vLLM's app state (the engine client, the API-server count, the API keys).
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY = 64 << 10
"""The largest request body the guard reads."""


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict[str, Any]
    headers: tuple[tuple[bytes, bytes], ...] = ()


def app_state(scope: Scope) -> Any:
    return getattr(scope.get("app"), "state", None)


def engine_client(scope: Scope) -> Any:
    return getattr(app_state(scope), "engine_client", None)


def api_server_count(scope: Scope) -> int:
    count = getattr(getattr(app_state(scope), "args", None), "api_server_count", None)
    return count if isinstance(count, int) and count > 0 else 1


def api_keys(scope: Scope) -> list[str]:
    keys = getattr(getattr(app_state(scope), "args", None), "api_key", None)
    if isinstance(keys, str):
        keys = [keys]
    keys = [k for k in keys or [os.environ.get("VLLM_API_KEY", "")] if k]
    return keys


def authorized(scope: Scope) -> bool:
    """The request carries one of the server's API keys (any request when it has none)."""
    keys = api_keys(scope)
    if not keys:
        return True
    headers = dict(scope.get("headers") or [])
    given = headers.get(b"authorization", b"").decode("latin-1")
    token = given.removeprefix("Bearer ").encode()
    return any(hmac.compare_digest(token, k.encode()) for k in keys)


async def read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if len(body) > MAX_BODY:
            raise ValueError(f"body over {MAX_BODY} bytes")
        if not message.get("more_body"):
            return body


async def send_reply(send: Send, reply: Reply) -> None:
    data = json.dumps(reply.body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        *reply.headers,
    ]
    if reply.status == 503:
        headers.append((b"retry-after", b"10"))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
