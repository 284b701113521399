// Forward, sequential part: ttt_linear_fwd_chain<T, D_PAD, BT, MMA, FUSE, KEY, OUT>. One block
// per (sequence, head) carries the state through the chunks in order (ttt_common.cuh):
//
//   kh = k W + hb  ->  xh, r (LayerNorm)  ->  g = l r (y - mean(y) - xh mean(y xh))
//   W <- W - eta_l k^T g,  hb <- hb - eta_l sum_i g_i
//
// It saves xh and r' = l r of every valid row (KEY: the LayerNorm's r to rlbuf), the state
// before every group in its slot and the final state (the last slot; ht / hbt when given).
// FUSE also writes o (fwd_out.cu's math) in place of fwd_out; with ck null (no backward) it
// saves nothing but o and ht / hbt.
//
// SIMT: the state in shared memory, a row pass then a tile pass; the next chunk's rows asked
// into L1. MMA (half inputs): the state in registers as mma accumulators (mma.cuh), the row
// statistics by warp shuffles and per-warp partials (Chan's formula), three barriers per
// chunk; the next chunk's k, v (FUSE: q, eta) load into registers a step early (StagedTile).
// FUSE's o_pre statistics cross the step's last barrier: o is finished in the next step.
//
// Segments: chunks [g_lo G, g_hi G), from the slot the previous segment stored last.
// Overlapped (sync given): each finished group is published for fwd_out (overlap.cuh).
#include "ttt_common.cuh"

namespace ttt {

// The MMA steps over a lane's accumulator entries (for_each_frag_row): row t, column n0 + 8 h
// of x[i][e + 2 h]; col_ok[h]: that column within D; cols[w]: warp w's valid columns.

// o <- o_pre in the output form OUT for a chunk's o_pre in ob (L_o rows from o_rows), from
// the per-warp statistics of its rows in s_ost.
template <typename T, int D_PAD, int BT, int OUT>
__device__ __forceinline__ void fwd_tc_finish_out(
    T* __restrict__ o_rows, const T* __restrict__ q_rows, const float (&ob)[BT / 8][4],
    const float* s_ost, const float (&cols)[Traits<D_PAD, BT>::kTcWarps],
    const bool (&col_ok)[2], const float (&lw)[2], const float (&lb)[2], int L_o, float inv_d,
    float eps, int rs, int tq, int n0) {
    const FloatK<2>* ost = reinterpret_cast<const FloatK<2>*>(s_ost);
    for_each_frag_row<BT / 8>(tq, [&](int i, int e, int t) {
        float m2;
        const float mean = chan_mean<Traits<D_PAD, BT>::kTcWarps, BT>(ost, cols, t, inv_d, m2);
        const float ro = 1.f / sqrtf(m2 * inv_d + eps);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float x = ob[i][e + 2 * h];
            if (col_ok[h] && t < L_o) {
                const int ix = t * rs + n0 + 8 * h;
                if constexpr (OUT == kOutNorm)
                    o_rows[ix] = from_f32<T>(x + (x - mean) * ro * lw[h] + lb[h]);
                else if constexpr (OUT == kOutQuery)
                    o_rows[ix] = from_f32<T>(to_f32(q_rows[ix]) + (x - mean) * ro * lw[h] + lb[h]);
                else
                    o_rows[ix] = from_f32<T>(x);
            }
        }
    });
}

// kh (in x, its per-warp statistics in stat) -> xh (in x) and r (KEY: g's factor l r); saves
// xh, r (KEY: and the LayerNorm's r) of valid rows when x_rows is given.
template <int D_PAD, int BT, bool KEY>
__device__ __forceinline__ void fwd_tc_layernorm(
    float (&x)[BT / 8][4], float (&r)[BT / 8][2], const FloatK<2>* stat,
    const float (&cols)[Traits<D_PAD, BT>::kTcWarps], const bool (&col_ok)[2], float inv_d,
    float eps, const float* __restrict__ ekey_rows, float* __restrict__ x_rows,
    float* __restrict__ r_rows, float* __restrict__ rl_rows, int L, int H, int rs, int tq, int n0) {
    const int wid = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;  // (warp 0, g = 0: r once)
    const bool save = x_rows != nullptr;
    for_each_frag_row<BT / 8>(tq, [&](int i, int e, int t) {
        float m2;
        const float mean = chan_mean<Traits<D_PAD, BT>::kTcWarps, BT>(stat, cols, t, inv_d, m2);
        r[i][e] = rsqrtf(m2 * inv_d + eps);
        x[i][e] = col_ok[0] ? (x[i][e] - mean) * r[i][e] : 0.f;          // xh
        x[i][e + 2] = col_ok[1] ? (x[i][e + 2] - mean) * r[i][e] : 0.f;
        if constexpr (KEY) {  // g's factor l r (rbuf), the LayerNorm's r (rlbuf)
            const float rk = t < L ? r[i][e] * ekey_rows[t * H] : 0.f;
            if (save && t < L && wid == 0 && g == 0) rl_rows[t * H] = r[i][e];
            r[i][e] = rk;
        }
        if (save && t < L) {  // the saved activations: xh, and r once
            if (col_ok[0]) x_rows[t * rs + n0] = x[i][e];
            if (col_ok[1]) x_rows[t * rs + n0 + 8] = x[i][e + 2];
            if (wid == 0 && g == 0) r_rows[t * H] = r[i][e];
        }
    });
}

// o_pre += (-e A) g (M = n, K = j: g's accumulators as the A operand, N = t; A lower), then
// the per-warp statistics of o_pre's rows into s_ost.
template <int D_PAD, int BT>
__device__ __forceinline__ void fwd_tc_out_pre(
    float (&ob)[BT / 8][4], const float (&y)[BT / 8][4], const float* s_A, float* s_ost,
    const bool (&col_ok)[2], float inv_cols, int tq, int n0) {
    constexpr int NR = BT / 8, LA = Traits<D_PAD, BT>::kLdA;
    const int wid = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
    FloatK<2>* ost = reinterpret_cast<FloatK<2>*>(s_ost);
#pragma unroll
    for (int I = 0; I < NR; ++I) {
        const float* arow = s_A + (8 * I + g) * LA + 2 * tq;
#pragma unroll
        for (int i = 0; i <= I; ++i) {
            unsigned a[4];
            acc_as_a(a, y[i], 1.f);
            const unsigned b[2] = {to_tf32(arow[8 * i]), to_tf32(arow[8 * i + 1])};
            mma_m16n8k8_tf32(ob[I], a, b);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e)  // (zero in padded columns)
            warp_row_stats(ost, wid * BT + 8 * I + 2 * tq + e, ob[I][e], ob[I][e + 2], col_ok,
                           inv_cols);
    }
}

// Both instances' parameters: the kernel's shared memory and FwdParams' fields (restrict:
// no aliasing, the read-only path), and the kernel's arguments for them.
#define TTT_FWD_CHAIN_PARAMS                                                                      \
    float* smem, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,       \
    const float* __restrict__ eta, const float* __restrict__ lnw, const float* __restrict__ lnb,  \
    const float* __restrict__ h0, const float* __restrict__ hb0, float* __restrict__ ht,          \
    float* __restrict__ hbt, float* __restrict__ ck, float* __restrict__ ckb,                     \
    float* __restrict__ xbuf, float* __restrict__ rbuf, T* __restrict__ o,                        \
    const float* __restrict__ ekey, float* __restrict__ rlbuf,                                    \
    const long long* __restrict__ cu_seqlens, const long long* __restrict__ grp_offsets,          \
    float scale, float eps, long long T_len, int H, int D, int G, long long g_lo, long long g_hi, \
    int* sync
#define TTT_FWD_CHAIN_ARGS(p)                                                                     \
    smem, p.q, p.k, p.v, p.eta, p.lnw, p.lnb, p.h0, p.hb0, p.ht, p.hbt, p.ck, p.ckb, p.xbuf,      \
    p.rbuf, p.o, p.ekey, p.rlbuf, p.cu_seqlens, p.grp_offsets, p.scale, p.eps, p.T_len, p.H, p.D, \
    p.G, p.g_lo, p.g_hi, p.sync

template <typename T, int D_PAD, int BT, bool FUSE, bool KEY, int OUT>
__device__ __forceinline__ void fwd_chain_tc(TTT_FWD_CHAIN_PARAMS) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NW = Tr::kTcWarps, NT = Tr::kTcThreads, LD = Tr::kLd, NR = BT / 8;
    constexpr int PE = (BT + NT - 1) / NT;  // rows of a chunk's eta per thread (FUSE)
    float* s_k = smem;                    // [2][BT, LD]  k, double-buffered
    float* s_v = s_k + 2 * Tr::kTile;     // [2][BT, LD]  v
    float* s_red = s_v + 2 * Tr::kTile;   // [2][NW][BT][2] per-warp row statistics (two rounds)
    float* s_q = s_red + 4 * NW * BT;     // [2][BT, LD]  FUSE: q * scale, double-buffered
    float* s_A = s_q + 2 * Tr::kTile;     // [BT, LA]     -e_t (q_t . k_j + 1) for j <= t < L
    float* s_e = s_A + Tr::kSquare;       // [2][BT]      per-row eta, double-buffered
    float* s_ost = s_e + 2 * BT;          // [NW][BT][2]  per-warp statistics of o_pre's rows
    const bool save = !FUSE || ck != nullptr;  // (no slots, xh or r without a backward)

    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, g = lane >> 2, tq = lane & 3;
    const int n0 = 16 * wid + g;                         // this lane's columns n0, n0 + 8
    const long long i_nh = blockIdx.x;
    const int i_h = (int)(i_nh % H);
    const Seq sq = seq_coords(i_nh / H, T_len, BT, G, cu_seqlens, grp_offsets);
    const long long DD = (long long)D * D;
    const long long row_stride = (long long)H * D;
    const long long p_base = (sq.bos * H + i_h) * D, p_ebase = sq.bos * H + i_h;

    const ChunkRange cr = chunk_range(sq, G, g_lo, g_hi);
    if (cr.skip) return;
    overlap_chain_started(sync);
    const long long c_lo = cr.lo, c_hi = cr.hi;
    const long long i_start = (sq.slot_base + c_lo / G) * H + i_h;

    float W[D_PAD / 8][4], hb[2], lw[2], lb[2];
    bool col_ok[2];
    if (c_lo > 0)
        load_state_frag<D_PAD>(W, hb, ck + i_start * DD, ckb + i_start * D, D);
    else
        load_state_frag<D_PAD>(W, hb, h0 != nullptr ? h0 + i_nh * DD : nullptr,
                               hb0 != nullptr ? hb0 + i_nh * D : nullptr, D);
    state_cols_ln(col_ok, lw, lb, lnw, lnb, i_h, D);
    const int rs = H * D;                                // row stride (32-bit in a chunk)
    const float inv_d = 1.f / (float)D;
    const int cols_w = max(0, min(16, D - 16 * wid));    // valid columns of this warp
    const float inv_cols = cols_w > 0 ? 1.f / (float)cols_w : 0.f;
    float cols[NW];                                      // valid columns of every warp
#pragma unroll
    for (int w2 = 0; w2 < NW; ++w2) cols[w2] = (float)max(0, min(16, D - 16 * w2));
    constexpr bool kExact = is_half_type<T>::value;  // k's tile holds tf32 values (tf32_operand)
    const bool vec = vec_rows_ok(k, row_stride, D) && vec_rows_ok(v, row_stride, D) &&
                     (!FUSE || vec_rows_ok(q, row_stride, D));

    const long long row_lo = c_lo * BT;
    const int L0 = c_hi > c_lo ? (int)min((long long)BT, sq.len - row_lo) : 0;
    if (c_hi > c_lo) {
        load_tile<D_PAD, BT, NT>(s_k, k, p_base, row_lo, L0, row_stride, D, 1.f);
        load_tile<D_PAD, BT, NT>(s_v, v, p_base, row_lo, L0, row_stride, D, 1.f);
        if constexpr (FUSE) {
            load_tile<D_PAD, BT, NT>(s_q, q, p_base, row_lo, L0, row_stride, D, scale);
            load_eta<BT, NT>(s_e, eta, p_ebase, row_lo, L0, H);
        }
    }
    float e_l = c_hi > c_lo ? eta[p_ebase + (row_lo + L0 - 1) * H] : 0.f;
    __syncthreads();
    // FUSE: o_pre of the previous chunk (L_o rows from row0_o) in kh's layout, finished in the
    // next step once its row statistics are in s_ost
    float ob[NR][4];
    long long row0_o = 0;
    int L_o = 0;
    auto finish_out = [&]() {
        fwd_tc_finish_out<T, D_PAD, BT, OUT>(
            o + p_base + row0_o * row_stride, q + p_base + row0_o * row_stride, ob, s_ost, cols,
            col_ok, lw, lb, L_o, inv_d, eps, rs, tq, n0);
    };
    long long i_slot = i_start;                          // the next slot to write
    int in_group = 0;                                    // i_c % G, without a 64-bit modulo
    for (long long i_c = c_lo; i_c < c_hi; ++i_c) {
        if (in_group == 0) {  // (a later segment's first slot holds this state already)
            if (save && !(i_c == c_lo && c_lo > 0))
                store_state_frag<D_PAD>(ck + i_slot * DD, ckb + i_slot * D, W, hb, D);
            i_slot += H;
        }
        in_group = in_group + 1 == G ? 0 : in_group + 1;
        const int buf = (int)((i_c - c_lo) & 1);
        const float* sk = s_k + buf * Tr::kTile;
        const float* sv = s_v + buf * Tr::kTile;
        const long long row0 = i_c * BT;
        const int L = (int)min((long long)BT, sq.len - row0);

        // the next chunk's k, v into registers (stored at the step's end) and its eta_l
        const int Ln = i_c + 1 < c_hi ? (int)min((long long)BT, sq.len - row0 - BT) : 0;
        const long long o_next = p_base + (row0 + BT) * row_stride;
        StagedTile<T, D_PAD, BT, NT> nk, nv, nq;  // nq: FUSE only
        nk.load(k + o_next, rs, Ln, D, vec);
        nv.load(v + o_next, rs, Ln, D, vec);
        if (i_c + 2 < c_hi) {  // and the chunk after it into L1
            const long long row0a = row0 + 2 * BT;
            const int La = (int)min((long long)BT, sq.len - row0a);
            constexpr int kLpr = (D_PAD * (int)sizeof(T) + 126) / 128 + 1;
            if constexpr (FUSE) {
                const RowSpan spans[3] = {row_span(k + p_base, row0a, La, row_stride, D),
                                          row_span(v + p_base, row0a, La, row_stride, D),
                                          row_span(q + p_base, row0a, La, row_stride, D)};
                prefetch_spans<NT, kLpr>(spans);
            } else {
                const RowSpan spans[2] = {row_span(k + p_base, row0a, La, row_stride, D),
                                          row_span(v + p_base, row0a, La, row_stride, D)};
                prefetch_spans<NT, kLpr>(spans);
            }
        }
        const float e_l_next = Ln > 0 ? eta[p_ebase + (row0 + BT + Ln - 1) * H] : 0.f;
        float ne[PE];            // FUSE: the next chunk's q and per-row eta likewise
        if constexpr (FUSE) {
            nq.load(q + o_next, rs, Ln, D, vec);
#pragma unroll
            for (int u = 0; u < PE; ++u) {
                const int i = threadIdx.x + NT * u;
                ne[u] = i < Ln ? eta[p_ebase + (row0 + BT + i) * H] : 0.f;
            }
        }

        // kh = k W + hb: x[i][c] = kh[t][n], t = 8 i + 2 tq + (c & 1), n = n0 + 8 (c >> 1);
        // its LayerNorm statistics per warp
        float x[NR][4];
        tile_times_state_frag<D_PAD, BT, kExact>(x, W, sk);
        if constexpr (FUSE) {
            // the previous chunk's o; this chunk's o_pre = q W + hb and -e A -> s_A
            if (i_c > c_lo) finish_out();
            const float* sqt = s_q + buf * Tr::kTile;
            tile_times_state_frag<D_PAD, BT>(ob, W, sqt);
            for_each_frag_entry<NR>([&](int i, int c, int, int) {
                ob[i][c] = col_ok[c >> 1] ? ob[i][c] + hb[c >> 1] : 0.f;
            });
            tri_dots_mma<D_PAD, BT, NW, true, true>(s_A, sqt, sk, L, 1.f, s_e + buf * BT, -1.f);
            row0_o = row0;
            L_o = L;
        }
        FloatK<2>* stat = reinterpret_cast<FloatK<2>*>(s_red);
        for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
            x[i][e] = col_ok[0] ? x[i][e] + hb[0] : 0.f;
            x[i][e + 2] = col_ok[1] ? x[i][e + 2] + hb[1] : 0.f;
            warp_row_stats(stat, wid * BT + t, x[i][e], x[i][e + 2], col_ok, inv_cols);
        });
        __syncthreads();
        float r[NR][2];
        fwd_tc_layernorm<D_PAD, BT, KEY>(
            x, r, stat, cols, col_ok, inv_d, eps, KEY ? ekey + p_ebase + row0 * H : nullptr,
            save ? xbuf + p_base + row0 * row_stride : nullptr, rbuf + p_ebase + row0 * H,
            rlbuf + p_ebase + row0 * H, L, H, rs, tq, n0);

        // y = (xh w + b - v + k) w; g = r (y - mean(y) - xh mean(y xh))
        float y[NR][4], sums[NR][2][2];
        for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
            sums[i][e][0] = sums[i][e][1] = 0.f;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = e + 2 * h, n = n0 + 8 * h;
                y[i][c] = col_ok[h] ? (x[i][c] * lw[h] + lb[h] - sv[t * LD + n] +
                                       sk[t * LD + n]) * lw[h]
                                    : 0.f;
                sums[i][e][0] += y[i][c];
                sums[i][e][1] += y[i][c] * x[i][c];
            }
        });
        frag_row_sums<NW, BT, 2>(sums, s_red + 2 * NW * BT);
        float hs[2] = {0.f, 0.f};
        for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
            const float ym = sums[i][e][0] * inv_d, yx = sums[i][e][1] * inv_d;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = e + 2 * h;
                const bool ok = col_ok[h] && t < L;
                const float gv = ok ? r[i][e] * (y[i][c] - ym - x[i][c] * yx) : 0.f;
                y[i][c] = gv;  // y now holds g
                hs[h] += gv;
            }
        });

        if constexpr (FUSE)  // o_pre += (-e A) g, then the statistics of o_pre's rows
            fwd_tc_out_pre<D_PAD, BT>(ob, y, s_A, s_ost, col_ok, inv_cols, tq, n0);

        // W <- W - eta_l k^T g, hb <- hb - eta_l sum_i g_i
        state_update_frag<D_PAD, BT, kExact>(W, y, -e_l, sk);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            hs[h] += __shfl_xor_sync(0xffffffffu, hs[h], 1);
            hs[h] += __shfl_xor_sync(0xffffffffu, hs[h], 2);
            hb[h] -= e_l * hs[h];
        }
        e_l = e_l_next;

        nk.store(s_k + (buf ^ 1) * Tr::kTile, 1.f);
        nv.store(s_v + (buf ^ 1) * Tr::kTile, 1.f);
        if constexpr (FUSE) {
            nq.store(s_q + (buf ^ 1) * Tr::kTile, scale);
#pragma unroll
            for (int u = 0; u < PE; ++u)
                if (threadIdx.x + NT * u < BT) s_e[(buf ^ 1) * BT + threadIdx.x + NT * u] = ne[u];
        }
        __syncthreads();
        if (in_group == 0 || i_c + 1 == c_hi)  // a group done: its slot, xh and r stored
            overlap_chain_progress(sync, i_nh, (int)((i_c + G) / G));
    }
    if constexpr (FUSE) {
        if (c_hi > c_lo) finish_out();
    }

    // the state after the range: the final slot (and ht), or the next segment's first slot
    const long long i_ck = (sq.slot_base + (c_hi + G - 1) / G) * H + i_h;
    if (save) store_state_frag<D_PAD>(ck + i_ck * DD, ckb + i_ck * D, W, hb, D);
    if (ht != nullptr && c_hi == sq.nc)
        store_state_frag<D_PAD>(ht + i_nh * DD, hbt + i_nh * D, W, hb, D);
}

template <typename T, int D_PAD, int BT, bool FUSE, bool KEY, int OUT>
__device__ __forceinline__ void fwd_chain_simt(TTT_FWD_CHAIN_PARAMS) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane;
    float* s_W = smem;                 // [D_PAD, LD]  state
    float* s_hb = s_W + Tr::kState;    // [D_PAD]      bias state
    float* s_k = s_hb + D_PAD;         // [BT, LD]     k
    float* s_g = s_k + Tr::kTile;      // [BT, LD]     g
    float* s_q = s_g + Tr::kTile;      // [BT, LD]     FUSE: q * scale
    float* s_A = s_q + Tr::kTile;      // [BT, LA]     tril(q k^T) + tril(1)
    float* s_e = s_A + Tr::kSquare;    // [BT]         eta (zero past the end)
    const bool save = !FUSE || ck != nullptr;

    const long long i_nh = blockIdx.x;
    const int i_h = (int)(i_nh % H);
    const Seq sq = seq_coords(i_nh / H, T_len, BT, G, cu_seqlens, grp_offsets);
    const long long DD = (long long)D * D;

    const ChunkRange cr = chunk_range(sq, G, g_lo, g_hi);
    if (cr.skip) return;
    overlap_chain_started(sync);
    const long long c_lo = cr.lo, c_hi = cr.hi;

    float b_w[P], b_b[P];                                            // [D] per lane
    load_ln_rows<D_PAD>(b_w, b_b, lnw, lnb, i_h, D);
    if (c_lo > 0) {
        const long long i_ck = (sq.slot_base + c_lo / G) * H + i_h;
        load_state<D_PAD, NT>(s_W, s_hb, ck + i_ck * DD, ckb + i_ck * D, D);
    } else {
        load_state<D_PAD, NT>(s_W, s_hb, h0 != nullptr ? h0 + i_nh * DD : nullptr,
                              hb0 != nullptr ? hb0 + i_nh * D : nullptr, D);
    }
    __syncthreads();

    const long long row_stride = (long long)H * D;       // rows are H * D apart
    const long long p_base = (sq.bos * H + i_h) * D;     // row 0 of this (sequence, head)
    const long long p_ebase = sq.bos * H + i_h;          // eta rows are H apart
    for (long long i_c = c_lo; i_c < c_hi; ++i_c) {
        // (a later segment's first slot holds this state already)
        if (save && i_c % G == 0 && !(i_c == c_lo && c_lo > 0)) {
            const long long i_ck = (sq.slot_base + i_c / G) * H + i_h;
            store_state<D_PAD, NT>(ck + i_ck * DD, ckb + i_ck * D, s_W, s_hb, D);
        }
        const long long row0 = i_c * BT;
        const int L = (int)min((long long)BT, sq.len - row0);
        load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
        const float e_l = eta[p_ebase + (row0 + L - 1) * H];
        if constexpr (FUSE) {
            load_tile<D_PAD, BT, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
            load_eta<BT, NT>(s_e, eta, p_ebase, row0, L, H);
        }
        if (i_c + 1 < c_hi) {  // the next chunk's rows into L1 while this one computes
            const long long row0n = row0 + BT;
            const int Ln = (int)min((long long)BT, sq.len - row0n);
            prefetch_rows<NT>(k + p_base, row0n, Ln, row_stride, D);
            prefetch_rows<NT>(v + p_base, row0n, Ln, row_stride, D);
            if constexpr (FUSE) {
                prefetch_rows<NT>(q + p_base, row0n, Ln, row_stride, D);
                prefetch_rows<NT>(eta + p_ebase, row0n, Ln, H, 1);
            } else {
                prefetch_rows<NT>(eta + p_ebase, row0n + Ln - 1, 1, H, 1);
            }
        }
        __syncthreads();

        // row pass: kh -> xh, r (xbuf, rbuf) -> g (s_g); FUSE: A = tril(q k^T) + tril(1) too
        if constexpr (FUSE) tri_dots<D_PAD, BT, NT, true>(s_A, s_q, s_k, L, 1.f);
        inner_grad_rows<D_PAD, BT, NW, FUSE, KEY>(s_g, s_k, s_W, s_hb, v, b_w, b_b, p_base,
                                                  p_ebase, row0, row_stride, L, H, D, eps,
                                                  save ? xbuf : nullptr, rbuf, ekey, rlbuf);
        __syncthreads();

        if constexpr (FUSE) {
            // row pass: o_pre = q W + hb - e (A g), then the post norm-residual -> o
            output_rows_simt<D_PAD, BT, NW, OUT>(o, q, s_q, s_W, s_A, s_g, s_hb, s_e, b_w, b_b,
                                                 p_base, row0, row_stride, L, D, eps,
                                                 (int)(threadIdx.x >> 5));
            __syncthreads();
        }

        // W <- W - eta_l k^T g, hb <- hb - eta_l sum_i g_i
        state_axpy<D_PAD, BT, NT>(s_W, s_hb, -e_l, s_k, s_g, D);
        __syncthreads();
        if ((i_c + 1) % G == 0 || i_c + 1 == c_hi)  // a group done: its slot, xh and r stored
            overlap_chain_progress(sync, i_nh, (int)((i_c + G) / G));
    }

    const long long i_ck = (sq.slot_base + (c_hi + G - 1) / G) * H + i_h;
    if (save) store_state<D_PAD, NT>(ck + i_ck * DD, ckb + i_ck * D, s_W, s_hb, D);
    if (ht != nullptr && c_hi == sq.nc)
        store_state<D_PAD, NT>(ht + i_nh * DD, hbt + i_nh * D, s_W, s_hb, D);
}

}  // namespace ttt

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value,
          bool FUSE = false, bool KEY = false, int OUT = ttt::kOutNorm>
__global__ void __launch_bounds__(MMA ? ttt::Traits<D_PAD, BT>::kTcThreads
                                      : ttt::Traits<D_PAD, BT>::kThreads,
                                  MMA && FUSE ? ttt::Traits<D_PAD, BT>::kFusedChainBlocks : 1)
ttt_linear_fwd_chain(const ttt::FwdParams<T> p) {
    // ck, ckb, xbuf, rbuf: all given, or (FUSE only: a forward without backward) all null
    static_assert(FUSE || OUT == ttt::kOutNorm, "only the FUSE instance writes outputs");
    using Tr = ttt::Traits<D_PAD, BT>;
    extern __shared__ float smem[];
    constexpr unsigned long long kBytes =
        MMA ? (FUSE ? Tr::kFwdChainFusedTcBytes : Tr::kFwdChainTcBytes)
            : (FUSE ? Tr::kFwdChainFusedBytes : Tr::kFwdChainBytes);
    ttt::check_launch<T, D_PAD, MMA>(p, kBytes, MMA ? Tr::kTcThreads : Tr::kThreads);
    if constexpr (MMA)
        ttt::fwd_chain_tc<T, D_PAD, BT, FUSE, KEY, OUT>(TTT_FWD_CHAIN_ARGS(p));
    else
        ttt::fwd_chain_simt<T, D_PAD, BT, FUSE, KEY, OUT>(TTT_FWD_CHAIN_ARGS(p));
}
