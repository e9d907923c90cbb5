"""JAX device packing for the NCCL data path.

A chunk is packed by one jitted XLA computation: every tensor bitcast to the widest
word its byte size allows, flattened and concatenated into a fresh device buffer (one fused kernel, no host
round trip). The buffer reaches NCCL through ``cupy.from_dlpack`` (zero-copy: same
device pointer) entered under the broadcast's stream; JAX then makes that stream
wait for the packing to finish, so no host synchronization is needed per chunk.

Bitcast, not ``astype``: the wire carries raw bytes; a conversion would change them.
``bool`` is the exception XLA refuses to bitcast; its bytes are 0/1, which
``astype(uint8)`` reproduces exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from weightwire.trainer.packing import DevicePacker

# cupy has no bfloat16 / float8 dtypes: those tensors cross as their bytes.
_CUPY_NATIVE = frozenset({"float16", "float32", "float64", "int8", "uint8", "int32", "int64"})


_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _word_size(tensors: Sequence[Any]) -> int:
    """The widest word (1, 2 or 4 bytes) that divides every tensor's byte size.

    Concatenating in 4-byte words instead of bytes moves the same bytes with a quarter
    of the elements: XLA's concatenate is element-granular, and a byte-wise kernel ran
    at ~190 GB/s on an H200 for 1 GiB chunks, slower than NVLink. Byte order is
    unchanged: a bitcast keeps the little-endian memory layout.
    """
    word = 4
    for t in tensors:
        nbytes = int(t.size) * jnp.dtype(t.dtype).itemsize
        while word > 1 and nbytes % word:
            word //= 2
    return word


def _as_words(x: jax.Array, word: int) -> jax.Array:
    if x.dtype == jnp.bool_:  # XLA refuses to bitcast bool; its bytes are 0/1
        x = x.astype(jnp.uint8)
    flat = x.reshape(-1)
    itemsize = jnp.dtype(flat.dtype).itemsize
    if itemsize < word:  # e.g. bf16 pairs -> one uint32
        flat = flat.reshape(-1, word // itemsize)
    return lax.bitcast_convert_type(flat, _WORDS[word]).reshape(-1)


@partial(jax.jit, static_argnums=0)
def _concat_words(word: int, *xs: jax.Array) -> jax.Array:
    parts = [_as_words(x, word) for x in xs]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


# A separate computation: fused into _concat_words, XLA's simplifier folds the two
# bitcasts (bf16 pairs -> u32 -> u8) into one with an invalid shape (jaxlib 0.10).
_words_to_bytes = jax.jit(lambda w: lax.bitcast_convert_type(w, jnp.uint8).reshape(-1))


def pack_words(tensors: Sequence[Any]) -> jax.Array:
    """The tensors' C-order little-endian bytes back to back, as one array of the
    widest unsigned word that fits (view it as bytes for free on the consumer side)."""
    if not tensors:
        raise ValueError("pack_words needs at least one tensor")
    arrays = [jnp.asarray(t) for t in tensors]
    return _concat_words(_word_size(arrays), *arrays)


def pack_bytes(tensors: Sequence[Any]) -> jax.Array:
    """``pack_words`` as a ``uint8`` array (one extra bitcast computation); dispatches
    asynchronously; tests compare it with the numpy reference ``pack_host``."""
    words = pack_words(tensors)
    return words if words.dtype == jnp.uint8 else _words_to_bytes(words)


def _bytes_of(x: jax.Array) -> jax.Array:
    return _concat_words(1, x)


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
        words = pack_words([self._here(t) for t in tensors])
        got = words.size * words.dtype.itemsize
        if got != nbytes:
            raise ValueError(f"packed chunk has {got} bytes, the plan says {nbytes}")
        return self._import(words, stream).view(self._cupy.uint8)  # zero-copy byte view

    def wire(self, tensor: Any, stream: Any) -> Any:
        x = self._here(tensor)
        from weightwire.jax_side.dtypes import wire_name  # noqa: PLC0415

        if wire_name(x.dtype) in _CUPY_NATIVE:
            return self._import(x, stream)
        return self._import(_bytes_of(x), stream)
