"""The round lease: a round whose trainer went quiet is aborted without a manual finish.

A live trainer posts its next weight call at once: its engine sends the update POST
as soon as start returns and posts finish as soon as the update returns. A round that
sits open with no weight operation running for longer than the lease has lost its
trainer (killed, partitioned, a bug). Left alone it would stay open until someone posts
finish by hand, and every stale request would meet "a weight update is active". When
the lease runs out the server aborts the round: staged tensors are dropped, the
previous weights and ``weight_version`` stay served, and the session's ``last_error``
says why.

The lease runs only while the round is idle: a receiving ``update_weights`` is bounded
by the data plane's own per-broadcast timeout instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class RoundLease:
    """One timer per server; arming it again replaces the previous deadline."""

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._running: asyncio.Task[None] | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self, seconds: float, expire: Callable[[], Awaitable[None]]) -> None:
        """Run ``expire()`` after ``seconds`` unless ``disarm``/``arm`` is called first."""
        self.disarm()
        self._handle = asyncio.get_running_loop().call_later(seconds, self._fire, expire)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self, expire: Callable[[], Awaitable[None]]) -> None:
        self._handle = None
        # Keep a reference: the loop holds tasks weakly, and a collected task never runs.
        self._running = asyncio.ensure_future(expire())
