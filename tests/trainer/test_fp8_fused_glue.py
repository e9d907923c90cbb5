"""``launch_fp8`` on the fused FP8 kernel, on CPU: the torch glue (``quant_cuda``) drives
the kernel's own source built by ``g++`` (``test_fp8_kernel_source.host_library``) over CPU
tensors, whose pointers are host memory. A group's block weights go as one launch per
input dtype (per-tensor ones as torch ops) and give the reference's bytes; a NaN / inf in a
fused weight fails the group naming it; stats, ``WEIGHTWIRE_FP8_KERNEL=0`` and a kernel
that did not compile leave the group on torch ops (that one said once per device)."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import pytest
import torch

from tests.trainer.test_fp8_kernel_source import host_library
from tests.trainer.test_fp8_quant import _bits, _group_case, _reference, _torch
from weightwire.shared.errors import ConfigError
from weightwire.shared.quant import Fp8Block, QuantizationError
from weightwire.torch_side.sender import quant_cuda
from weightwire.torch_side.sender.quant import launch_fp8, quantize_fp8
from weightwire.trainer import fp8_cuda
from weightwire.trainer.fp8_cuda_source import KERNELS


class HostKernels:
    """``fp8_cuda.Fp8Kernels``' interface over the host build: ``launch`` runs at once."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.launches: list[tuple[str, int, int]] = []

    def launch(self, dtype: str, table: int, rows: int, tiles: int, stream: int) -> None:
        self.launches.append((dtype, rows, tiles))
        getattr(self.lib, f"run_{KERNELS[dtype]}")(
            ctypes.c_void_p(table), ctypes.c_int(rows), ctypes.c_longlong(tiles),
            ctypes.c_int(tiles),
        )  # fmt: skip


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return host_library(tmp_path_factory.mktemp("fp8_glue"))


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, lib: Any) -> HostKernels:
    kernels = HostKernels(lib)
    monkeypatch.setattr(quant_cuda, "FUSED_TYPE", "cpu")
    monkeypatch.setattr(quant_cuda, "kernels_for", lambda device: kernels)
    monkeypatch.delenv("WEIGHTWIRE_FP8_KERNEL", raising=False)
    return kernels


def test_a_group_goes_as_one_launch_per_dtype_with_the_references_bytes(host: HostKernels) -> None:
    case = _group_case()
    launched = launch_fp8([(n, _torch(x), s) for n, x, s in case], False)
    assert launched.settle() == [None] * len(case)
    # the block weights: bf16 (two), float16, float32; the per-tensor two as torch ops
    assert sorted(d for d, _, _ in host.launches) == ["bfloat16", "float16", "float32"]
    assert dict((d, r) for d, r, _ in host.launches) == {"bfloat16": 2, "float16": 1, "float32": 1}
    for (name, x, scheme), (weight, scale) in zip(case, launched.pairs, strict=True):
        want_q, want_scale = _reference(x, scheme)
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, name
        assert _bits(weight) == want_q.tobytes(), name
        assert _bits(scale) == want_scale.tobytes(), name


def test_a_transposed_view_and_a_row_slice_give_the_references_bytes(host: HostKernels) -> None:
    rng = np.random.default_rng(4)
    base = torch.from_numpy(rng.standard_normal((384, 520)).astype(np.float32)).bfloat16()
    for x in (base.t(), base[:, 4:260], base[1:]):
        for scheme in (Fp8Block(), Fp8Block((64, 32), True)):
            got = quantize_fp8("w.weight", x, scheme)
            want_q, want_scale = _reference(x.float().numpy().astype(_np_bf16()), scheme)
            assert _bits(got.weight) == want_q.tobytes(), (x.stride(), scheme)
            assert _bits(got.scale) == want_scale.tobytes(), (x.stride(), scheme)
    assert len(host.launches) == 6


def _np_bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def test_a_non_finite_fused_weight_fails_the_group_naming_it(host: HostKernels) -> None:
    case = _group_case()
    case[0][1][200, 300] = np.nan  # bf16 block weight, a whole tile
    case[3][1][199, 129] = np.inf  # float32 (16, 8) blocks, the ragged corner
    launched = launch_fp8([(n, _torch(x), s) for n, x, s in case], False)
    assert host.launches
    with pytest.raises(
        QuantizationError,
        match=r"'l.q_proj.weight' holds NaN or inf \(so do 'l.gate_proj.weight'\)",
    ):
        launched.settle()


def test_stats_and_the_switch_keep_the_torch_ops(
    host: HostKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = _group_case()
    items = [(n, _torch(x), s) for n, x, s in case]
    errors = launch_fp8(items, True).settle()
    assert all(e is not None for e in errors) and not host.launches
    monkeypatch.setenv("WEIGHTWIRE_FP8_KERNEL", "0")
    launched = launch_fp8(items, False)
    launched.settle()
    assert not host.launches
    for (_, x, scheme), (weight, _) in zip(case, launched.pairs, strict=True):
        assert _bits(weight) == _reference(x, scheme)[0].tobytes()
    monkeypatch.setenv("WEIGHTWIRE_FP8_KERNEL", "on")
    with pytest.raises(ConfigError, match="WEIGHTWIRE_FP8_KERNEL must be '0' or '1', got 'on'"):
        launch_fp8(items, False)


def test_a_kernel_that_does_not_compile_falls_back_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(device: int) -> Any:
        raise RuntimeError("nvrtc: no")

    monkeypatch.setattr(quant_cuda, "FUSED_TYPE", "cpu")
    monkeypatch.setattr(fp8_cuda, "Fp8Kernels", broken)
    monkeypatch.setattr(fp8_cuda, "_COMPILED", {})
    case = _group_case()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            launched = launch_fp8([(n, _torch(x), s) for n, x, s in case], False)
            launched.settle()
            for (_, x, scheme), (weight, _) in zip(case, launched.pairs, strict=True):
                assert _bits(weight) == _reference(x, scheme)[0].tobytes()
    said = [r.getMessage() for r in caplog.records if "fused FP8" in r.getMessage()]
    assert said == [
        "the fused FP8 quantization kernel is unavailable on CUDA device 0 (RuntimeError: "
        "nvrtc: no); FP8 weights are quantized with the framework's ops"
    ]


DTENSOR = """
import ctypes, json, sys
import numpy as np, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from tests.trainer.test_fp8_fused_glue import HostKernels
from tests.trainer.test_fp8_quant import _bits
from weightwire.shared.quant import Fp8Block, quantize_block_reference
from weightwire.torch_side.sender import quant_cuda
from weightwire.torch_side.sender.quant import launch_fp8
kernels = HostKernels(ctypes.CDLL(sys.argv[1]))
quant_cuda.FUSED_TYPE = "cpu"
quant_cuda.kernels_for = lambda device: kernels
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
x = torch.randn(384, 260, generator=torch.Generator().manual_seed(1)) * 0.02
dt = distribute_tensor(x, init_device_mesh("cpu", (1,)), [Shard(0)])
launched = launch_fp8([("w.weight", dt, Fp8Block())], False)
launched.settle()
((weight, scale),) = launched.pairs
want_q, want_scale = quantize_block_reference("w.weight", x.numpy(), Fp8Block())
print(json.dumps({
    "dtensors": isinstance(weight, DTensor) and isinstance(scale, DTensor),
    "placements": [str(p) for p in weight.placements],
    "weight": _bits(weight.to_local()) == want_q.tobytes(),
    "scale": _bits(scale.to_local()) == want_scale.tobytes(),
    "launches": kernels.launches,
}))
dist.destroy_process_group()
"""


def test_a_dtensor_is_quantized_by_the_kernel_on_its_local_shard(
    lib: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One gloo rank in a subprocess (the process group): the DTensor's shard goes through the
    kernel, the results are DTensors of its placements with the reference's bytes."""
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", DTENSOR, lib._name],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "dtensors": True,
        "placements": ["S(0)"],
        "weight": True,
        "scale": True,
        "launches": [["float32", 1, 9]],
    }
