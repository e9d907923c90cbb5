"""The two trainers' sides of ``bench_delta.py``: weights, one Adam-like step, the dense copy
baseline, snapshots and host reads, for JAX and for torch (each imported on first use)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Jax:
    def __init__(self, variant: str) -> None:
        import jax
        import jax.numpy as jnp

        from weightwire.jax_side.delta import JaxDeltaKernel, Prefix

        self.name = f"jax/{variant}"
        self.jax, self.jnp, self.prefix = jax, jnp, Prefix
        self.kernel = JaxDeltaKernel(variant)
        self.device = jax.devices()[0].platform
        # One program copies every array: the floor a JAX trainer's copy can reach (one
        # dispatch per array would add its launch cost to the baseline).
        self._copy = jax.jit(lambda xs: [x.copy() for x in xs])
        self._key = jax.random.key(0)

    def weights(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        jax, jnp = self.jax, self.jnp
        keys = jax.random.split(self._key, len(shapes))
        return {
            n: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(jnp.bfloat16)
            for k, (n, s) in zip(keys, shapes.items(), strict=True)
        }

    def step(self, w: dict[str, Any], lr: float) -> dict[str, Any]:
        jax, jnp = self.jax, self.jnp
        keys = jax.random.split(jax.random.key(1), len(w))

        @jax.jit
        def one(x: Any, k: Any) -> Any:
            sign = jnp.where(jax.random.bernoulli(k, 0.5, x.shape), 1.0, -1.0)
            return (x.astype(jnp.float32) - lr * sign).astype(x.dtype)

        return {n: one(x, k) for k, (n, x) in zip(keys, w.items(), strict=True)}

    def copy_all(self, w: dict[str, Any]) -> Callable[[], Any]:
        arrays = list(w.values())
        return lambda: self._copy(arrays)

    def sync(self, out: Any) -> None:
        leaves = self.jax.tree.leaves(out, is_leaf=lambda x: isinstance(x, self.prefix))
        arrays = [x.array if isinstance(x, self.prefix) else x for x in leaves]
        # A group's patches are windows of a few shared buffers: wait for each buffer once.
        self.jax.block_until_ready(list({id(a): a for a in arrays}.values()))

    def snapshot(self, w: dict[str, Any]) -> dict[str, Any]:
        return {n: self.kernel.snapshot(x) for n, x in w.items()}

    def mark(self) -> None:
        pass

    def scratch(self) -> int:
        try:
            import cupy
        except ImportError:
            return 0
        return int(cupy.get_default_memory_pool().total_bytes())

    def host(self, x: Any) -> Any:
        import numpy as np

        out = x.host() if isinstance(x, self.prefix) else np.asarray(x)
        return out.reshape(-1).view(f"u{out.dtype.itemsize}")

    def same(self, a: Any, b: Any) -> bool:
        """Bit-equal, compared on the device (no host copy of the model per row)."""
        from weightwire.jax_side.delta import _bits

        return bool(self.jnp.array_equal(_bits(a), _bits(b)))

    def forget_scratch(self) -> None:
        try:
            import cupy
        except ImportError:
            return
        cupy.get_default_memory_pool().free_all_blocks()


class Torch:
    def __init__(self, variant: str) -> None:
        import torch

        from weightwire.torch_side.sender.delta import TorchDeltaKernel

        self.name = f"torch/{variant}"
        self.torch, self.kernel = torch, TorchDeltaKernel(variant)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._gen = torch.Generator(device=self.device).manual_seed(0)

    def weights(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        t = self.torch
        return {
            n: (0.02 * t.randn(s, generator=self._gen, device=self.device)).to(t.bfloat16)
            for n, s in shapes.items()
        }

    def step(self, w: dict[str, Any], lr: float) -> dict[str, Any]:
        t = self.torch
        out = {}
        for n, x in w.items():
            sign = t.randint(0, 2, x.shape, generator=self._gen, device=x.device) * 2 - 1
            out[n] = (x.float() - lr * sign).to(x.dtype)
        return out

    def copy_all(self, w: dict[str, Any]) -> Callable[[], Any]:
        dst = {n: self.torch.empty_like(x) for n, x in w.items()}
        return lambda: [dst[n].copy_(x) for n, x in w.items()]

    def sync(self, out: Any) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def snapshot(self, w: dict[str, Any]) -> dict[str, Any]:
        return {n: self.kernel.snapshot(x) for n, x in w.items()}

    def mark(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.reset_peak_memory_stats()
            self._held = self.torch.cuda.memory_allocated()

    def scratch(self) -> int:
        if self.device != "cuda":
            return 0
        return int(self.torch.cuda.max_memory_allocated() - self._held)

    def host(self, x: Any) -> Any:
        flat = x.detach().reshape(-1)
        words = {1: self.torch.uint8, 2: self.torch.int16, 4: self.torch.int32}
        return flat.view(words[flat.element_size()]).cpu().numpy()

    def same(self, a: Any, b: Any) -> bool:
        """Bit-equal, compared on the device (no host copy of the model per row)."""
        from weightwire.torch_side.sender.delta import _bits

        return bool(self.torch.equal(_bits(a), _bits(b)))

    def forget_scratch(self) -> None:
        self.kernel.forget()  # the fused path's workspace: each config's scratch measured anew
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
