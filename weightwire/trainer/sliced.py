"""Sliced rounds, rank 0's state: the workers' wants, whether slicing pays, the plan.

At the join each worker told which boxes of every tensor it reads (its hello: the JSON of
``shared.slices.Wants``; empty from a worker that told none, which wants everything whole).
They are parsed once per round metadata against the session's tensors (``SliceError``
naming the worker and the tensor, before any byte); a tensor a worker does not name (its
spec lacks it, e.g. a tied head the trainer sends anyway) is wanted whole. A hello names
every tensor of the worker's served checkpoint, so a sliced round that lacks one a worker
reads is refused before any call (``unsent``: ``ServedModelMismatch``, unless
``TrainerInitInfo.partial``), whether or not the servers told their served model.

Where every worker wants every tensor whole (tensor parallelism 1) rounds stay broadcasts.
Else every dense round is sliced: the plan (``slice_plan.PlanCache``: rebuilt only when the
metadata, the holdings or the wants change) gives each worker the pieces it wants, each read
from a shard this process holds (``pieces``). One sending process only: a plan that needs
another trainer process's shards is refused (``ConfigError``) before any call.

A hello may also say ``"patches": true`` (``takes_patches``): the worker lands its slices
through its landing map and applies a sliced delta round's patches. Where every worker says
so, ``delta="auto"`` rounds are sliced too (``trainer.sliced_delta``); else they go dense
and sliced (``round.sliced_instead_of_delta``).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from hashlib import sha256
from typing import Any

import numpy as np

from weightwire.backends.base import RoundSender, SlicePiece
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.served import SHOWN, ServedModelMismatch
from weightwire.shared.slices import Box, SliceError, Wants, split_box
from weightwire.trainer.slice_plan import Holdings, PlanCache, PlannedPiece, SlicePlan

log = logging.getLogger(__name__)

PATCHES_KEY = "patches"
"""The hello's key beside the wants: ``true`` from a worker that applies sliced patches."""
OLD_HELLO = "the worker told no wants (it predates sliced rounds, or knows no served checkpoint)"


def parse_wants(raw: bytes, metas: Sequence[ParamMeta], worker: int) -> Wants:
    """Worker ``worker``'s hello as its wants of ``metas`` (module docstring)."""
    shapes = {m.name: tuple(m.shape) for m in metas}
    if not raw:
        return Wants.whole(shapes, OLD_HELLO)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SliceError(
            f"worker {worker}'s wants are not JSON: {exc} (TrainerInitInfo(sliced='off') "
            "sends broadcasts instead)"
        ) from None
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k != PATCHES_KEY}  # told apart: takes_patches
    if isinstance(obj, dict) and isinstance(obj.get("tensors"), dict):
        told = obj["tensors"]
        # The worker names its served checkpoint's tensors: the round's own are judged,
        # one it does not name goes whole.
        obj = {
            **obj,
            "tensors": {n: told.get(n, [[[0, d] for d in shape]]) for n, shape in shapes.items()},
        }
    try:
        return Wants.from_json(obj, shapes)
    except SliceError as exc:
        raise SliceError(
            f"worker {worker}'s wants: {exc}: worker {worker} serves a checkpoint whose tensors "
            "differ from the trainer's (the source is not the served model's architecture or "
            "config: check the hidden size, vocab and head counts); where the shapes do match, "
            "TrainerInitInfo(sliced='off') sends broadcasts instead"
        ) from None


def takes_patches(raw: bytes) -> bool:
    """The worker said at the join that it applies a sliced delta round's patches (it lands
    its slices through its landing map); False from one that did not say (an older hello,
    or a worker that loads its slices through ``load_weights``), or from a hello that is not
    a JSON object (``parse_wants`` names that)."""
    try:
        obj = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get(PATCHES_KEY) is True


def read_names(raw: bytes) -> frozenset[str]:
    """The checkpoint tensors worker hello ``raw`` says the worker reads some element of
    (its served model's tensors, less those held only by other ranks); empty for a hello that
    told none or does not parse (``parse_wants`` names that)."""
    try:
        obj = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError):
        return frozenset()
    told = obj.get("tensors") if isinstance(obj, dict) else None
    if not isinstance(told, dict):
        return frozenset()
    return frozenset(n for n, boxes in told.items() if isinstance(boxes, list) and boxes)


def unsent(reads: Sequence[frozenset[str]], metas: Sequence[ParamMeta]) -> str | None:
    """Why a round of ``metas`` does not fit the workers' served model (None: it does): the
    tensors some worker reads (``reads``: each worker's ``read_names``) that the round lacks,
    which it would keep serving unchanged beside the new ones. Every worker's hello names its
    served checkpoint's tensors, so this holds whether or not the servers told their served
    model at init."""
    sent = {m.name for m in metas}
    for worker, read in enumerate(reads):
        missing = sorted(read - sent)
        if missing:
            shown = ", ".join(missing[:SHOWN]) + (", ..." if len(missing) > SHOWN else "")
            return (
                f"the round does not fit the served model; nothing was sent: worker {worker} "
                f"reads {len(missing)} checkpoint tensor(s) the round lacks [{shown}] ("
                f"{len(sent)} tensor(s) sent): the model would serve them unchanged beside the "
                "new ones. Send the whole model (a source that misses a layer: check its naming "
                "rules), or pass TrainerInitInfo(partial=True) if the rounds leave them out on "
                "purpose (frozen layers)"
            )
    return None


def wants_less(wants: Sequence[Wants], metas: Sequence[ParamMeta]) -> bool:
    """Some worker wants less than some whole tensor (slicing saves bytes)."""
    return any(w.regions[m.name] != (Box.whole(m.shape),) for w in wants for m in metas if m.numel)


class Slicing:
    """A session's sliced-round state: rank 0's, or with several sending processes
    (``several``) each process's, the hellos told by rank 0 over the trainer group."""

    def __init__(
        self,
        hellos: list[bytes],
        sender: RoundSender,
        *,
        several: bool = False,
        partial: bool = False,
    ) -> None:
        self.hellos = hellos
        self.sender = sender
        self.several = several
        self.partial = partial
        """``TrainerInitInfo.partial``: a round may leave out tensors the workers read."""
        self.plans = PlanCache()
        self.delta_plans = PlanCache()
        """The plan of delta rounds' dense tensors (a set of its own: kept apart so dense and
        delta rounds do not rebuild each other's plan every round)."""
        self.patch_takers = [takes_patches(raw) for raw in hellos]
        """Per worker: it applies a sliced delta round's patches (said at the join)."""
        self._reads = [read_names(raw) for raw in hellos]
        self._wants: dict[frozenset[ParamMeta], list[Wants]] = {}
        self._sliced: tuple[Sequence[ParamMeta], bool] | None = None
        """The last ``slices`` answer and its tensor list (a plan's rounds pass the same)."""
        self._whole: set[ParamMeta] = set()
        """Tensors every worker wants whole (a ``slices`` answer of no): a delta round's,
        a new list each round, answered without parsing the wants again nor caching them
        per round (#49: per-round additions to long-lived caches feed full collections)."""
        self._told: set[str] = set()
        self.split = False
        """A round went sliced: the workers are ranks of one model, each holding part of
        it, and their commits together make the model's round (``round.guard_split_commit``)."""
        self.agree: Callable[[SlicePlan | None, str | None], None] | None = None
        """Several processes: every rank checks it built the same plan, or learns which rank
        could not (before any call)."""
        self.merge: Callable[[Holdings], Holdings] | None = None
        """Several processes: what every process says it holds itself (a plain tensor is
        known whole only to the process that has it), the same on every process."""
        self.began: Callable[[], None] | None = None
        """Several processes: rank 0 tells the others its control plane ran (they may send)."""

    def wants(self, metas: Sequence[ParamMeta]) -> list[Wants]:
        """Every worker's wants of ``metas`` (parsed once per set of tensors: a delta session
        asks for its model's tensors and for a delta round's, in another order)."""
        key = frozenset(metas)
        if key not in self._wants:
            if len(self._wants) >= 8:  # the source's metadata changed: start afresh
                self._wants.clear()
            parsed = [parse_wants(raw, metas, w) for w, raw in enumerate(self.hellos)]
            self._wants[key] = parsed
            for w, want in enumerate(parsed):
                if want.whole_reason is not None:
                    self.note_once(
                        f"worker {w} wants every tensor whole: {want.whole_reason}", whole=False
                    )
        return self._wants[key]

    def slices(self, metas: Sequence[ParamMeta]) -> bool:
        """Slicing a round of ``metas`` saves bytes (some worker wants less than a whole
        tensor); else its rounds are broadcasts (said once)."""
        if self._sliced is not None and self._sliced[0] is metas:
            return self._sliced[1]
        if self._whole and all(m in self._whole for m in metas):
            return False  # a delta round's tensors: each one every worker wants whole
        less = wants_less(self.wants(metas), metas)
        self._sliced = (metas, less)
        if less:
            self.split = True
            return True
        self._whole.update(metas)
        self.note_once("every worker wants every tensor whole:")
        return False

    def plan(
        self,
        metas: Sequence[ParamMeta],
        holdings: Holdings,
        rank: int,
        *,
        carried: Sequence[ParamMeta] | None = None,
    ) -> SlicePlan:
        """The plan of ``metas`` (cached); before any call, ``ServedModelMismatch`` when the
        round lacks a tensor some worker reads (``unsent``; unless ``partial``), ``ConfigError``
        when it needs a shard that another trainer process holds. ``carried``: a delta round's
        tensors, its dense ones (``metas``, planned apart from the dense rounds') and each
        patched one; it leaves out what did not change (its base, a whole round the workers
        hold, was checked when it was sent), so it is not checked against the workers' reads."""
        if self.merge is not None:
            holdings = self.merge(holdings)
        told = metas if carried is None else carried
        try:
            missing = None if self.partial or carried is not None else unsent(self._reads, told)
            if missing is not None:
                raise ServedModelMismatch(missing)
            cache = self.plans if carried is None else self.delta_plans
            plan = cache.plan(metas, holdings, self.wants(told))
        except Exception as exc:
            if self.agree is not None:  # the other processes learn it instead of waiting
                self.agree(None, f"{type(exc).__name__}: {exc}")
            raise
        if self.agree is not None:
            self.agree(plan, None)
        others = sorted(set(plan.rank_bytes) - {rank})
        if others and not self.several:
            raise ConfigError(
                f"a sliced round needs shards held by trainer process(es) {others}, not by "
                f"this one ({rank}): sliced rounds are sent by one trainer process (every "
                "shard addressable here); pass TrainerInitInfo(sliced='off') to broadcast"
            )
        return plan

    def note_once(self, why: str, *, whole: bool = True) -> None:
        """One INFO line per reason a round of a sliced session is not sent as usual
        (``whole``: it is broadcast instead)."""
        if why not in self._told:
            self._told.add(why)
            log.info("sliced session: %s%s", why, " rounds are broadcast whole" if whole else "")


def pieces(
    plan: SlicePlan,
    metas: Sequence[ParamMeta],
    tensors: Mapping[str, Any],
    *,
    rank: int,
    read: Callable[[Any, Box], Any],
    buffer_bytes: int,
    hashes: dict[str, Any] | None = None,
) -> Iterator[list[SlicePiece]]:
    """Per tensor of ``metas`` (the update's order), the pieces ``rank`` sends: each
    planned piece cut to at most ``buffer_bytes`` (``split_box``), read lazily.
    ``hashes``: each tensor's sha256 over its pieces' bytes, as they are read (verify; a
    tensor no worker reads: the digest of no bytes)."""
    by_tensor: dict[str, list[tuple[int, PlannedPiece]]] = {}
    for worker, planned in sorted(plan.of_rank(rank).items()):
        for t in planned:
            by_tensor.setdefault(t.tensor, []).append((worker, t))
    for index, meta in enumerate(metas):
        itemsize = wire_dtype(meta.dtype).itemsize
        tensor = tensors[meta.name]
        reader = read
        if hashes is not None:
            reader = functools.partial(_hashed, read, hashes.setdefault(meta.name, sha256()))
        yield [
            SlicePiece(worker, index, sub, functools.partial(reader, tensor, sub))
            for worker, t in by_tensor.get(meta.name, ())
            for sub in split_box(t.box, itemsize, buffer_bytes)
        ]


def _hashed(read: Callable[[Any, Box], Any], digest: Any, tensor: Any, box: Box) -> Any:
    data = read(tensor, box)
    digest.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
    return data


def plan_digest(plan: SlicePlan) -> str:
    """A short digest of ``plan`` (every planned piece): the trainer processes compare theirs."""
    h = sha256()
    for (rank, worker), planned in sorted(plan.pieces.items()):
        for t in planned:
            h.update(f"{rank},{worker},{t.tensor},{t.box.ranges};".encode())
    return h.hexdigest()[:32]


__all__ = [
    "OLD_HELLO",
    "PATCHES_KEY",
    "Slicing",
    "parse_wants",
    "pieces",
    "plan_digest",
    "read_names",
    "takes_patches",
    "unsent",
    "wants_less",
]
