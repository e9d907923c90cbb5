"""Delta rounds, trainer side: what the workers hold, and the round that patches it.

At RL learning rates most low-precision weights do not change between steps, so a
round can send only the changed elements (``shared.delta``: per tensor a patch of flat
``int32`` indices plus values, or the tensor dense when too much of it changed).

``DeltaTracker`` keeps a device copy of every tensor as the workers hold it after the
last committed round (the *base*: one copy of the model on the trainer's device) and the
token of that round. A framework's ``DeltaKernel`` compares the new weights with the base
on the device (bitcast compare, count, compaction) and writes the new bytes into the base
as it goes, so after a round the base already is what the workers will hold. Bookkeeping:
the base is adopted (its token becomes the round's) only once the round committed; any
failure drops it, and the next round is dense. A dense round (the first, an anchor, a
forced one) re-snapshots every tensor as it is sent.
"""

from __future__ import annotations

import math
import secrets
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightwire.shared.delta import (
    FLAT_I32,
    INDEX_DTYPE,
    INDEX_SUFFIX,
    MAX_PATCH_NUMEL,
    VALUES_SUFFIX,
    Patch,
    PatchEntry,
)
from weightwire.shared.errors import ConfigError
from weightwire.shared.groups import batch_by_layer
from weightwire.shared.meta import MetaRows, ParamMeta

PATCH_INDEX_BYTES = 4
"""A patch's ``@index`` element (``int32``), beside each changed value."""

DEFAULT_GROUP_BYTES = 2 << 30
"""Whole layer groups per kernel launch up to this many bytes: every launch costs the host
a fixed amount (tables, allocations, the counts' sync, the pack), which at one launch per
decoder layer is more than the device's time for the layer. An 8B model in bf16 (16 GB):
about 8 launches."""
DEFAULT_AHEAD = 1


@dataclass
class Scan:
    """Changed-element counts of one group of tensors (``DeltaKernel.scan``); ``state`` is
    the kernel's own (masks, packed words) for ``extract``."""

    counts: list[int]
    state: Any = None
    updated: bool = False
    """The scan already wrote every tensor's new bytes into its base (the fused CUDA
    kernel): a tensor sent dense needs no ``refresh``."""


@dataclass
class Extracted:
    """One tensor's patch: the ``@index`` and ``@values`` wire tensors, and the base with
    the patch applied (the tensor's new bytes)."""

    index: Any
    values: Any
    base: Any


class DeltaKernel(ABC):
    """A framework's device kernels for delta rounds (``jax_side.delta``,
    ``torch_side.sender.delta``). Tensors compare by their bytes (a bitcast), so a NaN
    payload or a signed zero that changed is a change."""

    @abstractmethod
    def snapshot(self, tensor: Any) -> Any:
        """A private copy of ``tensor`` on its device (the trainer may donate or overwrite
        the original)."""

    @abstractmethod
    def scan(self, news: Sequence[Any], bases: Sequence[Any]) -> Scan:
        """How many elements of each ``news[i]`` differ from ``bases[i]`` (one host sync)."""

    def start(self, news: Sequence[Any], bases: Sequence[Any], limits: Sequence[int]) -> Any:
        """Begin the scan of one group; ``finish`` waits for it, and the tracker starts the
        next group in between. ``limits[i]``: the most changed elements tensor ``i`` may
        have and still go as a patch (a kernel may size its outputs by it). The default
        scans at once."""
        return self.scan(news, bases)

    def finish(self, started: Any) -> Scan:
        """The ``Scan`` of a group ``start`` began."""
        return started

    def begin(self) -> None:
        """A round's extraction starts (``build`` calls it first): the last round's wire
        tensors are no longer read (rounds run one at a time), so a kernel may reuse their
        memory from here on."""
        return None

    def settle(self) -> None:
        """Wait for all device work of the round so far (``build`` calls it on its way out,
        also on an error): after it, other readers may read the outputs and the bases, and
        the new tensors may be freed."""
        return None

    @abstractmethod
    def extract(self, scan: Scan, i: int, new: Any, base: Any) -> Extracted:
        """Tensor ``i`` of ``scan``'s patch (``scan.counts[i]`` elements, strictly increasing
        ``int32`` flat indices); ``base`` may be consumed."""

    @abstractmethod
    def refresh(self, new: Any, base: Any) -> Any:
        """The base of a tensor sent dense: ``new``'s bytes (written into ``base`` where the
        framework can)."""

    def held_bytes(self, base: Any) -> int | None:
        """Device bytes ``base`` holds where they differ from its tensor's (a sharded
        array's base: its shards on this process, replicas each); ``None``: the tensor's."""
        return None

    def unwrap(self, wire: Any) -> tuple[Any, Any]:
        """An ``extract`` output as ``(array, window)``, what the round holds until it is
        sent (``window``: atoms the collector does not track, or None); ``wrap`` makes the
        output again as the tensor is pulled. A kernel whose outputs are views of a bigger
        array (``jax_side.delta.Prefix``) keeps no record per wire tensor through the round
        (#49). The default: the output itself."""
        return wire, None

    def wrap(self, array: Any, window: Any) -> Any:
        """``unwrap``'s inverse."""
        return array

    @abstractmethod
    def first(self, base: Any) -> Extracted:
        """A one-element patch writing ``base``'s element 0 as it is (a round in which
        nothing changed still carries a patch, so the workers check its base)."""


@dataclass
class DeltaRound:
    """One delta round, ready to send: the wire tensors in broadcast order and what they
    stand for."""

    arrays: list[Any] = field(default_factory=list)
    """The wire tensors' arrays, ``metas``' order (a list beside it rather than a
    ``(name, array)`` pair each: a pair held for the whole round, per wire tensor, was
    objects the round's young collections promoted towards a full one, #49)."""
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    """The wire listing as three lists of atoms (``metas`` reads them): a ``ParamMeta`` per
    wire tensor, new every round (its patch sizes change) and held through it, was objects
    its young collections promoted towards a full one (#49)."""
    entries: list[PatchEntry] = field(default_factory=list)
    """Each patch as its update-info entry (``Patch.to_entry``): tuples of atoms, untracked
    by the first collection that sees them, where a ``Patch`` each, held for the round, was
    objects its young collections promoted towards a full one (#49)."""
    changed: int = 0
    """Elements that differ from the base, over every tensor of the source."""
    elements: int = 0
    dense_bytes: int = 0
    """Bytes the round stands for: every tensor of the source, dense."""
    patched: dict[str, Any] = field(default_factory=dict)
    """Patched tensor name -> its full new bytes (the base), for ``verify``."""
    windows: list[Any] = field(default_factory=list)
    """Per wire tensor, its window in ``arrays``' array (``DeltaKernel.unwrap``), or None."""
    wrap: Callable[[Any, Any], Any] | None = None
    """The kernel's ``wrap``, where some window is set: the wire tensor made as pulled."""
    metas: MetaRows = field(init=False)
    """The wire tensors in broadcast order (over ``names`` / ``dtypes`` / ``shapes``: each
    ``ParamMeta`` made as it is read)."""

    def __post_init__(self) -> None:
        self.metas = MetaRows(self.names, self.dtypes, self.shapes)

    def add(self, meta: ParamMeta, array: Any) -> None:
        """A tensor sent whole."""
        self.names.append(meta.name)
        self.dtypes.append(meta.dtype)
        self.shapes.append(meta.shape)
        self.arrays.append(array)
        self.windows.append(None)

    @property
    def patches(self) -> list[Patch]:
        """The round's patches, made as asked."""
        return [Patch(*e) for e in self.entries]

    @property
    def pairs(self) -> Iterator[tuple[str, Any]]:
        """``(wire name, array)`` in broadcast order, made as they are pulled."""
        if self.wrap is None:
            return zip(self.names, self.arrays, strict=True)
        return zip(self.names, map(self.wrap, self.arrays, self.windows), strict=True)

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


@dataclass(frozen=True)
class RoundTokens:
    """One engine's round tokens: ``<session>:<n>``, a fresh ``n`` for every attempt, so
    a failed attempt's token is never a later round's."""

    session: str = field(default_factory=lambda: secrets.token_hex(6))

    def token(self, attempt: int) -> str:
        return f"{self.session}:{attempt}"


def batch_by_bytes(
    groups: Iterable[list[tuple[str, Any]]], metas: dict[str, ParamMeta], budget: int
) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive groups joined while their tensors' bytes stay within ``budget`` (a group
    over it goes alone), in stream order. A stream that makes its tensors as it goes holds
    up to ``budget`` bytes of them at once."""
    batch: list[tuple[str, Any]] = []
    held = 0
    for group in groups:
        size = sum(metas[name].nbytes for name, _ in group)
        if batch and held + size > budget:
            yield batch
            batch, held = [], 0
        batch += group
        held += size
    if batch:
        yield batch


class DeltaTracker:
    """What the workers hold (``bases``, ``token``) and how the next round is built."""

    def __init__(
        self,
        kernel: DeltaKernel,
        *,
        density: float,
        anchor_every: int,
        group_bytes: int = DEFAULT_GROUP_BYTES,
        ahead: int = DEFAULT_AHEAD,
        smaller_only: bool = False,
    ) -> None:
        if group_bytes < 0 or ahead < 1:
            raise ConfigError(f"need group_bytes >= 0 and ahead >= 1, got {group_bytes}, {ahead}")
        self.kernel = kernel
        self.density = density
        self.anchor_every = anchor_every
        self.smaller_only = smaller_only
        """A patch only where it is smaller than the tensor dense (a receiver that also
        takes dense tensors): ``density`` capped per dtype."""
        self.group_bytes = group_bytes
        """A launch covers whole layer groups up to this many bytes of new weights (``0``:
        one layer group each; a group larger than it goes alone)."""
        self.ahead = ahead
        """Launches started before the oldest one's counts are read."""
        self.bases: dict[str, Any] = {}
        self.metas: list[ParamMeta] = []
        self.token: str | None = None
        """The committed round the bases are; ``None``: the next round is dense."""
        self.since_dense = 0
        self._tokens = RoundTokens()
        self._attempts = 0

    def next_token(self) -> str:
        self._attempts += 1
        return self._tokens.token(self._attempts)

    def wants_dense(self, metas: Sequence[ParamMeta], *, forced: bool) -> bool:
        anchor = self.anchor_every > 0 and self.since_dense + 1 >= self.anchor_every
        return forced or anchor or self.token is None or list(metas) != self.metas

    def drop(self) -> None:
        """Forget the base (a failed round, a dense one about to re-snapshot)."""
        self.bases.clear()
        self.metas = []
        self.token = None

    def adopt(self, token: str, *, dense: bool) -> None:
        """The round ``token`` committed: the bases are what the workers hold."""
        self.token = token
        self.since_dense = 0 if dense else self.since_dense + 1

    def memory_bytes(self) -> int:
        """Device bytes the base holds: one copy of the model, or for a sharded tensor a copy
        of this process's shards of it (``DeltaKernel.held_bytes``)."""
        total = 0
        for m in self.metas:
            base = self.bases.get(m.name)
            held = None if base is None else self.kernel.held_bytes(base)
            total += m.nbytes if held is None else held
        return total

    def snapshot_stream(
        self, pairs: Iterable[tuple[str, Any]], metas: Sequence[ParamMeta]
    ) -> Iterator[tuple[str, Any]]:
        """A dense round's stream, unchanged, each tensor copied into the base as it passes:
        into the tensor's base in place where one is held (``refresh``: an anchor or a forced
        dense round allocates nothing; a fresh copy each round freed and allocated the model
        again, 291 tensors of an 8B model), a new copy otherwise."""
        held, last = dict(self.bases), self.metas
        self.drop()
        # Set first: a consumer may stop pulling after the last tensor (a round that does not
        # complete is dropped by the caller anyway). The same dict and, for the same model,
        # the same list as last round: a source's fresh metadata each round, kept here, would
        # be objects swapped into the long-lived heap every round (#49).
        self.metas = last if last == list(metas) else list(metas)
        kernel = self.kernel
        for name, tensor in pairs:
            prior = held.pop(name, None)
            self.bases[name] = (
                kernel.snapshot(tensor) if prior is None else kernel.refresh(tensor, prior)
            )
            yield name, tensor

    def build(
        self, pairs: Iterable[tuple[str, Any]], metas: Sequence[ParamMeta]
    ) -> DeltaRound | None:
        """Compare the checked stream ``pairs`` (every tensor of ``metas``, in order) with the
        base, one layer group at a time; the base ends up holding the new bytes. ``None``:
        the round must go dense (it is partial but has no tensor a patch can name)."""
        by_name = {m.name: m for m in metas}
        out = DeltaRound()
        self.kernel.begin()
        try:
            self._compare(pairs, by_name, out)
            # Summed once the last launch is queued: the device works meanwhile.
            out.elements = sum(m.numel for m in metas)
            out.dense_bytes = sum(m.nbytes for m in metas)
        finally:
            self.kernel.settle()
        # A partial round still names its base, so the workers check it.
        partial = not out.entries and len(out.arrays) != len(metas)
        if partial and not self._first_patch(out, metas):
            return None
        return out

    def limit(self, meta: ParamMeta) -> int:
        """The most changed elements ``meta``'s tensor may have and still go as a patch
        (fewer than ``density`` of its elements; none past the int32 index range). With
        ``smaller_only``, also fewer than make the patch as large as the tensor: a patch
        costs 4 index bytes per element beside its value, so an e4m3 tensor (FP8 rounds)
        goes dense from 1/5 of its elements changed, below the default density."""
        numel = meta.numel
        got = 0 if numel > MAX_PATCH_NUMEL else math.ceil(self.density * numel) - 1
        if self.smaller_only and numel:
            itemsize = meta.nbytes // numel
            got = min(got, -(-numel * itemsize // (PATCH_INDEX_BYTES + itemsize)) - 1)
        return max(0, min(numel, got))

    def _compare(
        self, pairs: Iterable[tuple[str, Any]], by_name: dict[str, ParamMeta], out: DeltaRound
    ) -> None:
        """One launch at a time, ``ahead`` more started before its counts are read."""
        flight: deque[tuple[list[tuple[str, Any]], list[ParamMeta], list[int], Any]] = deque()
        for batch in batch_by_bytes(batch_by_layer(pairs), by_name, self.group_bytes):
            metas = [by_name[name] for name, _ in batch]
            limits = [self.limit(m) for m in metas]
            bases = [self.bases[name] for name, _ in batch]
            started = self.kernel.start([t for _, t in batch], bases, limits)
            flight.append((batch, metas, limits, started))
            if len(flight) > self.ahead:
                self._take(out, *flight.popleft())
        while flight:
            self._take(out, *flight.popleft())

    def _take(
        self,
        out: DeltaRound,
        batch: list[tuple[str, Any]],
        metas: list[ParamMeta],
        limits: list[int],
        started: Any,
    ) -> None:
        scan = self.kernel.finish(started)
        for i, count in enumerate(scan.counts):
            if count:
                self._add(out, metas[i], limits[i], scan, i, batch[i][1], count)

    def _add(
        self, out: DeltaRound, meta: ParamMeta, limit: int, scan: Scan, i: int, new: Any, count: int
    ) -> None:
        out.changed += count
        base = self.bases[meta.name]
        if count > limit:
            fresh = base if scan.updated else self.kernel.refresh(new, base)
            self.bases[meta.name] = fresh
            out.add(meta, fresh)
            return
        got = self.kernel.extract(scan, i, new, base)
        self.bases[meta.name] = got.base
        self._patch(out, meta, got, count)

    def _patch(self, out: DeltaRound, meta: ParamMeta, got: Extracted, nnz: int) -> None:
        out.entries.append((meta.name, meta.dtype, meta.shape, nnz, FLAT_I32))
        kernel = self.kernel
        index, index_window = kernel.unwrap(got.index)
        values, values_window = kernel.unwrap(got.values)
        out.arrays += (index, values)
        out.windows += (index_window, values_window)
        if out.wrap is None and (index_window is not None or values_window is not None):
            out.wrap = kernel.wrap
        out.names += (meta.name + INDEX_SUFFIX, meta.name + VALUES_SUFFIX)
        out.dtypes += (INDEX_DTYPE, meta.dtype)
        shape = (nnz,)  # one tuple of atoms for both wire tensors
        out.shapes += (shape, shape)
        out.patched[meta.name] = got.base

    def _first_patch(self, out: DeltaRound, metas: Sequence[ParamMeta]) -> bool:
        sent = set(out.names)
        free = (m for m in metas if m.name not in sent and 0 < m.numel <= MAX_PATCH_NUMEL)
        meta = next(free, None)
        if meta is None:
            return False
        self._patch(out, meta, self.kernel.first(self.bases[meta.name]), 1)
        return True
