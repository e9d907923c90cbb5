"""The state and the small cross-rank helpers ``MultiSource`` and its two wires share.

``MultiSource`` (``trainer.multi_source``) is this plus ``StarWire`` (``multi_star``:
TCP, a star per broadcaster) and ``GroupWire`` (``multi_group``: one NCCL group).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightwire.backends.base import RoundSender
from weightwire.shared.communicator import Communicator
from weightwire.shared.errors import RoundError
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.group import Exchange, GroupTimeout, TrainerGroup

if TYPE_CHECKING:
    from weightwire.trainer.engine import TrainerEngine

_GRACE_S = 2.0  # how long a rank waits for a failed broadcaster's own account of the failure


class RoundFailed(RoundError, RuntimeError):
    """Another trainer rank reported that this round failed; the message names it."""


class MultiBase:
    def __init__(self, engine: TrainerEngine, group: TrainerGroup) -> None:
        if not isinstance(group, TrainerGroup):
            raise TypeError(f"group must be a weightwire TrainerGroup, got {type(group).__name__}")
        if group.rank != engine.info.rank:
            raise ValueError(f"TrainerInitInfo.rank {engine.info.rank} is not the group's rank {group.rank}")
        self.engine = engine
        self.rank = group.rank
        self.x = Exchange(group)
        self._group_ranks: tuple[int, ...] | None = None
        self._planned: tuple[list[ParamMeta], BroadcastPlan] | None = None
        self._chunks: dict[int, list[Chunk]] = {}
        self._comm: Communicator | None = None  # a non-zero broadcaster's own star, or its group member
        self._pipeline: RoundSender | None = None
        self._sent: dict[tuple[bool, int], tuple[ParamMeta, ...]] = {}  # rank 0: what each src's slice is on the workers
        self._went: set[int] = set()  # stars: the turns whose go was posted this round
        self._go_lock = threading.Lock()

    @property
    def _shape(self) -> str | None:
        return self.engine._backend.caps.several

    def _report(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except BaseException as exc:
            self.x.post(name, {"error": f"{type(exc).__name__}: {exc}"})
            raise
        self.x.post(name, {"error": None})
        return out

    def _await_ok(self, name: str, timeout: float, rank: int = 0) -> dict[str, Any]:
        got = self.x.get(name, rank, timeout)
        if got.get("error"):
            raise RoundFailed(f"trainer rank {rank} failed ({name}): {got['error']}")
        return got

    def _await_all(self, name: str, ranks: list[int], timeout: float) -> None:
        for r in ranks:
            self._await_ok(name, timeout, rank=r)

    def _turn_error(self, turn: Turn, exc: BaseException) -> BaseException:
        """A failed turn, named by its broadcaster (rank and ``src``) on every rank, with the
        broadcaster's own account when it gave one within ``_GRACE_S``."""
        seen = "" if self.rank == 0 else f" (seen by trainer rank {self.rank})"
        note = ""
        if turn.rank not in (0, self.rank):
            try:
                status = self.x.get("status", turn.rank, _GRACE_S)
                if status.get("error"):
                    note = f"; rank {turn.rank} reported: {status['error']}"
            except GroupTimeout:
                note = f"; rank {turn.rank} did not report within {_GRACE_S:g} s (it may have died)"
        err = RoundFailed(f"turn of trainer rank {turn.rank} (src {turn.src}, {len(turn.metas)} tensors from "
                          f"{turn.metas[0].name!r}) failed{seen}: {type(exc).__name__}: {exc}{note}")
        err.__cause__ = exc
        return err

    def _break(self, exc: BaseException) -> None:
        self.engine._broken = exc
        if self._comm is not None:
            self._comm.abort()
