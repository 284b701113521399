// Conversions, warp sums and the coordinates of sequences, chunks and groups.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "traits.cuh"

namespace ttt {

// ---------------------------------------------------------------- variants
// The output form OUT (compile.OUT_FORMS): o_pre + LN(o_pre) w + b, q + LN(o_pre) w + b, o_pre
enum : int { kOutNorm = 0, kOutQuery = 1, kOutRaw = 2 };

// ---------------------------------------------------------------- conversions
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// The sum of x over LPR consecutive lanes (a power of two), in each; every lane calls it.
template <int LPR = 32>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int m = LPR / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// ---------------------------------------------------------------- coordinates
struct Seq {
    long long bos;        // first row (over the batch's B * T rows)
    long long len;        // rows
    long long nc;         // chunks (a partial last chunk counts)
    long long slot_base;  // index of the sequence's first checkpoint slot
};

__device__ __forceinline__ Seq seq_coords(long long i_n, long long T_len, int BT, int G,
                                          const long long* __restrict__ cu_seqlens,
                                          const long long* __restrict__ grp_offsets) {
    Seq s;
    if (cu_seqlens != nullptr) {
        s.bos = cu_seqlens[i_n];
        s.len = cu_seqlens[i_n + 1] - s.bos;
        s.slot_base = grp_offsets[i_n] + i_n;
    } else {
        s.bos = i_n * T_len;
        s.len = T_len;
        s.slot_base = i_n * (((T_len + BT - 1) / BT + G - 1) / G + 1);
    }
    s.nc = (s.len + BT - 1) / BT;
    return s;
}

// A segmented pass launches the groups [g_lo, g_hi) of every sequence (placement.segment_plan;
// g_hi <= g_lo: all): chunks [lo, hi); skip: past the sequence's end (the first segment keeps
// an empty sequence: its final slot and state).
struct ChunkRange {
    long long lo, hi;
    bool skip;
};

__device__ __forceinline__ ChunkRange chunk_range(const Seq& s, int G, long long g_lo,
                                                  long long g_hi) {
    if (g_hi <= g_lo) return ChunkRange{0, s.nc, false};
    const long long ng = (s.nc + G - 1) / G;
    const long long lo = g_lo >= ng ? s.nc : g_lo * G;
    const long long hi = g_hi >= ng ? s.nc : g_hi * G;
    return ChunkRange{lo, hi, g_lo > 0 && g_lo >= ng};
}

struct Group {
    Seq seq;
    long long gid;   // index over the batch's groups (slot - sequence index)
    long long c0;    // first chunk of the group (in its sequence)
    int nc;          // chunks in the group (1 .. G); 0: no such group
    long long slot;  // slot of the state before chunk c0 (slot + 1: after the group)
};

// Group j of sequence i_n (nc = 0 where the sequence has no group j).
__device__ __forceinline__ Group group_at(long long i_n, long long j, long long T_len, int BT,
                                          int G, const long long* __restrict__ cu_seqlens,
                                          const long long* __restrict__ grp_offsets) {
    const long long ng_fixed = ((T_len + BT - 1) / BT + G - 1) / G;  // (not varlen)
    Group g;
    g.seq = seq_coords(i_n, T_len, BT, G, cu_seqlens, grp_offsets);
    g.gid = (cu_seqlens != nullptr ? grp_offsets[i_n] : i_n * ng_fixed) + j;
    g.c0 = j * G;
    g.nc = (int)max(0LL, min((long long)G, g.seq.nc - g.c0));
    g.slot = g.seq.slot_base + j;
    return g;
}

// The group of a group block x (its (group, head) index / H): the group's index over the batch
// (g_hi <= g_lo), or of a segment x = i_n (g_hi - g_lo) + (j - g_lo) for group j of sequence i_n.
__device__ __forceinline__ Group group_coords(
    long long x, long long T_len, int BT, int G, const long long* __restrict__ cu_seqlens,
    const long long* __restrict__ grp_offsets, const int* __restrict__ grp_seq, long long g_lo,
    long long g_hi) {
    long long i_n, j;
    const long long ng_fixed = ((T_len + BT - 1) / BT + G - 1) / G;  // (not varlen)
    if (g_hi > g_lo) {
        i_n = x / (g_hi - g_lo);
        j = g_lo + x % (g_hi - g_lo);
    } else if (cu_seqlens != nullptr) {
        i_n = grp_seq[x];
        j = x - grp_offsets[i_n];
    } else {
        i_n = x / ng_fixed;
        j = x % ng_fixed;
    }
    return group_at(i_n, j, T_len, BT, G, cu_seqlens, grp_offsets);
}

}  // namespace ttt
