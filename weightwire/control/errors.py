"""Errors raised by the control-plane clients.

A trainer engine surfaces these unchanged, so a failed sync reads as "server X
refused route Y with status Z: <its message>" rather than as a secondary transport
error or an opaque ``HTTPStatusError``.
"""

from __future__ import annotations

import json

__all__ = ["server_error_field", "server_message"]

_MAX_MESSAGE = 2000


def server_message(body: bytes, *, fallback: str = "") -> str:
    """The human-readable error text in a response body, bounded in length.

    vLLM answers with ``{"error": "..."}`` from its routes, ``{"detail": ...}`` from
    FastAPI validation, and ``{"error": {"message": ...}}`` from its generic handler;
    anything else is shown as text.
    """
    text = body[: 4 * _MAX_MESSAGE].decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(body) if len(body) <= 1 << 20 else None
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        for key in ("error", "detail", "message"):
            if key in data:
                text = _flatten(data[key])
                break
    text = text or fallback
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


def server_error_field(body: bytes, key: str) -> str | None:
    """A string field the reference server's error body carries beside its message
    (``{"error": {"message": ..., key: ...}}``, e.g. ``routes.START_PAUSE_FIELD``); ``None``
    where the body has none (stock vLLM, a proxy's page, a non-string value)."""
    if len(body) > 1 << 20:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    error = data.get("error") if isinstance(data, dict) else None
    value = error.get(key) if isinstance(error, dict) else None
    return value if isinstance(value, str) else None


def _flatten(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "message" in value:
        return _flatten(value["message"])
    if isinstance(value, list):
        # FastAPI validation errors: [{"loc": [...], "msg": "...", ...}, ...]
        parts = []
        for item in value[:10]:
            if isinstance(item, dict) and "msg" in item:
                loc = ".".join(str(p) for p in item.get("loc", []))
                parts.append(f"{loc}: {item['msg']}" if loc else str(item["msg"]))
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return json.dumps(value)[:_MAX_MESSAGE]
