// Backward, sequential part: ttt_linear_bwd_chain<T, D_PAD, BT, MMA, KEY>. One block per
// (sequence, head) carries the state's cotangent back through the chunks, with dW, dhb the
// cotangents of the state *after* the chunk; g from the saved xh, r', dg_loc and do_pre from
// bwd_local.cu (ttt_common.cuh):
//
//   u   = k dW + dhb,      dg = dg_loc - eta_l u   ->  dkh (inner_grad_bwd_row)
//   dW <- dW + q^T do_pre + k^T dkh,     dhb <- dhb + sum_i do_pre_i + sum_i dkh_i
//   deta_last += -sum_i <u_i, g_i>       (added where bwd_local.cu left the rest)
//
// The full dg replaces dg_loc; KEY also writes deta_key sum_i dg_i (g_i / l_i) to dkey (when
// given). Slot cotangents go to dck, dckb for bwd_grads.cu, slot 0's to dh0 / dhb0 when given.
// Segments run chunks [g_lo G, g_hi G) in reverse, from dht or the slot cotangent the next
// segment stored. Overlapped (sync given): finished groups are published (overlap.cuh).
//
// SIMT: dW in shared memory, the previous chunk's rows asked into L1. MMA (half inputs): dW in
// registers as mma accumulators (mma.cuh), the row pass on each lane's accumulator entries
// with three rounds of row sums (frag_row_sums); the previous chunk's rows come by cp.async
// (Traits::kBwdChainStage) or q, k through registers (StagedTile) and the rest via L1.
#include "ttt_common.cuh"

namespace ttt {

// The MMA steps over a lane's accumulator entries: row t = 8 i + 2 tq + e, column n0 + 8 h,
// entry c = e + 2 h of x[i][c]; col_ok[h]: column n0 + 8 h within D. FUSE: the fused chain.

// This chunk's rows of xh, v, do_pre, dg_loc, r (KEY: and the LayerNorm's r): from the stage
// (kStage) or device memory.
template <typename T, int D_PAD, int BT, bool KEY>
__device__ __forceinline__ void bwd_tc_rows(
    float (&xh)[BT / 8][4], float (&vv)[BT / 8][4], float (&dop)[BT / 8][4], float (&dg)[BT / 8][4],
    float (&r)[BT / 8][2], float (&rl)[BT / 8][2], const float* s_xh, const T* s_v,
    const float* s_dop, const float* s_dg, const float* s_r, const float* __restrict__ xbuf,
    const T* __restrict__ v, const float* __restrict__ dopbuf, const float* __restrict__ dgbuf,
    const float* __restrict__ rbuf, const float* __restrict__ rlbuf, long long o_rows,
    long long p_ebase, long long row0, int rs, int L, int H, int D, int tq) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NR = BT / 8, NT = Tr::kTcThreads;
    constexpr bool kStage = Tr::kBwdChainStage;
    using RowsF = StagedRows<float, D_PAD, BT, NT>;
    using RowsT = StagedRows<T, D_PAD, BT, NT>;
    if constexpr (kStage) {  // staged by the step before
        frag_rows_from_smem<BT, RowsF::kLd>(xh, s_xh);
        frag_rows_from_smem<BT, RowsT::kLd>(vv, s_v);
        frag_rows_from_smem<BT, RowsF::kLd>(dop, s_dop);
        frag_rows_from_smem<BT, RowsF::kLd>(dg, s_dg);
        for_each_frag_row<NR>(tq, [&](int i, int e, int t) { r[i][e] = s_r[t]; });
    } else {
        load_frag_rows<BT>(xh, xbuf + o_rows, rs, L, D);
        load_frag_rows<BT>(vv, v + o_rows, rs, L, D);
        load_frag_rows<BT>(dop, dopbuf + o_rows, rs, L, D);
        load_frag_rows<BT>(dg, dgbuf + o_rows, rs, L, D);
        const float* r_rows = rbuf + p_ebase + row0 * H;
        for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
            r[i][e] = t < L ? r_rows[t * H] : 0.f;
        });
    }
    if constexpr (KEY) {  // the LayerNorm's r (r: g's factor l r)
        for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
            rl[i][e] = t < L ? rlbuf[p_ebase + (row0 + t) * H] : 0.f;
        });
    }
}

// The fused chain's tiles of a step: dW (after the chunk), do_pre, eta, and at a group start
// (slot given) W before the chunk.
template <int D_PAD, int BT>
__device__ __forceinline__ void bwd_tc_fused_tiles(
    float* s_dWs, float* s_out, float* s_e, float* s_W, const float (&dW)[D_PAD / 8][4],
    const float (&dop)[BT / 8][4], const float* __restrict__ eta, long long p_ebase,
    long long row0, int L, int H, const float* __restrict__ slot, int D) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NT = Tr::kTcThreads, LD = Tr::kLd, NR = BT / 8;
    for_each_state_entry<D_PAD>(
        [&](int J, int c, int a, int n) { s_dWs[a * LD + n] = dW[J][c]; });
    for_each_frag_entry<NR>([&](int i, int c, int t, int n) { s_out[t * LD + n] = dop[i][c]; });
    for (int j = threadIdx.x; j < BT; j += NT)
        s_e[j] = j < L ? eta[p_ebase + (row0 + j) * H] : 0.f;
    if (slot != nullptr) load_state_rows<D_PAD, D_PAD, NT>(s_W, slot, D, D);
}

// u += dhb; y = (xh w + b - v + k) w; round 1's row sums of y, y xh.
template <int NR, int LD>
__device__ __forceinline__ void bwd_tc_y(
    float (&u)[NR][4], float (&y)[NR][4], float (&s1)[NR][2][2], const float (&xh)[NR][4],
    const float (&vv)[NR][4], const bool (&col_ok)[2], const float (&dhb)[2], const float (&lw)[2],
    const float (&lb)[2], const float* skt, int tq, int n0) {
    for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
        s1[i][e][0] = s1[i][e][1] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = e + 2 * h;
            u[i][c] = col_ok[h] ? u[i][c] + dhb[h] : 0.f;
            y[i][c] = col_ok[h] ? (xh[i][c] * lw[h] + lb[h] - vv[i][c] +
                                   skt[t * LD + n0 + 8 * h]) * lw[h]
                                : 0.f;
            s1[i][e][0] += y[i][c];
            s1[i][e][1] += y[i][c] * xh[i][c];
        }
    });
}

// g (FUSE: into s_g); dg = dg_loc - eta_l u; round 2's row sums of dg, dg xh, dg g (KEY:
// dg g / l, deta_key), u g.
template <int NR, int LD, bool FUSE, bool KEY>
__device__ __forceinline__ void bwd_tc_dg(
    float (&gg)[NR][4], float (&dg)[NR][4], float (&s2)[NR][2][4], const float (&s1)[NR][2][2],
    const float (&u)[NR][4], const float (&y)[NR][4], const float (&xh)[NR][4],
    const float (&r)[NR][2], const float (&rl)[NR][2], const bool (&col_ok)[2], float e_l,
    float inv_d, int L, float* s_g, int tq, int n0) {
    for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
        const float ym = s1[i][e][0] * inv_d, yx = s1[i][e][1] * inv_d;
        s2[i][e][0] = s2[i][e][1] = s2[i][e][2] = s2[i][e][3] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = e + 2 * h;
            const bool ok = col_ok[h] && t < L;
            gg[i][c] = ok ? r[i][e] * (y[i][c] - ym - xh[i][c] * yx) : 0.f;
            if constexpr (FUSE) s_g[t * LD + n0 + 8 * h] = gg[i][c];
            dg[i][c] = ok ? dg[i][c] - e_l * u[i][c] : 0.f;
            s2[i][e][0] += dg[i][c];
            s2[i][e][1] += dg[i][c] * xh[i][c];
            if constexpr (KEY)
                s2[i][e][2] +=
                    dg[i][c] * (ok ? rl[i][e] * (y[i][c] - ym - xh[i][c] * yx) : 0.f);
            else
                s2[i][e][2] += dg[i][c] * gg[i][c];
            s2[i][e][3] += u[i][c] * gg[i][c];
        }
    });
}

// dy, dxh (inner_grad_bwd_row); round 3's row sums of dxh, dxh xh. FUSE: dy w (for dk),
// dv = -dy w, and the dw, db partials.
template <typename T, int NR, int LD, bool FUSE>
__device__ __forceinline__ void bwd_tc_dxh(
    float (&dxh)[NR][4], float (&s3)[NR][2][2], float (&dyw)[NR][4], float (&dwa)[2],
    float (&dba)[2], const float (&s1)[NR][2][2], const float (&s2)[NR][2][4],
    const float (&dg)[NR][4], const float (&xh)[NR][4], const float (&y)[NR][4],
    const float (&r)[NR][2], const float (&vv)[NR][4], const bool (&col_ok)[2],
    const float (&lw)[2], const float (&lb)[2], const float* skt, T* __restrict__ dv,
    long long o_rows, int rs, int L, float inv_d, int tq, int n0) {
    for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
        const float a1 = s2[i][e][0] * inv_d, a2 = s2[i][e][1] * inv_d;
        const float a3 = s1[i][e][1] * inv_d;
        s3[i][e][0] = s3[i][e][1] = 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = e + 2 * h;
            const bool ok = col_ok[h] && t < L;
            const float dy = ok ? r[i][e] * (dg[i][c] - a1 - xh[i][c] * a2) : 0.f;
            if constexpr (FUSE) {
                const int n = n0 + 8 * h;
                dyw[i][c] = dy * lw[h];
                if (ok) dv[o_rows + t * rs + n] = from_f32<T>(-dyw[i][c]);
                dwa[h] += dy * (2.f * xh[i][c] * lw[h] + lb[h] - vv[i][c] +
                                skt[t * LD + n]);
                dba[h] += dyw[i][c];
            }
            dxh[i][c] = ok ? -r[i][e] * (dg[i][c] * a3 + y[i][c] * a2) +
                                 dy * (lw[h] * lw[h])
                           : 0.f;
            s3[i][e][0] += dxh[i][c];
            s3[i][e][1] += dxh[i][c] * xh[i][c];
        }
    });
}

// dkh (into u; FUSE: s_dkh too); the full dg out (unfused); us += the rows' u g (deta's
// last-row term).
template <int NR, int LD, bool FUSE, bool KEY>
__device__ __forceinline__ void bwd_tc_dkh(
    float (&u)[NR][4], float& us, const float (&s2)[NR][2][4], const float (&s3)[NR][2][2],
    const float (&dxh)[NR][4], const float (&xh)[NR][4], const float (&r)[NR][2],
    const float (&rl)[NR][2], const float (&dg)[NR][4], const bool (&col_ok)[2], float inv_d,
    int L, float* s_dkh, float* __restrict__ dgbuf, long long o_rows, int rs, int tq, int n0) {
    for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
        const float c1 = s3[i][e][0] * inv_d, c2 = s3[i][e][1] * inv_d;
        const float dr = s2[i][e][2] * r[i][e] * inv_d;  // dr r^2 / D
        if (t < L) us += s2[i][e][3];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = e + 2 * h;
            const bool ok = col_ok[h] && t < L;
            u[i][c] = ok ? (KEY ? rl[i][e] : r[i][e]) * (dxh[i][c] - c1 - xh[i][c] * c2) -
                               dr * xh[i][c]
                         : 0.f;
            if constexpr (FUSE)
                s_dkh[t * LD + n0 + 8 * h] = u[i][c];
            else if (ok)
                dgbuf[o_rows + t * rs + n0 + 8 * h] = dg[i][c];
        }
    });
}

// The fused chain's dk: W before the chunk (W + eta_l k^T g, unless from its slot), then
// dk - dy w = (-scale e S) q + dkh W^T - eta_l g dW^T in one tile pass.
template <typename T, int D_PAD, int BT>
__device__ __forceinline__ void bwd_tc_fused_dk(
    float* s_W, float* s_out, const float* s_S, const float* s_g, const float* s_dkh,
    const float* s_dWs, const float* sqt, const float* skt, const float (&dyw)[BT / 8][4],
    const bool (&col_ok)[2], float e_l, int in_group, T* __restrict__ dk, long long o_rows,
    int rs, int L, int D) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NW = Tr::kTcWarps, LD = Tr::kLd, LA = Tr::kLdA, NR = BT / 8;
    if (in_group != 0)
        state_update_mma<D_PAD, BT, NW>(s_W, e_l, skt, s_g, nullptr, nullptr, D);
    __syncthreads();
    mma_tiles<BT, D_PAD, NW>(
        [&](float (&acc)[4], int m0, int n1) {
            float acc2[4] = {0.f, 0.f, 0.f, 0.f};
            mma_tile_acc(acc, s_S, LA, 1, sqt, LD, 1, m0, n1, m0, BT);
            mma_tile_acc(acc, s_dkh, LD, 1, s_W, 1, LD, m0, n1, 0, D_PAD);
            mma_tile_acc(acc2, s_g, LD, 1, s_dWs, 1, LD, m0, n1, 0, D_PAD);
#pragma unroll
            for (int q4 = 0; q4 < 4; ++q4) acc[q4] -= e_l * acc2[q4];
        },
        [&](float (&acc)[4], int m0, int n1) { store_acc_tile<LD>(s_out, acc, m0, n1); });
    __syncthreads();
    for_each_frag_entry<NR>([&](int i, int c, int t, int n) {
        if (t < L && col_ok[c >> 1])
            dk[o_rows + t * rs + n] = from_f32<T>(s_out[t * LD + n] + dyw[i][c]);
    });
}

// The fused chain's dw, db partials of a group: sums over a column's lanes, at i_p.
__device__ __forceinline__ void bwd_tc_group_partials(
    float (&dwa)[2], float (&dba)[2], float* __restrict__ dwp, float* __restrict__ dbp,
    long long i_p, const bool (&col_ok)[2], int tq, int n0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int m = 1; m <= 2; m <<= 1) {
            dwa[h] += __shfl_xor_sync(0xffffffffu, dwa[h], m);
            dba[h] += __shfl_xor_sync(0xffffffffu, dba[h], m);
        }
        if (tq == 0 && col_ok[h]) {
            dwp[i_p + n0 + 8 * h] = dwa[h];
            dbp[i_p + n0 + 8 * h] = dba[h];
        }
        dwa[h] = dba[h] = 0.f;
    }
}

// The instances' first parameters: the kernel's shared memory and BwdParams' fields
// (restrict: no aliasing, the read-only path), and the kernel's arguments for them.
#define TTT_BWD_CHAIN_PARAMS                                                                      \
    float* smem, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,       \
    const float* __restrict__ eta, const float* __restrict__ lnw, const float* __restrict__ lnb,  \
    const float* __restrict__ xbuf, const float* __restrict__ rbuf,                               \
    const float* __restrict__ dopbuf, float* __restrict__ dgbuf, float* __restrict__ deta,        \
    const float* __restrict__ dht, const float* __restrict__ dhbt, float* __restrict__ dck,       \
    float* __restrict__ dckb, float* __restrict__ dh0, float* __restrict__ dhb0,                  \
    const float* __restrict__ rlbuf, float* __restrict__ dkey,                                    \
    const long long* __restrict__ cu_seqlens, const long long* __restrict__ grp_offsets,          \
    float scale, long long T_len, int H, int D, int G, long long g_lo, long long g_hi
#define TTT_BWD_CHAIN_ARGS(p)                                                                     \
    smem, p.q, p.k, p.v, p.eta, p.lnw, p.lnb, p.xbuf, p.rbuf, p.dopbuf, p.dgbuf, p.deta, p.dht,   \
    p.dhbt, p.dck, p.dckb, p.dh0, p.dhb0, p.rlbuf, p.dkey, p.cu_seqlens, p.grp_offsets, p.scale,  \
    p.T_len, p.H, p.D, p.G, p.g_lo, p.g_hi

template <typename T, int D_PAD, int BT, bool FUSE = false, bool KEY = false>
__device__ __forceinline__ void bwd_chain_tc(
    TTT_BWD_CHAIN_PARAMS, const float* __restrict__ ck, T* __restrict__ dk, T* __restrict__ dv,
    float* __restrict__ dwp, float* __restrict__ dbp, int* sync) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NW = Tr::kTcWarps, NT = Tr::kTcThreads, LD = Tr::kLd, NR = BT / 8;
    float* s_q = smem;                    // [2][BT, LD]  q, double-buffered
    float* s_k = s_q + 2 * Tr::kTile;     // [2][BT, LD]  k
    float* s_red = s_k + 2 * Tr::kTile;   // [3][NW][BT][4] row sums, one region per round
    // kStage: the rows of the next step's chunk, staged by cp.async
    constexpr bool kStage = Tr::kBwdChainStage;
    using RowsF = StagedRows<float, D_PAD, BT, NT>;
    using RowsT = StagedRows<T, D_PAD, BT, NT>;
    float* s_xh = s_red + 12 * NW * BT;   // [BT, D_PAD + 4] xh
    float* s_dop = s_xh + Tr::kStageTile; // [BT, D_PAD + 4] do_pre
    float* s_dg = s_dop + Tr::kStageTile; // [BT, D_PAD + 4] dg_loc
    T* s_v = reinterpret_cast<T*>(s_dg + Tr::kStageTile);       // [BT, RowsT::kLd] v
    T* s_pq = reinterpret_cast<T*>(s_dg + 2 * Tr::kStageTile);  // [BT, RowsT::kLd] q
    T* s_pk = reinterpret_cast<T*>(s_dg + 3 * Tr::kStageTile);  // [BT, RowsT::kLd] k
    float* s_r = s_dg + 4 * Tr::kStageTile;                      // [BT] r
    // FUSE only, past the unfused instance's shared memory
    float* s_g = s_xh + (kStage ? Tr::kBwdChainStageFloats : 0);  // [BT, LD]  g
    float* s_dkh = s_g + Tr::kTile;       // [BT, LD]      dkh
    float* s_out = s_dkh + Tr::kTile;     // [BT, LD]      do_pre, then dk - dy w
    float* s_dWs = s_out + Tr::kTile;     // [D_PAD, LD]   dW (after the chunk)
    float* s_W = s_dWs + Tr::kState;      // [D_PAD, LD]   W (the state before the chunk)
    float* s_S = s_W + Tr::kState;        // [BT, LA]      -scale e_j g_i . do_pre_j (j >= i)
    float* s_e = s_S + Tr::kSquare;       // [BT]          per-row eta
    float dwa[2] = {0.f, 0.f}, dba[2] = {0.f, 0.f};  // FUSE: this lane's dw, db (this group)

    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, tq = lane & 3;
    const int n0 = 16 * wid + (lane >> 2);              // this lane's columns n0, n0 + 8
    const long long i_nh = blockIdx.x;
    const long long i_n = i_nh / H;
    const int i_h = (int)(i_nh % H);
    const Seq sq = seq_coords(i_n, T_len, BT, G, cu_seqlens, grp_offsets);
    const long long DD = (long long)D * D;
    const long long row_stride = (long long)H * D;
    const long long p_base = (sq.bos * H + i_h) * D, p_ebase = sq.bos * H + i_h;
    const float inv_d = 1.f / (float)D;
    const int rs = H * D;                                // row stride (32-bit in a chunk)
    constexpr bool kExact = is_half_type<T>::value;  // q's, k's tiles hold tf32 values
    constexpr int kLpr = (D_PAD * 4 + 126) / 128 + 1;  // line slots of an fp32 row (prefetch_spans)
    const bool vec = vec_rows_ok(q, row_stride, D) && vec_rows_ok(k, row_stride, D);
    const bool vec_v = vec_rows_ok(v, row_stride, D);
    const bool vec_f = vec_rows_ok(xbuf, row_stride, D) && vec_rows_ok(dopbuf, row_stride, D) &&
                       vec_rows_ok(dgbuf, row_stride, D);
    // kStage: rows r0 .. r0 + Lr - 1 of xh, do_pre, dg_loc, v, r into the stage
    auto stage_rows = [&](long long r0, int Lr) {
        const long long o = p_base + r0 * row_stride;
        RowsF::copy(s_xh, xbuf + o, rs, Lr, D, vec_f);
        RowsF::copy(s_dop, dopbuf + o, rs, Lr, D, vec_f);
        RowsF::copy(s_dg, dgbuf + o, rs, Lr, D, vec_f);
        RowsT::copy(s_v, v + o, rs, Lr, D, vec_v);
        stage_scalars<BT, NT>(s_r, rbuf + p_ebase + r0 * H, H, Lr);
    };

    // chunks [c_lo, c_hi) in reverse, from dht, dhbt (stored as the final slot's cotangent)
    // or the slot the next segment stored
    const ChunkRange cr = chunk_range(sq, G, g_lo, g_hi);
    if (cr.skip) return;
    overlap_chain_started(sync);
    const long long c_lo = cr.lo, c_hi = cr.hi;
    const long long i_end = (sq.slot_base + (c_hi + G - 1) / G) * H + i_h;

    float dW[D_PAD / 8][4], dhb[2], lw[2], lb[2];
    bool col_ok[2];
    if (c_hi < sq.nc) {
        load_state_frag<D_PAD>(dW, dhb, dck + i_end * DD, dckb + i_end * D, D);
    } else {
        load_state_frag<D_PAD>(dW, dhb, dht != nullptr ? dht + i_nh * DD : nullptr,
                               dhbt != nullptr ? dhbt + i_nh * D : nullptr, D);
        store_state_frag<D_PAD>(dck + i_end * DD, dckb + i_end * D, dW, dhb, D);
    }
    state_cols_ln(col_ok, lw, lb, lnw, lnb, i_h, D);
    if constexpr (FUSE)  // W after the launch's last chunk: the slot at its end
        load_state_rows<D_PAD, D_PAD, NT>(s_W, ck + i_end * DD, D, D);
    if (c_hi > c_lo) {
        const long long row0 = (c_hi - 1) * BT;
        const int L = (int)min((long long)BT, sq.len - row0);
        load_tile<D_PAD, BT, NT>(s_q, q, p_base, row0, L, row_stride, D, 1.f);
        load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
        if constexpr (kStage) {
            stage_rows(row0, L);
            cp_async_wait_all();
        }
    }
    __syncthreads();

    int in_group = c_hi > c_lo ? (int)((c_hi - 1) % G) : 0;  // i_c % G, counted down
    for (long long i_c = c_hi - 1; i_c >= c_lo; --i_c) {
        const int buf = (int)((c_hi - 1 - i_c) & 1);
        const float* sqt = s_q + buf * Tr::kTile;
        const float* skt = s_k + buf * Tr::kTile;
        const long long row0 = i_c * BT;
        const int L = (int)min((long long)BT, sq.len - row0);
        const long long o_last = p_ebase + (row0 + L - 1) * H;
        const float e_l = eta[o_last];
        const float deta_l = threadIdx.x == 0 ? deta[o_last] : 0.f;  // used last

        // the previous (full) chunk's q, k: staged or into registers, stored into the other
        // tile half at the step's end
        const long long row0p = row0 - BT;
        const long long o_prev = p_base + row0p * row_stride;
        StagedTile<T, D_PAD, BT, NT> pq, pk;  // (without kStage)
        if constexpr (kStage) {  // (the copies stay in flight until the step's end)
            if (i_c > c_lo) {
                RowsT::copy(s_pq, q + o_prev, rs, BT, D, vec);
                RowsT::copy(s_pk, k + o_prev, rs, BT, D, vec);
                const RowSpan spans[2] = {row_span(eta + p_ebase, row0p + BT - 1, 1, H, 1),
                                          row_span(deta + p_ebase, row0p + BT - 1, 1, H, 1)};
                prefetch_spans<NT, kLpr>(spans);
            }
        } else {
            pq.load(q + o_prev, rs, i_c > c_lo ? BT : 0, D, vec);
            pk.load(k + o_prev, rs, i_c > c_lo ? BT : 0, D, vec);
            if (i_c > c_lo) {  // and its other rows into L1
                const RowSpan spans[7] = {
                    row_span(v + p_base, row0p, BT, row_stride, D),
                    row_span(xbuf + p_base, row0p, BT, row_stride, D),
                    row_span(dopbuf + p_base, row0p, BT, row_stride, D),
                    row_span(dgbuf + p_base, row0p, BT, row_stride, D),
                    row_span(rbuf + p_ebase, row0p, BT, H, 1),
                    row_span(eta + p_ebase, row0p + BT - 1, 1, H, 1),
                    row_span(deta + p_ebase, row0p + BT - 1, 1, H, 1)};
                prefetch_spans<NT, kLpr>(spans);
            }
        }

        // this chunk's rows, each lane its entries
        float xh[NR][4], vv[NR][4], dop[NR][4], dg[NR][4], r[NR][2], rl[NR][2];
        const long long o_rows = p_base + row0 * row_stride;
        bwd_tc_rows<T, D_PAD, BT, KEY>(xh, vv, dop, dg, r, rl, s_xh, s_v, s_dop, s_dg, s_r, xbuf,
                                       v, dopbuf, dgbuf, rbuf, rlbuf, o_rows, p_ebase, row0, rs,
                                       L, H, D, tq);
        if constexpr (FUSE)  // (the step before ended with a barrier: these tiles are free)
            bwd_tc_fused_tiles<D_PAD, BT>(
                s_dWs, s_out, s_e, s_W, dW, dop, eta, p_ebase, row0, L, H,
                in_group == 0 ? ck + ((sq.slot_base + i_c / G) * H + i_h) * DD : nullptr, D);

        // u = k dW + dhb; y = (xh w + b - v + k) w; round 1: sums of y, y xh
        float u[NR][4], y[NR][4], s1[NR][2][2];
        tile_times_state_frag<D_PAD, BT, kExact>(u, dW, skt);
        bwd_tc_y<NR, LD>(u, y, s1, xh, vv, col_ok, dhb, lw, lb, skt, tq, n0);
        frag_row_sums<NW, BT, 2>(s1, s_red);
        // past its barrier every thread has read the stage: the previous chunk's rows go in
        if (kStage && i_c > c_lo) stage_rows(row0p, BT);

        // g; dg = dg_loc - eta_l u; round 2: sums of dg, dg xh, dg g (KEY: deta_key), u g
        float gg[NR][4], s2[NR][2][4];
        bwd_tc_dg<NR, LD, FUSE, KEY>(gg, dg, s2, s1, u, y, xh, r, rl, col_ok, e_l, inv_d, L, s_g,
                                     tq, n0);
        frag_row_sums<NW, BT, 4>(s2, s_red + 4 * NW * BT);
        if constexpr (KEY) {  // deta_key = sum(dg g / l), once a row (warp 0, g = 0)
            if (dkey != nullptr && wid == 0 && (lane >> 2) == 0) {  // (null: not needed)
                for_each_frag_row<NR>(tq, [&](int i, int e, int t) {
                    if (t < L) dkey[p_ebase + (row0 + t) * H] = s2[i][e][2];
                });
            }
        }
        if constexpr (FUSE)  // (g, do_pre, eta are in: round 2's barrier)
            tri_dots_mma<D_PAD, BT, NW, false>(s_S, s_g, s_out, L, 0.f, s_e, -scale);

        // dy, dxh; round 3: sums of dxh, dxh xh. FUSE: dy w, dv, the dw, db partials
        float dxh[NR][4], s3[NR][2][2], dyw[NR][4];
        bwd_tc_dxh<T, NR, LD, FUSE>(dxh, s3, dyw, dwa, dba, s1, s2, dg, xh, y, r, vv, col_ok, lw,
                                    lb, skt, dv, o_rows, rs, L, inv_d, tq, n0);
        frag_row_sums<NW, BT, 2>(s3, s_red + 8 * NW * BT);

        // dkh (into u); the full dg out; deta's last-row term
        float us = 0.f;
        bwd_tc_dkh<NR, LD, FUSE, KEY>(u, us, s2, s3, dxh, xh, r, rl, dg, col_ok, inv_d, L, s_dkh,
                                      dgbuf, o_rows, rs, tq, n0);

        if constexpr (FUSE) {
            bwd_tc_fused_dk<T, D_PAD, BT>(s_W, s_out, s_S, s_g, s_dkh, s_dWs, sqt, skt, dyw, col_ok,
                                          e_l, in_group, dk, o_rows, rs, L, D);
        }

        // dW += q^T do_pre + k^T dkh; dhb += sum_i (do_pre_i + dkh_i)
        state_update_frag<D_PAD, BT, kExact>(dW, dop, scale, sqt);  // (q scale)^T do_pre
        state_update_frag<D_PAD, BT, kExact>(dW, u, 1.f, skt);
        us += __shfl_xor_sync(0xffffffffu, us, 1);
        us += __shfl_xor_sync(0xffffffffu, us, 2);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float hs = 0.f;
#pragma unroll
            for (int i = 0; i < NR; ++i)
                hs += dop[i][2 * h] + dop[i][2 * h + 1] + u[i][2 * h] + u[i][2 * h + 1];
            hs += __shfl_xor_sync(0xffffffffu, hs, 1);
            hs += __shfl_xor_sync(0xffffffffu, hs, 2);
            dhb[h] += hs;
        }
        if (threadIdx.x == 0) deta[o_last] = deta_l - us;

        if constexpr (kStage) {
            cp_async_wait_all();  // then q, k from the pieces this thread staged
            if (i_c > c_lo) {
                RowsT::to_tile(s_q + (buf ^ 1) * Tr::kTile, s_pq, 1.f);
                RowsT::to_tile(s_k + (buf ^ 1) * Tr::kTile, s_pk, 1.f);
            }
        } else {
            pq.store(s_q + (buf ^ 1) * Tr::kTile, 1.f);
            pk.store(s_k + (buf ^ 1) * Tr::kTile, 1.f);
        }
        __syncthreads();
        if (in_group == 0) {
            // a group done (its full dg stored, the cotangent after it a group earlier)
            overlap_chain_progress(sync, i_nh, (int)((sq.nc + G - 1) / G - i_c / G));
            const long long i_ck = (sq.slot_base + i_c / G) * H + i_h;
            store_state_frag<D_PAD>(dck + i_ck * DD, dckb + i_ck * D, dW, dhb, D);
            if constexpr (FUSE) {  // the group's dw, db partials at bwd_grads' index, so
                // that the sums do not depend on how the launcher splits the chain
                const long long i_p = ((sq.slot_base - i_n + i_c / G) * H + i_h) * D;
                bwd_tc_group_partials(dwa, dba, dwp, dbp, i_p, col_ok, tq, n0);
            }
            in_group = G;
        }
        --in_group;
    }

    if (dh0 != nullptr && c_lo == 0)
        store_state_frag<D_PAD>(dh0 + i_nh * DD, dhb0 + i_nh * D, dW, dhb, D);
}

template <typename T, int D_PAD, int BT, bool KEY>
__device__ __forceinline__ void bwd_chain_simt(TTT_BWD_CHAIN_PARAMS, int* sync) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane, LD = Tr::kLd;
    float* s_dW = smem;                // [D_PAD, LD]  cotangent of the state after the chunk
    float* s_dhb = s_dW + Tr::kState;  // [D_PAD]
    float* s_q = s_dhb + D_PAD;        // [BT, LD]     q * scale
    float* s_k = s_q + Tr::kTile;      // [BT, LD]     k
    float* s_dop = s_k + Tr::kTile;    // [BT, LD]     do_pre
    float* s_dkh = s_dop + Tr::kTile;  // [BT, LD]     dkh
    float* s_s = s_dkh + Tr::kTile;    // [BT]         <u_i, g_i>

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const long long i_nh = blockIdx.x;
    const long long i_n = i_nh / H;
    const int i_h = (int)(i_nh % H);
    const Seq sq = seq_coords(i_n, T_len, BT, G, cu_seqlens, grp_offsets);
    const long long DD = (long long)D * D;

    const ChunkRange cr = chunk_range(sq, G, g_lo, g_hi);  // (in reverse, as above)
    if (cr.skip) return;
    overlap_chain_started(sync);
    const long long c_lo = cr.lo, c_hi = cr.hi;
    const long long i_end = (sq.slot_base + (c_hi + G - 1) / G) * H + i_h;

    float b_w[P], b_b[P];                                            // [D] per lane
    load_ln_rows<D_PAD>(b_w, b_b, lnw, lnb, i_h, D);
    if (c_hi < sq.nc) {
        load_state<D_PAD, NT>(s_dW, s_dhb, dck + i_end * DD, dckb + i_end * D, D);
        __syncthreads();
    } else {
        load_state<D_PAD, NT>(s_dW, s_dhb, dht != nullptr ? dht + i_nh * DD : nullptr,
                              dhbt != nullptr ? dhbt + i_nh * D : nullptr, D);
        __syncthreads();
        store_state<D_PAD, NT>(dck + i_end * DD, dckb + i_end * D, s_dW, s_dhb, D);
    }

    const long long row_stride = (long long)H * D;
    const long long p_base = (sq.bos * H + i_h) * D, p_ebase = sq.bos * H + i_h;
    for (long long i_c = c_hi - 1; i_c >= c_lo; --i_c) {
        const long long row0 = i_c * BT;
        const int L = (int)min((long long)BT, sq.len - row0);
        load_tile<D_PAD, BT, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
        load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
        load_tile<D_PAD, BT, NT>(s_dop, dopbuf, p_base, row0, L, row_stride, D, 1.f);
        const float e_l = eta[p_ebase + (row0 + L - 1) * H];
        const float deta_l = tid == 0 ? deta[p_ebase + (row0 + L - 1) * H] : 0.f;  // used last
        if (i_c > c_lo) {  // the previous chunk's rows into L1 while this one computes
            const long long row0p = row0 - BT;  // a full chunk
            prefetch_rows<NT>(q + p_base, row0p, BT, row_stride, D);
            prefetch_rows<NT>(k + p_base, row0p, BT, row_stride, D);
            prefetch_rows<NT>(v + p_base, row0p, BT, row_stride, D);
            prefetch_rows<NT>(xbuf + p_base, row0p, BT, row_stride, D);
            prefetch_rows<NT>(dopbuf + p_base, row0p, BT, row_stride, D);
            prefetch_rows<NT>(dgbuf + p_base, row0p, BT, row_stride, D);
            prefetch_rows<NT>(rbuf + p_ebase, row0p, BT, H, 1);
            prefetch_rows<NT>(eta + p_ebase, row0p + BT - 1, 1, H, 1);
            prefetch_rows<NT>(deta + p_ebase, row0p + BT - 1, 1, H, 1);
        }
        __syncthreads();

        // row pass: u = k dW + dhb; g from xhat; dg = dg_loc - eta_l u -> dgbuf; dkh -> s_dkh
        for (int i = warp; i < BT; i += NW) {
            if (i >= L) {
                zero_row<D_PAD>(s_dkh + i * LD);
                continue;
            }
            const long long o_r = p_base + (row0 + i) * row_stride;
            float b_u[P], b_xh[P], b_k[P], b_v[P], b_g[P], b_y[P], b_dg[P], b_dkh[P], b_dy[P];
            row_times_state<D_PAD>(b_u, s_k + i * LD, s_dW);
#pragma unroll
            for (int e = 0; e < P; ++e) {
                const int d = lane + 32 * e;
                b_u[e] = d < D ? b_u[e] + s_dhb[d] : 0.f;
            }
            const float r = rbuf[p_ebase + (row0 + i) * H];
            load_row<D_PAD>(b_xh, xbuf + o_r, D, 1.f);
            load_row<D_PAD>(b_k, s_k + i * LD, D, 1.f);
            load_row<D_PAD>(b_v, v + o_r, D, 1.f);
            inner_grad_row(b_g, b_y, b_xh, r, b_k, b_v, b_w, b_b, D);
            load_row<D_PAD>(b_dg, dgbuf + o_r, D, 1.f);
#pragma unroll
            for (int e = 0; e < P; ++e) b_dg[e] -= e_l * b_u[e];
            const float s = row_dot(b_u, b_g);
            if constexpr (KEY) {  // g / l from the LayerNorm's r; its dot with dg: deta_key
                const float rl = rlbuf[p_ebase + (row0 + i) * H];
                float b_gl[P];
                inner_grad_row(b_gl, b_y, b_xh, rl, b_k, b_v, b_w, b_b, D);
                const float dl =
                    inner_grad_bwd_row(b_dkh, b_dy, b_dg, b_xh, r, b_y, b_gl, b_w, D, rl);
                if (dkey != nullptr && lane == 0) dkey[p_ebase + (row0 + i) * H] = dl;
            } else {
                inner_grad_bwd_row(b_dkh, b_dy, b_dg, b_xh, r, b_y, b_g, b_w, D, r);
            }
            store_row<D_PAD>(dgbuf + o_r, b_dg, D);
            put_row<D_PAD>(s_dkh + i * LD, b_dkh);
            if (lane == 0) s_s[i] = s;
        }
        __syncthreads();

        // dW += q^T do_pre + k^T dkh; dhb += sum_i do_pre_i + sum_i dkh_i; deta's last row
        state_rows_add2<D_PAD, BT, NT>(s_dW, s_q, s_dop, s_k, s_dkh, D, D);
        for (int d = tid; d < D; d += NT) {
            float acc = 0.f;
            for (int i = 0; i < L; ++i) acc += s_dop[i * LD + d] + s_dkh[i * LD + d];
            s_dhb[d] += acc;
        }
        if (tid == 0) {
            float s = 0.f;
            for (int i = 0; i < L; ++i) s += s_s[i];
            deta[p_ebase + (row0 + L - 1) * H] = deta_l - s;
        }
        __syncthreads();
        if (i_c % G == 0) {
            overlap_chain_progress(sync, i_nh, (int)((sq.nc + G - 1) / G - i_c / G));
            const long long i_ck = (sq.slot_base + i_c / G) * H + i_h;
            store_state<D_PAD, NT>(dck + i_ck * DD, dckb + i_ck * D, s_dW, s_dhb, D);
        }
    }

    if (dh0 != nullptr && c_lo == 0)
        store_state<D_PAD, NT>(dh0 + i_nh * DD, dhb0 + i_nh * D, s_dW, s_dhb, D);
}

}  // namespace ttt

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value,
          bool KEY = false>
__global__ void __launch_bounds__(MMA ? ttt::Traits<D_PAD, BT>::kTcThreads
                                      : ttt::Traits<D_PAD, BT>::kThreads)
ttt_linear_bwd_chain(const ttt::BwdParams<T> p) {
    using Tr = ttt::Traits<D_PAD, BT>;
    extern __shared__ float smem[];
    ttt::check_launch<T, D_PAD, MMA>(p, MMA ? Tr::kBwdChainTcBytes : Tr::kBwdChainBytes,
                                     MMA ? Tr::kTcThreads : Tr::kThreads);
    if constexpr (MMA)
        ttt::bwd_chain_tc<T, D_PAD, BT, false, KEY>(TTT_BWD_CHAIN_ARGS(p), nullptr, nullptr,
                                                    nullptr, nullptr, nullptr, p.sync);
    else
        ttt::bwd_chain_simt<T, D_PAD, BT, KEY>(TTT_BWD_CHAIN_ARGS(p), p.sync);
}

// The fused backward chain (many chains, half inputs, D_PAD <= 64): the MMA instance with
// bwd_grads.cu's work per chunk. With W the state before the chunk (its slot at a group start,
// else W + eta_l k^T g, in shared memory) and dW the cotangent after it:
//
//   dk = dy w + dkh W^T - eta_l g dW^T + C_q (q scale),  (C_q)_ij = -[j >= i] e_j g_i . do_pre_j
//   dv = -dy w,   dw += sum_i dy (2 xh w + b - v + k),   db += sum_i dy w
//
// dw, db go to bwd_grads' per-group partials dwp, dbp [groups, H, D]. The full dg is not
// stored (nothing reads it); the slot cotangents are (a segment starts from them).
template <typename T, int D_PAD, int BT, bool MMA = true, bool KEY = false>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kTcThreads)
ttt_linear_bwd_chain_fused(const ttt::BwdParams<T> p) {
    static_assert(MMA && ttt::is_half_type<T>::value, "only the tensor-core instance fuses");
    static_assert(D_PAD <= 64, "D_PAD 128 would hold two [D_PAD, D_PAD] tiles per block");
    using Tr = ttt::Traits<D_PAD, BT>;
    extern __shared__ float smem[];
    ttt::check_launch<T, D_PAD, MMA>(p, Tr::kBwdChainFusedTcBytes, Tr::kTcThreads);
    ttt::bwd_chain_tc<T, D_PAD, BT, true, KEY>(TTT_BWD_CHAIN_ARGS(p), p.ck, p.dk, p.dv, p.dwp,
                                               p.dbp, nullptr);
}
