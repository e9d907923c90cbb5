"""JAX device packing for the NCCL data path.

A chunk is packed by one jitted XLA computation: every tensor bitcast to ``uint8``,
flattened and concatenated into a fresh device buffer (one fused kernel, no host
round trip). The buffer reaches NCCL through ``cupy.from_dlpack`` (zero-copy: same
device pointer) entered under the broadcast's stream; JAX then makes that stream
wait for the packing to finish, so no host synchronization is needed per chunk.

Bitcast, not ``astype``: the wire carries raw bytes; a conversion would change them.
``bool`` is the exception XLA refuses to bitcast; its bytes are 0/1, which
``astype(uint8)`` reproduces exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from weightwire.trainer.packing import DevicePacker

# cupy has no bfloat16 / float8 dtypes: those tensors cross as their bytes.
_CUPY_NATIVE = frozenset({"float16", "float32", "float64", "int8", "uint8", "int32", "int64"})


def _as_bytes(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).reshape(-1)
    return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


@jax.jit
def _concat_bytes(*xs: jax.Array) -> jax.Array:
    return jnp.concatenate([_as_bytes(x) for x in xs]) if len(xs) > 1 else _as_bytes(xs[0])


_bytes_of = jax.jit(_as_bytes)


def pack_bytes(tensors: Sequence[Any]) -> jax.Array:
    """The tensors' C-order little-endian bytes back to back, as one ``uint8`` array.

    Dispatches asynchronously; works on any backend (tests compare it with the numpy
    reference ``shared.framing.pack_host`` on CPU).
    """
    if not tensors:
        raise ValueError("pack_bytes needs at least one tensor")
    return _concat_bytes(*(jnp.asarray(t) for t in tensors))


class JaxDevicePacker(DevicePacker):
    """Packs JAX arrays on the GPU whose CUDA ordinal is ``device`` (default: current)."""

    def __init__(self, device: int | None) -> None:
        import cupy  # noqa: PLC0415  (GPU hosts only)

        self._cupy = cupy
        self._ordinal = cupy.cuda.runtime.getDevice() if device is None else device
        gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
        match = [d for d in gpus if getattr(d, "local_hardware_id", d.id) == self._ordinal]
        if not match:
            seen = [getattr(d, "local_hardware_id", d.id) for d in gpus]
            raise RuntimeError(f"JAX has no GPU with CUDA ordinal {self._ordinal} (JAX GPUs: {seen}); NCCL packs on the sender's GPU")
        self._device = match[0]

    def new_stream(self) -> Any:
        with self._cupy.cuda.Device(self._ordinal):
            return self._cupy.cuda.Stream(non_blocking=True)

    def _here(self, x: Any) -> jax.Array:
        if isinstance(x, jax.Array) and x.devices() == {self._device}:
            return x
        return jax.device_put(x, self._device)

    def _import(self, array: jax.Array, stream: Any) -> Any:
        # Entered under ``stream`` so cupy passes it to __dlpack__ and XLA orders the
        # stream after the array's producer instead of blocking the host.
        with self._cupy.cuda.Device(self._ordinal), stream:
            return self._cupy.from_dlpack(array)

    def pack(self, tensors: Sequence[Any], nbytes: int, stream: Any) -> Any:
        packed = _concat_bytes(*(self._here(t) for t in tensors))
        if packed.size != nbytes:
            raise ValueError(f"packed chunk has {packed.size} bytes, the plan says {nbytes}")
        return self._import(packed, stream)

    def wire(self, tensor: Any, stream: Any) -> Any:
        x = self._here(tensor)
        from weightwire.jax_side.dtypes import wire_name  # noqa: PLC0415

        if wire_name(x.dtype) in _CUPY_NATIVE:
            return self._import(x, stream)
        return self._import(_bytes_of(x), stream)
