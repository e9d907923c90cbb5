"""A worker's sliced rounds: its wants told at the join, its pieces landed through the map.

At init, when the trainer asks (the init info's ``sliced``), the worker tells the trainer
which boxes of each checkpoint tensor it reads (``hello``: ``wants.session_wants`` over the
served checkpoint's tensors; every tensor whole, with the reason, when it has no spec or no
landing map). A sliced update then brings only those boxes, as pieces
(``ReceiveLink.receive_sliced``).

``SlicedRound`` lands them as a dense round of the same size would: within the stage budget
it holds every piece and writes them all at the commit (a round that fails before leaves the
previous weights exactly); past it, it writes each piece in place as it lands
(``write_box``), and the round counts as written in place. A worker without a landing map
(its loader is a plain copy but its served parameters are processed after loading, or it
wants every tensor whole) places its pieces in full-shaped tensors and loads them through
the round's own strategy (``load_weights`` reads only what it wanted).

A sliced delta round (``UpdateInfo.shares``) brings this worker, of each patch, only the
elements inside its wants (``PatchShare``: its ``[share]`` wire tensors, checked against its
count by ``Cover`` and element by element by ``check_within``). The hello says whether it
can take them (``"patches"``: it has a landing map); its dense pieces land as above and its
patches through the same map at the commit (``MapSink``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from weightwire.shared.delta import Patch
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Wants, first_overlap, volume
from weightwire.shared.staging import round_streams
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.dtypes import torch_dtype
from weightwire.torch_side.worker.landing import LoaderMap
from weightwire.torch_side.worker.load import Pairs
from weightwire.torch_side.worker.spec import ModelSpec
from weightwire.torch_side.worker.strategy import ReceiveStrategy, RoundTarget
from weightwire.torch_side.worker.target_caches import TargetCaches
from weightwire.torch_side.worker.wants import landing_box, session_wants, write_box

if TYPE_CHECKING:  # the delta modules load at a delta round's patch step only
    from weightwire.torch_side.worker.delta import StagedPatch

log = logging.getLogger(__name__)

Received = tuple[str, Box, torch.Tensor]
"""One landed piece: ``box`` of checkpoint tensor ``name``, as a tensor of the box's shape."""


def hello(caches: TargetCaches, backend: str) -> tuple[bytes, Wants | None]:
    """The wants' JSON this worker sends at the join, and the wants (empty and None: every
    tensor whole, when the served checkpoint's tensors are unknown here)."""
    try:
        spec = caches.model_spec()
        if spec is None:
            log.info(
                "%s: no served checkpoint spec here: this worker wants every tensor whole", backend
            )
            return b"", None
        metas = spec_metas(spec)
        wants = session_wants(caches, metas)  # a refused map: logged once by the caches
        # Lands its slices through the map: it can apply a sliced delta round's patches too.
        patches = wants.whole_reason is None and caches.loader_map(metas) is not None
    except Exception as exc:  # never fail the join over an optimisation: whole tensors
        log.warning(
            "%s: this worker's wants could not be derived (%s: %s): it wants every tensor whole",
            backend,
            type(exc).__name__,
            exc,
        )
        return b"", None
    told = {**wants.to_json(), "patches": patches}
    return json.dumps(told, separators=(",", ":")).encode(), wants


def serves_a_slice(wants: Wants | None, caches: TargetCaches) -> bool:
    """The wants this worker told leave out part of some tensor: it is one tensor-parallel
    rank of the model (its commit alone is not the model's)."""
    spec = caches.model_spec()
    if wants is None or spec is None:
        return False
    return any(
        wants.regions.get(name, (Box.whole(t.shape),)) != (Box.whole(t.shape),)
        for name, t in spec.tensors.items()
        if int(torch.Size(t.shape).numel())
    )


def spec_metas(spec: ModelSpec) -> list[ParamMeta]:
    """The served checkpoint's tensors (what the wants and the landing map are of)."""
    return [ParamMeta(n, t.dtype, t.shape) for n, t in spec.tensors.items()]


def typed(
    pieces: Iterable[tuple[int, Box, torch.Tensor]], metas: Sequence[ParamMeta]
) -> Iterator[Received]:
    """Each piece's bytes as its tensor's dtype and its box's shape (a view)."""
    for index, box, raw in pieces:
        meta = metas[index]
        yield meta.name, box, raw.view(torch_dtype(meta.dtype)).view(box.shape)


class Cover:
    """What one sliced update must bring this worker: per tensor of the update, the boxes it
    told the trainer it wants (one it did not name, or every one when it told none: whole,
    as the trainer reads it). ``checked`` refuses a piece outside them and, once the update's
    last piece landed, pieces that overlap or leave a wanted element out: a round never
    commits half a worker's slice."""

    def __init__(self, metas: Sequence[ParamMeta], told: Wants | None) -> None:
        regions = told.regions if told is not None else {}
        self.wanted = {m.name: regions.get(m.name, (Box.whole(m.shape),)) for m in metas}
        self.got: dict[str, list[Box]] = {}

    def checked(self, pieces: Iterable[Received]) -> Iterator[Received]:
        for name, box, piece in pieces:
            if not any(w.contains(box) for w in self.wanted[name]):
                raise ValueError(
                    f"a sliced round sent {name!r} box {box.describe()}, outside what this "
                    "worker wants: the trainer planned from other wants"
                )
            self.got.setdefault(name, []).append(box)
            yield name, box, piece
        for name, wanted in self.wanted.items():
            boxes = self.got.get(name, [])
            overlap = first_overlap(boxes)
            if overlap is not None:
                raise ValueError(
                    f"a sliced round sent {name!r} boxes {overlap[0].describe()} and "
                    f"{overlap[1].describe()}, which overlap"
                )
            if volume(boxes) != volume(wanted):
                raise ValueError(
                    f"a sliced round brought {volume(boxes)} of the {volume(wanted)} elements "
                    f"of {name!r} this worker wants: the round is refused, nothing of it applies"
                )


def counted(pieces: Iterable[Received], total: list[int]) -> Iterator[Received]:
    """``pieces``, their bytes added to ``total[0]`` as they pass."""
    for name, box, piece in pieces:
        total[0] += piece.numel() * piece.element_size()
        yield name, box, piece


def assembled(pieces: Iterable[Received], metas: Sequence[ParamMeta], device: Any) -> Pairs:
    """A worker without a landing map: every tensor of the update at its full shape, its
    pieces in place and zeros elsewhere, for ``load_weights`` (called with the same tensors
    as a dense round's). Its wants are what its loader reads (``Cover`` checked every one
    arrived), so the zeros are never read: the parameters get what ``load_weights`` of the
    full tensors gives them."""
    whole = {m.name: torch.zeros(m.shape, dtype=torch_dtype(m.dtype), device=device) for m in metas}
    for name, box, piece in pieces:
        whole[name][box.slices()] = piece
    return list(whole.items())


class PatchShare:
    """This worker's part of a sliced delta round (``UpdateInfo.shares``): the update's
    tensors with each patch's ``@index`` / ``@values`` at its share's length (what the
    pieces are checked against, ``Cover``), the patches it gets (those of a share of 0
    left out), and, as the pieces land, each share's tensor. Indices are flat indices into
    the whole checkpoint tensor, applied through the landing map like a broadcast
    delta round's."""

    def __init__(self, update: UpdateInfo, patches: Sequence[Patch], worker: int) -> None:
        counts = update.share(worker)
        self.patches = [replace(p, nnz=n) for p, n in zip(patches, counts, strict=True) if n]
        self.sizes = {
            name: n
            for p, n in zip(patches, counts, strict=True)
            for name in (p.index_name, p.values_name)
        }
        self.metas = [
            ParamMeta(m.name, m.dtype, (self.sizes[m.name],)) if m.name in self.sizes else m
            for m in update.metas()
        ]
        self.lmap: LoaderMap | None = None
        """The landing map its patches and dense pieces land through (the patch step's)."""
        self._parts: dict[str, torch.Tensor] = {}
        self.nbytes = 0

    def split(self, pieces: Iterable[Received]) -> Iterator[Received]:
        """The dense tensors' pieces go on; the patch wire tensors' are copied into their
        share's tensor (the frame's buffer is reused)."""
        for name, box, piece in pieces:
            if name not in self.sizes:
                yield name, box, piece
                continue
            part = self._parts.get(name)
            if part is None:
                part = torch.empty(self.sizes[name], dtype=piece.dtype, device=piece.device)
                self._parts[name] = part
            part[box.slices()] = piece
            self.nbytes += piece.numel() * piece.element_size()

    def pairs(self) -> Pairs:
        """Every received share, as the wire tensors of a delta round (``PatchSplitter``)."""
        return list(self._parts.items())


def check_within(patches: Sequence[StagedPatch], told: Wants | None) -> None:
    """``ValueError`` when a patch writes an element outside the boxes this worker told it
    wants (the trainer filtered by other wants): refused before anything of it applies."""
    regions = told.regions if told is not None else {}
    for staged in patches:
        p = staged.patch
        boxes = regions.get(p.name, (Box.whole(p.shape),))
        if tuple(boxes) == (Box.whole(p.shape),) or not staged.index.numel():
            continue
        coords = torch.unravel_index(staged.index.to(torch.int64), p.shape)
        keep = torch.zeros(staged.index.shape, dtype=torch.bool, device=staged.index.device)
        for box in boxes:
            hit = torch.ones_like(keep)
            for c, (lo, hi) in zip(coords, box.ranges, strict=True):
                hit &= (c >= lo) & (c < hi)
            keep |= hit
        if not bool(keep.all()):
            at = int(torch.nonzero(~keep)[0, 0])
            raise ValueError(
                f"a sliced delta round patches {p.name!r} at flat index "
                f"{int(staged.index[at])}, outside what this worker wants: the trainer "
                "filtered its patches by other wants"
            )


class SlicedRound(ReceiveStrategy):
    """A round of pieces written through the landing map (module docstring)."""

    name = "sliced"

    def __init__(self, target: RoundTarget, lmap: LoaderMap, budget_bytes: int) -> None:
        super().__init__(target)
        self.lmap = lmap
        self.budget_bytes = budget_bytes
        self.held: list[Received] = []
        self.held_bytes = 0
        self.in_place = False
        self._boxes: dict[str, bool] = {}  # per tensor: its landings all read boxes
        self._wholes: dict[str, tuple[torch.Tensor, int]] = {}  # tensors assembled, filled

    @property
    def label(self) -> str:
        return "sliced_in_place" if self.in_place else self.name

    def begin(self) -> None:
        pass

    def receive(self, chunks: Iterator[Pairs]) -> None:
        raise TypeError("a sliced round receives pieces (receive_pieces), not chunks")

    def held_tensors(self) -> Pairs:
        return [*((name, piece) for name, _, piece in self.held), *super().held_tensors()]

    def receive_pieces(self, pieces: Iterable[Received]) -> int:
        """One update's pieces; held until every one landed (a failed update adds
        nothing), or written as they land once the round outgrew the budget. Returns the
        update's payload bytes."""
        update: list[Received] = []
        nbytes = 0
        for name, box, piece in pieces:
            size = piece.numel() * piece.element_size()
            nbytes += size
            if not self.in_place and round_streams(self.held_bytes + nbytes, self.budget_bytes):
                self._go_in_place(update)
                update = []
            if self.in_place:
                self._write([(name, box, piece)])
            else:
                update.append((name, box, piece))
        self.held.extend(update)
        self.held_bytes += sum(p.numel() * p.element_size() for _, _, p in update)
        self.names.update(n for n, _, _ in update)
        return nbytes

    def _go_in_place(self, update: list[Received]) -> None:
        log.info(
            "%s: the sliced round outgrew the stage budget (%d bytes); it lands in place",
            self.target.backend,
            self.budget_bytes,
        )
        self.in_place = True
        held, self.held, self.held_bytes = self.held, [], 0
        self._write([*held, *update])

    def _write(self, pieces: Sequence[Received]) -> None:
        self.wrote = True
        for name, box, piece in pieces:
            if self._boxed(name):
                write_box(self.lmap, name, box, piece)
            else:  # its loader reads a view that is not a box: the tensor goes whole
                self._assemble(name, box, piece)
            self.names.add(name)

    def _boxed(self, name: str) -> bool:
        boxed = self._boxes.get(name)
        if boxed is None:
            tl = self.lmap.tensors[name]
            boxed = all(landing_box(tl.shape, ld) is not None for ld in tl.landings if ld.numel)
            self._boxes[name] = boxed
        return boxed

    def _assemble(self, name: str, box: Box, piece: torch.Tensor) -> None:
        """A piece of a tensor wanted whole, into its whole copy; written through the map
        (``LoaderMap.write``) once every element is there."""
        shape = self.lmap.tensors[name].shape
        whole, filled = self._wholes.get(name, (None, 0))
        if whole is None:
            whole = torch.empty(shape, dtype=piece.dtype, device=piece.device)
        whole[box.slices()] = piece
        filled += box.volume
        if filled == whole.numel():
            self._wholes.pop(name, None)
            self.lmap.write(name, whole)
        else:
            self._wholes[name] = (whole, filled)

    def commit(self) -> None:
        held, self.held = self.held, []
        self.held_bytes = 0
        if held:
            self._write(held)
        delta = self.delta
        if delta is not None:  # a sliced delta round: its patches, after the dense pieces
            for name, tensor in delta.finish(self.names, set()):
                self.lmap.write(name, tensor)  # a sink that rebuilds tensors (none today)
            self.wrote = self.wrote or delta.writes_live
            delta.after_commit()

    def abort(self, why: str) -> None:
        dropped, self.held = len(self.held), []
        log.info(
            "%s: sliced round dropped (%s); %d received pieces discarded%s",
            self.target.backend,
            why,
            dropped,
            ", some were written in place" if self.wrote else ", weights unchanged",
        )


__all__ = [
    "Cover",
    "PatchShare",
    "Received",
    "SlicedRound",
    "assembled",
    "check_within",
    "counted",
    "hello",
    "spec_metas",
    "typed",
]
