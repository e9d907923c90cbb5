"""The state and the small cross-rank helpers ``MultiSource`` and its two wires share.

``MultiSource`` (``trainer.multi_source``) is this plus ``StarWire`` (``multi_star``:
a star per broadcaster) and ``GroupWire`` (``multi_group``: one group).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightwire.shared.errors import RoundError, WrongType
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.group import Exchange, GroupTimeout, TrainerGroup
from weightwire.trainer.session import Session

_GRACE_S = 2.0  # how long a rank waits for a failed broadcaster's own account of the failure


class RoundFailed(RoundError, RuntimeError):
    """Another trainer rank reported that this round failed; the message names it."""


@dataclass(frozen=True)
class TurnFailure:
    """The first turn that failed in a round, and why."""

    turn: Turn
    error: BaseException


@dataclass(frozen=True)
class PlannedBroadcast:
    """The broadcast plan of the last metadata agreed on, and each turn's chunks by ``src``."""

    metas: list[ParamMeta]
    plan: BroadcastPlan
    chunks: dict[int, list[Chunk]]


class MultiBase:
    def __init__(self, session: Session, group: TrainerGroup) -> None:
        if not isinstance(group, TrainerGroup):
            raise WrongType(f"group must be a weightwire TrainerGroup, got {type(group).__name__}")
        if group.rank != session.info.rank:
            raise ValueError(
                f"TrainerInitInfo.rank {session.info.rank} is not the group's rank {group.rank}"
            )
        self.session = session
        self.rank = group.rank
        self.exchange = Exchange(group)
        self._group_ranks: tuple[int, ...] | None = None
        self._planned: PlannedBroadcast | None = None
        self._went: set[int] = set()  # stars: the turns whose go was posted this round
        self._go_lock = threading.Lock()

    @property
    def _shape(self) -> str | None:
        return self.session.backend.caps.several

    @property
    def _chunks(self) -> dict[int, list[Chunk]]:
        assert self._planned is not None
        return self._planned.chunks

    def _report(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except BaseException as exc:
            self.exchange.post(name, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        self.exchange.post(name, {"error": None})
        return out

    def _await_ok(self, name: str, timeout: float, rank: int = 0) -> dict[str, Any]:
        got = self.exchange.get(name, rank, timeout)
        if got.get("error"):
            raise RoundFailed(f"trainer rank {rank} failed ({name}): {got['error']}")
        return got

    def _await_all(self, name: str, ranks: list[int], timeout: float) -> None:
        for r in ranks:
            self._await_ok(name, timeout, rank=r)

    def _turn_error(self, failure: TurnFailure) -> BaseException:
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

    def _break(self, exc: BaseException) -> None:
        self.session.broken = exc
        if (
            self.rank != 0 and self.session.link is not None
        ):  # rank 0's link: its own wire aborts it
            self.session.link.abort()
