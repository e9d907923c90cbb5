"""The trainers' FP8 quantizers agree bit for bit: the jitted JAX one
(``jax_side.quant``), the torch one (``torch_side.sender.quant``) and the numpy reference
(``shared.quant``, itself checked against vLLM's ``per_block_cast_to_fp8`` /
``input_to_float8`` in ``tests/interop/test_vllm_fp8.py``), over generated weights: uneven
edges, blocks of zeros, values near the 1e-4 amax floor, scales just above a power of two
(where ue8m0's float32 log2 rounds down), bfloat16 / float16 / float32 inputs."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightwire.jax_side.quant import quantize_fp8 as quantize_jax
from weightwire.shared.quant import (
    FP8_MAX,
    Fp8Block,
    Fp8PerTensor,
    Fp8Scheme,
    QuantizationError,
    dequantize_reference,
    quantize_block_reference,
    quantize_tensor_reference,
)
from weightwire.torch_side.sender.quant import quantize_fp8 as quantize_torch

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _bits(a: Any) -> bytes:
    if isinstance(a, torch.Tensor):
        return a.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _reference(x: np.ndarray, scheme: Fp8Scheme) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(scheme, Fp8PerTensor):
        return quantize_tensor_reference("w.weight", x)
    return quantize_block_reference("w.weight", x, scheme)


def _assert_all_equal(x: np.ndarray, scheme: Fp8Scheme) -> None:
    want_q, want_scale = _reference(x, scheme)
    got_jax = quantize_jax("w.weight", jnp.asarray(x), scheme)
    got_torch = quantize_torch("w.weight", _torch(x), scheme)
    for got in (got_jax, got_torch):
        assert tuple(got.weight.shape) == x.shape and tuple(got.scale.shape) == want_scale.shape
        assert _bits(got.scale) == want_scale.tobytes(), (scheme, x.dtype, x.shape)
        assert _bits(got.weight) == want_q.tobytes(), (scheme, x.dtype, x.shape)
    assert got_jax.weight.dtype == jnp.float8_e4m3fn and got_jax.scale.dtype == jnp.float32
    assert got_torch.weight.dtype == torch.float8_e4m3fn
    assert got_torch.scale.dtype == torch.float32


@st.composite
def weights(draw: st.DrawFn) -> tuple[np.ndarray, Fp8Scheme]:
    block = draw(st.sampled_from([(128, 128), (16, 8), (8, 32)]))
    scheme: Fp8Scheme = draw(
        st.sampled_from([Fp8Block(block, False), Fp8Block(block, True), Fp8PerTensor()])
    )
    dtype = draw(st.sampled_from(["bfloat16", "float32", "float16"]))
    if isinstance(scheme, Fp8PerTensor) and dtype == "float16":
        dtype = "float32"
    # uneven edges: rarely a multiple of the block
    m = draw(st.integers(1, 3 * block[0] + 5))
    n = draw(st.integers(1, 3 * block[1] + 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(st.sampled_from([1.0, 1e-2, 3e-4, 1e-4, 2e-5, 1e-7, 50.0, 3e3]))
    x = rng.standard_normal((m, n)) * magnitude
    if draw(st.booleans()):  # whole blocks of zeros
        x[: block[0]] = 0.0
    if draw(st.booleans()):  # amaxes 448 * 2^k (1 + a few ulps): ue8m0's log2 edge
        k = draw(st.integers(-20, 4))
        top = np.float32(FP8_MAX * 2.0**k).view(np.uint32) + np.uint32(draw(st.integers(0, 8)))
        x[::7, ::5] = np.array([top], dtype=np.uint32).view(np.float32)[0]
    x = x.astype(DTYPES[dtype]) if dtype != "float16" else np.clip(x, -6e4, 6e4).astype(np.float16)
    return x, scheme


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(weights())
def test_jax_torch_and_the_reference_quantize_to_the_same_bytes(
    case: tuple[np.ndarray, Fp8Scheme],
) -> None:
    _assert_all_equal(*case)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("ue8m0", [False, True])
def test_a_real_shaped_weight_quantizes_to_the_same_bytes(dtype: str, ue8m0: bool) -> None:
    # a 7168 x 2112-like projection, scaled down: 3 x 2 full blocks plus ragged edges
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((448, 330)) * 0.02).astype(DTYPES[dtype])
    _assert_all_equal(x, Fp8Block(ue8m0=ue8m0))


@pytest.mark.parametrize("scheme", [Fp8Block(), Fp8Block(ue8m0=True), Fp8PerTensor()])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_is_refused_by_both_trainers_naming_the_tensor(
    scheme: Fp8Scheme, bad: float
) -> None:
    x = np.full((200, 150), 0.5, dtype=np.float32)
    x[199, 149] = bad
    name = "model.layers.7.self_attn.o_proj.weight"
    with pytest.raises(QuantizationError, match=f"'{name}' holds NaN or inf"):
        quantize_jax(name, jnp.asarray(x), scheme)
    with pytest.raises(QuantizationError, match=f"'{name}' holds NaN or inf"):
        quantize_torch(name, torch.from_numpy(x), scheme)


def test_a_weight_the_scheme_cannot_take_is_refused_before_any_work() -> None:
    with pytest.raises(QuantizationError, match=r"'e.weight' has shape \[2, 3, 4\]"):
        quantize_jax("e.weight", jnp.zeros((2, 3, 4), jnp.bfloat16), Fp8Block())
    with pytest.raises(QuantizationError, match="'e.weight' is int32"):
        quantize_torch("e.weight", torch.zeros((4, 4), dtype=torch.int32), Fp8Block())


@pytest.mark.parametrize("scheme", [Fp8Block(), Fp8Block((64, 32), True), Fp8PerTensor()])
def test_the_error_stats_are_the_dequantized_weights_distance(scheme: Fp8Scheme) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((200, 300)) * 0.05).astype(ml_dtypes.bfloat16)
    q, scale = _reference(x, scheme)
    diff = np.abs(dequantize_reference(q, scale, scheme) - x.astype(np.float32))
    for got in (
        quantize_jax("w.weight", jnp.asarray(x), scheme, stats=True),
        quantize_torch("w.weight", _torch(x), scheme, stats=True),
    ):
        assert got.stats is not None
        assert got.stats.max_abs_error == pytest.approx(float(diff.max()), rel=1e-5)
        assert got.stats.mean_abs_error == pytest.approx(float(diff.mean()), rel=1e-4)
        assert 0 < got.stats.mean_abs_error < got.stats.max_abs_error
    assert quantize_torch("w.weight", _torch(x), scheme).stats is None


def _group_case() -> list[tuple[str, np.ndarray, Fp8Scheme]]:
    """A layer's worth of weights: whole 128-blocks (the view path, no padding) and ragged
    ones, every scheme, every input dtype."""
    rng = np.random.default_rng(11)

    def w(shape: tuple[int, int], dtype: str, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(DTYPES[dtype])

    return [
        ("l.q_proj.weight", w((256, 384), "bfloat16"), Fp8Block()),
        ("l.k_proj.weight", w((128, 384), "bfloat16"), Fp8Block(ue8m0=True)),
        ("l.o_proj.weight", w((384, 256), "float16", 3.0), Fp8Block()),
        ("l.gate_proj.weight", w((200, 130), "float32"), Fp8Block((16, 8), True)),
        ("l.up_proj.weight", w((256, 256), "bfloat16"), Fp8PerTensor()),
        ("l.down_proj.weight", w((130, 200), "float32", 1e-5), Fp8PerTensor()),
    ]


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_group_launch_quantizes_each_weight_to_the_references_bytes(framework: str) -> None:
    from weightwire.jax_side.quant import launch_fp8 as launch_jax
    from weightwire.torch_side.sender.quant import launch_fp8 as launch_torch

    case = _group_case()
    if framework == "jax":
        launched = launch_jax([(n, jnp.asarray(x), s) for n, x, s in case], True)
    else:
        launched = launch_torch([(n, _torch(x), s) for n, x, s in case], True)
    errors = launched.settle()
    assert len(launched.pairs) == len(errors) == len(case)
    for (name, x, scheme), (weight, scale), error in zip(case, launched.pairs, errors, strict=True):
        want_q, want_scale = _reference(x, scheme)
        assert _bits(weight) == want_q.tobytes(), name
        assert _bits(scale) == want_scale.tobytes(), name
        diff = np.abs(dequantize_reference(want_q, want_scale, scheme) - x.astype(np.float32))
        assert error is not None
        assert error.max_abs_error == pytest.approx(float(diff.max()), rel=1e-5), name


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_group_with_non_finite_weights_is_refused_naming_each_of_them(framework: str) -> None:
    from weightwire.jax_side.quant import launch_fp8 as launch_jax
    from weightwire.torch_side.sender.quant import launch_fp8 as launch_torch

    case = _group_case()
    # a NaN inside a whole bf16 block (the view path) and an inf in a per-tensor weight
    case[0][1][200, 300] = np.nan
    case[4][1][0, 255] = -np.inf
    items: list[tuple[str, Any, Fp8Scheme]]
    if framework == "jax":
        items = [(n, jnp.asarray(x), s) for n, x, s in case]
        launched = launch_jax(items, False)
    else:
        items = [(n, _torch(x), s) for n, x, s in case]
        launched = launch_torch(items, False)
    with pytest.raises(
        QuantizationError, match=r"'l.q_proj.weight' holds NaN or inf \(so do 'l.up_proj.weight'\)"
    ):
        launched.settle()


@pytest.mark.gpu
def test_a_group_on_a_gpu_reads_its_flags_back_once_and_gives_the_references_bytes() -> None:
    # the CUDA path: flags and errors copied back asynchronously, one event per group
    from weightwire.torch_side.sender.quant import launch_fp8 as launch_torch

    case = _group_case()
    launched = launch_torch([(n, _torch(x).cuda(), s) for n, x, s in case], True)
    errors = launched.settle()
    for (name, x, scheme), (weight, scale), error in zip(case, launched.pairs, errors, strict=True):
        want_q, want_scale = _reference(x, scheme)
        assert weight.is_cuda and _bits(weight.cpu()) == want_q.tobytes(), name
        assert _bits(scale.cpu()) == want_scale.tobytes(), name
        assert error is not None and error.max_abs_error > 0
    case[2][1][5, 6] = np.inf
    bad = launch_torch([(n, _torch(x).cuda(), s) for n, x, s in case], False)
    with pytest.raises(QuantizationError, match="'l.o_proj.weight' holds NaN or inf"):
        bad.settle()
