"""FP8 quantization of a trainer's weights into the checkpoint layout vLLM loads.

The schemes are the two FP8 layouts of served checkpoints:

- ``Fp8Block``: DeepSeek-V3 / Qwen3-FP8. ``X.weight`` in ``float8_e4m3fn`` plus
  ``X.weight_scale_inv`` (float32, one per ``block`` tile: ``ceil(m/bm) x ceil(n/bn)``),
  the arithmetic of vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``), bit for
  bit, with or without the ue8m0 (power-of-two) scale rounding.
- ``Fp8PerTensor``: ``X.weight`` in ``float8_e4m3fn`` plus ``X.weight_scale`` (float32,
  shape ``()``), the arithmetic of vLLM's ``input_to_float8``
  (``quantization/utils/fp8_utils.py``): computed in the input's dtype.

This module holds what both trainers agree on: the scheme records, the names and shapes
a scheme produces, the checks of an input, the ue8m0 rounding table and a numpy reference
implementation (what the JAX and torch quantizers are tested against). numpy + ml_dtypes
only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import ml_dtypes
import numpy as np

from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` (vLLM's ``get_fp8_min_max`` off ROCm)."""
BLOCK_AMAX_FLOOR = 1e-4
"""``per_block_cast_to_fp8`` clamps each block's amax to this (an all-zero block's scale)."""
TENSOR_AMAX_FLOOR = 1e-12
"""``input_to_float8`` clamps the tensor's amax to this."""
INPUT_DTYPES = ("bfloat16", "float16", "float32")
"""The trainer dtypes a block quantizer takes; the per-tensor one computes in its input's
dtype like vLLM's, and takes ``bfloat16`` and ``float32`` only (``float16`` overflows its
scale at small amax in vLLM's own arithmetic)."""
PER_TENSOR_DTYPES = ("bfloat16", "float32")


class QuantizationError(ConfigError):
    """A tensor cannot be quantized as asked (not 2-D, not a float, not finite, a scheme
    that does not fit): the message names the tensor; nothing was sent."""


@dataclass(frozen=True)
class Fp8Block:
    """Block-wise e4m3 with float32 ``weight_scale_inv`` per ``block`` = (rows, cols) tile.

    ``ue8m0``: each scale rounded up to a power of two (the served model's DeepGEMM scale
    format on Blackwell); the scale is still sent as float32.
    """

    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False

    def __post_init__(self) -> None:
        block = tuple(self.block)
        if len(block) != 2 or not all(type(b) is int and 0 < b <= 1 << 16 for b in block):
            raise QuantizationError(
                f"Fp8Block.block must be two positive ints (rows, cols), got {self.block!r}"
            )
        object.__setattr__(self, "block", block)
        if type(self.ue8m0) is not bool:
            raise QuantizationError(f"Fp8Block.ue8m0 must be a bool, got {self.ue8m0!r}")

    @property
    def scale_suffix(self) -> str:
        # vLLM's Fp8LinearMethod registers the block scale under this name (DeepSeek-V3's).
        return "weight_scale_inv"


@dataclass(frozen=True)
class Fp8PerTensor:
    """One e4m3 scale for the whole tensor, sent as float32 ``weight_scale`` of shape ()."""

    @property
    def scale_suffix(self) -> str:
        return "weight_scale"


Fp8Scheme = Fp8Block | Fp8PerTensor


class Fp8Names(NamedTuple):
    """The two checkpoint tensors one quantized ``X.weight`` becomes."""

    weight: str
    scale: str


class QuantStats(NamedTuple):
    """How far the dequantized tensor (``weight * scale`` per block) is from the input,
    in float32: what the trainer can watch of the train / rollout gap."""

    max_abs_error: float
    mean_abs_error: float


def fp8_names(name: str, scheme: Fp8Scheme) -> Fp8Names:
    """``X.weight`` -> (``X.weight``, ``X.weight_scale_inv`` or ``X.weight_scale``)."""
    if not isinstance(name, str) or not name.endswith(".weight") or name == ".weight":
        raise QuantizationError(
            f"only a linear's 'X.weight' can be sent in FP8 (its scale goes beside it as "
            f"'X.{scheme.scale_suffix}'), got {name!r}: leave it out of the FP8 spec"
        )
    return Fp8Names(name, name[: -len("weight")] + scheme.scale_suffix)


def scale_shape(shape: tuple[int, ...], scheme: Fp8Scheme) -> tuple[int, ...]:
    """The float32 scale's shape for a weight of ``shape`` (``ceil(m/bm), ceil(n/bn)``)."""
    if isinstance(scheme, Fp8PerTensor):
        return ()
    m, n = shape
    bm, bn = scheme.block
    return (-(-m // bm), -(-n // bn))


def check_input(name: str, dtype: str, shape: tuple[int, ...], scheme: Fp8Scheme) -> None:
    """Refuse, naming the tensor, an input the scheme cannot quantize (before any work)."""
    allowed = PER_TENSOR_DTYPES if isinstance(scheme, Fp8PerTensor) else INPUT_DTYPES
    if dtype not in allowed:
        raise QuantizationError(
            f"{name!r} is {dtype}; {type(scheme).__name__} quantizes {', '.join(allowed)} "
            f"weights: cast it first or leave it out of the FP8 spec"
        )
    if len(shape) != 2:
        raise QuantizationError(
            f"{name!r} has shape {list(shape)}; FP8 quantization takes a 2-D linear weight "
            f"(out_features, in_features): leave it out of the FP8 spec"
        )
    if math.prod(shape) == 0:
        raise QuantizationError(f"{name!r} has shape {list(shape)}: nothing to quantize")


def fp8_metas(name: str, shape: tuple[int, ...], scheme: Fp8Scheme) -> tuple[ParamMeta, ParamMeta]:
    """What the wire carries for one quantized ``X.weight``: the e4m3 weight, its scale."""
    names = fp8_names(name, scheme)
    return (
        ParamMeta(names.weight, FP8_DTYPE, tuple(shape)),
        ParamMeta(names.scale, "float32", scale_shape(tuple(shape), scheme)),
    )


def not_finite(name: str, *others: str) -> QuantizationError:
    also = f" (so do {', '.join(map(repr, others))})" if others else ""
    return QuantizationError(
        f"{name!r} holds NaN or inf{also}: an FP8 scale cannot represent it (vLLM's quantizer "
        f"would send NaN); fix the training step before sending"
    )


def refuse_not_finite(names: Sequence[str], finite: Sequence[bool]) -> None:
    """A quantized group's finite flags, read back once: ``QuantizationError`` naming every
    tensor of ``names`` whose flag is false."""
    bad = [n for n, ok in zip(names, finite, strict=True) if not ok]
    if bad:
        raise not_finite(*bad)


def _ue8m0_round_down_table() -> np.ndarray:
    """``T[e]``: the largest mantissa field ``f`` of a float32 ``x = 2^(e-127) (1 + f 2^-23)``
    whose float32 ``log2`` rounds down to the integer ``e - 127``.

    vLLM's ue8m0 rounding is ``2 ** ceil(log2(sf))`` in float32, and log2 of a scale just
    above a power of two rounds to that power's exponent, so the ceil keeps it: the scale
    is then a power of two *below* ``sf`` (its block's largest value scales to 448 * (1 + ulp)
    and saturates to 448). A table of those mantissas per exponent gives the same scale from
    the bits alone, on any device, whatever its log2's accuracy.
    """
    table = np.zeros(256, dtype=np.int32)
    f = np.arange(256, dtype=np.uint32)
    for e in range(1, 255):
        x = ((np.uint32(e) << np.uint32(23)) | f).view(np.float32).astype(np.float64)
        down = np.float32(np.log2(x)) == np.float32(e - 127)
        # log2 grows with f: the rounded-down mantissas are a prefix 0..T
        table[e] = int(np.argmin(down)) - 1
    return table


UE8M0_ROUND_DOWN = _ue8m0_round_down_table()


def ue8m0_ceil_reference(sf: np.ndarray) -> np.ndarray:
    """vLLM's ``_ceil_to_ue8m0`` on positive normal float32 scales, from their bits."""
    bits = np.ascontiguousarray(sf, dtype=np.float32).view(np.uint32)
    exponent = (bits >> np.uint32(23)).astype(np.int32)
    mantissa = (bits & np.uint32(0x7FFFFF)).astype(np.int32)
    up = (mantissa > UE8M0_ROUND_DOWN[exponent]).astype(np.int32)
    return ((exponent + up).astype(np.uint32) << np.uint32(23)).view(np.float32)


def _saturate_fp8(x: np.ndarray) -> np.ndarray:
    # torch's float -> float8_e4m3fn cast saturates at 448 (ml_dtypes and XLA give NaN past
    # 464); vLLM's scaled values stay below 464, but clipping first keeps all three equal.
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def quantize_block_reference(
    name: str, x: np.ndarray, scheme: Fp8Block
) -> tuple[np.ndarray, np.ndarray]:
    """``(weight e4m3, weight_scale_inv float32)`` as ``per_block_cast_to_fp8`` computes them."""
    check_input(name, x.dtype.name, x.shape, scheme)
    m, n = x.shape
    bm, bn = scheme.block
    rows, cols = scale_shape(x.shape, scheme)
    padded = np.zeros((rows * bm, cols * bn), dtype=np.float32)
    padded[:m, :n] = x.astype(np.float32)
    view = padded.reshape(rows, bm, cols, bn)
    amax = np.abs(view).max(axis=(1, 3), keepdims=True)
    if not np.isfinite(amax).all():
        raise not_finite(name)
    sf = np.maximum(amax, np.float32(BLOCK_AMAX_FLOOR)) / np.float32(FP8_MAX)
    if scheme.ue8m0:
        sf = ue8m0_ceil_reference(sf)
    scaled = view * (np.float32(1.0) / sf)
    q = _saturate_fp8(scaled).reshape(padded.shape)[:m, :n]
    return np.ascontiguousarray(q), sf.reshape(rows, cols)


def quantize_tensor_reference(name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(weight e4m3, weight_scale float32 of shape ())`` as ``input_to_float8`` computes
    them: amax, ``448 / amax`` and the scaled values in the input's dtype."""
    check_input(name, x.dtype.name, x.shape, Fp8PerTensor())
    dtype = x.dtype
    amax = np.abs(x).max()
    if not np.isfinite(amax):
        raise not_finite(name)
    amax = np.maximum(amax, np.asarray(TENSOR_AMAX_FLOOR).astype(dtype))
    # torch evaluates ``448 / amax`` as ``amax.reciprocal() * 448``, each step rounded
    recip = (np.float32(1.0) / amax.astype(np.float32)).astype(dtype)
    scale = (recip.astype(np.float32) * np.float32(FP8_MAX)).astype(dtype)
    scaled = (x.astype(np.float32) * scale.astype(np.float32)).astype(dtype)
    q = _saturate_fp8(scaled.astype(np.float32))
    return q, np.asarray(np.float32(1.0) / scale.astype(np.float32), dtype=np.float32)


def dequantize_reference(q: np.ndarray, scale: np.ndarray, scheme: Fp8Scheme) -> np.ndarray:
    """float32 ``q * scale``, each block times its scale (what the served layer computes with)."""
    values = q.astype(np.float32)
    if isinstance(scheme, Fp8PerTensor):
        return values * np.float32(scale)
    bm, bn = scheme.block
    m, n = q.shape
    full = np.repeat(np.repeat(scale, bm, axis=0), bn, axis=1)[:m, :n]
    return values * full


# -- the scheme a served checkpoint declares ----------------------------------------------


def scheme_to_dict(scheme: Fp8Scheme) -> dict[str, object]:
    """The scheme as JSON (the served model's ``fp8.scheme``, ``docs/wire-format.md``)."""
    if isinstance(scheme, Fp8Block):
        return {"kind": "block", "block": list(scheme.block), "ue8m0": scheme.ue8m0}
    return {"kind": "tensor"}


def scheme_from_dict(data: object, ctx: str) -> Fp8Scheme:
    """Strict parse of ``scheme_to_dict``'s JSON: ``ValueError`` naming ``ctx``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{ctx} must be a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    keys = {"block": {"kind", "block", "ue8m0"}, "tensor": {"kind"}}.get(str(kind))
    if keys is None:
        raise ConfigError(f"{ctx}.kind must be 'block' or 'tensor', got {kind!r}")
    extra = sorted(str(k) for k in data if k not in keys)
    if extra:
        raise ConfigError(f"{ctx}: unknown keys {extra}; allowed: {sorted(keys)}")
    if kind == "tensor":
        return Fp8PerTensor()
    block = data.get("block")
    if not isinstance(block, list):
        raise ConfigError(f"{ctx}.block must be a list of two ints, got {block!r}")
    try:
        return Fp8Block(tuple(block), data.get("ue8m0", False))
    except QuantizationError as exc:
        raise ConfigError(f"{ctx}: {exc}") from None


def scheme_of_config(quantization_config: object) -> Fp8Scheme | None:
    """The FP8 scheme an HF ``quantization_config`` declares (``quant_method: fp8``:
    ``weight_block_size`` -> ``Fp8Block``, with ``scale_fmt: ue8m0`` its power-of-two scales;
    none -> ``Fp8PerTensor``), ``None`` for no config or another method. A config that says
    fp8 in a form this cannot read is a ``QuantizationError``: a scheme is never guessed."""
    if not isinstance(quantization_config, dict):
        return None
    if quantization_config.get("quant_method") != "fp8":
        return None
    fmt = quantization_config.get("scale_fmt")
    if fmt not in (None, "ue8m0"):
        raise QuantizationError(
            f"the served model's quantization_config has scale_fmt {fmt!r}; weightwire's FP8 "
            "rounds know float32 scales and 'ue8m0': send this model's weights unquantized"
        )
    block = quantization_config.get("weight_block_size")
    if block is None:
        return Fp8PerTensor()
    if not isinstance(block, list | tuple):
        raise QuantizationError(
            f"the served model's quantization_config has weight_block_size {block!r}, not "
            "[rows, cols]"
        )
    return Fp8Block(tuple(block), fmt == "ue8m0")


def describe_scheme(scheme: Fp8Scheme) -> str:
    """``block [128, 128] e4m3`` (``+ ue8m0``) or ``per-tensor e4m3``: for messages."""
    if isinstance(scheme, Fp8Block):
        return f"block {list(scheme.block)} e4m3" + (" ue8m0" if scheme.ue8m0 else "")
    return "per-tensor e4m3"
