"""Rounds one rank sends alone: the engine's one-turn rounds (``SoleRounds``), each a
``trainer.round.Round`` run by ``lead_round``.

``sole_plan`` is the round's plan (reused while the metadata stays the same); ``SoleWire``
broadcasts it to every worker, ``SlicedWire`` sends each worker only its slices (a session
whose workers told wants, ``trainer.sliced``; a delta round's patches shared by slice,
``trainer.sliced_delta``). Several broadcasting ranks: ``trainer.multi_source``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightwire.backends.base import Sent, SlicePiece, WirePlan
from weightwire.shared.delta import Patch, parse_patch
from weightwire.shared.framing import Chunk, plan
from weightwire.shared.meta import MetaRows, ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.round import (
    Round,
    RoundEnd,
    Transmission,
    Wire,
    _Began,
    carries_patches,
    lead_round,
    send_update,
)
from weightwire.trainer.session import Session
from weightwire.trainer.slice_plan import SlicePlan
from weightwire.trainer.sliced import Slicing, pieces
from weightwire.trainer.sliced_delta import PatchShares, share_patches
from weightwire.trainer.snapshot import rewrapped
from weightwire.trainer.transfer import chunked, tensor_stream


@dataclass(frozen=True)
class SolePlan:
    """A single sender's round: its source metadata, its wire order and chunks, and the
    one-turn broadcast plan the driver runs."""

    metas: Sequence[ParamMeta]
    """A ``list``, or a delta round's ``MetaRows`` (its listing, new every round)."""
    wire: WirePlan
    chunks: list[Chunk]
    bplan: BroadcastPlan


def sole_plan(s: Session, metas: Sequence[ParamMeta], last: SolePlan | None) -> SolePlan:
    """The round's plan; the same metadata as last round reuses it (every round of a
    training run, in practice: the plan is on the critical path). A stock receiver's
    round is checked, maybe reordered or refused (``StockRefusal``), before any call."""
    if last is not None and last.metas == metas:
        return last
    assert s.features is not None
    size = s.info.packed_buffer_size_bytes
    wire = s.backend.plan_round(
        metas, features=s.features, packed=s.info.packed, buffer_size_bytes=size
    )
    if s.sender is not None:  # what this session's data path was opened for
        s.sender.check_round(wire.metas)
    chunks = plan(wire.metas, packed=s.info.packed, buffer_size_bytes=size)
    # Rows stay rows (a delta round's: no ParamMeta per wire tensor held through it, #49).
    rows = isinstance(metas, MetaRows)
    bplan = BroadcastPlan((0,), (Turn(0, 0, wire.metas if rows else tuple(wire.metas)),))
    return SolePlan(metas if rows else list(metas), wire, chunks, bplan)


class SoleRounds:
    """The engine's one-turn rounds (rank 0 the only broadcaster): each round's plan (the
    last one reused while the metadata stays the same) as a ``Round`` through ``lead_round``."""

    def __init__(self, s: Session) -> None:
        self._s = s
        self._planned: SolePlan | None = None

    def __call__(
        self,
        metas: Sequence[ParamMeta],
        version: str,
        clock: PhaseClock,
        draft: bool,
        end: RoundEnd | None = None,
        *,
        source: WeightSource | None = None,
        fields: Mapping[str, Any] | None = None,
        remap: Callable[[dict[str, str]], dict[str, str]] | None = None,
        before_commit: Callable[[], None] | None = None,
    ) -> RoundMetrics:
        """One round of ``metas``, told how it ended (``end``). ``source``: what the round
        reads (a delta round's wire tensors; default: the session's source); ``fields``: extra
        update-info fields (a delta round's); ``remap``: ``SoleWire``'s; ``before_commit``:
        ``Round``'s."""
        s = self._s
        with clock("metadata"):
            sole = sole_plan(s, metas, self._planned)  # a refusal: before any call
        if not carries_patches(fields):
            # A delta round's plan is not kept: its metadata (patch sizes) is never a later
            # round's, and a plan swapped in every round is long-lived garbage that feeds
            # the process's full collections (#49); the dense rounds' plan stays.
            self._planned = sole
        source = s.source if source is None else source
        if s.backend.caps.local_shards:  # each trainer rank sends its shard: left where held
            source = rewrapped(source, s.framework.sliced_source)
        wire: Wire = SoleWire(s, sole, source, remap)
        sender = s.sender
        slicing = s.slicing
        # Every worker wants every tensor whole (TP=1): the broadcast, nothing else asked.
        if (
            slicing is not None
            and slices_round(slicing, sole.wire.metas, fields)
            and sliced_round(s, slicing, draft=draft, fields=fields)
        ):
            with clock("metadata"):  # the plan (built once), and a refusal: before any call
                patches = patch_entries(fields)
                if patches:  # each worker its share of the patches (the shares: before any call)
                    sliced = SlicedWire.of_delta(s, slicing, sole, source, patches)
                    assert sliced.shares is not None
                    fields = {**(fields or {}), "shares": sliced.shares.counts}
                else:
                    sliced = SlicedWire.of(s, slicing, sole, source)
            wire, sender = sliced, slicing.sender  # each worker its pieces, on their own path
            fields = {**(fields or {}), "sliced": True}
        sole_round = Round(
            version,
            sole.bplan,
            sole.metas,  # ``metas``' equal: the same list every round of the plan
            wire,
            draft,
            fields=fields or {},
            # a stock receiver's own update info (nccl_m2n: the names), else built from metas
            payloads=None if sole.wire.update_info is None else [sole.wire.update_info],
            before_commit=before_commit,
            early_pause=True,  # SoleWire runs control as soon as its first chunk is prepared
            sender=sender,
        )
        return lead_round(s, sole_round, clock, end)


class SoleWire:
    """Rank 0 alone: the update POST beside its broadcasts, control folded into the first
    chunk's preparation (``trainer.transfer.Transfer``)."""

    def __init__(
        self,
        s: Session,
        sole: SolePlan,
        source: WeightSource,
        remap: Callable[[dict[str, str]], dict[str, str]] | None = None,
    ) -> None:
        self._s, self._sole, self._source, self._remap = s, sole, source, remap

    def transfer(self, t: Transmission) -> Sent:
        s, sole, source = self._s, self._sole, self._source
        pairs: Iterator[tuple[str, Any]] = s.stream(
            source, tensor_stream(source), sole.metas, t.own
        )
        return send_update(s, t, chunked(sole.wire.reorder(pairs), sole.chunks), sole.wire.metas)

    def digests(self, own: dict[str, str]) -> dict[str, str]:
        """``own``, keyed by what the workers hold (``remap``: a delta round's wire tensors ->
        the full tensors they patch)."""
        return own if self._remap is None else self._remap(own)


def sliced_instead_of_delta(s: Session, metas: list[ParamMeta]) -> bool:
    """``delta="auto"`` on a session whose workers want slices but where some round could not
    apply a sliced delta (``sliced_delta_refusal``): the rounds go dense and sliced (each
    worker its slices, never an element outside them) instead of as patches, which would
    reach every worker whole (said once in the log). False where the delta rounds go on:
    sliced (each worker its share of the patches) or, where the session is not sliced, as
    broadcasts."""
    slicing = s.slicing
    if slicing is None or not slicing.slices(metas):
        return False
    if not sliced_round(s, slicing, draft=False, fields=None):
        return False
    why = sliced_delta_refusal(s, slicing)
    if why is None:
        return False
    slicing.note_once(f"delta='auto' sends dense sliced rounds, not patches: {why};", whole=False)
    return True


def sliced_delta_refusal(s: Session, slicing: Slicing) -> str | None:
    """Why this sliced session's delta rounds cannot be sliced, or None: every worker said
    at the join that it applies sliced patches (it lands its slices through its landing map;
    one that loads them through ``load_weights``, e.g. vLLM on CPU, cannot), one sending
    process, no verify (its digests are of the slices sent, a delta round sends patches)."""
    if slicing.several:
        return "several sending processes"
    if s.verifier is not None:
        return "verify=True compares each round's slices, which a delta round does not send"
    if slicing.sender.device_pieces:  # patch shares are filtered on the host
        return "the backend packs sliced pieces on the device; sliced patches go over TCP only"
    unable = [w for w, ok in enumerate(slicing.patch_takers) if not ok]
    if unable:
        return (
            f"worker {unable[0]} did not say it applies sliced patches (it loads its slices "
            "through load_weights, or predates sliced delta rounds)"
        )
    return None


def sliced_round(
    s: Session, slicing: Slicing, *, draft: bool, fields: Mapping[str, Any] | None
) -> bool:
    """Whether this round of a session that asked for wants goes sliced: a round of the
    target model (verify: against a vLLM shard checker; a delta round: where every worker
    applies sliced patches), when some worker wants less than a whole tensor."""
    if draft:
        slicing.note_once("draft")  # the draft model's wants were not told
        return False
    if carries_patches(fields):
        why = sliced_delta_refusal(s, slicing)
        if why is not None:  # a delta round's patches then go to every worker
            slicing.note_once(f"a delta round's patches go whole: {why};")
            return False
    if s.framework.process_count() > 1 and not slicing.several:
        # The other processes' passes over the source gather (collectives): one process
        # cannot read its shards alone beside them. Several senders need a TrainerGroup.
        slicing.note_once("several trainer processes share the source without a TrainerGroup:")
        return False
    if slicing.several and s.verifier is not None:
        # each process would digest only its own pieces: the broadcast's digests are whole
        slicing.note_once("verify=True with several sending processes:")
        return False
    if s.verifier is not None and slicing.sender.device_pieces:
        # the slices' digests are taken of host bytes; an on-device sender never has them
        slicing.note_once("verify=True on an on-device backend:")
        return False
    if s.verifier is not None and not s.verifier.vllm_keyed(s.client):
        # digest mode compares whole tensors' sha256: only a broadcast sends them whole
        slicing.note_once("verify=True against a checker of whole tensors,")
        return False
    return True


class SlicedWire:
    """Rank 0 alone, sliced: the update POST (``sliced``) beside each worker's pieces on its
    own link (``trainer.sliced``); control before the first byte, as ``SoleWire``. A delta
    round's patch wire tensors go as each worker's share (``shares``:
    ``trainer.sliced_delta``)."""

    def __init__(
        self,
        s: Session,
        sole: SolePlan,
        tensors: dict[str, Any],
        plan: SlicePlan,
        shares: PatchShares | None = None,
    ) -> None:
        self._s, self._sole, self._tensors, self._plan = s, sole, tensors, plan
        self.shares = shares

    @classmethod
    def of(cls, s: Session, slicing: Slicing, sole: SolePlan, source: WeightSource) -> SlicedWire:
        """The round's wire (some worker wants less than a whole tensor). The source's
        tensors are referenced, not copied: the plan reads their holdings (metadata), each
        piece is read from its shard later."""
        metas = sole.wire.metas
        # tensors left where they are held, an overlapped round's snapshot too
        source = rewrapped(source, s.framework.sliced_source)
        tensors = dict(s.stream(source, tensor_stream(source), sole.metas, None))
        rank = s.framework.process_rank()
        builds = slicing.plans.builds
        plan = slicing.plan(metas, s.framework.slice_holdings(tensors), rank)
        if slicing.plans.builds != builds and s.verifier is not None:
            s.verifier.forget_previous()  # the slices' digests follow the plan's cuts
        return cls(s, sole, tensors, plan)

    @classmethod
    def of_delta(
        cls,
        s: Session,
        slicing: Slicing,
        sole: SolePlan,
        source: WeightSource,
        patches: list[Patch],
    ) -> SlicedWire:
        """A delta round's wire: its dense tensors (the base's copies, sharded as the
        source's arrays are: ``jax_side.shard_delta``) sliced by a plan of their own, each
        patch filtered per worker (``share_patches``, here: the shares go in the update
        POST)."""
        metas = sole.wire.metas
        tensors = dict(s.stream(source, tensor_stream(source), sole.metas, None))
        logical = logical_metas(metas, patches)
        dense = logical[: len(logical) - len(patches)]
        held = s.framework.slice_holdings({m.name: tensors[m.name] for m in dense})
        plan = slicing.plan(dense, held, s.framework.process_rank(), carried=logical)
        wants = slicing.wants(logical)
        shares = share_patches(patches, tensors, wants, s.framework.host_bytes)
        return cls(s, sole, tensors, plan, shares)

    def transfer(self, t: Transmission) -> Sent:
        s, metas, own = self._s, self._sole.wire.metas, t.own
        assert s.slicing is not None
        hashes: dict[str, Any] | None = None if own is None else {}
        # an on-device sender packs pieces cut on their shards' devices
        on_device = s.slicing.sender.device_pieces
        prepared: Iterator[list[SlicePiece]] = pieces(
            self._plan,
            metas,
            self._tensors,
            rank=s.framework.process_rank(),
            read=s.framework.cut_box if on_device else s.framework.read_box,
            buffer_bytes=s.info.packed_buffer_size_bytes,
            hashes=hashes,
        )
        if self.shares is not None:
            shared = self.shares.pieces(metas, s.info.packed_buffer_size_bytes)
            prepared = (shared.get(i, group) for i, group in enumerate(prepared))
        if s.slicing.began is not None:  # several processes: theirs go once control ran
            t = dataclasses.replace(t, control=_Began(t.control, s.slicing.began))
        sent = send_update(s, t, prepared, metas, sender=s.slicing.sender)
        if own is not None and hashes is not None:
            own.update({n: h.hexdigest() for n, h in hashes.items()})
        return sent

    def digests(self, own: dict[str, str]) -> dict[str, str]:
        """Per tensor, the sha256 of the pieces this round sent of it, in the plan's order:
        the same bytes give the same digest while the plan stands (vllm-diff mode compares
        them round to round; ``forget_previous`` when it was rebuilt)."""
        return own


def logical_metas(metas: Sequence[ParamMeta], patches: list[Patch]) -> Sequence[ParamMeta]:
    """A round's tensors as the workers' wants name them: its dense tensors, then each
    patched tensor whole (a dense round: ``metas`` itself)."""
    if not patches:
        return metas
    wire = {n for p in patches for n in (p.index_name, p.values_name)}
    dense = [m for m in metas if m.name not in wire]
    return dense + [ParamMeta(p.name, p.dtype, p.shape) for p in patches]


def slices_round(
    slicing: Slicing, wire_metas: Sequence[ParamMeta], fields: Mapping[str, Any] | None
) -> bool:
    """``slicing.slices`` of a round's tensors as the workers' wants name them (a delta
    round's patched tensors whole, read back from its update-info ``fields``). What it reads
    back dies on return, not held through the round's transfer (#49: fewer objects alive
    in a round, fewer promoted by the collections it meets)."""
    return slicing.slices(logical_metas(wire_metas, patch_entries(fields)))


def patch_entries(fields: Mapping[str, Any] | None) -> list[Patch]:
    """A delta round's patches from its update-info fields (none: a dense round)."""
    entries = (fields or {}).get("patches") or []
    return [parse_patch(i, entry) for i, entry in enumerate(entries)]
