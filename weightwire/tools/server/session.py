"""The weight-sync session: which route may run when, and what a failure resets.

vLLM's rules, enforced before any worker is touched:

- ``start`` / ``update`` / ``finish`` before ``init`` -> refused (no transfer engine);
- ``start`` twice without ``finish`` -> refused;
- ``update`` or ``finish`` without ``start`` -> refused;
- ``shutdown`` while a round is active -> refused;
- a failed ``init`` / ``start`` / ``update`` / ``finish`` clears the session: the
  trainer must ``init`` again.

One rule vLLM lacks: a round is a transaction. Received tensors are staged by the
workers and committed at ``finish``; a round that fails leaves the previous weights
and ``weight_version`` untouched. ``weight_version`` lives here, in the API process,
and changes only after every replica committed.

Only one weight operation runs at a time (``operation``): a second one arriving
while, say, an update is still receiving is refused with 409 instead of
interleaving with it on the workers.

Sessions have an owner. Every successful init mints a ``session_id`` (returned in the
init reply); a client that sends it back in the ``X-Weightwire-Session`` header on
start / update / finish / shutdown is refused with 409 once a newer init replaced its
session, so a displaced trainer can neither block serving with a round nobody sends
bytes for nor shut down the trainer that replaced it. Requests without the header
(stock vLLM clients) keep vLLM's last-init-wins semantics between rounds. An init
while a round is open is refused unless the round is stale (its trainer closed the
data link, or the worker's lease ran out); a stale round is dropped and counted in
``rounds_failed``.

Every round's outcome is logged at INFO or WARNING (``RoundRecord``): the session's
serial number (never its id, which is an ownership token), the version, tensors,
bytes, seconds and what ended it.
"""

from __future__ import annotations

import enum
import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from weightwire.shared.errors import ReferenceServerError

log = logging.getLogger(__name__)


class SessionError(ReferenceServerError):
    """A request the session's state forbids; ``status`` is the HTTP status to return."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.fields: dict[str, str] = {}
        """Keys the reply's ``"error"`` object carries beside its message (``ApiError``'s)."""


class Phase(enum.Enum):
    NO_ENGINE = "uninitialized"
    READY = "ready"
    ROUND = "round_active"


@dataclass
class RoundRecord:
    """One round's numbers, for its log line."""

    session: int
    round: int
    started: float = field(default_factory=time.monotonic)
    tensors: int = 0
    nbytes: int = 0

    def add(self, replies: Any) -> None:
        """Count one update from the workers' replies (every replica receives the same tensors: the
        first's)."""
        first = replies[0] if isinstance(replies, list) and replies else None
        if isinstance(first, dict):
            self.tensors += int(first.get("tensors") or 0)
            self.nbytes += int(first.get("nbytes") or 0)

    def log(self, outcome: str, *, level: int = logging.INFO) -> None:
        log.log(
            level,
            "round %d of session #%d %s (%d tensors, %.1f MB, %.2f s)",
            self.round,
            self.session,
            outcome,
            self.tensors,
            self.nbytes / 1e6,
            time.monotonic() - self.started,
        )


_NEED_INIT = "weight transfer engine is not initialized: POST /init_weight_transfer_engine first"


@dataclass
class Session:
    """State of the one trainer session a server accepts at a time."""

    phase: Phase = Phase.NO_ENGINE
    weight_version: str | None = "default"
    """None once ``/sleep?level=2`` discarded the weights, until a round names a version."""
    init_info: Any = None
    """The parsed init info of the live engine (``TCPInitInfo`` / ``NCCLInitInfo``)."""
    updates_in_round: int = 0
    rounds_committed: int = 0
    rounds_failed: int = 0
    last_error: str | None = None
    busy: str | None = field(default=None)
    session_id: str | None = None
    """Minted by every successful init; the owner of the live engine."""
    round_id: int = 0
    """Bumped by every start: a round lease only ever aborts the round it was armed for."""
    serial: int = 0
    """Bumped by every successful init: names the session in logs and messages (the id is a
    token)."""
    record: RoundRecord | None = None
    listings: dict[int, bool] = field(default_factory=dict)
    """Broadcaster (``src``) -> whether the last update info of this session that listed its
    tensors was a delta round's (patches): what an update of empty lists (vLLM 0.33's "the
    previous round's tensors") reuses on the workers, whose list is per session."""

    # -- ownership ----------------------------------------------------------------------
    def check_owner(self, claimed: str | None, route: str, *, idempotent: bool = False) -> None:
        """Refuse (409) a request that names a session other than the live one.

        ``idempotent`` (shutdown): a session that merely ended (failed, shut down) may
        still be shut down, a no-op; only a newer live session is protected. The live
        id is never echoed: a stale trainer must not learn how to act for the trainer
        that replaced it.
        """
        if (
            claimed is None
            or claimed == self.session_id
            or (idempotent and self.session_id is None)
        ):
            return
        if self.session_id is None:
            ended = f" ({self.last_error})" if self.last_error else ""
            raise SessionError(
                409,
                f"{route} refused: this trainer's session {claimed[:40]!r} has ended{ended}; "
                "POST /init_weight_transfer_engine to start a new one",
            )
        raise SessionError(
            409,
            f"{route} refused: this trainer's session {claimed[:40]!r} was replaced by a newer "
            "/init_weight_transfer_engine from another trainer; nothing was changed. "
            "Re-initialize (trainer_init) to take over again",
        )

    # -- guards: raise SessionError or return --------------------------------------
    def check_start(self) -> None:
        if self.phase is Phase.NO_ENGINE:
            raise SessionError(409, f"cannot start a weight update: {_NEED_INIT}")
        if self.phase is Phase.ROUND:
            raise SessionError(
                409,
                "a weight update is already active: POST "
                "/finish_weight_update before starting another",
            )

    def check_update(self) -> None:
        if self.phase is Phase.NO_ENGINE:
            raise SessionError(409, f"cannot update weights: {_NEED_INIT}")
        if self.phase is not Phase.ROUND:
            raise SessionError(
                409, "no weight update is active: POST /start_weight_update before /update_weights"
            )

    def check_finish(self) -> None:
        if self.phase is Phase.NO_ENGINE:
            raise SessionError(409, f"cannot finish a weight update: {_NEED_INIT}")
        if self.phase is not Phase.ROUND:
            raise SessionError(
                409,
                "no weight update is active: POST /start_weight_update before "
                "/finish_weight_update",
            )

    def active_round(self) -> str:
        """'round N of session #K (started X s ago)': names the open round in refusals."""
        idle = (
            f" (started {time.monotonic() - self.record.started:.1f} s ago)" if self.record else ""
        )
        return f"round {self.round_id} of session #{self.serial}{idle}"

    def check_no_round(self, route: str) -> None:
        """Refuse (409) ``route`` while a round is open: it would change what the round commits
        into."""
        if self.phase is Phase.ROUND:
            raise SessionError(
                409,
                f"{route} refused: {self.active_round()} is active; finish it "
                "(POST /finish_weight_update) or let it fail first",
            )

    def check_shutdown(self) -> None:
        if self.phase is Phase.ROUND:
            raise SessionError(
                409,
                "a weight update is active: finish it (POST /finish_weight_update) before "
                "shutting the engine down",
            )

    # -- transitions ----------------------------------------------------------------
    def initialized(self, init_info: Any) -> str:
        """A new engine is live; returns the new session's id."""
        self.phase, self.init_info, self.updates_in_round, self.last_error = (
            Phase.READY,
            init_info,
            0,
            None,
        )
        self.session_id = secrets.token_urlsafe(12)
        self.serial += 1
        self.listings = {}  # the workers' new engine remembers no listing
        log.info("session #%d initialized", self.serial)
        return self.session_id

    def started(self) -> None:
        self.phase, self.updates_in_round = Phase.ROUND, 0
        self.round_id += 1
        self.record = RoundRecord(self.serial, self.round_id)

    def updated(self, replies: Any = None) -> None:
        self.updates_in_round += 1
        if self.record is not None:
            self.record.add(replies)

    def committed(self, weight_version: str | None) -> None:
        self.phase, self.updates_in_round = Phase.READY, 0
        self.rounds_committed += 1
        if weight_version is not None:
            self.weight_version = weight_version
        self._end_round(f"committed: weight_version {self.weight_version!r}")

    def closed_empty(self) -> None:
        """A finish with no update in the round: the round ends, nothing was committed."""
        self.phase, self.updates_in_round = Phase.READY, 0
        self._end_round(f"closed empty (no update): weight_version stays {self.weight_version!r}")

    def dropped(self, reason: str, by: str = "a newer init") -> None:
        """A newer init (or its own trainer's shutdown, ``by``) drops the open, stale round
        (counted as failed); the init then replaces the session, the shutdown ends it."""
        self.phase, self.updates_in_round = Phase.READY, 0
        self.rounds_failed += 1
        self.last_error = f"round dropped by {by}: {reason}"
        self._end_round(f"dropped by {by} ({reason}): nothing committed", level=logging.WARNING)

    def shut_down(self) -> None:
        self.phase, self.init_info, self.updates_in_round, self.session_id = (
            Phase.NO_ENGINE,
            None,
            0,
            None,
        )

    def failed(self, reason: str) -> None:
        """Any failed weight operation: the engine is gone, the weights and version stay."""
        if self.phase is Phase.ROUND:
            self.rounds_failed += 1
            self._end_round(f"failed, nothing committed: {reason}", level=logging.WARNING)
        self.phase, self.init_info, self.updates_in_round, self.last_error = (
            Phase.NO_ENGINE,
            None,
            0,
            reason,
        )
        self.session_id = None

    def _end_round(self, outcome: str, *, level: int = logging.INFO) -> None:
        record, self.record = self.record, None
        if record is not None:
            record.log(outcome, level=level)

    # -- mutual exclusion --------------------------------------------------------------
    @asynccontextmanager
    async def operation(self, name: str) -> AsyncIterator[None]:
        """Hold the session for one weight operation; refuse (409) if another runs.

        Refusing rather than queueing: a trainer that posts a second operation while
        the first still runs has lost track of its round, and queueing would hide that.
        The event loop is single-threaded, so check-and-set needs no lock.
        """
        if self.busy is not None:
            raise SessionError(
                409, f"another weight operation ({self.busy}) is in progress; retry when it returns"
            )
        self.busy = name
        try:
            yield
        finally:
            self.busy = None

    def describe(self) -> dict[str, Any]:
        return {
            "state": self.phase.value,
            "busy": self.busy,
            "rounds_committed": self.rounds_committed,
            "rounds_failed": self.rounds_failed,
            "last_error": self.last_error,
        }
