"""What the served model holds, across rounds, sessions and engines.

``WeightState`` outlives sessions and engines: it records that the model holds part
of a round applied in place (``IncompleteRound``), until a committed round rewrote
every tensor the broken round may have touched; and, for delta rounds, the token of
the round each target model last committed (and the host copy a ``CopySink`` keeps).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from weightwire.torch_side.worker.delta import HostCopy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IncompleteRound:
    """The model holds part of a round applied in place: some tensors new, others old."""

    session: str | None
    reason: str
    names: frozenset[str]
    """Every tensor the broken round may have written (the names of its updates)."""
    since: float = field(default_factory=time.time)

    def describe(self) -> str:
        return (
            f"the model holds an incomplete weight round (session {self.session}, {self.reason}): "
            f"{len(self.names)} tensor(s) may be new, the rest old; a complete round must commit "
            "before it serves again"
        )


@dataclass
class _Base:
    """What a target model holds, for delta rounds: the last committed round's token and
    (``CopySink`` only) the host copy of its checkpoint tensors."""

    model: Any
    """Kept so that another model at a recycled ``id`` is not taken for this one."""
    token: str | None = None
    copy: HostCopy = field(default_factory=HostCopy)


class WeightState:
    """Whether the served model is whole, and which round it holds; shared by every engine
    that loads into it (so both survive an engine's re-init)."""

    def __init__(self) -> None:
        self.incomplete: IncompleteRound | None = None
        self._bases: dict[int, _Base] = {}

    def _base(self, model: Any) -> _Base:
        base = self._bases.get(id(model))
        if base is None or base.model is not model:
            base = self._bases[id(model)] = _Base(model)
        return base

    def token(self, model: Any) -> str | None:
        """The token of the last round committed into ``model`` (None: unknown)."""
        base = self._bases.get(id(model))
        return base.token if base is not None and base.model is model else None

    def host_copy(self, model: Any) -> HostCopy:
        return self._base(model).copy

    def adopt(self, model: Any, token: str | None) -> None:
        """A round committed into ``model``; ``token`` None: a trainer that sends none."""
        self._base(model).token = token

    def forget(self, *, copies: bool = False) -> None:
        """No model holds a known round any more (a failed round, another trainer);
        ``copies``: also free the host copies (delta rounds are off)."""
        for base in self._bases.values():
            base.token = None
            if copies:
                base.copy.clear()

    def broke(self, session: str | None, reason: str, names: frozenset[str]) -> None:
        """A round that wrote in place ended without its commit."""
        names = names | (self.incomplete.names if self.incomplete is not None else frozenset())
        self.incomplete = IncompleteRound(session, reason, names)
        self.forget()
        log.error("%s", self.incomplete.describe())

    def committed(self, names: frozenset[str]) -> None:
        """A round committed: the model is whole again once it rewrote every tensor in doubt."""
        if self.incomplete is None:
            return
        missing = self.incomplete.names - names
        if not missing:
            log.warning("a complete round committed: the model is whole again")
            self.incomplete = None
            return
        self.incomplete = IncompleteRound(
            self.incomplete.session, self.incomplete.reason, frozenset(missing)
        )
        log.error(
            "a round committed but left %d tensor(s) of the incomplete round unwritten: %s",
            len(missing),
            self.incomplete.describe(),
        )
