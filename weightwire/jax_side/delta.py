"""Delta rounds on a JAX device: find the elements that changed.

On a GPU with CuPy the default ``expand="auto"`` runs the fused CUDA kernel
(``jax_side.delta_cuda``: one pass over the new weights and the base per layer group,
shared with the torch trainer). The XLA kernels below are the fallback (CPU, no CuPy, arrays
not on one GPU) and the ``search`` / ``scatter`` choices. Two passes, both memory-bound
(no per-tensor gather of the whole tensor, no host round trip per tensor):

1. ``_scan_group`` (one jitted call per layer group): per tensor, bitcast compare new vs
   base and pack the mask into ``uint32`` words (32 elements per word, one read of each
   tensor), plus each tensor's popcount total. One host sync per group reads the counts.

2. ``_expand_search`` (per patched tensor, compiled per shape and size bucket): a prefix
   sum of the words' popcounts (32x shorter than the tensor); each output slot finds its
   word by binary search and its bit by a 5-step search within the word; a gather reads
   the values and the patch is scattered into the (donated) base. Only the words are
   read again, and the work scales with the patch, not the tensor.

A sharded array (several devices of this process) is compared shard by shard where it lives,
never gathered (``jax_side.shard_delta``); its base stays sharded the same way.

Output arrays are bucketed to a power of two (so a new count rarely compiles anything);
``Prefix`` marks which elements are the patch (the leading ones here; a window of a group's
tight buffer with the fused kernel): the engine sends exactly those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from weightwire.jax_side import shard_delta
from weightwire.jax_side.dtypes import wire_name
from weightwire.shared.errors import ConfigError
from weightwire.trainer import delta_cuda
from weightwire.trainer.delta import DeltaKernel, Extracted, Scan

_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
_MIN_BUCKET = 1024


@dataclass(frozen=True)
class Prefix:
    """Elements ``[offset, offset + count)`` of the 1-D ``array`` (a kernel output: a bucketed
    one, or a group's tight buffer): a wire tensor of shape ``[count]``.
    ``JAXTrainerEngine`` and ``JaxDevicePacker`` read just those. ``dtype``: the elements'
    dtype where ``array`` holds their bits as unsigned words of the same width (a buffer
    CuPy allocated: it has no bfloat16 or float8)."""

    array: jax.Array
    count: int
    offset: int = 0
    dtype: np.dtype | None = None

    def describe(self) -> tuple[str, tuple[int, ...]]:
        return wire_name(self.array.dtype if self.dtype is None else self.dtype), (self.count,)

    def host(self) -> np.ndarray:
        out = np.asarray(self.array)[self.offset : self.offset + self.count]
        return out if self.dtype is None else out.view(self.dtype)


def _bits(x: jax.Array) -> jax.Array:
    """``x``'s elements as unsigned words of the same width (a bitcast, not a cast)."""
    flat = x.reshape(-1)
    if flat.dtype == jnp.bool_:  # XLA refuses to bitcast bool; its bytes are 0/1
        return flat.astype(jnp.uint8)
    return lax.bitcast_convert_type(flat, _WORDS[jnp.dtype(flat.dtype).itemsize])


def _pack(mask: jax.Array) -> jax.Array:
    """A flat bool mask as ``uint32`` words, element ``32 w + k`` at bit ``k`` of word ``w``."""
    pad = (-mask.shape[0]) % 32
    if pad:
        mask = jnp.pad(mask, (0, pad))
    lanes = mask.reshape(-1, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(lanes, axis=1, dtype=jnp.uint32)  # distinct bits: the sum is their OR


@jax.jit
def _scan_group(news: Sequence[jax.Array], bases: Sequence[jax.Array]) -> tuple[Any, jax.Array]:
    words = [_pack(_bits(n) != _bits(b)) for n, b in zip(news, bases, strict=True)]
    counts = [jnp.sum(lax.population_count(w).astype(jnp.int32)) for w in words]
    return words, jnp.stack(counts)


def _select_bit(word: jax.Array, rank: jax.Array) -> jax.Array:
    """The position of set bit number ``rank`` (0-based, from bit 0) of each ``word``: the
    largest ``p`` with ``rank`` set bits below it, by a 5-step binary search."""
    pos = jnp.zeros(word.shape, jnp.uint32)
    for step in (16, 8, 4, 2, 1):
        probe = pos + step
        below = lax.population_count(word & ((jnp.uint32(1) << probe) - 1)).astype(jnp.int32)
        pos = jnp.where(below <= rank, probe, pos)
    return pos.astype(jnp.int32)


def _expand_search(
    new: jax.Array, base: jax.Array, words: jax.Array, size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Output slot ``j`` finds its word by binary search over the words' running popcount
    and its bit within the word: work and traffic scale with ``size`` (the patch), not
    with the tensor; only the words (1/16 of a bf16 tensor) are read."""
    n = new.size
    pc = lax.population_count(words).astype(jnp.int32)
    ends = jnp.cumsum(pc)  # set bits in words [0, w]
    slot = jnp.arange(size, dtype=jnp.int32)
    # Unrolled: a fixed-depth search in one kernel, no device loop (JAX's own advice on GPU).
    w = jnp.searchsorted(ends, slot, side="right", method="scan_unrolled").astype(jnp.int32)
    valid = w < words.shape[0]
    w = jnp.minimum(w, words.shape[0] - 1)
    rank = slot - (ends[w] - pc[w])
    index = jnp.where(valid, w * 32 + _select_bit(words[w], rank), n)
    return _gather_patch(new, base, index)


def _expand_scatter(
    new: jax.Array, base: jax.Array, words: jax.Array, size: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every bit of every word scatters its flat index to its output slot (a scatter over
    the whole tensor: the alternative the benchmark compares with ``_expand_search``)."""
    n = new.size
    pc = lax.population_count(words).astype(jnp.int32)
    start = jnp.cumsum(pc) - pc  # each word's first output slot
    k = jnp.arange(32, dtype=jnp.uint32)
    w = words[:, None]
    below = lax.population_count(w & ((jnp.uint32(1) << k) - 1)).astype(jnp.int32)
    dest = jnp.where((w >> k) & 1 == 1, start[:, None] + below, size).reshape(-1)
    word_index = jnp.arange(words.shape[0], dtype=jnp.int32)[:, None]
    src = (word_index * 32 + k.astype(jnp.int32)).reshape(-1)
    index = jnp.full((size,), n, jnp.int32).at[dest].set(src, mode="drop")
    return _gather_patch(new, base, index)


def _gather_patch(
    new: jax.Array, base: jax.Array, index: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The values at ``index`` (``n`` past the patch's end: filled, dropped) and the base
    with them written."""
    values = new.reshape(-1).at[index].get(mode="fill", fill_value=0)
    patched = base.reshape(-1).at[index].set(values, mode="drop").reshape(base.shape)
    return index, values, patched


EXPANDS = {"search": _expand_search, "scatter": _expand_scatter}
"""Compaction variants (``benchmarks/bench_delta.py --jax-expand``); ``search`` is the default."""


def _jitted(expand: Any, donate: bool) -> Any:
    return jax.jit(expand, static_argnames=("size",), donate_argnums=(1,) if donate else ())


@jax.jit
def _copy(x: jax.Array) -> jax.Array:
    return x.copy()


def bucket(count: int) -> int:
    """The static output size for ``count`` elements: a power of two, at least 1024."""
    return max(_MIN_BUCKET, 1 << (count - 1).bit_length())


EXPAND_CHOICES = ("auto", "cuda", *EXPANDS)


class JaxDeltaKernel(DeltaKernel):
    """``DeltaKernel`` over JAX (or numpy) arrays on one device each.

    ``expand``: ``auto`` (``cuda`` for a group wholly on one GPU when CuPy imports, else
    ``search``), ``cuda`` (the fused kernel; a group it cannot take falls back to
    ``search``), ``search`` or ``scatter`` (the XLA compactions); the benchmark compares
    them."""

    def __init__(self, expand: str = "auto") -> None:
        if expand not in EXPAND_CHOICES:
            raise ConfigError(f"expand must be one of {EXPAND_CHOICES}, got {expand!r}")
        xla = EXPANDS.get(expand, _expand_search)
        self._expand = {d: _jitted(xla, d) for d in (False, True)}
        self._fused: Any = None
        if expand in ("auto", "cuda") and delta_cuda.available():
            from weightwire.jax_side.delta_cuda import JaxFused

            self._fused = JaxFused()
        if expand == "cuda" and self._fused is None:
            raise ConfigError("expand='cuda' needs CuPy and a CUDA device")

    def start(self, news: Sequence[Any], bases: Sequence[Any], limits: Sequence[int]) -> Any:
        device = self._fused.device_of(news, bases) if self._fused and news else None
        if device is None:
            return self.scan(news, bases)
        return self._fused.start(device, news, bases, limits)

    def finish(self, started: Any) -> Scan:
        if isinstance(started, Scan):
            return started
        return self._fused.finish(started)

    def settle(self) -> None:
        if self._fused is not None:
            self._fused.settle()

    def snapshot(self, tensor: Any) -> Any:
        # a sharded array's copy keeps its sharding: each device copies its own shard
        return _copy(jnp.asarray(tensor))

    def scan(self, news: Sequence[Any], bases: Sequence[Any]) -> Scan:
        arrays = [jnp.asarray(n) for n in news]
        sharded = [i for i, a in enumerate(arrays) if shard_delta.is_sharded(a)]
        if not sharded:
            words, counts = _scan_group(arrays, list(bases))
            return Scan([int(c) for c in np.asarray(counts)], (arrays, words))
        return self._scan_mixed(arrays, bases, set(sharded))

    def _scan_mixed(self, arrays: list[Any], bases: Sequence[Any], sharded: set[int]) -> Scan:
        """A group with sharded arrays: those part by part on their devices
        (``shard_delta``), the rest in one call as usual."""
        whole = [i for i in range(len(arrays)) if i not in sharded]
        out = _Mixed(arrays)
        counts = [0] * len(arrays)
        pending = None
        if whole:
            pending = _scan_group([arrays[i] for i in whole], [bases[i] for i in whole])
        groups = []
        for i in sorted(sharded):
            parts = shard_delta.parts_of(arrays[i], bases[i])
            if parts is None:  # another layout: every element counts, the tensor goes dense
                counts[i] = int(arrays[i].size)
            else:
                groups.append((i, parts))
        out.parts = shard_delta.scan_parts(groups, _scan_group)
        for i, got in out.parts.items():
            counts[i] = sum(got.counts)
        if pending is not None:
            words, whole_counts = pending
            for i, w, c in zip(whole, words, np.asarray(whole_counts), strict=True):
                out.words[i], counts[i] = w, int(c)
        return Scan(counts, out)

    def extract(self, scan: Scan, i: int, new: Any, base: Any) -> Extracted:
        state = scan.state
        count = scan.counts[i]
        if isinstance(state, _Mixed):
            if i in state.parts:
                # Not donated (a shard's buffer is its global array's too), so popped: the
                # old base's shards are then held only by the tracker until it takes the
                # patched base (one tensor's changed shards twice, not a whole group's)
                index, values, total, patched = shard_delta.extract_parts(
                    state.parts.pop(i), base, self._expand[False], bucket
                )
                return Extracted(Prefix(index, total), Prefix(values, total), patched)
            arrays, words = state.arrays, state.words
        elif isinstance(state, tuple):
            arrays, words = state
        else:  # the fused kernel's group: windows of its buffers
            return _window(state, i, count, base)
        expand = self._expand[_donates(base)]
        index, values, patched = expand(arrays[i], base, words[i], size=bucket(count))
        return Extracted(Prefix(index, count), Prefix(values, count), patched)

    def refresh(self, new: Any, base: Any) -> Any:
        return _copy(jnp.asarray(new))

    def first(self, base: Any) -> Extracted:
        if shard_delta.is_sharded(base):
            index, value = shard_delta.first_of(base)
            return Extracted(index, value, base)
        flat = base.reshape(-1)
        return Extracted(jnp.zeros((1,), jnp.int32), flat[:1], base)

    def unwrap(self, wire: Any) -> tuple[Any, Any]:
        # the window as atoms (a numpy dtype is untracked): no Prefix held per wire tensor
        # through the round, one made as the tensor is sent (#49)
        if isinstance(wire, Prefix):
            return wire.array, (wire.count, wire.offset, wire.dtype)
        return wire, None

    def wrap(self, array: Any, window: Any) -> Any:
        return array if window is None else Prefix(array, *window)

    def held_bytes(self, base: Any) -> int | None:
        if shard_delta.is_sharded(base):
            return shard_delta.held_bytes(base)
        return None


class _Mixed:
    """A scanned group holding sharded arrays: the arrays, the whole ones' mask words, the
    sharded ones' parts (``shard_delta.ShardedScan``), by tensor."""

    def __init__(self, arrays: list[Any]) -> None:
        self.arrays = arrays
        self.words: dict[int, Any] = {}
        self.parts: dict[int, shard_delta.ShardedScan] = {}


def _window(group: Any, i: int, count: int, base: Any) -> Extracted:
    """Tensor ``i``'s patch in a fused group's tight buffers (its base is already written)."""
    plan = group.plan
    key = group.pending.operands[i].key
    values = group.values[key]
    index = Prefix(group.index, count, plan.index_at[i] // 4)
    at = plan.values_at[i] // values.dtype.itemsize
    return Extracted(index, Prefix(values, count, at, group.dtypes[key]), base)


def _donates(x: Any) -> bool:
    """Donate the base to the patch scatter where the platform reuses donated buffers."""
    return isinstance(x, jax.Array) and all(d.platform != "cpu" for d in x.devices())


def arrays_of(tensors: Sequence[Any]) -> tuple[list[Any], list[tuple[int, int] | None]]:
    """``tensors`` with each ``Prefix`` replaced by its array, and each one's window
    ``(offset, count)`` in elements (``None`` for a whole array)."""
    arrays: list[Any] = []
    windows: list[tuple[int, int] | None] = []
    for t in tensors:
        if isinstance(t, Prefix):
            arrays.append(t.array)
            windows.append((t.offset, t.count))
        else:
            arrays.append(t)
            windows.append(None)
    return arrays, windows


__all__ = ["JaxDeltaKernel", "Prefix", "bucket"]
