"""``--api-key``: every route but ``/health`` and ``/version`` needs ``Authorization: Bearer KEY``.

Unlike vLLM, whose key guards only ``/v1``, the weight routes are guarded too: whoever
can reach them can re-initialize the transfer group or replace the served weights.
The comparison is constant-time (``hmac.compare_digest``) so a wrong key leaks
nothing about the right one through response timing.
"""

from __future__ import annotations

import hmac
from typing import Any

from weightwire.shared.routes import ROUTES

OPEN_PATHS = frozenset(r.path for r in ROUTES.values() if r.name in ("health", "version"))


def bearer_matches(header: bytes | None, key: bytes) -> bool:
    """True iff ``header`` is ``Bearer <key>`` (scheme case-insensitive)."""
    if not header:
        return False
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), key)


class ApiKeyMiddleware:
    """Pure ASGI middleware: refuses unauthenticated requests before any body is read."""

    def __init__(self, app: Any, *, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        if bearer_matches(header, self.key):
            await self.app(scope, receive, send)
            return
        from weightwire.tools.server.web import error_response

        reason = "missing" if header is None else "invalid"
        response = error_response(
            401,
            f"{reason} API key: this server requires 'Authorization: Bearer <key>' (--api-key)",
            kind="authentication_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)
