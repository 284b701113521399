// Row passes: the LayerNorm, g and their backward, one row per warp or per lane group; a
// chunk's SIMT replay from the saved xh, r (replay_chunk_simt).
#pragma once

#include "types.cuh"
#include "tiles.cuh"
#include "staging.cuh"

namespace ttt {

// ---------------------------------------------------------------- row passes (LPR lanes a row)
// A row is held by LPR consecutive lanes (default 32: a warp a row; Traits::kRowLanes in the
// group kernels' MMA instances): lane l = lane % LPR holds columns d = l + LPR e, e < P =
// cdiv(D_PAD, LPR), zero past D. Every lane of a warp must call the helpers that sum over a
// row (row_sum, row_dot and the passes built on them).

template <int LPR = 32>
__device__ __forceinline__ int row_col(int e) {
    return (int)(threadIdx.x & (LPR - 1)) + LPR * e;
}

// x[e] = src[d] * mult for d < D, zero elsewhere (src: global or shared memory).
template <int D_PAD, int LPR = 32, typename S>
__device__ __forceinline__ void load_row(float (&x)[(D_PAD + LPR - 1) / LPR], const S* src, int D,
                                         float mult) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int d = row_col<LPR>(e);
        x[e] = d < D ? to_f32(src[d]) * mult : 0.f;
    }
}

// The LayerNorm weight and bias of head i_h (lnw, lnb [H, D]) in this lane's row elements.
template <int D_PAD, int LPR = 32, int P>
__device__ __forceinline__ void load_ln_rows(float (&w)[P], float (&b)[P], const float* lnw,
                                             const float* lnb, int i_h, int D) {
    load_row<D_PAD, LPR>(w, lnw + (long long)i_h * D, D, 1.f);
    load_row<D_PAD, LPR>(b, lnb + (long long)i_h * D, D, 1.f);
}

// dst[d] = x[e] for d < D.
template <int D_PAD, int LPR = 32, typename S>
__device__ __forceinline__ void store_row(S* dst, const float (&x)[(D_PAD + LPR - 1) / LPR],
                                          int D) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int d = row_col<LPR>(e);
        if (d < D) dst[d] = from_f32<S>(x[e]);
    }
}

// x[e] = srow[d - a0] for the lane's columns d in [a0, a0 + M), zero elsewhere.
template <int D_PAD, int M, int LPR = 32>
__device__ __forceinline__ void load_row_part(float (&x)[(D_PAD + LPR - 1) / LPR],
                                              const float* srow, int a0) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int dl = row_col<LPR>(e) - a0;
        x[e] = dl >= 0 && dl < M ? srow[dl] : 0.f;
    }
}

// store_row of the columns [a0, d1) (WHOLE: a0 = 0, d1 = D).
template <int D_PAD, int LPR, bool WHOLE, typename S, int P>
__device__ __forceinline__ void store_row_cols(S* dst, const float (&x)[P], int a0, int d1) {
    if constexpr (WHOLE) {
        store_row<D_PAD, LPR>(dst, x, d1);
    } else {
#pragma unroll
        for (int e = 0; e < P; ++e) {
            const int d = row_col<LPR>(e);
            if (d >= a0 && d < d1) dst[d] = from_f32<S>(x[e]);
        }
    }
}

// A row of a shared tile: srow[d] = x[e] for every d < D_PAD (zeros included).
template <int D_PAD, int LPR = 32>
__device__ __forceinline__ void put_row(float* srow, const float (&x)[(D_PAD + LPR - 1) / LPR]) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int d = row_col<LPR>(e);
        if (d < D_PAD) srow[d] = x[e];
    }
}

template <int D_PAD, int LPR = 32>
__device__ __forceinline__ void zero_row(float* srow) {
    for (int d = row_col<LPR>(0); d < D_PAD; d += LPR) srow[d] = 0.f;
}

template <int LPR = 32, int P>
__device__ __forceinline__ float row_dot(const float (&x)[P], const float (&y)[P]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) s += x[e] * y[e];
    return group_sum<LPR>(s);
}

template <int LPR = 32, int P>
__device__ __forceinline__ float row_sum(const float (&x)[P]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) s += x[e];
    return group_sum<LPR>(s);
}

// out[d] = sum_a arow[a] M[a, d]   (arow: a shared row; M: a [D_PAD, D_PAD + 1] state)
template <int D_PAD>
__device__ __forceinline__ void row_times_state(float (&out)[(D_PAD + 31) / 32],
                                                const float* arow, const float* sM) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < (D_PAD + 31) / 32; ++e) {
        const int d = lane + 32 * e;
        float acc = 0.f;
        if (d < D_PAD) {
#pragma unroll 8
            for (int a = 0; a < D_PAD; ++a) acc += arow[a] * sM[a * LD + d];
        }
        out[e] = acc;
    }
}

// out[d] = sum_c arow[c] M[d - a0, c] for d in [a0, a0 + M), else zero (sM: rows a0 .. of M).
template <int D_PAD, int M>
__device__ __forceinline__ void row_times_state_rows_t(float (&out)[(D_PAD + 31) / 32],
                                                       const float* arow, const float* sM,
                                                       int a0) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < (D_PAD + 31) / 32; ++e) {
        const int dl = lane + 32 * e - a0;
        float acc = 0.f;
        if (dl >= 0 && dl < M) {
#pragma unroll 8
            for (int c = 0; c < D_PAD; ++c) acc += arow[c] * sM[dl * LD + c];
        }
        out[e] = acc;
    }
}

// In place: x <- LN(x) over the D valid columns (no affine); returns r = 1 / sqrt(var + eps).
template <int LPR = 32, int P>
__device__ __forceinline__ float layer_norm_row(float (&x)[P], int D, float eps) {
    const float inv_d = 1.f / (float)D;
    const float mean = row_sum<LPR>(x) * inv_d;
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
        x[e] = row_col<LPR>(e) < D ? x[e] - mean : 0.f;
        s += x[e] * x[e];
    }
    const float r = 1.f / sqrtf(group_sum<LPR>(s) * inv_d + eps);
#pragma unroll
    for (int e = 0; e < P; ++e) x[e] *= r;
    return r;
}

// g and y of a row from xh and r: y = (xh w + b - v + k) w, g = r (y - mean(y) - xh mean(y xh)).
template <int LPR = 32, int P>
__device__ __forceinline__ void inner_grad_row(float (&g)[P], float (&y)[P], const float (&xh)[P],
                                               float r, const float (&k)[P], const float (&v)[P],
                                               const float (&w)[P], const float (&b)[P], int D) {
    const float inv_d = 1.f / (float)D;
#pragma unroll
    for (int e = 0; e < P; ++e)
        y[e] = row_col<LPR>(e) < D ? (xh[e] * w[e] + b[e] - v[e] + k[e]) * w[e] : 0.f;
    const float ym = row_sum<LPR>(y) * inv_d;
    const float yx = row_dot<LPR>(y, xh) * inv_d;
#pragma unroll
    for (int e = 0; e < P; ++e)
        g[e] = row_col<LPR>(e) < D ? r * (y[e] - ym - xh[e] * yx) : 0.f;
}

// fwd_chain's SIMT row pass over a chunk, warp w rows w, w + NW, ...: kh = k_i W + hb, xh, r
// (LayerNorm), g into sG's row (rows >= L zeroed); xh, r (KEY: l r, and r to rlbuf) saved to
// xbuf, rbuf for the group kernels (OPTIONAL_SAVE: when xbuf is not null).
template <int D_PAD, int BT, int NW, bool OPTIONAL_SAVE = false, bool KEY = false, typename T,
          int P>
__device__ __forceinline__ void inner_grad_rows(
    float* sG, const float* sK, const float* sW, const float* sHb, const T* __restrict__ v,
    const float (&b_w)[P], const float (&b_b)[P], long long p_base, long long p_ebase,
    long long row0, long long row_stride, int L, int H, int D, float eps, float* __restrict__ xbuf,
    float* __restrict__ rbuf, const float* __restrict__ ekey = nullptr,
    float* __restrict__ rlbuf = nullptr) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31;
    for (int i = threadIdx.x >> 5; i < BT; i += NW) {
        if (i >= L) {
            zero_row<D_PAD>(sG + i * LD);
            continue;
        }
        const long long o_r = p_base + (row0 + i) * row_stride;
        float b_x[P], b_k[P], b_v[P], b_g[P], b_y[P];
        row_times_state<D_PAD>(b_x, sK + i * LD, sW);
#pragma unroll
        for (int e = 0; e < P; ++e) {
            const int d = lane + 32 * e;
            if (d < D) b_x[e] += sHb[d];
        }
        const float r_ln = layer_norm_row(b_x, D, eps);
        const float r = KEY ? r_ln * ekey[p_ebase + (row0 + i) * H] : r_ln;
        load_row<D_PAD>(b_k, sK + i * LD, D, 1.f);
        load_row<D_PAD>(b_v, v + o_r, D, 1.f);
        inner_grad_row(b_g, b_y, b_x, r, b_k, b_v, b_w, b_b, D);
        put_row<D_PAD>(sG + i * LD, b_g);
        if (!OPTIONAL_SAVE || xbuf != nullptr) {
            store_row<D_PAD>(xbuf + o_r, b_x, D);
            if (lane == 0) rbuf[p_ebase + (row0 + i) * H] = r;
            if (KEY && lane == 0) rlbuf[p_ebase + (row0 + i) * H] = r_ln;
        }
    }
}

// g of a block's rows from the saved xh, r (fwd_out, bwd_local): row w + NW (s + 32 / LPR u)
// to lane group s of warp w in pass u; g_i = inner_grad_row(xh_i, r_i, k_i, v_i) into sG's
// row, k from sK, and `src(i, ok, b_x, b_v)` loads xh, v and returns r (all zero past L: !ok,
// so those rows get g = 0 while every lane takes part in the row sums).
template <int D_PAD, int BT, int NW, int LPR, int P, typename Src>
__device__ __forceinline__ void inner_grad_rows_from(
    float* sG, const float* sK, const float (&b_w)[P], const float (&b_b)[P], int L, int D,
    Src src) {
    constexpr int LD = D_PAD + 1, RPP = 32 / LPR;  // rows per warp pass
    static_assert(BT % (NW * RPP) == 0, "inner_grad_rows_from: whole passes");
    const int sub = (threadIdx.x & 31) / LPR;
    for (int i0 = threadIdx.x >> 5; i0 < BT; i0 += NW * RPP) {
        const int i = i0 + NW * sub;
        const bool ok = i < L;
        float b_x[P], b_k[P], b_v[P], b_g[P], b_y[P];
        const float r = src(i, ok, b_x, b_v);
        load_row<D_PAD, LPR>(b_k, sK + i * LD, ok ? D : 0, 1.f);
        inner_grad_row<LPR>(b_g, b_y, b_x, r, b_k, b_v, b_w, b_b, D);
        put_row<D_PAD, LPR>(sG + i * LD, b_g);
    }
}

// inner_grad_rows_from with xh, v, r of rows row0 + i from xbuf, v, rbuf.
template <int D_PAD, int BT, int NW, int LPR = 32, typename T, int P>
__device__ __forceinline__ void inner_grad_rows_saved(
    float* sG, const float* sK, const T* __restrict__ v, const float* xbuf, const float* rbuf,
    const float (&b_w)[P], const float (&b_b)[P], long long p_base, long long p_ebase,
    long long row0, long long row_stride, int L, int H, int D) {
    inner_grad_rows_from<D_PAD, BT, NW, LPR>(
        sG, sK, b_w, b_b, L, D, [&](int i, bool ok, float (&b_x)[P], float (&b_v)[P]) {
            const long long o_r = p_base + (row0 + (ok ? i : 0)) * row_stride;
            load_row<D_PAD, LPR>(b_x, xbuf + o_r, ok ? D : 0, 1.f);
            load_row<D_PAD, LPR>(b_v, v + o_r, ok ? D : 0, 1.f);
            return ok ? rbuf[p_ebase + (row0 + i) * H] : 0.f;
        });
}

// inner_grad_rows_from with xh, v, r staged in shared memory (StagedRows: strides ldx, ldv).
template <int D_PAD, int BT, int NW, int LPR = 32, typename T, int P>
__device__ __forceinline__ void inner_grad_rows_staged(
    float* sG, const float* sK, const T* sV, int ldv, const float* sX, int ldx, const float* sR,
    const float (&b_w)[P], const float (&b_b)[P], int L, int D) {
    inner_grad_rows_from<D_PAD, BT, NW, LPR>(
        sG, sK, b_w, b_b, L, D, [&](int i, bool ok, float (&b_x)[P], float (&b_v)[P]) {
            load_row<D_PAD, LPR>(b_x, sX + i * ldx, ok ? D : 0, 1.f);
            load_row<D_PAD, LPR>(b_v, sV + i * ldv, ok ? D : 0, 1.f);
            return ok ? sR[i] : 0.f;
        });
}

// o_pre of row i: q_i W + hb - e_i sum_{j <= i} A_ij g_j, zero past D. MMA: sQ's row holds
// q W - e (A g) (out_pre_mma), hb is added; else SIMT products (one warp a row).
template <int D_PAD, int BT, bool MMA, int LPR = 32, int P>
__device__ __forceinline__ void out_pre_row(float (&o)[P], int i, const float* sQ,
                                            const float* sW, const float* sA, const float* sG,
                                            const float* sHb, const float* sE, int D) {
    constexpr int LD = D_PAD + 1, LA = BT + 1;
    static_assert(MMA || LPR == 32, "the SIMT products take one warp a row");
    if constexpr (MMA)
        load_row<D_PAD, LPR>(o, sQ + i * LD, D_PAD, 1.f);
    else
        row_times_state<D_PAD>(o, sQ + i * LD, sW);
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const int d = row_col<LPR>(e);
        if (d >= D) {
            o[e] = 0.f;
            continue;
        }
        o[e] += sHb[d];
        if constexpr (!MMA) {
            float acc = 0.f;
            for (int jj = 0; jj <= i; ++jj) acc += sA[i * LA + jj] * sG[jj * LD + d];
            o[e] -= sE[i] * acc;
        }
    }
}

// The output form OUT of one row o (o_pre in): kOutNorm o + LN(o) w + b; kOutQuery
// q + LN(o) w + b (qrow unscaled, read where ok and d < D); kOutRaw o. Every lane calls it.
template <int OUT, int LPR = 32, typename T, int P>
__device__ __forceinline__ void output_row(float (&o)[P], const float (&w)[P],
                                           const float (&b)[P], int D, float eps,
                                           const T* qrow, bool ok) {
    if constexpr (OUT == kOutNorm) {
        float n[P];
#pragma unroll
        for (int e = 0; e < P; ++e) n[e] = o[e];
        layer_norm_row<LPR>(n, D, eps);
#pragma unroll
        for (int e = 0; e < P; ++e) o[e] += n[e] * w[e] + b[e];
    } else if constexpr (OUT == kOutQuery) {
        layer_norm_row<LPR>(o, D, eps);
#pragma unroll
        for (int e = 0; e < P; ++e) {
            const int d = row_col<LPR>(e);
            const float qv = ok && d < D ? to_f32(qrow[d]) : 0.f;
            o[e] = qv + o[e] * w[e] + b[e];
        }
    }
}

// The SIMT output rows of a chunk (fwd_chain's FUSE instance, fwd_out), a warp a row (warp:
// this warp's index): o_pre of row i < L (out_pre_row), its output form OUT (q's row row0 + i)
// -> o's row row0 + i.
template <int D_PAD, int BT, int NW, int OUT, typename T, int P>
__device__ __forceinline__ void output_rows_simt(
    T* __restrict__ o, const T* __restrict__ q, const float* sQ, const float* sW,
    const float* sA, const float* sG, const float* sHb, const float* sE, const float (&b_w)[P],
    const float (&b_b)[P], long long p_base, long long row0, long long row_stride, int L, int D,
    float eps, int warp) {
    for (int i = warp; i < L; i += NW) {
        float b_o[P];
        out_pre_row<D_PAD, BT, false>(b_o, i, sQ, sW, sA, sG, sHb, sE, D);
        output_row<OUT>(b_o, b_w, b_b, D, eps, q + p_base + (row0 + i) * row_stride, true);
        store_row<D_PAD>(o + p_base + (row0 + i) * row_stride, b_o, D);
    }
}

// The post norm-residual's backward for one row: o (o_pre in) becomes oh = LN(o_pre), dout
// (do in) do_pre = do + r_o (do w - mean(do w) - oh mean(do w oh)); dw += do oh, db += do.
// kOutQuery drops the leading do (bwd_local adds do to dq), kOutRaw leaves do_pre = do alone.
template <int LPR = 32, int OUT = kOutNorm, int P>
__device__ __forceinline__ void post_norm_bwd_row(float (&o)[P], float (&dout)[P],
                                                  const float (&w)[P], float (&dw)[P],
                                                  float (&db)[P], int D, float eps) {
    if constexpr (OUT == kOutRaw) return;
    const float inv_d = 1.f / (float)D;
    const float ro = layer_norm_row<LPR>(o, D, eps);      // o <- oh
    float doh[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
        doh[e] = dout[e] * w[e];
        dw[e] += dout[e] * o[e];
        db[e] += dout[e];
    }
    const float m1 = row_sum<LPR>(doh) * inv_d;
    const float m2 = row_dot<LPR>(doh, o) * inv_d;
#pragma unroll
    for (int e = 0; e < P; ++e)
        dout[e] = row_col<LPR>(e) < D ? (OUT == kOutQuery ? 0.f : dout[e]) +
                                             ro * (doh[e] - m1 - o[e] * m2)
                                       : 0.f;
}

// Backward of g(kh) for the cotangent dg: dkh and dy (ttt_common.cuh); r is g's factor l r,
// r_ln the LayerNorm's r, g the row's g / l (without eta_key: r_ln = r, g itself). Returns
// sum(dg g), deta_key with eta_key.
template <int LPR = 32, int P>
__device__ __forceinline__ float inner_grad_bwd_row(
    float (&dkh)[P], float (&dy)[P], const float (&dg)[P], const float (&xh)[P], float r,
    const float (&y)[P], const float (&g)[P], const float (&w)[P], int D, float r_ln) {
    const float inv_d = 1.f / (float)D;
    const float a1 = row_sum<LPR>(dg) * inv_d;
    const float a2 = row_dot<LPR>(dg, xh) * inv_d;
    const float a3 = row_dot<LPR>(xh, y) * inv_d;
    const float dgg = row_dot<LPR>(dg, g);
    const float dr = dgg * r * inv_d;  // dr r_ln^2 / D with dr = sum(dg l g) / r_ln
    float dxh[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const bool m = row_col<LPR>(e) < D;
        dy[e] = m ? r * (dg[e] - a1 - xh[e] * a2) : 0.f;
        dxh[e] = m ? -r * (dg[e] * a3 + y[e] * a2) + dy[e] * (w[e] * w[e]) : 0.f;
    }
    const float c1 = row_sum<LPR>(dxh) * inv_d;
    const float c2 = row_dot<LPR>(dxh, xh) * inv_d;
#pragma unroll
    for (int e = 0; e < P; ++e)
        dkh[e] = row_col<LPR>(e) < D ? r_ln * (dxh[e] - c1 - xh[e] * c2) - dr * xh[e] : 0.f;
    return dgg;
}

// A chunk of the SIMT replay from the saved xh, r (fwd_out, bwd_local): rows row0 .. row0 + L - 1
// of its sequence, e_l the eta of the last one.
struct SimtChunk {
    long long row0;
    int L;
    float e_l;
};

// Chunk j of the group gr in the SIMT replay: its rows of q * scale, k (X: and of x -> s_x)
// and eta -> s_q, s_k, s_e; A = tril(q k^T) + tril(1) -> s_A; g from xh, r, k, v -> s_g.
// Ends with a barrier.
template <int D_PAD, int BT, int NT, int NW, bool X = false, typename T, int P>
__device__ __forceinline__ SimtChunk replay_chunk_simt(
    const Group& gr, int j, float* s_q, float* s_k, float* s_x, float* s_A, float* s_g,
    float* s_e, const T* q, const T* k, const T* x, const T* v, const float* eta,
    const float* xbuf, const float* rbuf, const float (&b_w)[P], const float (&b_b)[P],
    long long p_base, long long p_ebase, long long row_stride, int H, int D, float scale) {
    const long long row0 = (gr.c0 + j) * BT;
    const int L = (int)min((long long)BT, gr.seq.len - row0);
    load_tile<D_PAD, BT, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
    load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
    if constexpr (X) load_tile<D_PAD, BT, NT>(s_x, x, p_base, row0, L, row_stride, D, 1.f);
    load_eta<BT, NT>(s_e, eta, p_ebase, row0, L, H);
    __syncthreads();
    const float e_l = s_e[L - 1];

    // A -> s_A (tile pass); row pass: g -> s_g
    tri_dots<D_PAD, BT, NT, true>(s_A, s_q, s_k, L, 1.f);
    inner_grad_rows_saved<D_PAD, BT, NW>(s_g, s_k, v, xbuf, rbuf, b_w, b_b, p_base, p_ebase,
                                         row0, row_stride, L, H, D);
    __syncthreads();
    return SimtChunk{row0, L, e_l};
}

}  // namespace ttt
