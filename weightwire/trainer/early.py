"""A round's pause and start sent from a helper thread, ahead of the round's own set-up.

With the pause sent early (``lead_round(early_pause=True)``), the start used to wait for
both the pause's answer and the wire's call of the control plane. ``EarlyStart`` sends
the start from the pause's helper as soon as the pause returned and the data path is
``ready``: the data path clears what an earlier round left on its channels before a start
can reach a worker (``weightwire_ipc`` drops a stale "early" / "go" message there; one of
*this* round's, sent by a worker from inside its start, must not be dropped), so the start
never goes out before that (``round.announced`` says so once the first chunk was made;
the IPC data paths run the control plane as their pump starts, so there the start goes when
it went before; the host and device pipelines run it only after packing the first chunk).
The wire's control plane then only awaits the helper.

The main thread that fails before the control plane ran calls ``abandon``: from then on no
start goes out, and it learns, once the helper settled (bounded), whether the pause held
and whether the start may have been sent: such a round counts as started (its failure
rules are those of any round that failed after its start).

``together``: the pause and the start are independent calls that both must be in effect
before the first byte lands, not one after the other: the pause goes out at once on a
helper of its own, the start as above, and ``wait`` returns once both answered. Only for a
plugin worker, whose start touches no weight (a stock vLLM worker's start opens its
layerwise reload, so the pause must come first there), and with the data path told to
hold a write into the serving parameters until both answered (the data path's ``begin``,
``backends.base.Begin``, returns only then).
A pause that fails beside a start that opened a round fails the round as one whose start
opened a round that gets no bytes (the engine needs a new init).

``go_accepts``: where the start carries the pause (``START_PAUSES``) and the round has one
server, the workers' go from inside that start accepts the round: the data path may write
before the start answered (``backends.base.Outgoing.go_accepts``). ``release``: a data path
that clears its channels at once (``weightwire_ipc``) lets the start go from its own thread
and gives the helper the interpreter until it took the start, before its first chunk's work.

``one_request``: where, besides, the update carries the finish (``freshness.FinishInUpdate``),
the server offers ``UPDATE_STARTS`` and the data path writes nothing before each worker's
own word (``RoundSender.hears_workers``), no start is sent early at all: it rides on the
update (``FinishInUpdate.start_in_update``), which the data path's ``begin`` sends
(``transfer.Transfer``: ``one_request``); the round is one request.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from weightwire.control.fanout import spawn
from weightwire.shared.client import named_servers
from weightwire.shared.errors import ControlTimeout
from weightwire.trainer.caps import ClientCaps
from weightwire.trainer.transfer import await_call

_RELEASE_BOUND_S = 0.002
"""How long ``release`` lets the helper take the start: it wakes within tens of microseconds;
the bound only keeps a slow wake from holding the data path up."""


class EarlyStart:
    """``pause()`` then, once ``ready()`` was called, ``start()``, on a helper thread."""

    def __init__(
        self,
        pause: Callable[[], bool] | None,
        start: Callable[[], object],
        timeout: float,
        *,
        together: bool = False,
    ) -> None:
        """``pause`` None: ``start`` pauses too (the reference server's ``START_PAUSES``), so
        the pause counts as held once it was sent. ``together``: the pause goes out beside
        the start, not before it (the module docstring)."""
        self._pause, self._start, self._timeout = pause, start, timeout
        self._ready = threading.Event()
        self._going = threading.Event()  # the helper took the start call
        self._lock = threading.Lock()  # the start is sent, or abandoned: never both
        self._abandoned = False
        self.paused = False
        """The pause returned and held (``Session.pause``'s answer)."""
        self.start_sent = False
        """The start went out (whatever it answered): the workers may be in the round."""
        self.start_returned = False
        """The start answered success: the servers are in the round."""
        self.start_pauses = pause is None
        """The start pauses generation first, in its one request (``START_PAUSES``)."""
        self.start_error: BaseException | None = None
        """What the start raised (its refusal says what became of a pause it carried)."""
        self._beside: Future[None] | None = None
        if together and pause is not None:
            self._beside = spawn(self._pause_beside, name="weightwire-pause")
        self._future = spawn(self._run, name="weightwire-pause-start")

    def _pause_beside(self) -> None:
        assert self._pause is not None
        self.paused = self._pause()

    def _run(self) -> None:
        if self._pause is not None and self._beside is None:
            self.paused = self._pause()  # a pause that raised: no start goes out
        if not self._ready.wait(self._timeout):
            raise ControlTimeout(
                f"the round's data path was not ready for the start within {self._timeout:g} s",
                route="start_weight_update",
            )
        with self._lock:
            if self._abandoned:
                return
            self.start_sent = True
            self.paused |= self._pause is None  # the start pauses: held, whatever it answers
        self._going.set()
        try:
            self._start()
        except BaseException as exc:
            self.start_error = exc
            raise
        self.start_returned = True

    def ready(self) -> None:
        """The data path did what must precede the start (called once per round, or more)."""
        self._ready.set()

    def release(self, bound_s: float = _RELEASE_BOUND_S) -> None:
        """``ready``, then, where the start is the helper's next call (it carries the pause,
        or the pause goes beside it), block until the helper took it, at most ``bound_s``:
        the helper then holds the interpreter while it builds and writes the request, ahead
        of the caller's own work (a data path's first chunk), instead of contending with it
        at every switch interval. A start behind a pause of its own is not waited for."""
        self.ready()
        if self._pause is None or self._beside is not None:
            self._going.wait(bound_s)

    def wait(self) -> None:
        """The control plane's turn: the pause and the start answered (their error raised)."""
        self.ready()  # a wire that never said so: the start goes now, as it used to
        # Two calls one after the other, each bounded by the client's own timeout.
        await_call(self._future, 2 * self._timeout, "pause / start_weight_update")
        if self._beside is not None:  # sent beside the start: out as long as the start, at most
            await_call(self._beside, 2 * self._timeout, "pause")

    def abandon(self) -> tuple[bool, bool, bool]:
        """The round failed before its control plane finished: no start from now on.
        Returns ``(paused, start_sent, start_returned)`` once the helper settled (bounded by
        the timeout; a helper still out then sends no start, and its pause is taken as not
        held: nothing of ours to undo)."""
        with self._lock:
            self._abandoned = True
        self._ready.set()  # a helper waiting for the data path: wake it, to send nothing
        with contextlib.suppress(Exception):  # its own error, or still out: the flags tell
            self._future.result(timeout=2 * self._timeout)
        settled = self._future.done()
        if self._beside is not None:
            with contextlib.suppress(Exception):
                self._beside.result(timeout=2 * self._timeout)
            settled = settled and self._beside.done()
        return self.paused and settled, self.start_sent, self.start_returned


def starts_with_pause(client: Any, caps: ClientCaps) -> bool:
    """Every server advertised a start that pauses first (``routes.START_PAUSES``: weightwire's
    reference server, never stock vLLM)."""
    return caps.starts_with_pause and client.starts_with_pause() is True


def one_server(client: Any) -> bool:
    """The client drives exactly one server (one base URL); a client that names none (a Ray
    client, a user's adapter) counts as several."""
    servers = named_servers(client)
    return servers is not None and len(servers) == 1


def one_request(client: Any, caps: ClientCaps, sender: Any, finish: Any) -> bool:
    """The round's start may ride on its update, which carries its finish already (``finish``:
    ``freshness.FinishInUpdate``, so one server and a single round): the whole round one
    request (``routes.UPDATE_STARTS``). Only over a data path that writes nothing before each
    worker's own word from inside the round (``RoundSender.hears_workers``: ``weightwire_ipc``
    written through): a refused start then finds nothing written, as a refused start of its
    own would. Asked only where the start would carry the pause (``starts_with_pause``, one
    server: where the workers' go accepts the round, ``go_accepts``). A round with no byte to
    write is never offered here (``round.writes_a_byte``)."""
    return (
        finish is not None
        and getattr(sender, "hears_workers", False) is True
        and one_server(client)
        and caps.updates_with_start
        and client.updates_with_start() is True
    )


def go_accepts(client: Any, early: EarlyStart | None) -> bool:
    """The workers' word from inside their start accepts the round: it has one server (a go
    from inside one server's start says nothing of another's), whose start pauses generation
    before its workers' start (the reference server's ``START_PAUSES``: a pause sent beside
    the start may land after a worker's go). The failure rule for a start that fails after
    the go is ``backends.ipc.through.pipeline``'s."""
    return early is not None and early.start_pauses and one_server(client)
