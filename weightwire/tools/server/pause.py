"""``/pause`` / ``/resume``: vLLM's three pause modes for generation requests.

- ``abort``: new requests get 503; in-flight ones stop at their next token and
  return with ``finish_reason: "abort"`` (queued ones get 503).
- ``wait``: new requests get 503; ``/pause`` returns once in-flight ones finished.
- ``keep``: new requests are accepted and wait until ``/resume`` (bounded); ``/health``'s
  ``requests_held`` counts them (``PauseGate.held``).

Two independent holds share the gate: a trainer's ``/pause`` and ``/sleep``. Each is
lifted only by its own route (``/resume``, ``/wake_up``), so waking the server never
lifts a trainer's pause, and requests run only while neither holds.
"""

from __future__ import annotations

import asyncio

from weightwire.shared.routes import PAUSE_MODES
from weightwire.tools.server.web import ApiError


class PauseGate:
    def __init__(self) -> None:
        self.mode: str | None = None
        """The trainer's ``/pause`` mode, or None."""
        self.sleep_mode: str | None = None
        """The pause mode ``/sleep`` holds generation in while the server sleeps, or None."""
        self.inflight = 0
        self.held = 0
        """Requests waiting in ``admit`` for the hold to lift (``/health``'s ``requests_held``):
        what tells a client that its request reached the gate, not that it is still on its
        way."""
        self.pauses = 0
        """How many times ``pause`` was called: whether anyone paused since a given moment."""
        self.round_pause: tuple[int, int] | None = None
        """``(pauses, round id)``: the pause a round's start took (``START_PAUSES``), the
        ``pauses`` count it made: while that count is still the latest and the mode held,
        the hold is that round's (``after_commit.lift_left_pause``)."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        return self.mode is not None or self.sleep_mode is not None

    async def admit(self, timeout: float) -> None:
        """Return when a new request may run; 503 while held in abort/wait mode."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.paused:
            if self.mode not in (None, "keep"):
                raise ApiError(
                    503,
                    f"generation is paused (mode={self.mode}); POST /resume to "
                    "accept requests again",
                )
            if self.sleep_mode not in (None, "keep"):
                raise ApiError(
                    503,
                    f"the server is asleep (/sleep mode={self.sleep_mode}); POST /wake_up to "
                    "accept requests again",
                )
            self.held += 1
            try:
                await asyncio.wait_for(self._resumed.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise ApiError(
                    503, f"generation stayed paused (mode=keep) for {timeout:.0f}s; request dropped"
                ) from None
            finally:  # also a client gone meanwhile (the request's task cancelled)
                self.held -= 1

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    def pause(self, mode: str) -> None:
        self.mode = _checked(mode)
        self.pauses += 1
        self._resumed.clear()

    def resume(self) -> None:
        self.mode = None
        self._settle()

    def hold_for_sleep(self, mode: str | None) -> None:
        """Set (a mode) or lift (None) the hold of ``/sleep``; the ``/pause`` hold is untouched."""
        self.sleep_mode = None if mode is None else _checked(mode)
        self._settle()

    async def drain(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            raise ApiError(
                504, f"{self.inflight} request(s) still running after {timeout:.3g} s (mode=wait)"
            ) from None

    def _settle(self) -> None:
        if self.paused:
            self._resumed.clear()
        else:
            self._resumed.set()


def _checked(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ApiError(422, f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", param="mode")
    return mode
