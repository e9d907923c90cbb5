"""JAX device packing for the NCCL data path.

``JaxDevicePacker`` (what the engine uses) hands the backend each array's own device
buffer (``unsafe_buffer_pointer``), which the NCCL backend gathers into the slot's
reusable CuPy buffer with one device-to-device copy per array: no XLA computation, no
new allocation, at the device's copy rate. Unpacked rounds hand NCCL the array's own
buffer. The host waits for a chunk's arrays to be computed (``block_until_ready``)
before enqueueing the copies: they are read outside XLA's stream order.

``pack_words`` / ``pack_bytes`` are the XLA alternative (one fused concatenate per
chunk, bitcast to the widest word that fits), kept as the reference the benchmark
compares against and for callers that want a JAX array. Bitcast, not ``astype``: the
wire carries raw bytes. ``bool`` is the exception XLA refuses to bitcast; its bytes
are 0/1, which ``astype(uint8)`` reproduces exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from weightwire.backends.base import DevicePacker
from weightwire.backends.device import DeviceBytes
from weightwire.jax_side.delta import arrays_of
from weightwire.jax_side.dtypes import is_array

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


class JaxDevicePacker(DevicePacker):
    """JAX arrays' device bytes on the GPU whose CUDA ordinal is ``device`` (default: current)."""

    def __init__(self, device: int | None) -> None:
        import cupy  # GPU hosts only

        ordinal = cupy.cuda.runtime.getDevice() if device is None else device
        gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
        match = [d for d in gpus if getattr(d, "local_hardware_id", d.id) == ordinal]
        if not match:
            seen = [getattr(d, "local_hardware_id", d.id) for d in gpus]
            raise RuntimeError(
                f"JAX has no GPU with CUDA ordinal {ordinal} (JAX GPUs: {seen}); NCCL packs on "
                "the sender's GPU"
            )
        self._bind(match[0])
        self._cupy = cupy
        self.ordinal = ordinal

    def _bind(self, device: Any) -> None:
        """What ``regions`` compares and reads per array, worked out once."""
        self._device = device
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self._hardware_id = getattr(device, "local_hardware_id", None)
        self._nbytes: dict[
            tuple[Any, Any], int
        ] = {}  # (shape, dtype) -> bytes: jax's nbytes is slow

    def new_stream(self) -> Any:
        with self._cupy.cuda.Device(self.ordinal):
            return self._cupy.cuda.Stream(non_blocking=True)

    def regions(self, tensors: Sequence[Any], stream: Any) -> list[Any]:
        """The arrays' own buffers (``unsafe_buffer_pointer``), zero-copy for every dtype
        (CuPy has no bfloat16 / float8 to import them as); ``owner`` keeps each array
        alive while NCCL or the slot copy reads it. Per array (per tensor, per round) one
        sharding comparison, one pointer read and a cached byte size: what
        ``array_device_bytes`` derives, for an array known to sit on this one device."""
        sharding = self._sharding
        arrays, windows = arrays_of(tensors)  # a delta round's patches: windows of arrays
        arrays = [x if is_array(x) and x.sharding == sharding else self._here(x) for x in arrays]
        # The copies read the buffers outside XLA's stream order: wait until they hold
        # their values (a no-op for arrays computed long ago, e.g. the trainer's params).
        # One readiness wait for the whole chunk.
        jax.block_until_ready(arrays)
        sizes, device = self._nbytes, self._hardware_id
        out = []
        for x, window in zip(arrays, windows, strict=True):
            aval = x.aval  # its shape and dtype at a quarter of the array's own properties' cost
            key = (aval.shape, aval.dtype)
            nbytes = sizes.get(key)
            if nbytes is None:
                if len(sizes) > 4096:  # shapes that keep changing: stay bounded
                    sizes.clear()
                nbytes = sizes[key] = int(x.nbytes)
            skip = 0
            if window is not None:
                skip, nbytes = window[0] * aval.dtype.itemsize, window[1] * aval.dtype.itemsize
            # An empty array may have no buffer to point at.
            ptr = int(x.unsafe_buffer_pointer()) + skip if nbytes else 0
            out.append(DeviceBytes(ptr, nbytes, device, x))
        return out

    def _here(self, x: Any) -> jax.Array:
        """``x`` as an array on this device alone (a copy unless it already is one)."""
        if isinstance(x, jax.Array) and x.devices() == {self._device}:
            return x
        return jax.device_put(x, self._device)
