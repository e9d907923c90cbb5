"""Delta-round kernels on a GPU (``pytest -m gpu tests/gpu/test_delta_gpu.py`` on the H200
host): the JAX and torch kernels (the XLA / torch compactions and the fused CUDA kernel) on
device arrays give whole rounds (several layer groups) whose patches, applied with numpy,
rebuild the new weights exactly; the JAX device packer hands out exactly a patch's bytes."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from weightwire.shared.delta import apply_patch
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.delta import DeltaTracker

SHAPES = {
    "model.embed_tokens.weight": (1000, 64),
    "model.layers.0.mlp.experts.w1": (8, 96, 64),
    "model.layers.0.self_attn.q_proj.bias": (64,),
    "lm_head.weight": (1000, 64),
}


def _step(old: dict[str, np.ndarray], density: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    new = {}
    for name, a in old.items():
        b = a.copy().reshape(-1)
        picked = rng.random(b.size) < density
        b[picked] = (b[picked].astype(np.float32) + 0.25).astype(a.dtype)
        new[name] = b.reshape(a.shape)
    return new


def _check(kind: str, to_device: Any, to_host: Any, kernel: Any) -> None:
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    old = {n: rng.standard_normal(s).astype(bf16) for n, s in SHAPES.items()}
    metas = [ParamMeta(n, "bfloat16", s) for n, s in SHAPES.items()]
    for density in (0.0, 0.001, 0.02, 0.2, 0.9):
        tracker = DeltaTracker(kernel, density=0.25, anchor_every=0)
        list(tracker.snapshot_stream([(n, to_device(a)) for n, a in old.items()], metas))
        new = _step(old, density, 1)
        built = tracker.build([(n, to_device(a)) for n, a in new.items()], metas)
        assert built is not None
        got = dict(old)
        wire = {n: to_host(t) for n, t in built.pairs}
        for m in built.metas:
            if "@" not in m.name:
                got[m.name] = wire[m.name].view(bf16).reshape(m.shape)
        for p in built.patches:
            index = wire[p.index_name].view(np.int32)
            got[p.name] = apply_patch(old[p.name], index, wire[p.values_name].view(bf16))
        assert {n: a.tobytes() for n, a in got.items()} == {
            n: a.tobytes() for n, a in new.items()
        }, (kind, density)


@pytest.mark.gpu
@pytest.mark.parametrize("expand", ["search", "cuda"])
def test_jax_kernel_on_gpu(expand: str) -> None:
    import jax

    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax sees no GPU")
    from weightwire.jax_side.delta import JaxDeltaKernel, Prefix

    def host(t: Any) -> np.ndarray:
        out = t.host() if isinstance(t, Prefix) else np.asarray(t)
        return out.reshape(-1).view(f"u{out.dtype.itemsize}")

    if expand == "cuda":
        pytest.importorskip("cupy")
    _check("jax", lambda a: jax.device_put(a, gpu), host, JaxDeltaKernel(expand))


@pytest.mark.gpu
@pytest.mark.parametrize("compaction", ["static", "cuda"])
def test_torch_kernel_on_gpu(compaction: str) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    from weightwire.torch_side.sender.delta import TorchDeltaKernel

    def device(a: np.ndarray) -> Any:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()

    def host(t: Any) -> np.ndarray:
        flat = t.detach().reshape(-1)
        words = {2: torch.int16, 4: torch.int32}
        return flat.view(words[flat.element_size()]).cpu().numpy()

    if compaction == "cuda":
        pytest.importorskip("cupy")
    _check("torch", device, host, TorchDeltaKernel(compaction))


@pytest.mark.gpu
def test_jax_packer_hands_out_exactly_a_patch() -> None:
    import jax
    import jax.numpy as jnp

    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax sees no GPU")
    pytest.importorskip("cupy")
    from weightwire.jax_side.delta import Prefix
    from weightwire.jax_side.packer import JaxDevicePacker

    packer = JaxDevicePacker(getattr(gpu, "local_hardware_id", gpu.id))
    array = jax.device_put(jnp.arange(1024, dtype=jnp.int32), gpu)
    whole, part = packer.regions([array, Prefix(array, 7)], packer.new_stream())
    assert whole.nbytes == 4096 and part.nbytes == 28 and part.ptr == whole.ptr
