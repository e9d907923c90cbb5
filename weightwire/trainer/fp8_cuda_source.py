"""The CUDA source of the fused FP8 block quantizer (``fp8_cuda``), framework-neutral.

One CUDA block per ``bm x bn`` tile of a weight, a table row per weight (``fp8_cuda.ROW``),
one kernel per input dtype (``ww_fp8_block_bf16`` / ``_f16`` / ``_f32``). A tile is read
once: a whole, aligned tile that fits in the threads' registers (a 128 x 128 one does: 8
16-byte vectors per thread for 2-byte inputs, 16 for float32) stays there between the
reduction and the products; any other tile (an uneven edge, an unaligned or too large one)
is walked element by element, its second walk served by the caches.

Bit-exactness with vLLM's ``per_block_cast_to_fp8`` rests on integer arithmetic where a
float instruction's flags could differ: ``|x|``'s maximum is the maximum of the float32 bit
patterns with the sign cleared (exact, and a NaN's pattern is above every number's: it
propagates), the amax floor is a bit compare, ue8m0's round-up is ``shared.quant``'s table,
and the e4m3 cast is integer round-to-nearest-even (``ww_e4m3``; CuPy compiles with
``-ftz=true`` and NVRTC may lack ``cuda_fp8.h``). The scale and its reciprocal are true
float32 divisions and the product one float32 multiply, each as PTX without ``.ftz``. On a
host compiler (the CPU tests, ``g++``) the same functions run; only the thread loop and the
reduction differ (``#ifndef __CUDA_ARCH__``: the threads in turn, then the maximum of their
partial maxima: what the warp shuffles compute).
"""

from __future__ import annotations

from weightwire.shared.quant import UE8M0_ROUND_DOWN

THREADS = 256
ROW = 12
"""int64 slots of one weight's table row: src, dst, scale, amax pointers, m, n, ld (the
source's row stride, elements), bm, bn, cols (tiles per tile row), first tile, flags."""
FLAG_UE8M0 = 1
FLAG_VECTOR = 2
"""The weight's rows and pointers are 16-byte aligned and ``n`` a multiple of a vector:
its whole tiles may take the register path."""
KERNELS = {
    "bfloat16": "ww_fp8_block_bf16",
    "float16": "ww_fp8_block_f16",
    "float32": "ww_fp8_block_f32",
}
VECTOR = {"bfloat16": 8, "float16": 8, "float32": 4}
"""Elements of one 16-byte load."""

_TABLE = ", ".join(str(int(v)) for v in UE8M0_ROUND_DOWN)

SOURCE = (
    r"""
#ifndef WW_THREADS
#define WW_THREADS """
    + str(THREADS)
    + r"""
#endif
#ifndef WW_MIN_BLOCKS
// resident blocks per SM the 2-byte kernels are built for: 3 measured fastest on an H100
// (bench_fp8_kernel.py: 10.0 ms vs 13.4 ms unbounded for an 8B set, a copy 9.9 ms)
#define WW_MIN_BLOCKS 3
#endif
#ifndef WW_HW_CVT
#define WW_HW_CVT 1
#endif
typedef unsigned int ww_u32;
typedef unsigned long long ww_u64;

__constant__ int ww_round_down[256] = {"""
    + _TABLE
    + r"""};

__device__ __forceinline__ ww_u32 ww_umax(ww_u32 a, ww_u32 b) { return a > b ? a : b; }

// the input element's float32 bit pattern (exact for every input dtype)
__device__ __forceinline__ ww_u32 ww_bits_bf16(unsigned short h) { return ((ww_u32)h) << 16; }
__device__ __forceinline__ ww_u32 ww_bits_f16(unsigned short h) {
    ww_u32 sign = ((ww_u32)h & 0x8000u) << 16;
    ww_u32 e = ((ww_u32)h >> 10) & 0x1fu, m = (ww_u32)h & 0x3ffu;
    if (e == 0x1fu) return sign | 0x7f800000u | (m << 13);
    if (e == 0u) {
        if (m == 0u) return sign;
        ww_u32 exp = 113u;  // a subnormal m 2^-24: normalized, its exponent goes down
        while (!(m & 0x400u)) { m <<= 1; --exp; }
        return sign | (exp << 23) | ((m & 0x3ffu) << 13);
    }
    return sign | ((e + 112u) << 23) | (m << 13);
}
__device__ __forceinline__ ww_u32 ww_bits_f32(ww_u32 u) { return u; }

__device__ __forceinline__ float ww_div(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a / b;
#endif
}
__device__ __forceinline__ float ww_mul(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a * b;
#endif
}

// float32 -> float8_e4m3fn, round to nearest even, from the bits alone. NaN -> 0x7f;
// |f| >= 464 (never a block product) saturates to 448, as the reference's clip.
__device__ __forceinline__ unsigned char ww_e4m3(float f) {
    ww_u32 u = __float_as_uint(f);
    ww_u32 sign = (u >> 24) & 0x80u;
    ww_u32 a = u & 0x7fffffffu;
    ww_u32 r;
    if (a > 0x7f800000u) {
        r = 0x7fu;
    } else if (a >= 0x43e80000u) {
        r = 0x7eu;
    } else if (a >= 0x3c800000u) {  // >= 2^-6: a normal e4m3, 3 of the 23 mantissa bits
        a += 0x7ffffu + ((a >> 20) & 1u);
        r = (a >> 20) - (120u << 3);
    } else {  // a subnormal e4m3: k 2^-9, k = |f| 2^9 rounded
        ww_u32 e = a >> 23;
        if (e < 117u) {  // below 2^-10, half the smallest subnormal
            r = 0u;
        } else {
            ww_u32 m = (a & 0x7fffffu) | 0x800000u;
            ww_u32 s = 141u - e;  // 21 .. 24
            ww_u32 rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
            r = m >> s;
            if (rem > half || (rem == half && (r & 1u))) ++r;
        }
    }
    return (unsigned char)(r | sign);
}

// two products -> their e4m3 bytes (lo in the low byte). On sm_89+ one hardware
// conversion (round to nearest even, saturating: the same bytes as ww_e4m3 for every
// product below 464 and for NaN's class; a block's products stay below 450); elsewhere,
// and with -DWW_HW_CVT=0, ww_e4m3 twice.
__device__ __forceinline__ ww_u32 ww_e4m3_pair(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && WW_HW_CVT
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (ww_u32)r;
#else
    return (ww_u32)ww_e4m3(lo) | ((ww_u32)ww_e4m3(hi) << 8);
#endif
}

// amax (bits of |x|'s maximum) -> the block's sf, as per_block_cast_to_fp8 computes it
__device__ __forceinline__ float ww_scale(ww_u32 amax, int ue8m0) {
    const ww_u32 floor_bits = __float_as_uint(1e-4f);
    float sf = ww_div(__uint_as_float(amax < floor_bits ? floor_bits : amax), 448.0f);
    if (ue8m0) {
        ww_u32 b = __float_as_uint(sf), e = b >> 23;
        ww_u32 up = (int)(b & 0x7fffffu) > ww_round_down[e & 0xffu] ? 1u : 0u;
        sf = __uint_as_float((e + up) << 23);
    }
    return sf;
}

struct ww_row {
    ww_u64 src, dst, scale, amax;
    long long m, n, ld, bm, bn, cols, first, flags;
};

__device__ __forceinline__ ww_row ww_row_of(const long long* table, int rows, long long tile,
                                            long long* first) {
    int lo = 0, hi = rows - 1;  // the last row whose first tile is <= tile
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (table[(long long)mid * """
    + str(ROW)
    + r""" + 10] <= tile) lo = mid; else hi = mid - 1;
    }
    const long long* t = table + (long long)lo * """
    + str(ROW)
    + r""";
    ww_row r;
    r.src = (ww_u64)t[0]; r.dst = (ww_u64)t[1]; r.scale = (ww_u64)t[2]; r.amax = (ww_u64)t[3];
    r.m = t[4]; r.n = t[5]; r.ld = t[6]; r.bm = t[7]; r.bn = t[8]; r.cols = t[9];
    r.first = t[10]; r.flags = t[11];
    *first = r.first;
    return r;
}

__device__ __forceinline__ ww_u32 ww_word(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One input dtype: its raw element, its float32 bits, its 16-byte vectors per thread.
template <int K> struct ww_in;
template <> struct ww_in<0> {
    typedef unsigned short raw;
    enum { VEC = 8, PER = 8 };
    static __device__ __forceinline__ ww_u32 bits(raw h) { return ww_bits_bf16(h); }
    static __device__ __forceinline__ ww_u32 lane(const uint4& v, int j) {  // little-endian
        return ww_bits_bf16((unsigned short)(ww_word(v, j >> 1) >> (16 * (j & 1))));
    }
};
template <> struct ww_in<1> {
    typedef unsigned short raw;
    enum { VEC = 8, PER = 8 };
    static __device__ __forceinline__ ww_u32 bits(raw h) { return ww_bits_f16(h); }
    static __device__ __forceinline__ ww_u32 lane(const uint4& v, int j) {
        return ww_bits_f16((unsigned short)(ww_word(v, j >> 1) >> (16 * (j & 1))));
    }
};
template <> struct ww_in<2> {
    typedef ww_u32 raw;
    enum { VEC = 4, PER = 16 };
    static __device__ __forceinline__ ww_u32 bits(raw h) { return ww_bits_f32(h); }
    static __device__ __forceinline__ ww_u32 lane(const uint4& v, int j) { return ww_word(v, j); }
};

typedef uint4 ww_vec;  // one 16-byte vector of raw elements (16-byte aligned: one load)

// A tile: where it is, which path it takes.
struct ww_tile {
    long long row0, col0, h, w;  // its first element, its rows and columns inside the weight
    int vector;                  // whole, aligned, fits the registers: the register path
    int vpr;                     // vectors per tile row (the register path)
};

template <int K>
__device__ __forceinline__ ww_tile ww_tile_of(const ww_row& r, long long t) {
    typedef ww_in<K> In;
    ww_tile g;
    long long tr = t / r.cols, tc = t - tr * r.cols;
    g.row0 = tr * r.bm;
    g.col0 = tc * r.bn;
    g.h = r.m - g.row0 < r.bm ? r.m - g.row0 : r.bm;
    g.w = r.n - g.col0 < r.bn ? r.n - g.col0 : r.bn;
    g.vpr = (int)(r.bn / In::VEC);
    g.vector = (r.flags & """
    + str(FLAG_VECTOR)
    + r""") && g.h == r.bm && g.w == r.bn && r.bn % In::VEC == 0
               && r.bm * (r.bn / In::VEC) <= (long long)WW_THREADS * In::PER;
    return g;
}

// Thread tid's share of a register-path tile: loaded into v, its partial |x| maximum.
template <int K>
__device__ __forceinline__ ww_u32 ww_load_vectors(const ww_row& r, const ww_tile& g, int tid,
                                                  ww_vec* v) {
    typedef ww_in<K> In;
    typedef typename In::raw raw;
    const raw* src = (const raw*)r.src;
    const int total = (int)r.bm * g.vpr;
    ww_u32 amax = 0u;
#pragma unroll
    for (int k = 0; k < In::PER; ++k) {
        const int i = tid + k * WW_THREADS;
        if (i < total) {
            const int rr = i / g.vpr, c = (i - rr * g.vpr) * In::VEC;
            v[k] = *(const ww_vec*)(src + (g.row0 + rr) * r.ld + g.col0 + c);
#pragma unroll
            for (int j = 0; j < In::VEC; ++j) amax = ww_umax(amax, In::lane(v[k], j) & 0x7fffffffu);
        }
    }
    return amax;
}

template <int K>
__device__ __forceinline__ void ww_store_vectors(const ww_row& r, const ww_tile& g, int tid,
                                                 const ww_vec* v, float inv) {
    typedef ww_in<K> In;
    unsigned char* dst = (unsigned char*)r.dst;
    const int total = (int)r.bm * g.vpr;
#pragma unroll
    for (int k = 0; k < In::PER; ++k) {
        const int i = tid + k * WW_THREADS;
        if (i < total) {
            const int rr = i / g.vpr, c = (i - rr * g.vpr) * In::VEC;
            ww_u32 out[2] = {0u, 0u};
#pragma unroll
            for (int j = 0; j < In::VEC; j += 2) {
                ww_u32 q = ww_e4m3_pair(ww_mul(__uint_as_float(In::lane(v[k], j)), inv),
                                        ww_mul(__uint_as_float(In::lane(v[k], j + 1)), inv));
                out[j >> 2] |= q << (8 * (j & 3));
            }
            unsigned char* at = dst + (g.row0 + rr) * r.n + g.col0 + c;
            if (In::VEC == 8) {
                *(uint2*)at = make_uint2(out[0], out[1]);
            } else {
                *(ww_u32*)at = out[0];
            }
        }
    }
}

// Thread tid's share of any tile, element by element (edges, unaligned, large blocks): its
// elements tid, tid + THREADS, ... in row-major order, walked as (row, column) with two
// divisions per tile (a 64-bit division per element would dominate).
struct ww_walk {
    long long rr, c, step_r, step_c;
};
__device__ __forceinline__ ww_walk ww_walk_of(const ww_tile& g, int tid) {
    ww_walk k;
    k.rr = tid / g.w;
    k.c = tid - k.rr * g.w;
    k.step_r = WW_THREADS / g.w;
    k.step_c = WW_THREADS - k.step_r * g.w;
    return k;
}
__device__ __forceinline__ void ww_step(ww_walk& k, const ww_tile& g) {
    k.rr += k.step_r;
    k.c += k.step_c;
    if (k.c >= g.w) { k.c -= g.w; ++k.rr; }
}

template <int K>
__device__ __forceinline__ ww_u32 ww_load_elements(const ww_row& r, const ww_tile& g, int tid) {
    typedef typename ww_in<K>::raw raw;
    const raw* src = (const raw*)r.src + g.row0 * r.ld + g.col0;
    ww_u32 amax = 0u;
    for (ww_walk k = ww_walk_of(g, tid); k.rr < g.h; ww_step(k, g))
        amax = ww_umax(amax, ww_in<K>::bits(src[k.rr * r.ld + k.c]) & 0x7fffffffu);
    return amax;
}

template <int K>
__device__ __forceinline__ void ww_store_elements(const ww_row& r, const ww_tile& g, int tid,
                                                  float inv) {
    typedef typename ww_in<K>::raw raw;
    const raw* src = (const raw*)r.src + g.row0 * r.ld + g.col0;
    unsigned char* dst = (unsigned char*)r.dst + g.row0 * r.n + g.col0;
    for (ww_walk k = ww_walk_of(g, tid); k.rr < g.h; ww_step(k, g)) {
        float x = __uint_as_float(ww_in<K>::bits(src[k.rr * r.ld + k.c]));
        dst[k.rr * r.n + k.c] = ww_e4m3(ww_mul(x, inv));
    }
}

// The tile's scale and amax (one thread writes them), its reciprocal for every thread.
__device__ __forceinline__ float ww_finish(const ww_row& r, long long t, ww_u32 amax, int tid) {
    float sf = ww_scale(amax, (int)(r.flags & """
    + str(FLAG_UE8M0)
    + r"""));
    if (tid == 0) {
        ((float*)r.scale)[t] = sf;
        ((float*)r.amax)[t] = __uint_as_float(amax);  // NaN / inf: the group's flag
    }
    return ww_div(1.0f, sf);
}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ ww_u32 ww_block_max(ww_u32 x) {
    __shared__ ww_u32 part[WW_THREADS / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = ww_umax(x, __shfl_xor_sync(0xffffffffu, x, o));
    if ((threadIdx.x & 31u) == 0u) part[threadIdx.x >> 5] = x;
    __syncthreads();
    x = part[0];
#pragma unroll
    for (int w = 1; w < WW_THREADS / 32; ++w) x = ww_umax(x, part[w]);
    __syncthreads();  // part is the next tile's
    return x;
}

template <int K>
__device__ __forceinline__ void ww_quantize(const long long* table, int rows, long long tiles) {
    ww_vec v[ww_in<K>::PER];
    const int tid = (int)threadIdx.x;
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        long long first;
        const ww_row r = ww_row_of(table, rows, tile, &first);
        const long long t = tile - first;
        const ww_tile g = ww_tile_of<K>(r, t);
        if (g.vector) {
            ww_u32 amax = ww_block_max(ww_load_vectors<K>(r, g, tid, v));
            ww_store_vectors<K>(r, g, tid, v, ww_finish(r, t, amax, tid));
        } else {
            ww_u32 amax = ww_block_max(ww_load_elements<K>(r, g, tid));
            ww_store_elements<K>(r, g, tid, ww_finish(r, t, amax, tid));
        }
    }
}
#else
// The host compiler's twin: the threads one after another, each with its own registers.
template <int K>
static void ww_quantize(const long long* table, int rows, long long tiles) {
    static ww_vec v[WW_THREADS][ww_in<K>::PER];
    for (long long tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        long long first;
        const ww_row r = ww_row_of(table, rows, tile, &first);
        const long long t = tile - first;
        const ww_tile g = ww_tile_of<K>(r, t);
        ww_u32 amax = 0u;
        for (int tid = 0; tid < WW_THREADS; ++tid)
            amax = ww_umax(amax, g.vector ? ww_load_vectors<K>(r, g, tid, v[tid])
                                          : ww_load_elements<K>(r, g, tid));
        for (int tid = 0; tid < WW_THREADS; ++tid) {
            float inv = ww_finish(r, t, amax, tid);
            if (g.vector) ww_store_vectors<K>(r, g, tid, v[tid], inv);
            else ww_store_elements<K>(r, g, tid, inv);
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(WW_THREADS, WW_MIN_BLOCKS)
ww_fp8_block_bf16(const long long* table, int rows, long long tiles) {
    ww_quantize<0>(table, rows, tiles);
}
extern "C" __global__ void __launch_bounds__(WW_THREADS, WW_MIN_BLOCKS)
ww_fp8_block_f16(const long long* table, int rows, long long tiles) {
    ww_quantize<1>(table, rows, tiles);
}
extern "C" __global__ void __launch_bounds__(WW_THREADS)
ww_fp8_block_f32(const long long* table, int rows, long long tiles) {
    ww_quantize<2>(table, rows, tiles);
}
"""
)
