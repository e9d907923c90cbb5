"""The worker's session rules: who may join, when a round's trainer counts as gone, and
how a session's receive link is closed.

Sessions: ``_ReceiverCore.init`` records the trainer's session. A second init while a round of a
live session is open is refused; between rounds it takes over and closes the old
session's link, so the displaced trainer sees its link closed before its next round.
A round whose trainer vanished (its link closed, no call for ``lease_s``, or its bytes waiting
unread with no update for longer than its transfer bound) is stale: the next init aborts it
(state unchanged) instead of refusing.

``_ReceiverCore`` holds the session's state; these are the rules it applies to it.
"""

from __future__ import annotations

import logging
import time

from weightwire.backends.worker_base import ReceiveLink
from weightwire.backends.worker_base import WorkerInitInfo as InitInfo

log = logging.getLogger(__name__)


def check_info_type(backend: str, info: InitInfo, info_type: type[InitInfo]) -> None:
    """Refuse init info of another backend's type."""
    if not isinstance(info, info_type):
        raise TypeError(
            f"{backend}: init info must be {info_type.__name__}, got {type(info).__name__}"
        )


def session_rank(backend: str, info: InitInfo, worker_rank: int) -> int:
    """This worker's rank in the session ``info`` opens; raises when it is outside it."""
    rank = info.rank_offset + worker_rank
    if rank >= info.world_size:
        raise ValueError(
            f"{backend}: this worker's rank {rank} (rank_offset {info.rank_offset} + "
            f"worker {worker_rank}) is outside world_size {info.world_size}; world_size "
            "must be 1 + the number of inference workers (GET /get_world_size)"
        )
    return rank


def stale_reason(link: ReceiveLink | None, touched: float, lease_s: float) -> str | None:
    """Why an open round's trainer counts as gone, or None while it may still act.

    ``touched`` is the monotonic time of the round's last call."""
    if link is None:
        return "its link is gone"
    if link.peer_closed():
        return "its trainer closed the data link"
    idle = time.monotonic() - touched
    if idle > lease_s:
        return f"no call for {idle:.0f} s (lease {lease_s:.0f} s)"
    if idle > link.timeout_s and link.bytes_unread():
        # A live trainer's send of those bytes gave up at its transfer bound (no update
        # reads them); one that died mid-send keeps its close queued behind them (a full
        # receive window holds back its FIN), so peer_closed stays false until the lease.
        return (
            f"its trainer's bytes wait unread on the data link with no update for "
            f"{idle:.0f} s, past its transfer bound ({link.timeout_s:g} s): its trainer gave "
            "the round up or died mid-send"
        )
    return None


def busy_error(backend: str, session: str | None, touched: float, lease_s: float) -> RuntimeError:
    """The refusal of an init while a live trainer's round is open."""
    return RuntimeError(
        f"{backend}: refused: a weight update of session {session} is in "
        f"progress (last call {time.monotonic() - touched:.0f} s ago); a new "
        "trainer can init once it finished, or once it is gone (link closed, or idle "
        f"for {lease_s:.0f} s)"
    )


def not_ready_error(backend: str, broken: str | None) -> RuntimeError:
    """The refusal of a round call without a link: never initialized, or aborted by a
    failed round (``broken`` names it)."""
    if broken is not None:
        return RuntimeError(
            f"{backend}: the communicator was aborted after a failed round "
            f"({broken}); call init_weight_transfer_engine again"
        )
    return RuntimeError(f"{backend}: not initialized; call init_weight_transfer_engine first")


def abort_link(backend: str, link: ReceiveLink | None, what: str) -> None:
    """Abort ``link`` (never blocks); a failing abort is logged, never raised, since the
    caller's own error, if any, is the one to report."""
    if link is not None:
        try:
            link.abort()
        except Exception:
            log.exception("%s: %s failed", backend, what)


def close_link(backend: str, link: ReceiveLink | None) -> None:
    """Close ``link`` in order; abort it when closing fails."""
    if link is not None:
        try:
            link.close()
        except Exception:
            log.exception("%s: communicator close failed; aborting it", backend)
            link.abort()
