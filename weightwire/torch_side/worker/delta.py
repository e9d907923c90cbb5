"""Delta rounds on the worker: round tokens, patches staged until finish, and where they land.

A delta round (``shared.delta``) sends some tensors dense and others as patches: a flat
``int32`` index and the new values, as two wire tensors ``T@index`` / ``T@values``. The
worker checks the round's ``delta_base`` against the token of the last round it committed
(``WeightState``) before any byte, regroups the wire tensors into ``StagedPatch``es while the
round receives (they are small, so they are held), and applies them at finish, after the
round's dense tensors. A round that fails before finish applies none of them.

Where a patch lands depends on the model (``PatchSink``):

- ``ModelSink``: the model patches itself (``HFModelHost.patch_weights``, the reference
  server): the patches join its all-or-nothing round.
- ``MapSink``: a vLLM worker whose ``LoaderMap`` (``landing``) was recorded: the patches
  go straight into the serving parameters (``LoaderMap.patch``), and so do the round's
  dense tensors (``LoaderMap.write``) so no layer is reloaded for a few changed elements.
- ``CopySink``: the fallback where the map is refused (e.g. a CPU worker's prepacked
  weights) and the trainer declared delta rounds (``delta_rounds`` in the init info): the
  worker keeps a host copy of every checkpoint tensor as last committed (``HostCopy``),
  rebuilds each patched tensor from it and loads it through ``load_weights`` like a dense
  one; under a framework that reloads whole layers (vLLM), the untouched tensors of every
  layer the round loads are loaded from the copy too.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from weightwire.shared.delta import INDEX_SUFFIX, VALUES_SUFFIX, Patch, PatchEntry, PatchRows
from weightwire.shared.errors import DeltaBaseMismatch
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.load import Model, Pairs

log = logging.getLogger(__name__)


class StagedPatch:
    """One received patch, held until finish: flat indices into ``patch.name`` and values.

    The patch is kept as its entry (``PatchEntry``, a tuple of atoms the collector untracks),
    ``patch`` made as it is read: a ``Patch`` record held per patch through the round was
    objects its young collections promoted towards a full one (#49)."""

    __slots__ = ("entry", "index", "values")

    def __init__(
        self, patch: Patch | PatchEntry, index: torch.Tensor, values: torch.Tensor
    ) -> None:
        self.entry: PatchEntry = patch.to_entry() if isinstance(patch, Patch) else patch
        self.index = index
        self.values = values

    @property
    def patch(self) -> Patch:
        return Patch(*self.entry)

    @property
    def name(self) -> str:
        return self.entry[0]

    @property
    def numel(self) -> int:
        """The patched tensor's elements."""
        return math.prod(self.entry[2])

    @property
    def values_name(self) -> str:
        return self.entry[0] + VALUES_SUFFIX

    def __repr__(self) -> str:
        return f"StagedPatch({self.name!r}, {self.index.numel()} elements)"


def patch_tensor(base: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` at the flat C-order ``index`` of ``base`` (contiguous), in place.

    Bits are copied as they are (an integer view of the same width), so NaN payloads and
    signed zeros land exactly like the trainer's bytes."""
    flat = base.view(-1)
    if values.dtype != flat.dtype:
        raise ValueError(f"patch values are {values.dtype}, the tensor is {flat.dtype}")
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    idx = index.to(device=flat.device, dtype=torch.int64)
    # index_put_: on a CPU index_copy_ is a serial loop (~100x slower at a round's 2 %)
    flat.view(word).index_put_((idx,), values.to(flat.device).view(word))


def check_index(patch: StagedPatch) -> None:
    """``ValueError`` unless every index addresses an element of the tensor and the indices
    are strictly increasing (the wire's rule: a repeated index would leave either of its
    values, the last on a CPU and any on a GPU)."""
    idx = patch.index
    if not idx.numel():
        return
    if int(idx.min()) < 0 or int(idx.max()) >= patch.numel:
        raise ValueError(f"patch of {patch.name!r}: an index is outside its {patch.numel} elements")
    falls = torch.nonzero(idx[1:] <= idx[:-1])
    if falls.numel():
        at = int(falls[0, 0]) + 1
        raise ValueError(
            f"patch of {patch.name!r}: indices must be strictly increasing, but index "
            f"{int(idx[at])} at position {at} follows {int(idx[at - 1])} (the trainer's "
            "extraction sends each changed element once, in order)"
        )


def check_indices(patches: Sequence[StagedPatch], *, concat: bool | None = None) -> None:
    """``check_index`` for every patch, with one host sync per device for all of them (a
    sync per patch costs a GPU worker hundreds of waits per round); the slow pass runs only
    to name the first bad patch. ``concat`` (None: on a CUDA device only): check a device's
    patches concatenated, a dozen launches for the round instead of a few per patch."""
    by_device: dict[torch.device, list[StagedPatch]] = {}
    for p in patches:
        if p.index.numel():
            by_device.setdefault(p.index.device, []).append(p)
    flags: list[torch.Tensor] = []
    for device, group in by_device.items():
        if device.type == "cuda" if concat is None else concat:
            flags.append(_bad_concatenated(group, device))
            continue
        bad: torch.Tensor | None = None
        for p in group:
            idx = p.index
            low, high = torch.aminmax(idx)
            flag = (low < 0) | (high >= p.numel) | (idx[1:] <= idx[:-1]).any()
            # folded as it goes (no sync): a flag per patch held to the end was hundreds of
            # objects alive through the round's young collections (#49)
            bad = flag if bad is None else bad | flag
        if bad is not None:
            flags.append(bad)
    if flags and any(bool(f.any()) for f in flags):  # one sync per device's last flag
        for p in patches:
            check_index(p)


def _bad_concatenated(group: Sequence[StagedPatch], device: torch.device) -> torch.Tensor:
    """Whether any patch of ``group`` (none empty, all on ``device``) has an index out of its
    tensor or not above the one before it, from their indices concatenated (in the wire's
    int32): one order check over them all (each patch's first index exempt: it follows
    another tensor's), then only each patch's first and last index against its bounds, which
    while the order holds are its smallest and largest. No per-index bound is built (an
    expansion of every tensor's size runs one warp per patch on a GPU: an 8B round's largest
    patch, ~10 M indices, took that warp milliseconds), and a patch out of order is refused
    by the order check whatever its ends."""
    counts = [p.index.numel() for p in group]
    idx = torch.cat([p.index for p in group])
    ends = list(itertools.accumulate(counts))  # one past each patch's last index
    firsts = [e - c for e, c in zip(ends, counts, strict=True)]
    host = torch.tensor(
        [p.numel for p in group] + firsts + [e - 1 for e in ends] + [f - 1 for f in firsts[1:]]
    )
    dev = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    n = len(group)
    first, last = idx.index_select(0, dev[n : 2 * n]), idx.index_select(0, dev[2 * n : 3 * n])
    bad = (first < 0).any() | (last >= dev[:n]).any()
    rising = idx[1:] > idx[:-1]
    if n > 1:
        rising.index_fill_(0, dev[3 * n :], True)  # a patch's first index follows another's
    return bad | ~rising.all()


def check_tied(patches: Sequence[StagedPatch], aliases: Mapping[str, str]) -> None:
    """``ValueError`` when two names of one tied tensor (``aliases``: alias -> canonical) are
    patched with different values: the one tensor would keep whichever landed last, so the
    conflict is refused as a dense round's is."""
    if not aliases:
        return
    seen: dict[str, StagedPatch] = {}
    for p in patches:
        key = aliases.get(p.name, p.name)
        first = seen.setdefault(key, p)
        if first is p:
            continue
        same = (
            first.index.shape == p.index.shape
            and torch.equal(first.index, p.index.to(first.index.device))
            and torch.equal(first.values, p.values.to(first.values.device))
        )
        if not same:
            raise ValueError(
                f"{p.name!r} received twice in one round with different values: it is tied to "
                f"{first.name!r} (one tensor) and both were patched differently; patch one name"
            )


def logical_metas(metas: Sequence[ParamMeta], patches: Sequence[Patch]) -> list[ParamMeta]:
    """The round's tensors as the model sees them: dense ones, then each patched tensor
    whole (what a ``ModelSpec`` checks: names, shapes and dtypes of the model's tensors)."""
    dense = set(dense_names(metas, patches))
    return [m for m in metas if m.name in dense] + [
        ParamMeta(p.name, p.dtype, p.shape) for p in patches
    ]


class PatchSplitter:
    """Splits one update's received chunks: dense pairs go on, patch wire tensors are held.

    A chunk of patch wire tensors only is held as it landed (views of its buffer, which
    holds nothing else: every link lands a chunk in memory of its own, never reused under
    a live view); beside dense tensors, the ``@index`` / ``@values`` views are cloned, so
    the chunk's buffer can go once those are loaded. A delta round is mostly patches, so
    its chunks are held without a copy (an 8B round's 582 wire tensors: as many launches
    and 0.94 GB of device copies saved on a GPU). ``patches`` is filled only once the
    whole update arrived."""

    def __init__(
        self, patches: Sequence[Patch], *, observe: Callable[[Pairs], None] | None
    ) -> None:
        entries = patches.entries if isinstance(patches, PatchRows) else None
        if entries is None:
            entries = [p.to_entry() for p in patches]
        self._entries: Sequence[PatchEntry] = entries
        # wire name -> its patch's row: atoms only (a Patch per wire name, held through the
        # round, was objects its young collections promoted, #49)
        self._by_wire: dict[str, int] = {}
        for i, e in enumerate(entries):
            self._by_wire[e[0] + INDEX_SUFFIX] = i
            self._by_wire[e[0] + VALUES_SUFFIX] = i
        self._observe = observe
        self._parts: dict[str, torch.Tensor] = {}
        self.patches: list[StagedPatch] = []

    def split(self, chunks: Iterator[Pairs]) -> Iterator[Pairs]:
        for dense in map(self._hold, chunks):  # the chunk's pairs go as it is split (#49)
            if not dense:
                continue
            if self._observe is not None:
                self._observe(dense)
            yield dense
        parts = self._parts
        staged = [
            StagedPatch(e, parts[e[0] + INDEX_SUFFIX], parts[e[0] + VALUES_SUFFIX])
            for e in {e[0]: e for e in self._entries}.values()
        ]
        check_indices(staged)
        self.patches = staged

    def _hold(self, pairs: Pairs) -> Pairs:
        """Holds the chunk's patch wire tensors; returns its dense pairs."""
        dense: Pairs = []
        held: Pairs = []
        for pair in pairs:  # the pair itself: a new tuple each was objects of the round
            (held if pair[0] in self._by_wire else dense).append(pair)
        for name, tensor in held:
            self._parts[name] = tensor.clone() if dense else tensor
        return dense


class PatchSink:
    """Where a round's patches land (see the module docstring); the base applies nothing."""

    name: ClassVar[str] = "none"
    writes_live: ClassVar[bool] = False
    """``after_commit`` writes into the live parameters (no rollback once it started)."""
    completes_layers: bool = False
    """Loads the unsent tensors of every layer a round loads (a partial round is fine)."""
    aliases: Mapping[str, str] = {}
    """The model's tied names (alias -> canonical): both patched differently is refused."""

    def refusal(self, dense: Sequence[str], patches: Sequence[Patch]) -> str | None:
        """Why this update cannot be applied on the held base (checked before any byte)."""
        return None

    def completion(self, loaded: set[str], patches: Sequence[StagedPatch]) -> Pairs:
        """Full tensors to load with the round's dense ones, at finish."""
        return []

    def in_round(self, model: Model, patches: Sequence[StagedPatch]) -> None:
        """Inside the model's own round, after its dense tensors (``ModelSink``)."""

    def after_commit(self, patches: Sequence[StagedPatch]) -> None:
        """After the framework's round closed (``MapSink``): the round is committed."""

    @property
    def observe_fn(self) -> Callable[[Pairs], None] | None:
        """Called with the dense tensors of any round as they are received, if set."""
        return None

    def round_failed(self) -> None:
        """The round ended without its commit: forget what it touched."""


@dataclass
class RoundDelta:
    """A round's delta part: its staged patches and where they land. A round gets one only
    when it takes the patch step (``_ReceiverCore._patch_step``): a dense round has none."""

    sink: PatchSink | None = None
    patches: list[StagedPatch] = field(default_factory=list)

    @property
    def model_round(self) -> bool:
        """The patches go into the model's own round (``ModelSink``)."""
        return self.sink is not None and self.sink.name == "model" and bool(self.patches)

    @property
    def writes_live(self) -> bool:
        """``after_commit`` will write into the live parameters."""
        return self.sink is not None and self.sink.writes_live and bool(self.patches)

    def took(self, splitter: PatchSplitter) -> None:
        """One update of the round was received whole: hold its patches."""
        self.patches += splitter.patches
        if self.sink is not None:  # a tie's other name may have come in an earlier update
            check_tied(self.patches, self.sink.aliases)

    def held_values(self) -> Pairs:
        return [(p.values_name, p.values) for p in self.patches]

    def finish(self, names: set[str], loaded: set[str]) -> Pairs:
        """At commit: the full tensors to load beside the round's ``loaded`` dense ones (the
        fallback's rebuilt tensors); adds them and the patched tensors to ``names``."""
        extra = self.sink.completion(loaded, self.patches) if self.sink is not None else []
        names.update(n for n, _ in extra)
        names.update(p.name for p in self.patches)
        return extra

    def in_round(self, model: Model) -> None:
        if self.sink is not None:
            self.sink.in_round(model, self.patches)

    def after_commit(self) -> None:
        if self.sink is not None:
            self.sink.after_commit(self.patches)

    def drop(self) -> None:
        self.patches = []
        if self.sink is not None:
            self.sink.round_failed()


def refuse(delta_base: str, held: str | None, why: str | None = None) -> DeltaBaseMismatch:
    """The refusal of a delta update; ``why``: the worker holds the base round but cannot
    patch on it (said after the tokens)."""
    exc = DeltaBaseMismatch(delta_base, held)
    if why is not None:
        exc.args = (f"{exc.args[0]} ({why})",)
    return exc


def dense_names(metas: Sequence[ParamMeta], patches: Sequence[Patch]) -> list[str]:
    """The names of an update's dense tensors (its wire tensors that are no patch's)."""
    wire = {p.name + INDEX_SUFFIX for p in patches} | {p.name + VALUES_SUFFIX for p in patches}
    return [m.name for m in metas if m.name not in wire]
