"""FP8 quantization on the JAX trainer's device (no torch): one jitted program per layer group.

``quantize_fp8(name, x, scheme)`` gives the two checkpoint arrays vLLM loads for
``X.weight`` (``shared.quant``: the schemes, names, shapes), bit-identical to vLLM's
quantizers: ``per_block_cast_to_fp8`` for ``Fp8Block`` (with or without ue8m0),
``input_to_float8`` for ``Fp8PerTensor``. What bit identity rests on, spelled out where
XLA could otherwise choose differently:

- amax in float32, clamped to 1e-4 (a block of zeros gets scale 1e-4 / 448), then ``/ 448``;
- ``_pinned`` values between these steps: XLA's simplifier would otherwise reorder them
  (``A / c`` as ``A * (1 / c)``, ``1 / (A / c)`` as ``c / A``: one ulp off);
- ``x * (1 / sf)``: a float32 reciprocal, then a multiply (not a divide);
- ue8m0 from the scale's bits (``UE8M0_ROUND_DOWN``), not from this device's log2;
- the cast after a clip to +-448: torch's cast saturates, XLA's gives NaN past 464;
- per-tensor: each step rounded to the input's dtype as torch does (bfloat16 rounding done
  on the bits, so XLA's excess-precision simplifications cannot skip it), and ``448 / amax``
  as torch evaluates it: ``amax.reciprocal() * 448``.

A tensor holding NaN or inf is refused (``QuantizationError`` naming it) from a flag the
amax reduction itself gives (NaN read as inf: XLA's max need not propagate NaN): one
device-to-host read per layer group (``launch_fp8``, what ``Fp8Source`` drives), none per
tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache, partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from weightwire.jax_side.dtypes import wire_name
from weightwire.shared.errors import WrongType
from weightwire.shared.quant import (
    BLOCK_AMAX_FLOOR,
    FP8_MAX,
    TENSOR_AMAX_FLOOR,
    UE8M0_ROUND_DOWN,
    Fp8Block,
    Fp8PerTensor,
    Fp8Scheme,
    QuantStats,
    check_input,
    refuse_not_finite,
    scale_shape,
)
from weightwire.shared.source import WeightSource, as_source
from weightwire.trainer.fp8_source import Fp8Source, LaunchedGroup


class Fp8Arrays(NamedTuple):
    """One quantized ``X.weight``: the e4m3 weight, its float32 scale, the error (if asked)."""

    weight: jax.Array
    scale: jax.Array
    stats: QuantStats | None


class _Opaque(NamedTuple):
    """Runtime values XLA cannot fold: its algebraic simplifier rewrites ``A / broadcast(c)``
    as ``A * (1 / c)`` and ``1 / (A / c)`` as ``c / A`` (each one ulp off vLLM's order of
    operations for some inputs), and an optimization barrier does not stop it on CPU."""

    fp8_max: jax.Array  # 448.0
    zero: jax.Array  # 0, uint32


@cache  # uncommitted scalars: jit places them beside any input
def _opaque_args() -> _Opaque:
    return _Opaque(jnp.asarray(FP8_MAX, jnp.float32), jnp.asarray(0, jnp.uint32))


def _pinned(v: jax.Array, zero: jax.Array) -> jax.Array:
    """``v`` itself, through an OR with a runtime zero: the simplifier sees no division."""
    bits = lax.bitcast_convert_type(v, jnp.uint32) | zero
    return lax.bitcast_convert_type(bits, jnp.float32)


def _ue8m0_ceil(sf: jax.Array) -> jax.Array:
    bits = lax.bitcast_convert_type(sf, jnp.uint32)
    exponent = (bits >> 23).astype(jnp.int32)
    mantissa = (bits & 0x7FFFFF).astype(jnp.int32)
    up = (mantissa > jnp.asarray(UE8M0_ROUND_DOWN)[exponent]).astype(jnp.int32)
    return lax.bitcast_convert_type(((exponent + up) << 23).astype(jnp.uint32), jnp.float32)


def _to_fp8(scaled: jax.Array) -> jax.Array:
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def _errors(x: jax.Array, dequantized: jax.Array) -> jax.Array:
    diff = jnp.abs(dequantized - x.astype(jnp.float32))
    return jnp.stack([jnp.max(diff), jnp.mean(diff)])


def _magnitudes(x: jax.Array) -> jax.Array:
    """``|x|`` in ``x``'s own dtype (exact), NaN as inf: the amax reduction then also says
    whether the tensor is finite (XLA's max need not propagate NaN), with no second pass."""
    mag = jnp.abs(x)
    return jnp.where(jnp.isnan(mag), jnp.asarray(jnp.inf, mag.dtype), mag)


def _quantize_block(
    x: jax.Array, opaque: _Opaque, scheme: Fp8Block, stats: bool
) -> tuple[jax.Array, ...]:
    m, n = x.shape
    bm, bn = scheme.block
    rows, cols = -(-m // bm), -(-n // bn)
    # Whole blocks (every real linear): a reshape, no padded copy; an uneven edge pads with
    # zeros in the input's dtype. |x| and its max are exact in that dtype, so the widening
    # waits until after the reduction, and the product below widens each element exactly:
    # the bits of vLLM's padded float32 path.
    whole = (m, n) == (rows * bm, cols * bn)
    tiled = x if whole else jnp.pad(x, ((0, rows * bm - m), (0, cols * bn - n)))
    view = tiled.reshape(rows, bm, cols, bn)
    amax = jnp.max(_magnitudes(view), axis=(1, 3), keepdims=True).astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(amax))
    # 448 per block, as an array the simplifier cannot tell from data (not a broadcast)
    data_zero = lax.bitcast_convert_type(amax, jnp.uint32) & opaque.zero
    divisor = _pinned(jnp.broadcast_to(opaque.fp8_max, amax.shape), data_zero)
    sf = _pinned(jnp.maximum(amax, jnp.float32(BLOCK_AMAX_FLOOR)) / divisor, opaque.zero)
    if scheme.ue8m0:
        sf = _ue8m0_ceil(sf)
    q = _to_fp8(view.astype(jnp.float32) * _pinned(jnp.float32(1.0) / sf, opaque.zero))
    weight = q.reshape(tiled.shape)
    if not whole:
        weight = weight[:m, :n]
    scale = sf.reshape(rows, cols)
    if not stats:
        return weight, scale, finite
    dequantized = (q.astype(jnp.float32) * sf).reshape(tiled.shape)[:m, :n]
    return weight, scale, finite, _errors(x, dequantized)


def _round_bf16(x: jax.Array) -> jax.Array:
    """float32 -> the nearest bfloat16 (ties to even), kept in float32; finite inputs."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _quantize_tensor(x: jax.Array, opaque: _Opaque, stats: bool) -> tuple[jax.Array, ...]:
    # input_to_float8 works in the input's dtype: every step rounds to it.
    rnd = _round_bf16 if x.dtype == jnp.bfloat16 else (lambda v: v)
    amax = jnp.max(_magnitudes(x)).astype(jnp.float32)
    finite = jnp.isfinite(amax)
    floor = jnp.asarray(TENSOR_AMAX_FLOOR, dtype=x.dtype).astype(jnp.float32)
    # torch computes ``448 / amax`` as ``amax.reciprocal() * 448``, each rounded.
    recip = _pinned(rnd(jnp.float32(1.0) / jnp.maximum(amax, floor)), opaque.zero)
    scale = _pinned(rnd(recip * opaque.fp8_max), opaque.zero)
    q = _to_fp8(rnd(x.astype(jnp.float32) * scale))
    scale_inv = jnp.float32(1.0) / scale
    if not stats:
        return q, scale_inv, finite
    return q, scale_inv, finite, _errors(x, q.astype(jnp.float32) * scale_inv)


@partial(jax.jit, static_argnames=("schemes", "stats"))
def _quantize_group(
    xs: tuple[jax.Array, ...], opaque: _Opaque, schemes: tuple[Fp8Scheme, ...], stats: bool
) -> tuple[list[jax.Array], list[jax.Array], jax.Array, jax.Array | None]:
    """A layer group's weights in one program (compiled once per shapes and schemes): one
    dispatch, and XLA free to run the weights' passes side by side."""
    weights, scales, flags, errors = [], [], [], []
    for x, scheme in zip(xs, schemes, strict=True):
        if isinstance(scheme, Fp8Block):
            out = _quantize_block(x, opaque, scheme, stats)
        else:
            out = _quantize_tensor(x, opaque, stats)
        weights.append(out[0])
        scales.append(out[1])
        flags.append(out[2])
        if stats:
            errors.append(out[3])
    return weights, scales, jnp.stack(flags), jnp.stack(errors) if stats else None


def launch_fp8(items: Sequence[tuple[str, jax.Array, Fp8Scheme]], stats: bool) -> LaunchedGroup:
    """Quantize ``items`` (``(name, x, scheme)``: ``X.weight``s) by one jitted dispatch; no
    host sync until the result's ``settle`` (one read of every flag and error)."""
    for name, x, scheme in items:
        check_input(name, wire_name(x.dtype), tuple(x.shape), scheme)
        if not isinstance(scheme, Fp8Block | Fp8PerTensor):
            raise WrongType(f"not an FP8 scheme: {scheme!r}")
    names = [name for name, _, _ in items]
    xs = tuple(x for _, x, _ in items)
    schemes = tuple(scheme for _, _, scheme in items)
    weights, scales, finite, errors = _quantize_group(xs, _opaque_args(), schemes, stats)

    def settle() -> list[QuantStats | None]:
        flags, errs = jax.device_get((finite, errors))
        refuse_not_finite(names, flags.tolist())
        if errs is None:
            return [None] * len(names)
        return [QuantStats(float(e[0]), float(e[1])) for e in errs]

    return LaunchedGroup(list(zip(weights, scales, strict=True)), settle)


def quantize_fp8(name: str, x: jax.Array, scheme: Fp8Scheme, *, stats: bool = False) -> Fp8Arrays:
    """``X.weight`` -> its FP8 checkpoint arrays, on ``x``'s device.

    ``stats``: also the max and mean abs error of the dequantized weight against ``x``.
    Raises ``QuantizationError`` naming ``name`` for a shape, dtype or value (NaN / inf)
    the scheme cannot take.
    """
    launched = launch_fp8([(name, x, scheme)], stats)
    (errors,) = launched.settle()
    ((weight, scale),) = launched.pairs
    assert scale.shape == scale_shape(tuple(x.shape), scheme)
    return Fp8Arrays(weight, scale, errors)


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
