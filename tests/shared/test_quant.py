"""The FP8 contract (``weightwire.shared.quant``): the checkpoint names and shapes a scheme
produces, the checks that refuse a weight by name, the ue8m0 rounding as vLLM computes it,
and the numpy reference's error bounds. (Bit identity with vLLM's own quantizer:
``tests/interop/test_vllm_fp8.py``; JAX == torch == this reference:
``tests/trainer/test_fp8_quant.py``.)"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from weightwire.shared.errors import ConfigError
from weightwire.shared.quant import (
    BLOCK_AMAX_FLOOR,
    FP8_MAX,
    Fp8Block,
    Fp8PerTensor,
    QuantizationError,
    check_input,
    dequantize_reference,
    fp8_metas,
    fp8_names,
    quantize_block_reference,
    quantize_tensor_reference,
    scale_shape,
    ue8m0_ceil_reference,
)


def _f32(exponent: int, mantissa: int) -> np.float32:
    bits = np.array([((exponent + 127) << 23) | mantissa], dtype=np.uint32)
    return bits.view(np.float32)[0]


def test_a_weight_becomes_the_checkpoint_pair_vllm_loads() -> None:
    assert fp8_names("model.layers.0.mlp.down_proj.weight", Fp8Block()) == (
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale_inv",
    )
    assert fp8_names("lm_head.weight", Fp8PerTensor()).scale == "lm_head.weight_scale"
    weight, scale = fp8_metas("a.weight", (300, 200), Fp8Block())
    assert (weight.dtype, weight.shape) == ("float8_e4m3fn", (300, 200))
    assert (scale.name, scale.dtype, scale.shape) == ("a.weight_scale_inv", "float32", (3, 2))
    assert scale_shape((128, 129), Fp8Block((64, 32))) == (2, 5)
    assert fp8_metas("a.weight", (3, 5), Fp8PerTensor())[1].shape == ()


@pytest.mark.parametrize("name", ["model.norm.bias", "weight", ".weight", "a.weights"])
def test_only_a_linear_weight_name_is_quantized(name: str) -> None:
    with pytest.raises(QuantizationError, match="only a linear's 'X.weight'") as info:
        fp8_names(name, Fp8Block())
    assert repr(name) in str(info.value)
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize(
    ("dtype", "shape", "scheme", "match"),
    [
        ("int8", (4, 4), Fp8Block(), "is int8; Fp8Block quantizes bfloat16, float16, float32"),
        ("float16", (4, 4), Fp8PerTensor(), "is float16; Fp8PerTensor quantizes bfloat16"),
        ("bfloat16", (2, 4, 4), Fp8Block(), r"has shape \[2, 4, 4\]; FP8 quantization takes"),
        ("float32", (4,), Fp8PerTensor(), r"has shape \[4\]"),
        ("float32", (0, 4), Fp8Block(), "nothing to quantize"),
    ],
)
def test_a_weight_the_scheme_cannot_take_is_refused_by_name(
    dtype: str, shape: tuple[int, ...], scheme: Fp8Block | Fp8PerTensor, match: str
) -> None:
    with pytest.raises(QuantizationError, match=match) as info:
        check_input("model.layers.3.q_proj.weight", dtype, shape, scheme)
    assert "'model.layers.3.q_proj.weight'" in str(info.value)


@pytest.mark.parametrize("block", [(128,), (0, 128), (128, -1), (1.5, 2), "ab"])
def test_a_bad_block_is_refused(block: object) -> None:
    with pytest.raises(QuantizationError, match="Fp8Block.block must be two positive ints"):
        Fp8Block(block=block)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_nan_and_inf_are_refused_naming_the_tensor(bad: float, per_tensor: bool) -> None:
    x = np.ones((130, 7), dtype=np.float32)
    x[129, 6] = bad
    with pytest.raises(QuantizationError, match="'m.w.weight' holds NaN or inf"):
        if per_tensor:
            quantize_tensor_reference("m.w.weight", x)
        else:
            quantize_block_reference("m.w.weight", x, Fp8Block())


def test_ue8m0_keeps_vllms_float32_log2_just_above_a_power_of_two() -> None:
    # vLLM: 2 ** ceil(log2(sf)) in float32. log2(2^-9 (1 + 2 ulp)) rounds to -9.0 exactly,
    # so the scale stays 2^-9, below sf; one more ulp and log2 leaves -9.0 (scale 2^-8).
    # (Checked against torch.log2 over exponents -40..39, mantissas 0..79.)
    sf = np.array([_f32(-9, 0), _f32(-9, 2), _f32(-9, 3), _f32(-22, 5), _f32(-22, 6)])
    want = np.array([_f32(-9, 0), _f32(-9, 0), _f32(-8, 0), _f32(-22, 0), _f32(-21, 0)])
    assert ue8m0_ceil_reference(sf).view(np.uint32).tolist() == want.view(np.uint32).tolist()
    # away from a power of two it is the plain ceiling
    rng = np.random.default_rng(0)
    sf = (rng.random(10_000) * 10.0 + 1e-6).astype(np.float32)
    mantissa = sf.view(np.uint32) & 0x7FFFFF
    far = mantissa > 64
    want_far = np.exp2(np.ceil(np.log2(sf[far].astype(np.float64)))).astype(np.float32)
    assert np.array_equal(ue8m0_ceil_reference(sf[far]), want_far)


def test_an_all_zero_block_gets_the_floor_scale_and_zeros() -> None:
    x = np.zeros((256, 130), dtype=ml_dtypes.bfloat16)
    x[200, 129] = 3.0
    q, scale = quantize_block_reference("w.weight", x, Fp8Block())
    assert scale.shape == (2, 2) and scale.dtype == np.float32
    floor = np.float32(BLOCK_AMAX_FLOOR) / np.float32(FP8_MAX)
    assert scale[0, 0] == floor and scale[0, 1] == floor and scale[1, 0] == floor
    assert scale[1, 1] == np.float32(3.0) / np.float32(FP8_MAX)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == (256, 130)
    assert float(q[200, 129]) == FP8_MAX and np.count_nonzero(q.astype(np.float32)) == 1


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
def test_dequantized_weights_stay_within_e4m3s_rounding(ue8m0: bool, dtype: type) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((300, 260)) * np.exp(rng.uniform(-8, 4, (300, 1)))).astype(dtype)
    scheme = Fp8Block(ue8m0=ue8m0)
    q, scale = quantize_block_reference("w.weight", x, scheme)
    values = x.astype(np.float32)
    error = np.abs(dequantize_reference(q, scale, scheme) - values)
    per_element_scale = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:300, :260]
    # 3 mantissa bits: half a step is 2^-4 of the value; subnormals step 2^-9 of the scale
    bound = np.abs(values) * 2.0**-4 + per_element_scale * 2.0**-10
    assert np.all(error <= bound * (1 + 1e-6))
    # ue8m0 rounds the scale up to a power of two: never more than twice the plain one
    plain = quantize_block_reference("w.weight", x, Fp8Block())[1]
    if ue8m0:
        assert np.all((scale >= plain * (1 - 2.0**-20)) & (scale <= 2 * plain))
        assert np.all(np.frexp(scale)[0] == 0.5)
    else:
        assert np.array_equal(scale, plain)


def test_per_tensor_scale_maps_the_largest_value_to_448() -> None:
    x = np.array([[0.5, -2.0], [1.0, 0.25]], dtype=ml_dtypes.bfloat16)
    q, scale = quantize_tensor_reference("w.weight", x)
    assert scale.shape == () and scale.dtype == np.float32
    assert float(q[0, 1]) == -FP8_MAX
    assert scale == np.float32(1.0) / np.float32(224.0)
    assert np.allclose(dequantize_reference(q, scale, Fp8PerTensor()), x.astype(np.float32))
