"""The fused FP8 block quantizer on a GPU (``trainer.fp8_cuda`` through the torch glue
``torch_side.sender.quant_cuda``): it compiles under NVRTC (CuPy's ``-ftz=true``), each
launch goes on torch's current stream, and its bytes and scales are the reference's
(``quantize_block_reference``, vLLM's ``per_block_cast_to_fp8``) and the torch ops' over
the CPU lane's weights (``tests/trainer/test_fp8_kernel_source.py``: ties, tiny values and
subnormals, zero blocks, ue8m0's edge, every input dtype, uneven edges, other block
shapes, strided and unaligned views) and a real-shaped layer; a NaN / inf fails the group
naming the weight.

    CUDA_VISIBLE_DEVICES=0 pytest -m gpu tests/gpu/test_fp8_kernel_gpu.py
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """The kernel's launches (dtype, rows, tiles); fails the test where it did not compile."""
    pytest.importorskip("cupy")
    from weightwire.trainer import fp8_cuda

    monkeypatch.delenv("WEIGHTWIRE_FP8_KERNEL", raising=False)
    kernels = fp8_cuda.kernels(0)
    assert kernels is not None, "the fused FP8 kernel did not compile (see the log)"
    launches: list[tuple[str, int, int]] = []
    real = kernels.launch

    def launch(dtype: str, table: int, rows: int, tiles: int, stream: int) -> None:
        launches.append((dtype, rows, tiles))
        real(dtype, table, rows, tiles, stream)

    monkeypatch.setattr(kernels, "launch", launch)
    return launches


def _cuda(x: np.ndarray) -> Any:
    from tests.trainer.test_fp8_quant import _torch

    return _torch(np.ascontiguousarray(x)).cuda()


def _check(x: Any, want_from: np.ndarray, scheme: Any, what: str) -> None:
    from tests.trainer.test_fp8_quant import _bits, _reference
    from weightwire.torch_side.sender.quant import quantize_fp8

    got = quantize_fp8("w.weight", x, scheme)
    want_q, want_scale = _reference(want_from, scheme)
    assert got.weight.is_cuda and got.scale.is_cuda
    assert _bits(got.scale.cpu()) == want_scale.tobytes(), f"scales {what}"
    diff = np.flatnonzero(got.weight.cpu().view(__import__("torch").uint8).numpy().reshape(-1)
                          != want_q.view(np.uint8).reshape(-1))  # fmt: skip
    assert not diff.size, f"{diff.size} bytes differ {what}, first at {diff[0]}"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_the_kernel_gives_the_references_bytes_on_the_cpu_lanes_weights(
    spy: list, dtype: str, ue8m0: bool
) -> None:
    from tests.trainer.test_fp8_kernel_source import KINDS, _weight
    from weightwire.shared.quant import Fp8Block

    rng = np.random.default_rng(5)
    shapes = [(256, 384), (448, 330), (130, 200), (1, 7), (129, 128)]
    for block in ((128, 128), (16, 8), (1, 128), (256, 128)):
        scheme = Fp8Block(block, ue8m0)
        for kind in KINDS:
            for shape in shapes:
                x = _weight(rng, shape, dtype, kind)
                _check(_cuda(x), x, scheme, f"{dtype} {kind} {shape} {scheme}")
    assert spy and {d for d, _, _ in spy} == {dtype}


def test_views_strided_rows_and_an_unaligned_start(spy: list) -> None:
    from tests.trainer.test_fp8_kernel_source import _weight
    from weightwire.shared.quant import Fp8Block

    wide_np = _weight(np.random.default_rng(8), (256, 400), "bfloat16", "normal")
    wide = _cuda(wide_np)
    flat = wide.reshape(-1)
    cases = [
        (wide[:, 8:264], wide_np[:, 8:264]),
        (flat[1 : 1 + 256 * 256].view(256, 256), wide_np.reshape(-1)[1 : 1 + 256 * 256]),
        (wide.t(), wide_np.T),
    ]
    for x, ref in cases:
        ref = np.ascontiguousarray(ref).reshape(tuple(x.shape))
        for scheme in (Fp8Block(), Fp8Block(ue8m0=True)):
            _check(x, ref, scheme, f"{x.stride()} {scheme}")
    assert len(spy) == 6


def test_a_real_shaped_layer_matches_the_torch_ops_and_goes_on_the_current_stream(
    spy: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from weightwire.shared.quant import Fp8Block
    from weightwire.torch_side.sender.quant import launch_fp8

    shapes = {
        "q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096),
        "o_proj": (4096, 4096), "gate_proj": (14336, 4096), "up_proj": (14336, 4096),
        "down_proj": (4096, 14336),
    }  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()
    for ue8m0 in (False, True):
        with torch.cuda.stream(side):  # produced and quantized on a side stream, not synced
            weights = {
                n: torch.empty(s, dtype=torch.bfloat16, device="cuda").normal_(
                    0, 0.02, generator=gen
                )
                for n, s in shapes.items()
            }
            items = [(f"l.{n}.weight", w, Fp8Block(ue8m0=ue8m0)) for n, w in weights.items()]
            fused = launch_fp8(items, False)
            fused.settle()
        side.synchronize()
        monkeypatch.setenv("WEIGHTWIRE_FP8_KERNEL", "0")
        ops = launch_fp8(items, False)
        ops.settle()
        monkeypatch.delenv("WEIGHTWIRE_FP8_KERNEL")
        for (name, _, _), (fw, fs), (ow, os_) in zip(items, fused.pairs, ops.pairs, strict=True):
            assert torch.equal(fw.view(torch.uint8), ow.view(torch.uint8)), name
            assert torch.equal(fs.view(torch.int32), os_.view(torch.int32)), name
    assert len(spy) == 2 and spy[0][1] == 7


def test_a_non_finite_weight_fails_the_group_naming_it(spy: list) -> None:
    from tests.trainer.test_fp8_quant import _group_case
    from weightwire.shared.quant import QuantizationError
    from weightwire.torch_side.sender.quant import launch_fp8

    case = _group_case()
    case[0][1][200, 300] = np.nan
    case[2][1][5, 6] = np.inf
    launched = launch_fp8([(n, _cuda(x), s) for n, x, s in case], False)
    with pytest.raises(
        QuantizationError, match=r"'l.q_proj.weight' holds NaN or inf \(so do 'l.o_proj.weight'\)"
    ):
        launched.settle()
    assert spy
