"""Our FP8 quantizers against vLLM's own, bit for bit.

vLLM's ``per_block_cast_to_fp8`` (block 128 x 128 e4m3 + float32 ``weight_scale_inv``, with
and without ue8m0) and ``input_to_float8`` (per-tensor) come unchanged from the interop
venv's vLLM (and, with ``WEIGHTWIRE_VLLM_SRC``, from that tree too), loaded into this process
(``fp8_harness``; the block quantizer runs compiled by inductor, as vLLM's CPU platform runs
it). For each weight the numpy reference, the JAX quantizer and the torch quantizer must
give exactly vLLM's e4m3 bytes and float32 scales. The weights: random and real-shaped, in
bfloat16 / float16 / float32, uneven edges, blocks of zeros, values around the 1e-4 amax
floor, large values, and amaxes whose scale lies a few ulps above a power of two (where
ue8m0's float32 log2 rounds down). Where vLLM's quantizer is fed NaN or inf it sends NaN
bytes; ours refuse (``tests/trainer/test_fp8_quant.py``).

Runs in the interop lane; needs no vLLM server (only the two files are read).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from tests.interop.fp8_harness import (
    load_input_to_float8,
    load_per_block_cast_to_fp8,
    tree_path,
    trees,
)
from weightwire.jax_side.quant import quantize_fp8 as quantize_jax
from weightwire.shared.quant import (
    FP8_MAX,
    Fp8Block,
    Fp8PerTensor,
    quantize_block_reference,
    quantize_tensor_reference,
)
from weightwire.torch_side.sender.quant import quantize_fp8 as quantize_torch

pytestmark = pytest.mark.interop

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
Quantizer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module", params=trees())
def vllm_fp8(request: pytest.FixtureRequest) -> Iterator[tuple[Quantizer, Quantizer]]:
    root = tree_path(request.param)
    # every (dtype, ue8m0) pair is a graph of its own: compile them all, not fall back to eager
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 64
    try:
        yield load_per_block_cast_to_fp8(root), load_input_to_float8(root)
    finally:
        torch._dynamo.config.recompile_limit = limit


def _pow2_edges(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    """One amax per 128 x 128 block at 448 * 2^k, plus 0..8 ulps."""
    x = rng.standard_normal(shape) * 1e-3
    for r in range(0, shape[0], 128):
        for c in range(0, shape[1], 128):
            top = np.array([FP8_MAX * 2.0 ** int(rng.integers(-22, 6))], dtype=np.float32)
            x[r, c] = (top.view(np.uint32) + np.uint32(rng.integers(0, 9))).view(np.float32)[0]
    return x


def _weights(dtype: str) -> Iterator[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(51)
    yield "real-shaped", rng.standard_normal((576, 448)) * 0.02  # q_a-like, 4.5 x 3.5 blocks
    yield "uneven-edges", rng.standard_normal((129, 257))
    yield "one-element", np.array([[0.75]])
    yield "tiny", rng.standard_normal((200, 130)) * 2e-5  # amax under the 1e-4 floor
    yield "near-floor", rng.uniform(0.9e-4, 1.1e-4, (130, 200)) * rng.choice([-1, 1], (130, 200))
    zeros = rng.standard_normal((300, 260)) * 3.0
    zeros[:128] = 0.0
    zeros[:, 256:] = 0.0
    yield "zero-blocks", zeros
    yield "large", rng.standard_normal((140, 150)) * (3e3 if dtype != "float16" else 3e2)
    yield "mixed-scales", rng.standard_normal((384, 384)) * np.exp(rng.uniform(-12, 6, (384, 1)))
    if dtype == "float32":
        yield "pow2-edges", _pow2_edges(rng, (512, 640))


def _cases() -> list[Any]:
    return [
        pytest.param(dtype, label, x.astype(DTYPES[dtype]), id=f"{dtype}-{label}")
        for dtype in DTYPES
        for label, x in _weights(dtype)
    ]


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _bytes(a: Any) -> bytes:
    if isinstance(a, torch.Tensor):
        return a.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _ours(x: np.ndarray, scheme: Fp8Block | Fp8PerTensor) -> dict[str, tuple[bytes, bytes]]:
    if isinstance(scheme, Fp8Block):
        ref = quantize_block_reference("w.weight", x, scheme)
    else:
        ref = quantize_tensor_reference("w.weight", x)
    jx = quantize_jax("w.weight", jnp.asarray(x), scheme)
    th = quantize_torch("w.weight", _torch(x), scheme)
    return {
        "numpy": (_bytes(ref[0]), _bytes(ref[1])),
        "jax": (_bytes(jx.weight), _bytes(jx.scale)),
        "torch": (_bytes(th.weight), _bytes(th.scale)),
    }


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scale", "ue8m0"])
@pytest.mark.parametrize(("dtype", "label", "x"), _cases())
def test_block_quantizers_give_vllms_bytes_and_scales(
    vllm_fp8: tuple[Quantizer, Quantizer], ue8m0: bool, dtype: str, label: str, x: np.ndarray
) -> None:
    per_block_cast_to_fp8, _ = vllm_fp8
    q, scale = per_block_cast_to_fp8(_torch(x), use_ue8m0=ue8m0)
    want = (_bytes(q), _bytes(scale))
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    for who, got in _ours(x, Fp8Block(ue8m0=ue8m0)).items():
        assert got[1] == want[1], f"{who}: scales differ from vLLM's ({dtype} {label})"
        assert got[0] == want[0], f"{who}: e4m3 bytes differ from vLLM's ({dtype} {label})"


@pytest.mark.parametrize(("dtype", "label", "x"), [c for c in _cases() if c.values[0] != "float16"])
def test_per_tensor_quantizers_give_vllms_bytes_and_scale(
    vllm_fp8: tuple[Quantizer, Quantizer], dtype: str, label: str, x: np.ndarray
) -> None:
    _, input_to_float8 = vllm_fp8
    q, scale = input_to_float8(_torch(x))
    want = (_bytes(q), _bytes(scale.reshape(())))
    for who, got in _ours(x, Fp8PerTensor()).items():
        assert got[1] == want[1], f"{who}: scale differs from vLLM's ({dtype} {label})"
        assert got[0] == want[0], f"{who}: e4m3 bytes differ from vLLM's ({dtype} {label})"


def test_vllms_block_quantizer_sends_nan_for_a_non_finite_weight(
    vllm_fp8: tuple[Quantizer, Quantizer],
) -> None:
    # why ours refuse instead: vLLM's would put NaN into the served weights
    per_block_cast_to_fp8, _ = vllm_fp8
    x = torch.ones((130, 130), dtype=torch.bfloat16)
    x[3, 4] = float("inf")
    q, _ = per_block_cast_to_fp8(x)
    assert torch.isnan(q[:128, :128].float()).any()
