"""The fused CUDA delta kernel (``trainer.delta_cuda``) for JAX arrays on a GPU.

JAX does not expose its stream, so each GPU gets a CuPy stream of its own, and the hand-overs
are host waits: a group's arrays are ready (``block_until_ready``) before the kernel reads
them through their buffers (``unsafe_buffer_pointer``), and ``settle`` waits for the stream
before anything JAX runs reads the outputs or the bases (written in place: the base is the
tracker's private copy, never an array the trainer holds). The scratch comes from CuPy's
pool on that stream; the tight outputs are JAX arrays (one ``int32`` array of indices and
one values array per dtype per group), each patch a ``Prefix`` window of them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from weightwire.trainer import delta_cuda
from weightwire.trainer.delta import Scan


@dataclass
class FusedGroup:
    """A group on the fused kernel: launched, later its tight outputs."""

    pending: Any
    ordinal: int
    device: Any
    dtypes: dict[str, Any]
    plan: delta_cuda.Layout | None = None
    index: Any = None
    values: dict[str, Any] = field(default_factory=dict)


def coarse(n: int) -> int:
    """``n`` rounded up to at most 8 sizes per power of two (at least 1024): XLA compiles
    ``zeros`` once per shape, and a round's counts are new every round, so the buffers
    take a few recurring sizes (< 1/8 more bytes) instead of a compilation each. Finer than
    ``jax_side.delta.bucket`` (powers of two): a ``zeros`` compiles in a moment, the XLA
    compaction ``bucket`` sizes does not, so memory wins here and compilations there."""
    if n <= 1024:
        return 1024
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


@functools.lru_cache(maxsize=256)
def _zeros_of(n: int, dtype: Any, device: Any) -> Any:
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(lambda: jnp.zeros(n, dtype), out_shardings=sharding)


def _zeros(n: int, dtype: Any, device: Any) -> jax.Array:
    # A jitted zeros per size dispatches in microseconds; ``jnp.zeros(device=...)`` took
    # about 0.2 ms a call, twice or more per launch.
    return _zeros_of(coarse(n), jnp.dtype(dtype), device)()


def _pointer(x: jax.Array) -> int:
    return int(x.unsafe_buffer_pointer()) if x.size else 0


class JaxFused:
    """Launches groups of JAX GPU arrays on the fused kernel (see the module docstring)."""

    platform = "gpu"
    """The platform the fused kernel takes (a CPU test emulates it on ``cpu``)."""

    def __init__(self, cupy: Any = None) -> None:
        if cupy is None:
            import cupy as imported

            cupy = imported
        self._cp = cupy
        self._streams: dict[int, Any] = {}

    def device_of(self, news: Sequence[Any], bases: Sequence[Any]) -> Any:
        """The one GPU every array of the group sits on alone, or ``None``."""
        device = None
        for x in (*news, *bases):
            if not isinstance(x, jax.Array) or len(x.devices()) != 1:
                return None
            (d,) = x.devices()
            if d.platform != self.platform or device not in (None, d):
                return None
            device = d
        for n, b in zip(news, bases, strict=True):
            if n.dtype != b.dtype or n.size != b.size or n.dtype.itemsize not in (1, 2, 4, 8):
                return None
        return device

    def start(
        self, device: Any, news: Sequence[Any], bases: Sequence[Any], limits: Sequence[int]
    ) -> FusedGroup:
        # The kernel reads (and writes the bases) outside XLA's stream order.
        jax.block_until_ready([*news, *bases])
        ordinal = int(getattr(device, "local_hardware_id", device.id))
        ops = [
            delta_cuda.Operand(
                _pointer(n), _pointer(b), n.size, n.dtype.itemsize, limit, n.dtype.name
            )
            for n, b, limit in zip(news, bases, limits, strict=True)
        ]
        cp, stream = self._cp, self._stream(ordinal)

        def alloc(nbytes: int) -> tuple[int, Any]:
            with cp.cuda.Device(ordinal), stream:
                a = cp.empty(nbytes, dtype=cp.uint8)
            return int(a.data.ptr), a

        kernel = delta_cuda.fused(ordinal)
        pending = kernel.launch(ops, stream.ptr, alloc, (list(news), list(bases)))
        dtypes = {n.dtype.name: n.dtype for n in news}
        return FusedGroup(pending, ordinal, device, dtypes)

    def finish(self, group: FusedGroup) -> Scan:
        kernel = delta_cuda.fused(group.ordinal)
        counts = kernel.counts(group.pending)
        plan = group.plan = delta_cuda.layout(group.pending.operands, counts)
        if plan.index_bytes:
            group.index = _zeros(plan.index_bytes // 4, jnp.int32, group.device)
            for key, nbytes in plan.values_bytes.items():
                dtype = group.dtypes[key]
                group.values[key] = _zeros(nbytes // dtype.itemsize, dtype, group.device)
            # Written below on the CuPy stream: XLA must have made them first.
            jax.block_until_ready([group.index, *group.values.values()])
            values = {k: _pointer(v) for k, v in group.values.items()}
            kernel.pack(group.pending, plan, counts, _pointer(group.index), values)
        else:
            kernel.pack(group.pending, plan, counts, 0, {})
        return Scan(counts, group, updated=True)

    def settle(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def _stream(self, ordinal: int) -> Any:
        stream = self._streams.get(ordinal)
        if stream is None:
            with self._cp.cuda.Device(ordinal):
                stream = self._streams[ordinal] = self._cp.cuda.Stream(non_blocking=True)
        return stream
