"""The CUDA C source of the fused delta extraction (``delta_cuda``), compiled with NVRTC.

``ww_delta``: one launch per layer group; one block per tile (a tile never straddles two
tensors). A block takes its tile number from a counter (``atomicAdd``), so a tile only ever
waits on tiles whose blocks already run: the look-back cannot deadlock however the blocks
are scheduled. Per tile: load new and base (16-byte vectors where both tensors are aligned
and the tile is whole, element by element otherwise), compare bit patterns, count, scan the
counts across the block, then the decoupled look-back: the tile publishes its count
(``AGG``) at once, sums the predecessors' published values back to the nearest inclusive
one (``INC``; a tensor's first tile publishes ``INC`` directly), and publishes its own
inclusive prefix. Then it writes each changed element's flat index (``int32``) and value
at its slot (in increasing index order; slots past the tensor's capacity are dropped) and
the new bytes into the base. The tensor's last tile stores the tensor's count.

Element order inside a tile: vector ``v`` of thread ``t`` holds elements
``(v * WW_THREADS + t) * EPV + [0, EPV)`` (coalesced loads), so slots are ordered by ``v``,
then ``t``, then the element within the vector; each thread's per-vector counts are packed
as 16-bit fields of 64-bit words (four vectors a word) and scanned once.

``ww_pack``: copies byte ranges (each changed tensor's indices and values, out of the
group's scratch into tight buffers), 16-byte vectors where both ends are aligned.
"""

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

#ifndef WW_THREADS
#define WW_THREADS 256
#endif
#define WW_WARPS (WW_THREADS / 32)
#define WW_WORDS ((WW_VEC + 3) / 4)
#define WW_FULL 0xffffffffu
#define WW_AGG (1ull << 62)
#define WW_INC (2ull << 62)
#define WW_VALUE ((1ull << 62) - 1)
#define WW_PACK_CHUNK 65536

struct WwEntry {
    u64 fresh;
    u64 base;
    u64 index;
    u64 values;
    long long numel;
    long long capacity;
    long long first_tile;
    long long tiles;
    int itemsize;
    int aligned;
};

struct WwCopy {
    u64 src;
    u64 dst;
    u64 bytes;
};

__device__ __forceinline__ u32 ww_lane(const uint4& q, int i) {
    return i == 0 ? q.x : (i == 1 ? q.y : (i == 2 ? q.z : q.w));
}

// Element k of a 16-byte vector of W words (little-endian); k is a constant after unrolling.
template <typename W>
__device__ __forceinline__ W ww_word(const uint4& q, int k) {
    if constexpr (sizeof(W) == 8) {
        return (W)(((u64)ww_lane(q, 2 * k + 1) << 32) | (u64)ww_lane(q, 2 * k));
    } else {
        constexpr int per = 4 / sizeof(W);
        return (W)(ww_lane(q, k / per) >> (8 * sizeof(W) * (k % per)));
    }
}

// Exclusive sums of the WW_WORDS words x over the block (each word: four 16-bit fields);
// total: the sums over every thread.
__device__ __forceinline__ void ww_block_scan(
    const u64 (&x)[WW_WORDS], u64 (&excl)[WW_WORDS], u64 (&total)[WW_WORDS], u64* warp_sums
) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 incl[WW_WORDS];
#pragma unroll
    for (int i = 0; i < WW_WORDS; ++i) incl[i] = x[i];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
        for (int i = 0; i < WW_WORDS; ++i) {
            u64 y = __shfl_up_sync(WW_FULL, incl[i], o);
            if (lane >= o) incl[i] += y;
        }
    }
    if (lane == 31) {
#pragma unroll
        for (int i = 0; i < WW_WORDS; ++i) warp_sums[warp * WW_WORDS + i] = incl[i];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < WW_WORDS; ++i) {
            u64 w = lane < WW_WARPS ? warp_sums[lane * WW_WORDS + i] : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                u64 y = __shfl_up_sync(WW_FULL, w, o);
                if (lane >= o) w += y;
            }
            if (lane < WW_WARPS) warp_sums[lane * WW_WORDS + i] = w;
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < WW_WORDS; ++i) {
        total[i] = warp_sums[(WW_WARPS - 1) * WW_WORDS + i];
        excl[i] = (warp ? warp_sums[(warp - 1) * WW_WORDS + i] : 0) + incl[i] - x[i];
    }
}

// Warp 0: the sum of the counts of tiles [first, tile) from their published status words.
// Only tiles numbered below `tile` are read: their blocks took their numbers earlier and
// are running or done, so each word is published in finite time.
__device__ u64 ww_look_back(u64* status, long long tile, long long first) {
    const int lane = threadIdx.x & 31;
    u64 prefix = 0;
    long long pred = tile - 1;
    while (true) {
        const long long at = pred - lane;
        u64 s = WW_INC;  // before the tensor's first tile: nothing to add
        if (at >= first) {
            do {
                s = *(volatile u64*)(status + at);
            } while (s == 0);
        }
        const u32 inc = __ballot_sync(WW_FULL, (s >> 62) == 2);
        const int stop = inc ? __ffs(inc) - 1 : 31;  // the nearest inclusive predecessor
        u64 v = lane <= stop ? (s & WW_VALUE) : 0;
#pragma unroll
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(WW_FULL, v, o);
        prefix += v;
        if (inc) return prefix;
        pred -= 32;
    }
}

template <typename W>
__device__ __forceinline__ void ww_tile(
    const WwEntry& e, int entry, long long tile, u64* status, u64* counts, u64* warp_sums,
    u64* shared_prefix
) {
    constexpr int EPV = 16 / sizeof(W);
    constexpr long long TILE = (long long)WW_THREADS * WW_VEC * EPV;
    const long long local = tile - e.first_tile;
    const long long start = local * TILE;
    const W* fresh = (const W*)e.fresh;
    W* base = (W*)e.base;
    const bool fast = e.aligned && start + TILE <= e.numel;

    uint4 nv[WW_VEC];
    u32 mask[WW_VEC];
    u64 packed[WW_WORDS] = {};
    if (fast) {
        uint4 bv[WW_VEC];
#pragma unroll
        for (int v = 0; v < WW_VEC; ++v) {
            const long long at = start + ((long long)v * WW_THREADS + threadIdx.x) * EPV;
            nv[v] = __ldg((const uint4*)(fresh + at));
            bv[v] = *(const uint4*)(base + at);
        }
#pragma unroll
        for (int v = 0; v < WW_VEC; ++v) {
            u32 m = 0;
#pragma unroll
            for (int k = 0; k < EPV; ++k) {
                m |= (u32)(ww_word<W>(nv[v], k) != ww_word<W>(bv[v], k)) << k;
            }
            mask[v] = m;
        }
    } else {
#pragma unroll
        for (int v = 0; v < WW_VEC; ++v) {
            const long long at = start + ((long long)v * WW_THREADS + threadIdx.x) * EPV;
            u32 m = 0;
#pragma unroll
            for (int k = 0; k < EPV; ++k) {
                if (at + k < e.numel && fresh[at + k] != base[at + k]) m |= 1u << k;
            }
            mask[v] = m;
        }
    }
#pragma unroll
    for (int v = 0; v < WW_VEC; ++v) packed[v / 4] |= (u64)__popc(mask[v]) << (16 * (v % 4));

    u64 total[WW_WORDS], excl[WW_WORDS];
    ww_block_scan(packed, excl, total, warp_sums);
    u64 row[WW_VEC];
    u64 agg = 0;
#pragma unroll
    for (int v = 0; v < WW_VEC; ++v) {
        row[v] = agg;
        agg += (total[v / 4] >> (16 * (v % 4))) & 0xffff;
    }

    if (threadIdx.x < 32) {
        u64 prefix = 0;
        if (local == 0) {
            if (threadIdx.x == 0) atomicExch(status + tile, WW_INC | agg);
        } else {
            if (threadIdx.x == 0) atomicExch(status + tile, WW_AGG | agg);
            prefix = ww_look_back(status, tile, e.first_tile);
            if (threadIdx.x == 0) atomicExch(status + tile, WW_INC | (prefix + agg));
        }
        if (threadIdx.x == 0) {
            *shared_prefix = prefix;
            if (local == e.tiles - 1) counts[entry] = prefix + agg;
        }
    }
    __syncthreads();
    const u64 prefix = *shared_prefix;
    const u64 capacity = (u64)e.capacity;
    int* index = (int*)e.index;
    W* values = (W*)e.values;
#pragma unroll
    for (int v = 0; v < WW_VEC; ++v) {
        const u32 m = mask[v];
        if (!m) continue;
        const long long at = start + ((long long)v * WW_THREADS + threadIdx.x) * EPV;
        u64 slot = prefix + row[v] + ((excl[v / 4] >> (16 * (v % 4))) & 0xffff);
        if (fast) *(uint4*)(base + at) = nv[v];  // unchanged words rewrite their own bytes
        // One pass per changed element, not per element: a warp's store instructions follow
        // its lanes' most changes in this vector (one or two at a few percent), not EPV.
        for (u32 left = m; left; left &= left - 1) {
            const int k = __ffs(left) - 1;
            const W value = fast ? ww_word<W>(nv[v], k) : fresh[at + k];
            if (!fast) base[at + k] = value;
            if (slot < capacity) {
                index[slot] = (int)(at + k);
                values[slot] = value;
            }
            ++slot;
        }
    }
}

#ifndef WW_MIN_BLOCKS
#define WW_MIN_BLOCKS 1
#endif

extern "C" __global__ void __launch_bounds__(WW_THREADS, WW_MIN_BLOCKS) ww_delta(
    const WwEntry* table, int entries, u32* ticket, u64* counts, u64* status
) {
    __shared__ long long s_tile;
    __shared__ int s_entry;
    __shared__ u64 s_prefix;
    __shared__ u64 s_warp[WW_WARPS * WW_WORDS];
    if (threadIdx.x == 0) s_tile = (long long)atomicAdd(ticket, 1u);
    __syncthreads();
    const long long tile = s_tile;
    for (int j = threadIdx.x; j < entries; j += WW_THREADS) {
        const long long first = table[j].first_tile;
        if (first <= tile && tile < first + table[j].tiles) s_entry = j;
    }
    __syncthreads();
    const int entry = s_entry;
    const WwEntry e = table[entry];
    switch (e.itemsize) {
        case 1:
            ww_tile<unsigned char>(e, entry, tile, status, counts, s_warp, &s_prefix);
            break;
        case 2:
            ww_tile<unsigned short>(e, entry, tile, status, counts, s_warp, &s_prefix);
            break;
        case 4:
            ww_tile<unsigned int>(e, entry, tile, status, counts, s_warp, &s_prefix);
            break;
        default:
            ww_tile<u64>(e, entry, tile, status, counts, s_warp, &s_prefix);
            break;
    }
}

extern "C" __global__ void ww_pack(const WwCopy* copies, int n) {
    for (int c = blockIdx.y; c < n; c += gridDim.y) {
        const WwCopy job = copies[c];
        const u64 begin = (u64)blockIdx.x * WW_PACK_CHUNK;
        if (begin >= job.bytes) continue;
        const u64 end = min(job.bytes, begin + WW_PACK_CHUNK);
        const unsigned char* src = (const unsigned char*)job.src;
        unsigned char* dst = (unsigned char*)job.dst;
        u64 tail = begin;
        if (((job.src | job.dst) & 15) == 0) {
            tail = begin + ((end - begin) & ~15ull);
            for (u64 at = begin + 16 * (u64)threadIdx.x; at < tail; at += 16 * (u64)blockDim.x) {
                *(uint4*)(dst + at) = *(const uint4*)(src + at);
            }
        }
        for (u64 at = tail + threadIdx.x; at < end; at += blockDim.x) dst[at] = src[at];
    }
}
"""
