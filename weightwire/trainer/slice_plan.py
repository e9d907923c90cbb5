"""The slice plan: which trainer rank sends which slice of which tensor to which worker.

Built once per session from the tensors' metadata, what each trainer rank holds
(``Holdings``: from a ``jax.Array``'s sharding in ``jax_side.holdings``, from a tensor or
DTensor in ``torch_side.sender.holdings``) and each worker's ``Wants``; rebuilt only when
the metadata changes. Every wanted element is sent exactly once to each worker wanting it,
from a rank that holds it, so no rank ever assembles a tensor it does not hold whole.

Where several ranks hold the same box (a replicated tensor, the FSDP replicas of a
TP-sharded one) each piece goes from the one that has been given the fewest bytes so
far (ties: the lowest rank), tensor by tensor in metadata order: deterministic, so
every trainer process that builds the plan from the same inputs gets the same plan.

Framework-neutral: ranks and boxes only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Shape, Wants


class SlicePlanError(ConfigError):
    """The holdings or wants do not fit the session's tensors, or a wanted element is
    held by no trainer rank."""

    everywhere = False
    """Raised by the processes' plan agreement (``multi_sliced``): on every process, before
    any byte."""


@dataclass(frozen=True)
class Held:
    """Trainer ``rank`` holds ``box`` of tensor ``tensor`` (one copy; replicas are
    several ``Held`` with the same box)."""

    tensor: str
    rank: int
    box: Box


@dataclass(frozen=True)
class Holdings:
    """Every trainer rank's boxes of every tensor, as all ranks agree on them."""

    shapes: Mapping[str, Shape]
    held: Mapping[str, tuple[Held, ...]]

    @classmethod
    def of(cls, shapes: Mapping[str, Sequence[int]], held: Iterable[Held]) -> Holdings:
        by: dict[str, list[Held]] = {n: [] for n in shapes}
        for h in held:
            if h.tensor not in by:
                raise SlicePlanError(f"a rank holds {h.tensor!r}, which has no declared shape")
            shape = tuple(shapes[h.tensor])
            if not h.box.within(shape):
                raise SlicePlanError(
                    f"rank {h.rank} holds {h.tensor!r} box {h.box.describe()}, outside its "
                    f"shape {list(shape)}"
                )
            by[h.tensor].append(h)
        return cls({n: tuple(s) for n, s in shapes.items()}, {n: tuple(v) for n, v in by.items()})

    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({h.rank for hs in self.held.values() for h in hs}))


@dataclass(frozen=True)
class PlannedPiece:
    """One slice on the wire: ``box`` of ``tensor``, from the plan's rank to its worker."""

    tensor: str
    box: Box
    nbytes: int


@dataclass(frozen=True)
class SlicePlan:
    """``pieces[(rank, worker)]``: what that rank sends that worker, in metadata order
    (tensor, then box origin). Workers are numbered by their place in the wants list."""

    pieces: Mapping[tuple[int, int], tuple[PlannedPiece, ...]]
    workers: int
    _worker_bytes: dict[int, int] = field(default_factory=dict, repr=False)
    _rank_bytes: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def worker_bytes(self) -> Mapping[int, int]:
        """Bytes each worker receives in a round."""
        return self._worker_bytes

    @property
    def rank_bytes(self) -> Mapping[int, int]:
        """Bytes each trainer rank sends in a round (ranks that send nothing: absent)."""
        return self._rank_bytes

    def of_rank(self, rank: int) -> dict[int, tuple[PlannedPiece, ...]]:
        """Worker -> what ``rank`` sends it."""
        return {w: ts for (r, w), ts in self.pieces.items() if r == rank}


def build_plan(metas: Sequence[ParamMeta], holdings: Holdings, wants: Sequence[Wants]) -> SlicePlan:
    """The plan (module docstring). Raises ``SlicePlanError`` when holdings or wants
    disagree with ``metas`` or a wanted element is held by no rank."""
    shapes = {m.name: tuple(m.shape) for m in metas}
    for name, shape in holdings.shapes.items():
        if shapes.get(name) != tuple(shape):
            raise SlicePlanError(
                f"holdings describe {name!r} as {list(shape)}, the session declares "
                f"{list(shapes[name]) if name in shapes else 'no such tensor'}: build the "
                "holdings from the arrays the metadata was taken from"
            )
    sent: dict[int, int] = {}
    got: dict[int, int] = {w: 0 for w in range(len(wants))}
    out: dict[tuple[int, int], list[PlannedPiece]] = {}
    for meta in metas:
        itemsize = wire_dtype(meta.dtype).itemsize
        copies = _distinct(holdings.held.get(meta.name, ()))
        for w, want in enumerate(wants):
            if meta.name not in want.regions:
                raise SlicePlanError(
                    f"worker {w}'s wants do not name {meta.name!r}: parse them with "
                    "Wants.from_json against the session's tensors"
                )
            for region in want.regions[meta.name]:
                if not region.within(meta.shape):
                    raise SlicePlanError(
                        f"worker {w} wants {meta.name!r} {region.describe()}, outside its "
                        f"shape {list(meta.shape)}: parse wants with Wants.from_json"
                    )
                for rank, box in _cover(meta.name, region, copies, sent, itemsize, w):
                    nbytes = box.volume * itemsize
                    out.setdefault((rank, w), []).append(PlannedPiece(meta.name, box, nbytes))
                    got[w] += nbytes
    order = {m.name: i for i, m in enumerate(metas)}
    return SlicePlan(
        {
            k: tuple(sorted(v, key=lambda t: (order[t.tensor], t.box.ranges)))
            for k, v in sorted(out.items())
        },
        len(wants),
        got,
        {r: n for r, n in sorted(sent.items()) if n},
    )


class PlanCache:
    """A session's plan: built on first use, the same object every round after while the
    metadata, holdings and wants stay equal; rebuilt when any of them changes."""

    def __init__(self) -> None:
        self._key: tuple[tuple[ParamMeta, ...], Holdings, tuple[Wants, ...]] | None = None
        self._plan: SlicePlan | None = None
        self.builds = 0

    def plan(
        self, metas: Sequence[ParamMeta], holdings: Holdings, wants: Sequence[Wants]
    ) -> SlicePlan:
        key = (tuple(metas), holdings, tuple(wants))
        if self._plan is None or key != self._key:
            self._plan = build_plan(metas, holdings, wants)
            self._key = key
            self.builds += 1
        return self._plan


def _distinct(held: Sequence[Held]) -> list[tuple[Box, tuple[int, ...]]]:
    """Each distinct held box with the ranks holding it, largest first (fewer, bigger
    pieces), then by origin."""
    ranks: dict[Box, set[int]] = {}
    for h in held:
        if not h.box.empty:
            ranks.setdefault(h.box, set()).add(h.rank)
    return sorted(
        ((b, tuple(sorted(rs))) for b, rs in ranks.items()),
        key=lambda item: (-item[0].volume, item[0].ranges),
    )


def _touching(
    region: Box, copies: list[tuple[Box, tuple[int, ...]]]
) -> list[tuple[Box, tuple[int, ...]]]:
    """The held boxes sharing an element with ``region`` (a plain range test per box: a
    trainer of hundreds of ranks holds hundreds of boxes of each tensor)."""
    want = region.ranges
    return [
        (held, ranks)
        for held, ranks in copies
        if all(
            lo < whi and wlo < hi for (lo, hi), (wlo, whi) in zip(held.ranges, want, strict=True)
        )
    ]


def _cover(
    name: str,
    region: Box,
    copies: list[tuple[Box, tuple[int, ...]]],
    sent: dict[int, int],
    itemsize: int,
    worker: int,
) -> list[tuple[int, Box]]:
    """``region`` cut into pieces each inside one held box, each with the rank to send it."""
    left = [region]
    pieces: list[tuple[int, Box]] = []
    for held, ranks in _touching(region, copies):
        if not left:
            break
        rest: list[Box] = []
        for part in left:
            piece = part.intersect(held)
            if piece is None:
                rest.append(part)
                continue
            rank = min(ranks, key=lambda r: (sent.get(r, 0), r))
            sent[rank] = sent.get(rank, 0) + piece.volume * itemsize
            pieces.append((rank, piece))
            rest.extend(part.minus(piece))
        left = rest
    if left:
        raise SlicePlanError(
            f"worker {worker} wants {name!r} {left[0].describe()}, which no trainer rank "
            "holds: the holdings must cover every tensor (a sharded array's every shard)"
        )
    return pieces


__all__ = [
    "Held",
    "Holdings",
    "PlanCache",
    "SlicePlan",
    "SlicePlanError",
    "PlannedPiece",
    "build_plan",
]
