// Chunked TTT-linear: forward and backward kernels (plain SIMT fp32, no tensor cores).
//
// A port of the Triton backend's design (ttt_triton/ops/ttt_linear/{fwd,bwd}.py): one thread
// block per (sequence, head) walks that sequence's chunks in order, carrying the fp32 state
// W [D, D] and the bias state hb [D] in shared memory. Per chunk of L <= BT valid rows
// (q pre-multiplied by `scale`; rows past the sequence's end are exactly zero and take no part
// in anything: the padding rule of docs/math.md):
//
//   kh   = k W + hb,          xh = (kh - mean) * r,   r = 1 / sqrt(var(kh) + eps)
//   y    = (xh * w + b - v + k) * w                              (dl / dxh)
//   g    = r * (y - mean(y) - xh * mean(y * xh))                 (dl / dkh)
//   A    = tril(q k^T) + tril(1)
//   o    = q W + hb - eta * (A g)
//   W   <- W - eta_last * k^T g,      hb <- hb - eta_last * sum_i g_i
//
// with eta_last the eta of the chunk's last *valid* row; the epilogue writes
// out = o + LN(o) * w + b (LayerNorm over D without affine, same eps).
//
// Forward: when `ck` is given, the state *before* every G-th chunk (chunks 0, G, 2G, ...) is
// written in fp32 to a checkpoint buffer for the backward.
//
// Backward (post norm-residual included): the block walks the groups of G chunks in reverse.
// It recomputes the states before each chunk of the group from the group's checkpoint into a
// per-block scratch buffer in global memory (L2 resident), then walks the group's chunks in
// reverse carrying dW = dL/dW' and dhb = dL/dhb' (cotangents of the state *after* the chunk)
// in shared memory. With E = eta * dop, e_l = eta_last and the forward quantities recomputed:
//
//   dop  = do + r_o (doh - mean(doh) - oh mean(doh oh)),  doh = do * w,  oh = LN(o_pre)
//   dg   = -A^T E - e_l k dW - e_l dhb
//   dA   = dop g^T,   dP = -tril(eta * dA)
//   dq   = scale (dop W^T + dP k)
//   dk   = dP^T q - e_l g dW^T + dy w + dkh W^T
//   deta_i = -sum_j A_ij dA_ij   [- <k dW, g> - dhb . sum_i g_i on the last valid row]
//   dy   = r (dg - mean(dg) - xh mean(dg xh))
//   dxh  = -r (dg mean(xh y) + y mean(dg xh)) + dy w^2,    dr = sum(dg g) / r
//   dkh  = r (dxh - mean(dxh) - xh mean(dxh xh)) - dr r^2 xh / D
//   dv   = -dy w
//   dw  += sum_i dy (2 xh w + b - v + k) + sum_i do oh,   db += sum_i dy w + sum_i do
//   dW  <- dW + q^T dop + k^T dkh,    dhb <- dhb + sum_i dop_i + sum_i dkh_i
//
// dw and db are written per block ([N, H, D] partials, summed in torch: deterministic, no
// atomics). Every reduction has a fixed order, so results are bitwise reproducible.
//
// Layout: q, k, v, o, do, dq, dk, dv are [B, T, H, D] in the input dtype T (float, __half or
// __nv_bfloat16); eta and deta [B, T, H] fp32; w, b [H, D] fp32; states [N, H, D, D] and
// [N, H, D] fp32. Packed batches (cu_seqlens, int64, B == 1) read their offsets on device.
// Global offsets are 64-bit (long long). D <= D_PAD: padded columns are masked to zero.
//
// Shared memory (fp32, dynamic; rows padded by one float against bank conflicts) is given by
// TttTraits<D_PAD, BT>::kFwdBytes / kBwdBytes; the launcher computes the same numbers
// (ttt_cupy.compile.smem_bytes, checked against these by ttt_cupy.nvrtc_check).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ttt {

// ---------------------------------------------------------------- tile sizes per head dim
template <int D_PAD, int BT>
struct TttTraits {
    static_assert(D_PAD == 16 || D_PAD == 32 || D_PAD == 64 || D_PAD == 128,
                  "D_PAD must be 16, 32, 64 or 128");
    static_assert(BT == 16 || BT == 32 || BT == 64, "BT must be 16, 32 or 64");
    static constexpr int kThreads = D_PAD >= 64 ? 256 : 128;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kPerLane = (D_PAD + 31) / 32;  // row elements per lane in row passes
    static constexpr int kLdT = D_PAD + 1;               // row stride of [BT, D_PAD] tiles
    static constexpr int kLdW = D_PAD + 1;               // row stride of [D_PAD, D_PAD] states
    static constexpr int kLdA = BT + 1;                  // row stride of [BT, BT] tiles
    static constexpr int kTile = BT * kLdT;
    static constexpr int kState = D_PAD * kLdW;
    static constexpr int kSquare = BT * kLdA;
    // forward: W, hb, w, b, Q, K, G, X, A, eta
    static constexpr int kFwdFloats = kState + 3 * D_PAD + 4 * kTile + kSquare + BT;
    // backward: W, dW, hb, dhb, w, b, Q, K, DO, X, G, T1, DY, A, P, eta, rstd, deta, scalars
    static constexpr int kBwdFloats = 2 * kState + 4 * D_PAD + 7 * kTile + 2 * kSquare + 3 * BT + 4;
    static constexpr unsigned long long kFwdBytes = 4ull * kFwdFloats;
    static constexpr unsigned long long kBwdBytes = 4ull * kBwdFloats;
};

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

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// ---------------------------------------------------------------- block-wide helpers
// s[i, d] = src[base + (row0 + i) * row_stride + d] * mult for i < L, d < D; zero elsewhere.
template <int D_PAD, int BT, int NT, typename T>
__device__ __forceinline__ void load_tile(float* s, const T* __restrict__ src, long long base,
                                          long long row0, int L, long long row_stride, int D,
                                          float mult) {
    constexpr int LD = D_PAD + 1;
    for (int idx = threadIdx.x; idx < BT * D_PAD; idx += NT) {
        const int i = idx / D_PAD, d = idx % D_PAD;
        float val = 0.f;
        if (i < L && d < D) val = to_f32(src[base + (row0 + i) * row_stride + d]) * mult;
        s[i * LD + d] = val;
    }
}

// sW[a, d] = src[a * D + d] (zero outside [D, D] or when src is null); sHb likewise.
template <int D_PAD, int NT>
__device__ __forceinline__ void load_state(float* sW, float* sHb, const float* src,
                                           const float* srcb, int D) {
    constexpr int LW = D_PAD + 1;
    for (int idx = threadIdx.x; idx < D_PAD * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        sW[a * LW + d] = (src != nullptr && a < D && d < D) ? src[a * D + d] : 0.f;
    }
    for (int d = threadIdx.x; d < D_PAD; d += NT)
        sHb[d] = (srcb != nullptr && d < D) ? srcb[d] : 0.f;
}

template <int D_PAD, int NT>
__device__ __forceinline__ void store_state(float* dst, float* dstb,
                                            const float* sW, const float* sHb, int D) {
    constexpr int LW = D_PAD + 1;
    for (int idx = threadIdx.x; idx < D_PAD * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        if (a < D && d < D) dst[a * D + d] = sW[a * LW + d];
    }
    for (int d = threadIdx.x; d < D; d += NT) dstb[d] = sHb[d];
}

// sX[i, d] = (sK sW)[i, d] + sHb[d] for valid rows / columns, zero elsewhere.
template <int D_PAD, int BT, int NT>
__device__ __forceinline__ void kh_tile(float* sX, const float* sK, const float* sW,
                                        const float* sHb, int L, int D) {
    constexpr int LD = D_PAD + 1, LW = D_PAD + 1;
    for (int idx = threadIdx.x; idx < BT * D_PAD; idx += NT) {
        const int i = idx / D_PAD, d = idx % D_PAD;
        float acc = 0.f;
        if (i < L && d < D) {
#pragma unroll 8
            for (int a = 0; a < D_PAD; ++a) acc += sK[i * LD + a] * sW[a * LW + d];
            acc += sHb[d];
        }
        sX[i * LD + d] = acc;
    }
}

// W <- W - e_l K^T G,  hb <- hb - e_l sum_i G_i.
template <int D_PAD, int BT, int NT>
__device__ __forceinline__ void state_step(float* sW, float* sHb, const float* sK,
                                           const float* sG, float e_l, int D) {
    constexpr int LD = D_PAD + 1, LW = D_PAD + 1;
    for (int idx = threadIdx.x; idx < D_PAD * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        if (a < D && d < D) {
            float acc = 0.f;
#pragma unroll 8
            for (int i = 0; i < BT; ++i) acc += sK[i * LD + a] * sG[i * LD + d];
            sW[a * LW + d] -= e_l * acc;
        }
    }
    for (int d = threadIdx.x; d < D; d += NT) {
        float acc = 0.f;
        for (int i = 0; i < BT; ++i) acc += sG[i * LD + d];
        sHb[d] -= e_l * acc;
    }
}

// One warp, one valid row: xh = LN(kh) in place in xrow, g -> grow; returns r = rstd.
// v is read from global memory (vrow: that row of v).
template <int D_PAD, typename T>
__device__ __forceinline__ float inner_grad_row(float* xrow, float* grow, const float* krow,
                                                const T* __restrict__ vrow, const float* sLw,
                                                const float* sLb, int D, float eps) {
    constexpr int P = (D_PAD + 31) / 32;
    const int lane = threadIdx.x & 31;
    float xh[P], y[P];
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const int d = lane + 32 * e;
        xh[e] = d < D ? xrow[d] : 0.f;
        s += xh[e];
    }
    const float mean = warp_sum(s) / (float)D;
    s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const int d = lane + 32 * e;
        xh[e] = d < D ? xh[e] - mean : 0.f;
        s += xh[e] * xh[e];
    }
    const float r = 1.f / sqrtf(warp_sum(s) / (float)D + eps);
    float sy = 0.f, syx = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const int d = lane + 32 * e;
        xh[e] *= r;
        y[e] = 0.f;
        if (d < D) y[e] = (xh[e] * sLw[d] + sLb[d] - ttt::to_f32(vrow[d]) + krow[d]) * sLw[d];
        sy += y[e];
        syx += y[e] * xh[e];
    }
    const float ym = warp_sum(sy) / (float)D;
    const float yx = warp_sum(syx) / (float)D;
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const int d = lane + 32 * e;
        if (d < D_PAD) {
            xrow[d] = xh[e];
            grow[d] = d < D ? r * (y[e] - ym - xh[e] * yx) : 0.f;
        }
    }
    return r;
}

// ---------------------------------------------------------------- block coordinates
struct SeqCoords {
    long long bos, seq_len, ck0;
};

__device__ __forceinline__ SeqCoords seq_coords(long long i_n, long long T_len, int BT, int G,
                                                const long long* __restrict__ cu_seqlens,
                                                const long long* __restrict__ ck_offsets) {
    SeqCoords c;
    if (cu_seqlens != nullptr) {
        c.bos = cu_seqlens[i_n];
        c.seq_len = cu_seqlens[i_n + 1] - c.bos;
        c.ck0 = ck_offsets != nullptr ? ck_offsets[i_n] : 0;
    } else {
        c.bos = i_n * T_len;
        c.seq_len = T_len;
        c.ck0 = i_n * (((T_len + BT - 1) / BT + G - 1) / G);
    }
    return c;
}

}  // namespace ttt
