"""The fused FP8 block quantizer on a CUDA device (CuPy), framework-neutral.

``per_block_cast_to_fp8``'s bytes and scales in one pass over each weight: per
``bm x bn`` tile one CUDA block reads the tile, reduces its ``|x|`` maximum, computes the
scale as vLLM does (ue8m0 where the row says), writes the e4m3 bytes, the float32 scale
and the tile's amax (NaN / inf there is the caller's non-finite flag). One launch per input
dtype of a group of weights, driven by a table (``block_table``, one ``ROW`` per weight).
The source and what its exactness rests on: ``fp8_cuda_source``. Tensors reach it as raw
device pointers; the caller allocates the outputs and uploads the table, on the stream it
launches on. CuPy is imported on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightwire.trainer.fp8_cuda_source import (
    FLAG_UE8M0,
    FLAG_VECTOR,
    KERNELS,
    ROW,
    SOURCE,
    THREADS,
    VECTOR,
)

log = logging.getLogger(__name__)

_ALIGN = 16
_MAX_GRID = (1 << 31) - 1


@dataclass(frozen=True)
class BlockJob:
    """One weight of a launch: ``m x n`` elements of ``dtype`` at ``src`` (row stride ``ld``
    elements, unit column stride), its e4m3 output at ``dst`` (``m x n``, contiguous), its
    scales and amaxes at ``scale`` / ``amax`` (float32, ``ceil(m/bm) x ceil(n/bn)`` each)."""

    src: int
    dst: int
    scale: int
    amax: int
    m: int
    n: int
    ld: int
    dtype: str
    block: tuple[int, int]
    ue8m0: bool

    @property
    def tiles(self) -> int:
        bm, bn = self.block
        return -(-self.m // bm) * -(-self.n // bn)


def block_table(jobs: Sequence[BlockJob]) -> tuple[np.ndarray, int]:
    """One launch's table (int64, ``ROW`` per job, in order) and its tiles. The jobs share
    one dtype (one kernel); a job is flagged for the register path when its rows and
    pointers are 16-byte aligned and ``n`` a whole number of vectors."""
    if len({j.dtype for j in jobs}) > 1:
        raise ValueError("one launch takes one input dtype")
    table = np.zeros((len(jobs), ROW), dtype=np.int64)
    first = 0
    for row, j in zip(table, jobs, strict=True):
        bm, bn = j.block
        vec = VECTOR[j.dtype]
        itemsize = 16 // vec
        aligned = (
            j.src % _ALIGN == 0
            and (j.ld * itemsize) % _ALIGN == 0
            and j.dst % _ALIGN == 0
            and j.n % vec == 0
        )
        flags = (FLAG_UE8M0 if j.ue8m0 else 0) | (FLAG_VECTOR if aligned else 0)
        # pointers above 2^63 do not occur on x86-64 / CUDA (user space is 47-57 bits)
        row[:] = (
            j.src,
            j.dst,
            j.scale,
            j.amax,
            j.m,
            j.n,
            j.ld,
            bm,
            bn,
            -(-j.n // bn),
            first,
            flags,
        )
        first += j.tiles
    return table, first


class Fp8Kernels:
    """The compiled kernels on one CUDA device."""

    def __init__(self, device: int, defines: Sequence[str] = ()) -> None:
        """``defines``: ``-DWW_MIN_BLOCKS=n`` / ``-DWW_HW_CVT=0`` (``bench_fp8_kernel.py``
        compares them); the defaults are what a round uses."""
        import cupy

        self._cp = cupy
        self.device = int(device)
        with cupy.cuda.Device(self.device):
            module = cupy.RawModule(code=SOURCE, options=("-std=c++17", *defines))
            # get_function compiles the module (NVRTC): a failure raises here, not at launch
            self._kernels = {dtype: module.get_function(name) for dtype, name in KERNELS.items()}

    def launch(self, dtype: str, table: int, rows: int, tiles: int, stream: int) -> None:
        """Enqueue one launch over the table at device pointer ``table`` on ``stream`` (a
        raw CUDA stream pointer)."""
        from weightwire.backends.device import StreamRef

        if not tiles:
            return
        with self._cp.cuda.Device(self.device):
            self._kernels[dtype](
                (min(tiles, _MAX_GRID),),
                (THREADS,),
                (np.uint64(table), np.int32(rows), np.int64(tiles)),
                stream=StreamRef(stream),
            )


_COMPILED: dict[int, Fp8Kernels | None] = {}


def kernels(device: int) -> Fp8Kernels | None:
    """The kernels for ``device``, compiled once per process; ``None`` (said once per
    device) where CuPy is missing or NVRTC cannot build them: the caller falls back."""
    if device in _COMPILED:
        return _COMPILED[device]
    got: Fp8Kernels | None
    try:
        got = Fp8Kernels(device)
    except Exception as exc:  # correct without it: the framework's own ops
        log.warning(
            "the fused FP8 quantization kernel is unavailable on CUDA device %d (%s: %s); "
            "FP8 weights are quantized with the framework's ops",
            device,
            type(exc).__name__,
            str(exc)[:200],
        )
        got = None
    _COMPILED[device] = got
    return got
