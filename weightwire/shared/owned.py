"""``OwnedSource``: give a source's parameters owners, and yield only this rank's share.

For trainers whose ranks each hold (a copy or a shard of) the model and broadcast a
share of it (``trainer.broadcast_plan``): ``owner(name)`` says which rank broadcasts a
parameter; ``metadata()`` declares it as ``owners=(owner,)`` on every rank alike, and
iteration yields only the parameters this rank owns. The inner source is still
iterated in full on every rank, so trainer-side gathers (FSDP ``full_tensor``) stay in
lockstep.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource, as_source


class OwnedSource(WeightSource):
    def __init__(self, inner: Any, owner: Callable[[str], int], *, rank: int) -> None:
        self.inner = as_source(inner)
        self.owner = owner
        self.rank = rank

    def __repr__(self) -> str:
        return f"OwnedSource({self.inner!r}, rank={self.rank})"

    def metadata(self) -> list[ParamMeta]:
        return [replace(m, owners=(self.owner(m.name),)) for m in self.inner.metadata()]

    def held_names(self) -> set[str] | None:
        held = self.inner.held_names()
        return {
            m.name
            for m in self.metadata()
            if m.owners == (self.rank,) and (held is None or m.name in held)
        }

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, tensor in self.inner:
            if self.owner(name) == self.rank:
                yield name, tensor
