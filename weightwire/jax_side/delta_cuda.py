"""The fused CUDA delta kernel (``trainer.delta_cuda``) for JAX arrays on a GPU.

JAX does not expose its stream, so each GPU gets a CuPy stream of its own. A group's arrays
are ready (``block_until_ready``) before the kernel reads them through their buffers
(``unsafe_buffer_pointer``), and ``settle`` waits for the stream before anything JAX runs
reads the bases (written in place: the base is the tracker's private copy, never an array
the trainer holds). The scratch (``delta_cuda.ScratchRing``: kept across rounds) and the
tight outputs (one ``int32`` array of indices and one array of unsigned words per dtype per
group) come from CuPy's pool on that stream, so no launch waits on the host. The outputs
reach JAX through DLPack, zero-copy and ordered after the pack on XLA's side (so they are
not reused under a live array: each round's come from the pool); each patch is a ``Prefix``
window of them. (Outputs made by XLA, ``zeros`` say, waited on the host for the next
group's kernel: it holds every SM.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.dlpack

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
        self._scratch: dict[int, delta_cuda.ScratchRing] = {}
        """Per device, the launches' scratch on its stream, kept across rounds."""

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
        stream = self._stream(ordinal)
        kernel = delta_cuda.fused(ordinal)
        ring = self._ring(ordinal)
        pending = kernel.launch(ops, stream.ptr, ring.take, (list(news), list(bases)))
        dtypes = {n.dtype.name: n.dtype for n in news}
        return FusedGroup(pending, ordinal, device, dtypes)

    def finish(self, group: FusedGroup) -> Scan:
        kernel = delta_cuda.fused(group.ordinal)
        counts = kernel.counts(group.pending)
        plan = group.plan = delta_cuda.layout(group.pending.operands, counts)
        scratch = group.pending.scratch_ptr, group.pending.scratch
        if not plan.index_bytes:
            kernel.pack(group.pending, plan, counts, 0, {})
            self._ring(group.ordinal).give_back(*scratch)
            return Scan(counts, group, updated=True)
        cp, stream = self._cp, self._stream(group.ordinal)
        with cp.cuda.Device(group.ordinal), stream:
            index = cp.empty(plan.index_bytes // 4, dtype=cp.int32)
            values = {  # unsigned words of each dtype's width (CuPy has no bfloat16)
                key: cp.empty(nbytes // size, dtype=f"uint{8 * size}")
                for key, nbytes in plan.values_bytes.items()
                for size in [group.dtypes[key].itemsize]
            }
        pointers = {k: int(v.data.ptr) for k, v in values.items()}
        kernel.pack(group.pending, plan, counts, int(index.data.ptr), pointers)
        self._ring(group.ordinal).give_back(*scratch)
        with cp.cuda.Device(group.ordinal), stream:
            # Imported with CuPy's current stream (this one) past the pack: XLA's reads of
            # them wait for it on the device.
            group.index = jax.dlpack.from_dlpack(index)
            group.values = {k: jax.dlpack.from_dlpack(v) for k, v in values.items()}
        return Scan(counts, group, updated=True)

    def settle(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def _ring(self, ordinal: int) -> delta_cuda.ScratchRing:
        ring = self._scratch.get(ordinal)
        if ring is None:
            cp, stream = self._cp, self._stream(ordinal)

            def alloc(nbytes: int) -> tuple[int, Any]:
                with cp.cuda.Device(ordinal), stream:
                    a = cp.empty(nbytes, dtype=cp.uint8)
                return int(a.data.ptr), a

            ring = self._scratch[ordinal] = delta_cuda.ScratchRing(alloc)
        return ring

    def _stream(self, ordinal: int) -> Any:
        stream = self._streams.get(ordinal)
        if stream is None:
            with self._cp.cuda.Device(ordinal):
                stream = self._streams[ordinal] = self._cp.cuda.Stream(non_blocking=True)
        return stream
