"""Broadcast plan: which trainer rank sends which parameters, in which turn.

Each parameter is broadcast by its first owner (``ParamMeta.owners[0]``; rank 0 when
``owners`` is ``None``). The transfer group's trainer part is rank 0 plus every
distinct first owner, in ascending rank order; a rank's index there is its group rank,
the ``src`` of its turn. A round is one ``update_weights`` per broadcaster, in that
order; ranks outside the group only iterate their source (trainer-side gathers).

Rules, each checked identically on every rank (so every rank raises alike, before
anything is sent):

1. rank 0 may not be a non-first owner of a parameter: it gathers only in its own turn;
2. with several broadcasters, every parameter declares its owners (``None`` would mean
   "every rank", which names no single broadcaster), and a rank that owns parameters of
   two broadcasters is refused (each broadcaster sends in its own turn);
3. each broadcaster's parameters form one contiguous run of the metadata, and the runs
   appear in ascending broadcaster rank. Turn order is then metadata order, so sources
   whose iteration is a collective (JAX multi-process gathers, FSDP ``full_tensor``)
   never wait on a broadcaster that is blocked until a later turn;
4. every name a rank cannot produce has a holder: ``held_names`` of its broadcaster
   must include it (an orphan name would leave the worker waiting for bytes nobody
   sends);
5. metadata is identical on every rank: ``digest`` is exchanged over the trainer's own
   group (``trainer.group.Exchange``) and a disagreement names the ranks.

Version gate (``check_receiver``): a plan with several broadcasters goes only to our
plugin's receivers (a stock vLLM 0.33 worker takes only ``src`` 0) over a backend that
carries several (``weightwire_tcp``: a star per broadcaster; ``weightwire_nccl``: one
group, a root per turn; not ``weightwire_ipc``), refused before any request.
``verify=True`` covers every broadcaster: each one digests its own slice and rank 0
checks their union (``trainer.multi_source``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightwire import backends
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta


class PlanError(ConfigError):
    """The metadata cannot be broadcast by this set of ranks; the message names
    the rank and name."""


@dataclass(frozen=True)
class Turn:
    """One broadcaster's share of a round: ``src`` is its group rank."""

    rank: int
    src: int
    metas: Sequence[ParamMeta]
    """A tuple, or a delta round's ``MetaRows`` (``trainer.sole_round.sole_plan``)."""


@dataclass(frozen=True)
class BroadcastPlan:
    group_ranks: tuple[int, ...]
    """Trainer ranks of the transfer group, in group-rank order (rank 0 first)."""
    turns: tuple[Turn, ...]
    """Broadcasters in turn order (= group-rank order = metadata order); empty slices omitted."""

    @property
    def multi(self) -> bool:
        """More than one broadcaster: needs a receiver that takes ``src != 0``."""
        return len(self.group_ranks) > 1

    def turn_of(self, rank: int) -> Turn | None:
        return next((t for t in self.turns if t.rank == rank), None)

    def in_group(self, rank: int) -> bool:
        return rank in self.group_ranks

    def world_size(self, num_workers: int) -> int:
        """Transfer group size: the group's trainer ranks plus the inference workers."""
        return len(self.group_ranks) + num_workers


def first_owner(meta: ParamMeta) -> int:
    return 0 if meta.owners is None else meta.owners[0]


def plan_broadcast(metas: Sequence[ParamMeta]) -> BroadcastPlan:
    """The plan for ``metas``, or ``PlanError`` naming the first parameter that
    breaks a rule (1-3)."""
    for m in metas:
        if m.owners is not None and 0 in m.owners[1:]:
            raise PlanError(
                f"parameter {m.name!r} has owners {list(m.owners)}: rank 0 gathers only in its own "
                "turn, so it must be the first owner of every parameter it owns"
            )
    broadcasters = sorted({first_owner(m) for m in metas})
    if len(broadcasters) > 1:
        home: dict[int, int] = {}
        for m in metas:
            if m.owners is None:
                raise PlanError(
                    f"parameter {m.name!r} has no owners (every rank), but the source has several "
                    f"broadcasting ranks {broadcasters}; every parameter must declare its owners"
                )
            for r in m.owners:
                prev = home.setdefault(r, m.owners[0])
                if prev != m.owners[0]:
                    raise PlanError(
                        f"rank {r} owns parameters broadcast by ranks {prev} and {m.owners[0]} (at "
                        f"{m.name!r}); each broadcaster sends in its own turn, so every parameter "
                        "a rank owns must share its first owner"
                    )
    runs: list[tuple[int, list[ParamMeta]]] = []
    for m in metas:
        b = first_owner(m)
        if runs and runs[-1][0] == b:
            runs[-1][1].append(m)
            continue
        if runs and b < runs[-1][0]:
            raise PlanError(
                f"parameter {m.name!r} (broadcaster rank {b}) follows parameters of rank "
                f"{runs[-1][0]}: each broadcaster's parameters must be one contiguous run, runs in "
                "ascending rank order"
            )
        runs.append((b, [m]))
    if len({b for b, _ in runs}) != len(runs):  # unreachable given ascending order; kept as a guard
        raise PlanError("a broadcaster's parameters are split into several runs")
    group = tuple(sorted({0, *broadcasters}))
    turns = tuple(Turn(b, group.index(b), tuple(ms)) for b, ms in runs)
    return BroadcastPlan(group, turns)


def check_holders(plan: BroadcastPlan, rank: int, held: set[str] | None) -> None:
    """Rule 4 on this rank: the broadcaster can produce every name of its turn."""
    turn = plan.turn_of(rank)
    if turn is None or held is None:
        return
    orphans = [m.name for m in turn.metas if m.name not in held]
    if orphans:
        more = f" (+{len(orphans) - 1} more)" if len(orphans) > 1 else ""
        raise PlanError(
            f"rank {rank} is the first owner of {orphans[0]!r}{more} but does not hold it "
            "(held_names); no rank would send it, and the workers would wait for it"
        )


def digest(metas: Sequence[ParamMeta]) -> str:
    """A stable hash of names, dtypes, shapes and owners, for the cross-rank comparison (rule 5)."""
    text = json.dumps([m.to_dict() for m in metas], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_agreement(digests: Sequence[str], differences: Mapping[int, str] | None = None) -> None:
    """Rule 5: every rank's metadata digest equals rank 0's; else name the disagreeing ranks
    and, where told (``first_difference`` per rank), what differs."""
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if odd:
        told = "".join(
            f"; rank {r}: {differences[r]}" for r in odd if differences and r in differences
        )
        raise PlanError(
            f"trainer ranks disagree on the metadata: rank(s) {odd} differ from rank 0 (digest "
            f"{digests[0][:12]} vs {', '.join(digests[r][:12] for r in odd)}){told}; every rank "
            "must declare the same names, dtypes, shapes and owners in the same order"
        )


def first_difference(zero: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]]) -> str:
    """Where another rank's metadata (``ParamMeta.to_dict``s) first departs from rank 0's."""
    for i, (a, b) in enumerate(zip(zero, other, strict=False)):
        if a == b:
            continue
        if a.get("name") != b.get("name"):
            return f"tensor #{i} is {b.get('name')!r} there, {a.get('name')!r} on rank 0"
        fields = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        return f"{a.get('name')!r} has " + ", ".join(
            f"{k} {b.get(k)!r} there, {a.get(k)!r} on rank 0" for k in fields
        )
    if len(other) != len(zero):
        longer, where = (other, "there") if len(other) > len(zero) else (zero, "on rank 0")
        extra = longer[min(len(zero), len(other))].get("name")
        return (
            f"{len(other)} tensors there, {len(zero)} on rank 0 (first one only {where}: {extra!r})"
        )
    return "the same tensors in another form"


def _carriers() -> str:
    """The registered backends that carry several broadcasters (``SenderCaps.several``)."""
    return " or ".join(n for n in backends.SPECS if backends.get_backend(n).caps.several)


def check_receiver(plan: BroadcastPlan, backend: str, *, stock: bool, several: str | None) -> None:
    """The version gate: several broadcasters only to receivers that take ``src != 0``
    (our plugin's), over a backend that can carry them (``SenderCaps.several``:
    TCP stars, or one NCCL group with a root per turn)."""
    if not plan.multi:
        return
    if stock:
        raise PlanError(
            f"the metadata has broadcasting ranks {list(plan.group_ranks)}, but backend "
            f"{backend!r} runs vLLM's own receiver, which (vLLM 0.33) receives only from src 0; "
            f"use {_carriers()}, or make rank 0 the first owner of every parameter"
        )
    if several not in ("stars", "group"):
        raise PlanError(
            f"the metadata has broadcasting ranks {list(plan.group_ranks)}, but backend "
            f"{backend!r} carries one broadcaster only; use {_carriers()}, or make rank 0 the "
            "first owner of every parameter"
        )
