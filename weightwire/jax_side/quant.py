"""FP8 quantization on the JAX trainer's device (no torch): one jitted pass per weight.

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

A tensor holding NaN or inf is refused (``QuantizationError`` naming it) from one flag the
same jitted pass computes over the input (XLA's max need not propagate NaN): one
device-to-host read per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache, partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from weightwire.jax_side.dtypes import wire_name
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
    not_finite,
    scale_shape,
)
from weightwire.shared.source import WeightSource, as_source
from weightwire.trainer.fp8_source import Fp8Source, as_quantize


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


def _errors(x: jax.Array, dequantized: jax.Array) -> tuple[jax.Array, jax.Array]:
    diff = jnp.abs(dequantized - x.astype(jnp.float32))
    return jnp.max(diff), jnp.mean(diff)


@partial(jax.jit, static_argnames=("block", "ue8m0", "stats"))
def _quantize_block(
    x: jax.Array, opaque: _Opaque, block: tuple[int, int], ue8m0: bool, stats: bool
) -> tuple[jax.Array, ...]:
    m, n = x.shape
    bm, bn = block
    rows, cols = -(-m // bm), -(-n // bn)
    padded = jnp.pad(x.astype(jnp.float32), ((0, rows * bm - m), (0, cols * bn - n)))
    view = padded.reshape(rows, bm, cols, bn)
    amax = jnp.max(jnp.abs(view), axis=(1, 3), keepdims=True)
    finite = jnp.all(jnp.isfinite(x))
    # 448 per block, as an array the simplifier cannot tell from data (not a broadcast)
    data_zero = lax.bitcast_convert_type(amax, jnp.uint32) & opaque.zero
    divisor = _pinned(jnp.broadcast_to(opaque.fp8_max, amax.shape), data_zero)
    sf = _pinned(jnp.maximum(amax, jnp.float32(BLOCK_AMAX_FLOOR)) / divisor, opaque.zero)
    if ue8m0:
        sf = _ue8m0_ceil(sf)
    q = _to_fp8(view * _pinned(jnp.float32(1.0) / sf, opaque.zero))
    weight = q.reshape(padded.shape)[:m, :n]
    scale = sf.reshape(rows, cols)
    if not stats:
        return weight, scale, finite
    dequantized = (q.astype(jnp.float32) * sf).reshape(padded.shape)[:m, :n]
    return (weight, scale, finite, *_errors(x, dequantized))


def _round_bf16(x: jax.Array) -> jax.Array:
    """float32 -> the nearest bfloat16 (ties to even), kept in float32; finite inputs."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


@partial(jax.jit, static_argnames=("stats",))
def _quantize_tensor(x: jax.Array, opaque: _Opaque, stats: bool) -> tuple[jax.Array, ...]:
    # input_to_float8 works in the input's dtype: every step rounds to it.
    rnd = _round_bf16 if x.dtype == jnp.bfloat16 else (lambda v: v)
    values = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(values))
    finite = jnp.all(jnp.isfinite(x))
    floor = jnp.asarray(TENSOR_AMAX_FLOOR, dtype=x.dtype).astype(jnp.float32)
    # torch computes ``448 / amax`` as ``amax.reciprocal() * 448``, each rounded.
    recip = _pinned(rnd(jnp.float32(1.0) / jnp.maximum(amax, floor)), opaque.zero)
    scale = _pinned(rnd(recip * opaque.fp8_max), opaque.zero)
    q = _to_fp8(rnd(values * scale))
    scale_inv = jnp.float32(1.0) / scale
    if not stats:
        return q, scale_inv, finite
    return (q, scale_inv, finite, *_errors(x, q.astype(jnp.float32) * scale_inv))


def quantize_fp8(name: str, x: jax.Array, scheme: Fp8Scheme, *, stats: bool = False) -> Fp8Arrays:
    """``X.weight`` -> its FP8 checkpoint arrays, on ``x``'s device.

    ``stats``: also the max and mean abs error of the dequantized weight against ``x``.
    Raises ``QuantizationError`` naming ``name`` for a shape, dtype or value (NaN / inf)
    the scheme cannot take.
    """
    check_input(name, wire_name(x.dtype), tuple(x.shape), scheme)
    if isinstance(scheme, Fp8Block):
        out = _quantize_block(x, _opaque_args(), scheme.block, scheme.ue8m0, stats)
    elif isinstance(scheme, Fp8PerTensor):
        out = _quantize_tensor(x, _opaque_args(), stats)
    else:
        raise TypeError(f"not an FP8 scheme: {scheme!r}")
    if not bool(out[2]):
        raise not_finite(name)
    assert out[1].shape == scale_shape(tuple(x.shape), scheme)
    errors = QuantStats(float(out[3]), float(out[4])) if stats else None
    return Fp8Arrays(out[0], out[1], errors)


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
    return Fp8Source(as_source(source), spec, as_quantize(quantize_fp8), stats=stats)
