"""Fill in the calls a foreign client lacks, from the server it already talks to.

vLLM's own ``HTTPVLLMWeightSyncClient`` has the four round calls and shutdown, but
no ``version``, ``get_world_size``, ``pause``, ``resume`` or cache resets. Without those an engine
can neither gate features on the server version nor size the group, and a round
run without pausing generation crashes vLLM (layerwise reload puts weights on the
meta device). When such a client names its server (``base_url`` / ``base_urls``),
``with_fallback_routes`` answers the missing calls with our HTTP client on that same
server; the calls the client has keep going through it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from weightwire.shared.client import WeightSyncClient, named_servers

if TYPE_CHECKING:
    from weightwire.control.client import HTTPWeightSyncClient

log = logging.getLogger(__name__)

OPTIONAL_CALLS = (
    "version",
    "get_world_size",
    "pause",
    "resume",
    "weight_checker",
    "reset_prefix_cache",
    "reset_encoder_cache",
)
"""Calls an engine may need beyond the four-call protocol, in the order it needs them."""


class FallbackClient:
    """The user's client for what it has; an ``HTTPWeightSyncClient`` on its server for the rest."""

    def __init__(
        self, client: WeightSyncClient, extra: HTTPWeightSyncClient, filled: Sequence[str]
    ) -> None:
        self.inner = client
        self.extra = extra
        self.filled = tuple(filled)

    def __repr__(self) -> str:
        return f"FallbackClient({self.inner!r}, filled={list(self.filled)})"

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set in __init__: the round calls go to the
        # user's client; the filled-in ones to ours.
        if name in self.filled:
            return getattr(self.extra, name)
        return getattr(self.inner, name)

    def close(self) -> None:
        """Close our own connections; the user's client stays theirs to close."""
        self.extra.close()


def _server_urls(client: object) -> list[str] | None:
    urls = named_servers(client)
    if not urls or not all(
        isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls
    ):
        return None
    return [str(u) for u in urls]


def with_fallback_routes(client: WeightSyncClient, *, timeout: float) -> WeightSyncClient:
    """``client`` itself when it has every optional call or names no server; else a
    ``FallbackClient`` answering the missing ones from ``client``'s ``base_url``."""
    missing = [name for name in OPTIONAL_CALLS if not callable(getattr(client, name, None))]
    urls = _server_urls(client) if missing else None
    if not missing or urls is None:
        return client
    from weightwire.control.client import HTTPWeightSyncClient  # httpx only when needed

    extra = HTTPWeightSyncClient(urls if len(urls) > 1 else urls[0], timeout=timeout)
    log.info(
        "%s lacks %s: asking %s directly",
        type(client).__name__,
        ", ".join(missing),
        ", ".join(urls),
    )
    return FallbackClient(client, extra, missing)
