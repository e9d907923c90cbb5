"""What a stock vLLM ``nccl`` worker can receive, decided before a round starts.

A stock worker fails *mid-round* on some inputs, after earlier chunks were already
loaded into the model (half old, half new). Each rule below is a way it fails, read
from its code (0.28-0.33):

- packed consumer: each tensor's slice of the uint8 chunk is viewed as its dtype,
  which torch allows only at a byte offset that is a multiple of the itemsize (zero-size
  tensors included). All versions.
- packed consumer before 0.32 reshapes with ``view(*shape)``: a scalar (shape ``[]``)
  raises ``TypeError``. Rewriting it as ``[1]`` is not done: vLLM's default loader would
  take a one-element tensor for a one-element parameter, but parameter-specific loaders
  (quantization scales, the usual scalars) differ by model and version, and a guess that
  is wrong fails mid-round. Unpacked mode carries scalars unchanged.
- unpacked mode: the NCCL wrapper maps no NCCL type for ``bool`` and ``float8_e5m2``.

Where a legal fix exists it is preferred: tensors may be reordered *within a layer
group* (vLLM's layerwise reload materializes a layer once all its tensors of the round
arrived, in any order), so an order is searched in which every offset is aligned; the
update info then lists that order and the engine feeds the tensors in it
(``base.WirePlan.reorder``, which holds at most one layer group). Otherwise the round is
refused with ``StockRefusal`` naming the tensor and the reason, before any control
call. Our plugin backends receive all of this and never go through here.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightwire.backends.base import StockRefusal, WirePlan
from weightwire.shared.errors import WeightwireError
from weightwire.shared.framing import plan_packed
from weightwire.shared.groups import layer_key
from weightwire.shared.meta import ParamMeta
from weightwire.shared.version import ServerFeatures

UNPACKED_REFUSED_DTYPES = ("bool", "float8_e5m2")
"""No NCCL type in vLLM's ``pynccl_wrapper`` (0.28-0.33): its per-tensor broadcast raises."""


def _align(offset: int) -> int:
    return offset & -offset if offset else 1 << 30


def _groups(metas: Sequence[ParamMeta]) -> list[list[int]]:
    """Consecutive runs of one ``layer_key`` (the unit vLLM materializes), as indices."""
    out: list[list[int]] = []
    last: object = object()
    for i, meta in enumerate(metas):
        key = layer_key(meta.name)
        if out and key == last:
            out[-1].append(i)
        else:
            out.append([i])
        last = key
    return out


def _first_misaligned(metas: Sequence[ParamMeta], buffer_size_bytes: int) -> tuple[int, int] | None:
    for chunk in plan_packed(metas, buffer_size_bytes):
        for i, offset in zip(range(chunk.start, chunk.stop), chunk.offsets, strict=True):
            if offset % metas[i].itemsize:
                return i, offset
    return None


def _aligned_order(metas: Sequence[ParamMeta], buffer_size_bytes: int) -> list[int]:
    """A wire order, permuting only inside layer groups, with every packed offset aligned.

    Greedy per group with the running chunk offset: of the tensors that fit at the
    current offset, take the widest itemsize, then the one leaving the offset best
    aligned (narrow tensors go last, where they cannot misalign a wide one). Raises
    ``_NoOrder`` with the first tensor of the group that fits nowhere.
    """
    order: list[int] = []
    offset = 0
    for group in _groups(metas):
        remaining = list(group)
        while remaining:
            fits = [i for i in remaining if offset % metas[i].itemsize == 0]
            if not fits:
                raise _NoOrder(remaining[0], offset, group)
            pick = max(
                fits, key=lambda i: (metas[i].itemsize, _align(offset + metas[i].nbytes), -i)
            )
            remaining.remove(pick)
            order.append(pick)
            offset += metas[pick].nbytes
            if offset > buffer_size_bytes:  # plan_packed's rule: this tensor closes the chunk
                offset = 0
    return order


class _NoOrder(WeightwireError):
    """Internal: no order of a layer group aligns every tensor.

    ``plan_for_stock`` turns it into ``StockRefusal``.
    """

    def __init__(self, index: int, offset: int, group: list[int]) -> None:
        self.index, self.offset, self.group = index, offset, group


def plan_for_stock(
    metas: Sequence[ParamMeta], *, features: ServerFeatures, packed: bool, buffer_size_bytes: int
) -> WirePlan:
    """The wire plan a stock ``nccl`` worker of ``features.version`` receives.

    Raises ``StockRefusal`` where no such plan exists.
    """
    metas = list(metas)
    version = features.version
    if not packed:
        for m in metas:
            if m.dtype in UNPACKED_REFUSED_DTYPES:
                raise StockRefusal(
                    m.name,
                    f"dtype {m.dtype} has no NCCL type in vLLM's per-tensor (unpacked) "
                    "broadcast; packed mode carries it as bytes",
                    version,
                )
        return WirePlan(metas)
    if not features.packed_scalars:
        for m in metas:
            if m.shape == ():
                raise StockRefusal(
                    m.name,
                    f"it is a scalar (shape []), which vLLM's packed consumer before 0.32 "
                    f"cannot reshape (view(*[]) raises TypeError); the server is {features.basis}. "
                    "Unpacked mode (packed=False) carries scalars",
                    version,
                )
    bad = _first_misaligned(metas, buffer_size_bytes)
    if bad is None:
        return WirePlan(metas)
    try:
        order = _aligned_order(metas, buffer_size_bytes)
    except _NoOrder as exc:
        m = metas[exc.index]
        names = [metas[i].name for i in exc.group]
        group = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} tensors)"
        raise StockRefusal(
            m.name,
            f"its {m.dtype} data would start at byte {exc.offset} of a packed chunk, not a "
            f"multiple of its {m.itemsize}-byte itemsize "
            f"(vLLM views the chunk slice as {m.dtype}), "
            f"and no order of its layer group [{group}] aligns every offset; packed chunks have no "
            "padding. Unpacked mode (packed=False) has no offsets",
            version,
        ) from None
    wire = [metas[i] for i in order]
    assert (
        _first_misaligned(wire, buffer_size_bytes) is None
    )  # the greedy simulated plan_packed exactly
    return WirePlan(wire, tuple(order))
