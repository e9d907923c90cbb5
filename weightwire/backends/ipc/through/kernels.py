"""``StridedCopy``: write-through copies that are not contiguous runs, on the fill stream.

A landing whose views do not run together (a slice across a fused parameter's columns, a
transposed layout) or whose dtypes differ (a float32 tensor into a bfloat16 parameter) is
one launch of a grid-stride kernel: each thread walks element indices, turns each into a
source and a destination offset through the view's shape and strides, and converts the
element as torch's ``copy_`` does (float16 through ``__float2half_rn``, bfloat16 by
round-to-nearest-even with NaN kept quiet, float64 narrowed through float32 for the two
16-bit types). Same-dtype copies move raw words of the element's size (every wire dtype,
float8 and bool included). One kernel per dtype pair, compiled with NVRTC on first use;
the view's geometry is uploaded once per table (``prepare``) and kept on the device.

CUDA through CuPy, imported inside functions (a JAX trainer uses it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Template
from typing import Any

from weightwire.backends.ipc.through.table import Strided
from weightwire.shared.dtypes import WIRE_DTYPES
from weightwire.shared.errors import TransferError

_THREADS = 256
_MAX_BLOCKS = 4096
_WORDS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

_HALF = r"""
#include <cuda_fp16.h>
__device__ __forceinline__ float ww_load_float16(unsigned short x) {
    return __half2float(__ushort_as_half(x));
}
__device__ __forceinline__ unsigned short ww_store_float16(float f) {
    return __half_as_ushort(__float2half_rn(f));
}
"""
_HEAD = r"""
__device__ __forceinline__ float ww_load_bfloat16(unsigned short x) {
    return __uint_as_float(((unsigned int)x) << 16);
}
__device__ __forceinline__ float ww_load_float32(float x) { return x; }
__device__ __forceinline__ double ww_load_float64(double x) { return x; }
__device__ __forceinline__ unsigned short ww_store_bfloat16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float ww_store_float32(float f) { return f; }
__device__ __forceinline__ double ww_store_float64(double f) { return f; }
"""
_RAW = {
    "bfloat16": "unsigned short",
    "float16": "unsigned short",
    "float32": "float",
    "float64": "double",
}

_BODY = Template(
    r"""
extern "C" __global__ void ww_strided(
    unsigned long long src, unsigned long long dst, const long long* geo, int ndim, long long n
) {
    const $ST* s = (const $ST*)src;
    $DT* t = ($DT*)dst;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        long long rem = i, so = 0, dof = 0;
        for (int d = ndim - 1; d >= 0; --d) {
            long long k = rem % geo[d];
            rem /= geo[d];
            so += k * geo[ndim + d];
            dof += k * geo[2 * ndim + d];
        }
        t[dof] = $EXPR;
    }
}
"""
)


def _source(src: str, dst: str) -> str:
    """The kernel's source for one dtype pair."""
    if src == dst:
        word = _WORDS[WIRE_DTYPES[src].itemsize]
        return _BODY.substitute(ST=word, DT=word, EXPR="s[so]")
    # float64 reaches a 16-bit dtype through float32, as torch converts it
    narrow = "(float)" if src == "float64" and dst != "float32" else ""
    expr = f"ww_store_{dst}({narrow}ww_load_{src}(s[so]))"
    half = _HALF if "float16" in (src, dst) else ""  # the header only where it is needed
    return half + _HEAD + _BODY.substitute(ST=_RAW[src], DT=_RAW[dst], EXPR=expr)


@dataclass(frozen=True)
class Launch:
    """One prepared strided copy: its kernel, geometry on the device and element count."""

    kernel: Any
    geo: Any
    ndim: int
    numel: int
    src_offset_bytes: int
    alloc: int
    dst: int


class StridedCopy:
    """Compiles and launches ``Strided`` copies on one stream (see the module docstring)."""

    def __init__(self, cp: Any, device: int) -> None:
        self._cp, self._device = cp, int(device)
        self._kernels: dict[tuple[str, str], Any] = {}

    def prepare(self, job: Strided) -> Launch:
        """Compile the job's kernel (once per dtype pair) and upload its geometry; raises
        ``TransferError`` naming the pair where NVRTC cannot build it."""
        import numpy as np

        cp = self._cp
        key = (job.src_dtype, job.dst_dtype)
        kernel = self._kernels.get(key)
        with cp.cuda.Device(self._device):
            if kernel is None:
                try:
                    kernel = cp.RawKernel(_source(*key), "ww_strided")
                    kernel.compile()
                except Exception as exc:
                    raise TransferError(
                        f"the write-through copy kernel for {key[0]} -> {key[1]} did not "
                        f"compile ({type(exc).__name__}: {str(exc)[:200]})"
                    ) from exc
                self._kernels[key] = kernel
            geo = np.array(job.shape + job.src_strides + job.dst_strides, dtype=np.int64)
            device_geo = cp.asarray(geo) if geo.size else cp.zeros(1, dtype=cp.int64)
        item = WIRE_DTYPES[job.src_dtype].itemsize
        return Launch(
            kernel, device_geo, len(job.shape), job.numel, job.src_offset * item, job.alloc, job.dst
        )

    def launch(self, job: Launch, src: int, dst: int, stream: Any) -> None:
        """Enqueue ``job`` reading the tensor at ``src`` into the allocation at ``dst``."""
        import numpy as np

        if not job.numel:
            return
        blocks = min(-(-job.numel // _THREADS), _MAX_BLOCKS)
        job.kernel(
            (blocks,),
            (_THREADS,),
            (
                np.uint64(src + job.src_offset_bytes),
                np.uint64(dst + job.dst),
                job.geo,
                np.int32(job.ndim),
                np.int64(job.numel),
            ),
            stream=stream,
        )
