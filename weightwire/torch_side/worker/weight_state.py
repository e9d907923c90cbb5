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

import torch

from weightwire.torch_side.worker.load import Model

log = logging.getLogger(__name__)


@dataclass
class HostCopy:
    """The checkpoint tensors a worker's model holds, on the host (the ``CopySink`` base)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def clear(self) -> None:
        self.tensors.clear()


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

    model: Model
    """Kept so that another model at a recycled ``id`` is not taken for this one."""
    token: str | None = None
    generation: int = -1
    """``WeightState.generation`` when the token was adopted: the token names the model's
    weights only while no other change came since."""
    copy: HostCopy = field(default_factory=HostCopy)


class WeightState:
    """Whether the served model is whole, and which round it holds; shared by every engine
    that loads into it (so both survive an engine's re-init).

    A delta base is only as good as the weights it describes: every change of the weights
    that is not a committed round (a failed or refused round, a new session, sleep level 2,
    a reset, ...) goes through ``weights_changed``, which bumps ``generation``; a token
    adopted in an earlier generation is no base any more (``token`` says None), so the next
    delta round is refused before any byte (``DeltaBaseMismatch``) and the trainer resends
    dense."""

    def __init__(self) -> None:
        self.incomplete: IncompleteRound | None = None
        self._bases: dict[int, _Base] = {}
        self.generation = 0

    def _base(self, model: Model) -> _Base:
        base = self._bases.get(id(model))
        if base is None or base.model is not model:
            base = self._bases[id(model)] = _Base(model)
        return base

    def token(self, model: Model) -> str | None:
        """The token of the last round committed into ``model`` (None: unknown, or the
        weights changed since)."""
        base = self._bases.get(id(model))
        if base is None or base.model is not model or base.generation != self.generation:
            return None
        return base.token

    def host_copy(self, model: Model) -> HostCopy:
        return self._base(model).copy

    def adopt(self, model: Model, token: str | None) -> None:
        """A round committed into ``model``; ``token`` None: a trainer that sends none."""
        base = self._base(model)
        base.token, base.generation = token, self.generation

    def weights_changed(self, why: str, *, copies: bool = False) -> None:
        """The one place a delta base dies: the weights changed (or may have) without a
        committed round, ``why``. ``copies``: the host copies no longer hold what the model
        holds either (sleep level 2, a reset; a failed round's sink drops what it touched)."""
        held = [b.token for b in self._bases.values() if b.generation == self.generation]
        self.generation += 1
        if copies:
            for base in self._bases.values():
                base.copy.clear()
        if any(token is not None for token in held):
            log.info("the delta base (round %s) is forgotten: %s", held[0], why)

    def broke(self, session: str | None, reason: str, names: frozenset[str]) -> None:
        """A round that wrote in place ended without its commit."""
        names = names | (self.incomplete.names if self.incomplete is not None else frozenset())
        self.incomplete = IncompleteRound(session, reason, names)
        self.weights_changed(reason)
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
