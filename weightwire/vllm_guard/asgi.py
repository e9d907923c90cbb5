"""The ASGI plumbing the round guard runs on: the types, a request's body and a JSON reply,
and what it reads of vLLM's app state (the engine client, the API-server count, the API keys).
"""

from __future__ import annotations

import hashlib
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


def authorization(scope: Scope) -> str | None:
    """The request's first ``Authorization`` header (the one vLLM reads: Starlette's
    ``Headers.get``), decoded as latin-1; None when it has none."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            return bytes(value).decode("latin-1")
    return None


def authorized(scope: Scope) -> bool:
    """The request carries one of the server's API keys (any request when it has none).

    Parsed as vLLM's ``--api-key`` middleware parses it, so the guard and vLLM never disagree
    on who is authenticated: the first ``Authorization`` header, split at its first space
    into a scheme compared without case (``bearer``) and a token taken as it is, no
    whitespace stripped, compared as UTF-8 with every key (in constant time)."""
    keys = api_keys(scope)
    if not keys:
        return True
    given = authorization(scope)
    if not given:
        return False
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Digests have one length, so the comparison takes as long for a key of any length.
    digest = hashlib.sha256(token.encode("utf-8")).digest()
    match = False
    for key in keys:
        match |= hmac.compare_digest(digest, hashlib.sha256(key.encode("utf-8")).digest())
    return match


def route_path(scope: Scope) -> str:
    """The request's path inside the app (``root_path`` removed, as vLLM's checks do), with
    no trailing slash."""
    path = str(scope.get("path", "/")).removeprefix(str(scope.get("root_path", "")))
    return path.rstrip("/") or "/"


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
