"""FP8 quantization on the torch trainer's device (no jax).

``quantize_fp8(name, x, scheme)``: the torch twin of ``jax_side.quant`` (read its docstring
for what bit identity with vLLM's quantizers rests on), written out in eager torch:
``per_block_cast_to_fp8``'s arithmetic for ``Fp8Block``, ``input_to_float8``'s for
``Fp8PerTensor``. NaN / inf refused, naming the tensor, from the amax's flag: one device
read per layer group (``launch_fp8``, what ``Fp8Source`` drives), none per tensor.

On a CUDA device the block weights go through the fused kernel (``quant_cuda``: one read
of each tile, one launch per input dtype of a group; the same bytes) where CuPy compiles
it and no error stats are asked; per-tensor weights, stats and every other device run the
eager ops here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch

from weightwire.shared.errors import WrongType
from weightwire.shared.quant import (
    BLOCK_AMAX_FLOOR,
    FP8_MAX,
    TENSOR_AMAX_FLOOR,
    UE8M0_ROUND_DOWN,
    Fp8Block,
    Fp8PerTensor,
    Fp8Scheme,
    QuantizationError,
    QuantStats,
    check_input,
    refuse_not_finite,
    scale_shape,
)
from weightwire.shared.source import WeightSource, as_source
from weightwire.torch_side.dtypes import wire_name
from weightwire.torch_side.sender import quant_cuda
from weightwire.trainer.fp8_source import Fp8Source, LaunchedGroup

_ROUND_DOWN = torch.from_numpy(UE8M0_ROUND_DOWN)
_ROUND_DOWN_ON: dict[torch.device, torch.Tensor] = {}
_FP8_MAX_ON: dict[torch.device, torch.Tensor] = {}


class Fp8Tensors(NamedTuple):
    """One quantized ``X.weight``: the e4m3 weight, its float32 scale, the error (if asked)."""

    weight: torch.Tensor
    scale: torch.Tensor
    stats: QuantStats | None


def _fp8_max_on(device: torch.device) -> torch.Tensor:
    """448 as a tensor on ``device``: CUDA torch divides by a Python number as a multiply by
    its reciprocal (one ulp off some scales); by a device tensor, it divides, as vLLM's
    ``x_amax / 448.0`` on a CPU does, so the scales do not depend on the device."""
    value = _FP8_MAX_ON.get(device)
    if value is None:
        value = torch.tensor(FP8_MAX, dtype=torch.float32, device=device)
        value = _FP8_MAX_ON.setdefault(device, value)
    return value


def _ue8m0_ceil(sf: torch.Tensor) -> torch.Tensor:
    table = _ROUND_DOWN_ON.get(sf.device)
    if table is None:
        table = _ROUND_DOWN_ON.setdefault(sf.device, _ROUND_DOWN.to(sf.device))
    bits = sf.view(torch.int32)  # positive floats: the sign bit is clear
    exponent = bits >> 23
    up = ((bits & 0x7FFFFF) > table[exponent.long()]).to(torch.int32)
    return ((exponent + up) << 23).view(torch.float32)


def _scaled_fp8(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``(x * factor).to(float8_e4m3fn)`` as vLLM computes it (the product in the promoted
    dtype: float32 for a block's float32 factor, the input's for a per-tensor scale), in one
    pass where the device allows: an ``out`` of another dtype makes the kernel cast each
    product as it stores it (c10's cast, the one ``.to`` uses; on a CPU torch goes through a
    temporary instead), so no float32 product is written out and read back.

    No clip (the JAX twin and the reference clip to 448, free there): vLLM's own cast is
    unclipped, and its products stay below 464, the midpoint past 448 where casts part ways
    (at most 448 (1 + 2^-8) rounded to the input's dtype: a bfloat16 per-tensor scale
    rounded up; the block scales are float32, ue8m0's within ulps of the block's 448): every
    cast rounds them to 448."""
    shape = torch.broadcast_shapes(x.shape, factor.shape)
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    return torch.mul(x, factor, out=out)


def _amax(x: torch.Tensor, blocks: bool) -> torch.Tensor:
    """``x.abs().amax()`` in ``x``'s dtype (over each block's dims 1 and 3 for a
    ``(rows, bm, cols, bn)`` view, kept), from one ``aminmax`` pass: no ``|x|`` written out
    (exact: a max and a negation). NaN propagates, so the flag comes from the result."""
    if not blocks:
        low, high = torch.aminmax(x)
        return torch.maximum(high, low.neg())
    # one reading pass along each row of a block; the second stage reads 1/bn of that
    low, high = torch.aminmax(x, dim=3, keepdim=True)
    return torch.maximum(high.amax(dim=1, keepdim=True), low.amin(dim=1, keepdim=True).neg())


def _errors(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    diff = (dequantized - x.float()).abs()
    return torch.stack([diff.max(), diff.mean()])


Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(e4m3 weight, float32 scale, the amax(es) its finite flag comes from, [max, mean] abs
error or None), all on the device: nothing here reads a value back."""


class _Blocks(NamedTuple):
    """One block-quantized weight between the group's two stages."""

    position: int  # in the group
    x: torch.Tensor
    scheme: Fp8Block
    view: torch.Tensor  # (rows, bm, cols, bn): the weight, or its zero-padded float32 copy
    amax: torch.Tensor  # float32 (rows, 1, cols, 1): each block's |x| max


def _block_amax(index: int, x: torch.Tensor, scheme: Fp8Block) -> _Blocks:
    m, n = x.shape
    bm, bn = scheme.block
    rows, cols = -(-m // bm), -(-n // bn)
    if (m, n) == (rows * bm, cols * bn) and x.is_contiguous():
        # Whole blocks (every real linear): a view, no padded copy. Absolute values and their
        # maximum are exact in the input's own dtype, so the widening can wait until after
        # the reduction, and the product below widens each element exactly as a float32
        # copy would: the same bits as the padded float32 path, with fewer passes.
        padded = x
    else:
        padded = torch.zeros((rows * bm, cols * bn), dtype=torch.float32, device=x.device)
        padded[:m, :n] = x
    view = padded.view(rows, bm, cols, bn)
    return _Blocks(index, x, scheme, view, _amax(view, blocks=True).float())


def _block_scales(blocks: list[_Blocks]) -> list[torch.Tensor]:
    """Every block weight's ``sf`` (``amax.clamp(1e-4) / 448``, ue8m0-rounded where its
    scheme says) from one run of elementwise ops over the group's amaxes together, not one
    run of small launches per weight (the same elementwise arithmetic: the same bits)."""
    flat = torch.cat([b.amax.view(-1) for b in blocks])
    sf = flat.clamp(min=BLOCK_AMAX_FLOOR) / _fp8_max_on(flat.device)
    sf_up = _ue8m0_ceil(sf) if any(b.scheme.ue8m0 for b in blocks) else sf
    out, offset = [], 0
    for b in blocks:
        count = b.amax.numel()
        out.append((sf_up if b.scheme.ue8m0 else sf)[offset : offset + count].view(b.amax.shape))
        offset += count
    return out


def _quantize_blocks(b: _Blocks, sf: torch.Tensor, stats: bool) -> Quantized:
    m, n = b.x.shape
    q = _scaled_fp8(b.view, 1.0 / sf)  # float32 products of the mixed operands
    padded_shape = (b.view.shape[0] * b.view.shape[1], b.view.shape[2] * b.view.shape[3])
    weight = q.view(padded_shape)
    if weight.shape != (m, n):
        weight = weight[:m, :n].contiguous()
    errors = _errors(b.x, (q.float() * sf).view(padded_shape)[:m, :n]) if stats else None
    rows, cols = b.amax.shape[0], b.amax.shape[2]
    return weight, sf.view(rows, cols), b.amax, errors


def _quantize_tensor(x: torch.Tensor, stats: bool) -> Quantized:
    # input_to_float8's expressions, in the input's dtype as it computes them.
    amax = _amax(x, blocks=False)
    scale = FP8_MAX / amax.clamp(min=TENSOR_AMAX_FLOOR)
    q = _scaled_fp8(x, scale)
    scale_inv = scale.float().reciprocal()
    errors = _errors(x, q.float() * scale_inv) if stats else None
    return q, scale_inv, amax, errors


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


class _Shard(NamedTuple):
    """A DTensor weight quantized on this rank's shard: how to put the results back."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: tuple[int, ...]
    scale_shape: tuple[int, ...]


def _shard_of(name: str, x: Any, scheme: Fp8Scheme) -> _Shard:
    """How DTensor ``x`` is quantized without a gather: each rank its own shard, which
    holds whole blocks (every shard boundary on a block boundary, so this rank's scales are
    exactly its blocks' and torch shards the scale tensor alike). Else
    ``QuantizationError`` naming the weight: a block cut by a shard boundary needs both
    shards' maxima."""
    from weightwire.torch_side.sender.holdings import placement_boxes
    from weightwire.trainer.slice_plan import SlicePlanError

    shape = tuple(x.shape)
    placements = tuple(x.placements)
    sharded = [p for p in placements if type(p).__name__ != "Replicate"]
    how = f"{name!r} is a DTensor ({', '.join(map(str, placements))})"
    sshape = scale_shape(shape, scheme)
    if isinstance(scheme, Fp8PerTensor):
        if sharded:
            raise QuantizationError(
                f"{how}: a per-tensor FP8 scale needs the whole tensor's maximum, not one "
                "shard's; send its full_tensor() (or a block scheme)"
            )
        return _Shard(x.device_mesh, placements, shape, sshape)  # replicated: each rank whole
    mesh = x.device_mesh.mesh
    try:
        weights = placement_boxes(shape, mesh, placements, name=name)
        scales = dict(placement_boxes(sshape, mesh, placements, name=name))
    except SlicePlanError as exc:
        raise QuantizationError(f"{exc} (FP8 quantization of its shards)") from None
    block = scheme.block
    for rank, box in weights:
        whole = tuple((lo // b, -(-hi // b)) for (lo, hi), b in zip(box.ranges, block, strict=True))
        aligned = all(lo % b == 0 for (lo, _), b in zip(box.ranges, block, strict=True))
        mine = scales[rank]
        fits = not box.empty and aligned and mine.ranges == whole
        if not fits:
            raise QuantizationError(
                f"{how}: rank {rank} holds {box.describe()}, which cuts its "
                f"{' x '.join(map(str, block))} FP8 blocks; a block's scale needs all of its "
                "elements, so the shards cannot be quantized apart. Shard it along whole "
                "blocks, or send its full_tensor()"
            )
    return _Shard(x.device_mesh, placements, shape, sshape)


def _as_dtensor(local: torch.Tensor, shard: _Shard, shape: tuple[int, ...]) -> Any:
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local,
        shard.mesh,
        shard.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


@torch.no_grad()
def launch_fp8(items: Sequence[tuple[str, torch.Tensor, Fp8Scheme]], stats: bool) -> LaunchedGroup:
    """``_launch`` on plain tensors; a DTensor is quantized on this rank's shard where its
    shards hold whole blocks (``_shard_of``: never gathered, refused by name otherwise), the
    results DTensors of its placements. A rank's flags and errors are its shards' (a NaN on
    another rank's shard fails that rank's part of the round)."""
    dtensor = _dtensor_type()
    if dtensor is None or not any(isinstance(x, dtensor) for _, x, _ in items):
        return _launch(items, stats)
    shards: list[_Shard | None] = []
    local: list[tuple[str, torch.Tensor, Fp8Scheme]] = []
    for name, x, scheme in items:
        if not isinstance(x, dtensor):
            shards.append(None)
            local.append((name, x, scheme))
            continue
        check_input(name, wire_name(x.dtype), tuple(x.shape), scheme)
        shards.append(_shard_of(name, x, scheme))
        local.append((name, x.to_local(), scheme))  # type: ignore[attr-defined]
    launched = _launch(local, stats)
    pairs = []
    for held, (weight, scale) in zip(shards, launched.pairs, strict=True):
        if held is not None:
            weight = _as_dtensor(weight, held, held.shape)
            scale = _as_dtensor(scale, held, held.scale_shape)
        pairs.append((weight, scale))

    return LaunchedGroup(pairs, launched.settle)


def _launch(items: Sequence[tuple[str, torch.Tensor, Fp8Scheme]], stats: bool) -> LaunchedGroup:
    """Quantize ``items`` (``(name, x, scheme)``: ``X.weight``s) as eager ops or the fused
    kernel's launches queued on the device, with no host sync until the result's ``settle``.
    Per weight only the passes over its elements (the block maxima, the scaled cast; the
    kernel: one); the small ops on the scales run once for the group. One flag for the whole
    group (and the errors) is copied back once, asynchronously on a GPU, so the next group's
    ops queue meanwhile; only a group that holds NaN or inf reads its per-weight flags, to
    name them."""
    for name, x, scheme in items:
        check_input(name, wire_name(x.dtype), tuple(x.shape), scheme)
        if not isinstance(scheme, Fp8Block | Fp8PerTensor):
            raise WrongType(f"not an FP8 scheme: {scheme!r}")
    names = [name for name, _, _ in items]
    block_items = [
        (i, x.detach(), scheme)
        for i, (_, x, scheme) in enumerate(items)
        if isinstance(scheme, Fp8Block)
    ]
    # the fused kernel where it takes them (CUDA, no stats asked); the rest as torch ops
    fused = {} if stats else quant_cuda.quantize_blocks(block_items)
    blocks = [_block_amax(i, x, scheme) for i, x, scheme in block_items if i not in fused]
    done: list[Quantized | None] = [None] * len(items)
    for i, (weight, scale, amax) in fused.items():
        done[i] = (weight, scale, amax, None)
    for b, sf in zip(blocks, _block_scales(blocks) if blocks else [], strict=True):
        done[b.position] = _quantize_blocks(b, sf, stats)
    for i, (_, x, _) in enumerate(items):
        if done[i] is None:  # per-tensor: its scale is in the input's dtype, one weight's own
            done[i] = _quantize_tensor(x.detach(), stats)
    outs = [d for d in done if d is not None]
    amaxes = [amax.float().view(-1) for _, _, amax, _ in outs]
    finite = torch.isfinite(torch.cat(amaxes))
    errors = [e for _, _, _, e in outs if e is not None]
    packed = torch.cat([finite.all().float().view(1), *errors])
    event: torch.cuda.Event | None = None
    if packed.is_cuda:
        packed = packed.to("cpu", non_blocking=True)  # pinned: the copy is queued, not waited
        event = torch.cuda.Event()
        event.record()
    else:
        packed = packed.cpu()

    def settle() -> list[QuantStats | None]:
        if event is not None:
            event.synchronize()
        values = packed.tolist()
        if values[0] != 1.0:  # the failure path: which weights (one more read)
            per_weight = torch.split(finite, [a.numel() for a in amaxes])
            refuse_not_finite(names, [bool(f.all()) for f in per_weight])
        if not stats:
            return [None] * len(names)
        return [QuantStats(values[1 + 2 * i], values[2 + 2 * i]) for i in range(len(names))]

    return LaunchedGroup([(w, s) for w, s, _, _ in outs], settle)


def quantize_fp8(
    name: str, x: torch.Tensor, scheme: Fp8Scheme, *, stats: bool = False
) -> Fp8Tensors:
    """``X.weight`` -> its FP8 checkpoint tensors, on ``x``'s device.

    ``stats``: also the max and mean abs error of the dequantized weight against ``x``.
    Raises ``QuantizationError`` naming ``name`` for a shape, dtype or value (NaN / inf)
    the scheme cannot take.
    """
    launched = launch_fp8([(name, x, scheme)], stats)
    (errors,) = launched.settle()
    ((weight, scale),) = launched.pairs
    return Fp8Tensors(weight, scale, errors)


def fp8_source(
    source: WeightSource | Any,
    spec: Mapping[str, Fp8Scheme] | Literal["auto"],
    *,
    stats: bool = False,
) -> Fp8Source:
    """``source`` with the ``spec``'s weights (name -> scheme) sent as FP8 checkpoint pairs,
    quantized here as each round reads them (``trainer.fp8_source.Fp8Source``); ``"auto"``:
    exactly the weights the served model tells at ``trainer_init`` it takes in FP8, with its
    scheme."""
    return Fp8Source(as_source(source), spec, launch_fp8, stats=stats)
