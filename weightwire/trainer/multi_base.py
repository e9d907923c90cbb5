"""What ``MultiSource`` and its two wires share: ``Ranks`` (the cross-rank state and small
helpers, held by each, never inherited) and ``SeveralWire`` (how several broadcasters' turns
go out: ``multi_star.StarWire``, a star each; ``multi_group.GroupWire``, one group).

``MultiSource`` (``trainer.multi_source``) chooses the wire once, at set-up, from the
backend's ``caps.several``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from weightwire.backends.base import Sent
from weightwire.shared.errors import ConfigError, RoundError, WrongType
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.group import Exchange, GroupTimeout, TrainerGroup
from weightwire.trainer.multi_verify import gather_digests
from weightwire.trainer.round import Transmission
from weightwire.trainer.session import Session

_GRACE_S = 2.0  # how long a rank waits for a failed broadcaster's own account of the failure


class RoundFailed(RoundError, RuntimeError):
    """Another trainer rank reported that this round failed; the message names it."""

    kept_before_any_byte = False
    """Set where rank 0 ended a sliced round before its "go" (no process wrote a byte) and
    kept its engine (``multi_sliced``): this rank keeps its own too."""


@dataclass(frozen=True)
class TurnFailure:
    """The first turn that failed in a round, and why."""

    turn: Turn
    error: BaseException


@dataclass
class Leading:
    """Rank 0's round over several broadcasters, while it runs: its plan, each turn's
    ``update_weights`` payload (in turn order), the turns that failed (the first one is
    raised once the wire returned)."""

    bplan: BroadcastPlan
    payloads: list[dict[str, Any]]
    failed: list[TurnFailure] = field(default_factory=list)


Lead = Callable[[Leading, Iterator[tuple[str, Any]]], Sent]
"""A wire's part of rank 0's transfer: every turn of the round, beside rank 0's own stream of
``(name, tensor)`` pairs (a failed turn joins ``Leading.failed``); what rank 0 sent."""


@dataclass(frozen=True)
class PlannedBroadcast:
    """The broadcast plan of the last metadata agreed on, and each turn's chunks by ``src``."""

    metas: list[ParamMeta]
    plan: BroadcastPlan
    chunks: dict[int, list[Chunk]]


class Ranks:
    """This rank's place among the trainer ranks: the session, the exchange, the plan agreed
    on, and the round rank 0 is leading."""

    def __init__(self, session: Session, group: TrainerGroup) -> None:
        if not isinstance(group, TrainerGroup):
            raise WrongType(f"group must be a weightwire TrainerGroup, got {type(group).__name__}")
        if group.rank != session.info.rank:
            raise ConfigError(
                f"TrainerInitInfo.rank {session.info.rank} is not the group's rank {group.rank}"
            )
        self.session = session
        self.rank = group.rank
        self.exchange = Exchange(group)
        self.group_ranks: tuple[int, ...] | None = None
        """The broadcasting ranks agreed on at init (a round may not change them)."""
        self.planned: PlannedBroadcast | None = None
        self.round: BroadcastPlan | None = None
        """Rank 0: the round in flight (its verdict is published)."""
        self.went: set[int] = set()  # the turns whose go was posted this round
        self._go_lock = threading.Lock()

    @property
    def chunks(self) -> dict[int, list[Chunk]]:
        assert self.planned is not None
        return self.planned.chunks

    def report(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except BaseException as exc:
            self.exchange.post(name, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        self.exchange.post(name, {"error": None})
        return out

    def await_ok(self, name: str, timeout: float, rank: int = 0) -> dict[str, Any]:
        got = self.exchange.get(name, rank, timeout)
        if got.get("error"):
            raise RoundFailed(f"trainer rank {rank} failed ({name}): {got['error']}")
        return got

    def await_all(self, name: str, ranks: list[int], timeout: float) -> None:
        for r in ranks:
            self.await_ok(name, timeout, rank=r)

    def turn_error(self, failure: TurnFailure) -> BaseException:
        """A failed turn, named by its broadcaster (rank and ``src``) on every rank, with the
        broadcaster's own account when it gave one within ``_GRACE_S``."""
        turn, exc = failure.turn, failure.error
        seen = "" if self.rank == 0 else f" (seen by trainer rank {self.rank})"
        note = ""
        if turn.rank not in (0, self.rank):
            try:
                status = self.exchange.get("status", turn.rank, _GRACE_S)
                if status.get("error"):
                    note = f"; rank {turn.rank} reported: {status['error']}"
            except GroupTimeout:
                note = f"; rank {turn.rank} did not report within {_GRACE_S:g} s (it may have died)"
        err = RoundFailed(
            f"turn of trainer rank {turn.rank} (src {turn.src}, {len(turn.metas)} tensors from "
            f"{turn.metas[0].name!r}) failed{seen}: {type(exc).__name__}: {exc}{note}"
        )
        err.__cause__ = exc
        return err

    def break_(self, exc: BaseException) -> None:
        self.session.broken = exc
        if (
            self.rank != 0 and self.session.link is not None
        ):  # rank 0's link: its own wire aborts it
            self.session.link.abort()

    def go(self, turn: Turn, go: bool) -> None:
        """Tell ``turn``'s broadcaster whether its turn runs (each key once per round: the JAX
        store refuses to overwrite; rank 0's own turn needs none)."""
        with self._go_lock:
            if turn.rank == 0 or turn.src in self.went:
                return
            self.went.add(turn.src)
        self.exchange.post(f"go{turn.src}", go)

    def lead(self, t: Transmission, run: Lead) -> Sent:
        """Rank 0's transfer of the round in flight: its control plane first, then ``run``
        (a wire's turns over rank 0's own stream); raises on the first failed turn."""
        bplan = self.round
        assert bplan is not None
        started = time.perf_counter()
        t.control()  # before any turn: rank 0's own slice is produced only after it
        t.clock.shift("transfer", "control", time.perf_counter() - started)
        leading = Leading(bplan, t.payloads)
        sent = run(leading, self.pairs(bplan.turn_of(0), t.own))
        if leading.failed:
            raise self.turn_error(leading.failed[0])
        return sent

    def pairs(self, turn: Turn | None, digests: dict[str, str] | None) -> Iterator[tuple[str, Any]]:
        """This rank's checked stream (its own slice), digested for verify when asked."""
        source = self.session.source
        return self.session.stream(source, iter(source), list(turn.metas) if turn else [], digests)

    def digests(self, own: dict[str, str]) -> dict[str, str]:
        """Every slice's digests of the round in flight (rank 0's are ``own``)."""
        assert self.round is not None
        return gather_digests(self.exchange, self.round, own, self.session.info.timeouts.http_s)


class SeveralWire(Protocol):
    """How several broadcasters' turns go out: set up at ``connect``, run by rank 0 as the
    round's ``Wire``, and by every other rank as its part of the round (``follow``)."""

    ranks: Ranks
    """The cross-rank state and helpers, shared with ``MultiSource``."""

    def connect(self, bplan: BroadcastPlan, workers: int) -> None: ...

    def transfer(self, t: Transmission) -> Sent: ...

    def digests(self, own: dict[str, str]) -> dict[str, str]: ...

    def follow(self, bplan: BroadcastPlan, pairs: Iterator[tuple[str, Any]]) -> Sent:
        """A non-zero rank's part of every turn; what it sent itself (raises on a failed turn)."""
        ...


class _LeadsTurns(Protocol):
    ranks: Ranks

    @property
    def _lead(self) -> Lead: ...


# Stars and a group spell ``Wire.transfer`` / ``digests`` alike (only ``_lead`` differs): each
# class binds these two as its methods, so both stay plain classes holding a ``Ranks``.
def lead_transfer(wire: _LeadsTurns, t: Transmission) -> Sent:
    """Rank 0's transfer over ``wire``, its control plane first."""
    return wire.ranks.lead(t, wire._lead)


def ranks_digests(wire: _LeadsTurns, own: dict[str, str]) -> dict[str, str]:
    return wire.ranks.digests(own)
