// Backward, parallel part 2: ttt_linear_bwd_grads<T, D_PAD, BT, MMA, KEY>. dk, dv and the
// inner-loss part of dw, db; one block per (group of G chunks, head), walking its group in
// reverse from the slots at its end (state from fwd_chain.cu, cotangent from bwd_chain.cu).
// With the full dg stored, dkh and dy are row-local; per chunk (ttt_common.cuh):
//
//   S_ij = g_i . do_pre_j   (j >= i)
//   dk_i = dy_i w - sum_{j >= i} e_j S_ij q_j + dkh_i W^T - eta_l g_i dW^T
//   dv   = -dy w,   dw += sum_i dy (2 xh w + b - v + k),   db += sum_i dy w
//
// and between chunks
//
//   W  <- W + eta_l k^T g          (undoing the chunk's update: the state before it)
//   dW <- dW + q^T do_pre + k^T dkh
//
// The group's first chunk takes its state from its slot (stepping back to a zero state is
// ill-conditioned). Traits::kGradsSplit blocks may share a (group, head), each with DA =
// D_PAD / SPLIT rows of W, dW and those columns of q, k, writing dk, dv, dw, db of its
// columns. MMA (half inputs): the state steps, S and the dk products on tensor cores.
#include "ttt_common.cuh"

// The row pass over a chunk: g (s_g), dkh (s_dkh), dy w (b_dyw), dv, this lane's dw / db
// partials. Row warp + NW (sub + RPP u) in pass u; rows >= L run on zeros (r = 0: g, dkh, dy 0).
template <typename T, int D_PAD, int BT, bool MMA, bool KEY,
          int LPR = MMA ? ttt::Traits<D_PAD, BT>::template kRowLanes<BT> : 32,
          int PL = (D_PAD + LPR - 1) / LPR,
          int NPASS = ttt::Traits<D_PAD, BT>::kRowsPerWarp / (32 / LPR)>
__device__ __forceinline__ void bwd_grads_rows(
    float (&b_dyw)[NPASS][PL], float (&b_dw)[PL], float (&b_db)[PL], float* s_g, float* s_dkh,
    const float* s_k, const float* __restrict__ xbuf, const T* __restrict__ k,
    const T* __restrict__ v, const float* dgbuf, const float* __restrict__ rbuf,
    const float* __restrict__ rlbuf, T* __restrict__ dv, const float (&b_w)[PL],
    const float (&b_b)[PL], long long p_base, long long p_ebase, long long row0,
    long long row_stride, int L, int H, int D, int a0, int d1) {
    using Tr = ttt::Traits<D_PAD, BT>;
    constexpr int NW = Tr::kWarps, LD = Tr::kLd, SPLIT = Tr::kGradsSplit, RPP = 32 / LPR;
    const int warp = threadIdx.x >> 5, sub = (threadIdx.x & 31) / LPR;
#pragma unroll
    for (int u = 0; u < NPASS; ++u) {
        const int i = warp + NW * (sub + RPP * u);
        const bool ok = i < L;
        const int n = ok ? D : 0;
        const long long o_r = p_base + (row0 + (ok ? i : 0)) * row_stride;
        float b_xh[PL], b_k[PL], b_v[PL], b_g[PL], b_y[PL], b_dg[PL], b_dkh[PL], b_dy[PL];
        const float r = ok ? rbuf[p_ebase + (row0 + i) * H] : 0.f;
        ttt::load_row<D_PAD, LPR>(b_xh, xbuf + o_r, n, 1.f);
        if constexpr (SPLIT == 1)
            ttt::load_row<D_PAD, LPR>(b_k, s_k + i * LD, n, 1.f);
        else  // s_k holds the block's columns only
            ttt::load_row<D_PAD, LPR>(b_k, k + o_r, n, 1.f);
        ttt::load_row<D_PAD, LPR>(b_v, v + o_r, n, 1.f);
        ttt::load_row<D_PAD, LPR>(b_dg, dgbuf + o_r, n, 1.f);
        ttt::inner_grad_row<LPR>(b_g, b_y, b_xh, r, b_k, b_v, b_w, b_b, D);
        if constexpr (KEY) {  // (g / l from the LayerNorm's r: inner_grad_bwd_row)
            const float rl = ok ? rlbuf[p_ebase + (row0 + i) * H] : 0.f;
            float b_gl[PL];
            ttt::inner_grad_row<LPR>(b_gl, b_y, b_xh, rl, b_k, b_v, b_w, b_b, D);
            ttt::inner_grad_bwd_row<LPR>(b_dkh, b_dy, b_dg, b_xh, r, b_y, b_gl, b_w, D, rl);
        } else {
            ttt::inner_grad_bwd_row<LPR>(b_dkh, b_dy, b_dg, b_xh, r, b_y, b_g, b_w, D, r);
        }
        ttt::put_row<D_PAD, LPR>(s_g + i * LD, b_g);
        ttt::put_row<D_PAD, LPR>(s_dkh + i * LD, b_dkh);
#pragma unroll
        for (int e = 0; e < PL; ++e) {
            b_dyw[u][e] = b_dy[e] * b_w[e];
            b_dw[e] += b_dy[e] * (2.f * b_xh[e] * b_w[e] + b_b[e] - b_v[e] + b_k[e]);
            b_db[e] += b_dyw[u][e];
            b_dy[e] = -b_dyw[u][e];
        }
        if (ok) ttt::store_row_cols<D_PAD, LPR, SPLIT == 1>(dv + o_r, b_dy, a0, d1);
    }
}

template <typename T, int D_PAD, int BT, bool MMA, bool KEY>
__device__ __forceinline__ void bwd_grads_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ eta, const float* __restrict__ lnw, const float* __restrict__ lnb,
    const float* __restrict__ ck,
    // written by bwd_chain, running beside this kernel when overlapped: not __restrict__, so
    // that they are not read through the read-only path
    const float* dck, const float* __restrict__ xbuf, const float* __restrict__ rbuf,
    const float* __restrict__ dopbuf, const float* dgbuf, T* __restrict__ dk, T* __restrict__ dv,
    float* __restrict__ dwp, float* __restrict__ dbp, const float* __restrict__ rlbuf,
    const long long* __restrict__ cu_seqlens, const long long* __restrict__ grp_offsets,
    const int* __restrict__ grp_seq, float scale, long long T_len, int H, int D, int G,
    long long g_lo, long long g_hi, int* sync, int mode, long long n_chains, int wait_spins,
    unsigned long long smem_bytes) {
    static_assert(!MMA || ttt::is_half_type<T>::value, "float inputs keep the SIMT fp32 path");
    using Tr = ttt::Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane, RW = Tr::kRowsPerWarp;
    constexpr int LD = Tr::kLd, LA = Tr::kLdA;
    constexpr int SPLIT = Tr::kGradsSplit, DA = Tr::kGradsRows, LDH = Tr::kLdH;
    // the row passes: LPR lanes a row (SIMT: 32), RPP rows per warp pass, PL elements per lane
    constexpr int LPR = MMA ? Tr::template kRowLanes<BT> : 32, RPP = 32 / LPR;
    constexpr int PL = (D_PAD + LPR - 1) / LPR, NPASS = RW / RPP;
    static_assert(RW % RPP == 0, "bwd_grads: whole row passes");
    if (smem_bytes < Tr::kBwdGradsBytes || blockDim.x != NT || D > D_PAD || G < 1) __trap();

    extern __shared__ float smem[];
    float* s_W = smem;                 // [DA, LD]     state before the chunk (rows a0 ..)
    float* s_dW = s_W + DA * LD;       // [DA, LD]     cotangent of the state after the chunk
    float* s_q = s_dW + DA * LD;       // [BT, LDH]    q * scale (columns a0 ..)
    float* s_k = s_q + BT * LDH;       // [BT, LDH]    k (columns a0 ..)
    float* s_dop = s_k + BT * LDH;     // [BT, LD]     do_pre
    float* s_g = s_dop + Tr::kTile;    // [BT, LD]     g
    float* s_dkh = s_g + Tr::kTile;    // [BT, LD]     dkh
    float* s_S = s_dkh + Tr::kTile;    // [BT, LA]     S = g do_pre^T (upper triangle)
    float* s_e = s_S + Tr::kSquare;    // [BT]         eta (zero past the end)
    // the stage: the next chunk's do_pre and eta by cp.async
    constexpr bool STAGE = Tr::kGradsStage;
    float* s_stdop = smem + Tr::kGradsStageOffset;  // [BT, D_PAD + 4]
    float* s_ste = s_stdop + Tr::kStageTile;       // [BT]
    using StagedF = ttt::StagedRows<float, D_PAD, BT, NT>;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, sub = lane / LPR;
    int i_h, a0;
    ttt::Group gr;
    static __shared__ int s_ticket;
    if (!ttt::group_block<SPLIT, DA, true>(i_h, a0, gr, s_ticket, sync, mode, n_chains,
                                           wait_spins, T_len, H, BT, G, cu_seqlens,
                                           grp_offsets, grp_seq, g_lo, g_hi))
        return;
    const int rows = D - a0;                                // its valid rows (with a < DA)
    const int d1 = SPLIT == 1 ? D : min(D, a0 + DA);        // its columns: [a0, d1)
    const long long gid = gr.gid;
    const long long DD = (long long)D * D;

    float b_w[PL], b_b[PL];                                          // [D] per lane
    ttt::load_ln_rows<D_PAD, LPR>(b_w, b_b, lnw, lnb, i_h, D);
    float b_dw[PL] = {}, b_db[PL] = {};                              // this lane's partials
    const long long row_stride = (long long)H * D;
    const long long p_base = (gr.seq.bos * H + i_h) * D, p_ebase = gr.seq.bos * H + i_h;
    // a chunk's unstaged rows asked into L1 in one pass, a step early
    constexpr int kLpr = (D_PAD * 4 + 126) / 128 + 1;  // line slots of an fp32 row
    auto ask_rows = [&](long long r0, int Lr) {
        const ttt::RowSpan rows6[6] = {ttt::row_span(q + p_base, r0, Lr, row_stride, D),
                                       ttt::row_span(k + p_base, r0, Lr, row_stride, D),
                                       ttt::row_span(xbuf + p_base, r0, Lr, row_stride, D),
                                       ttt::row_span(v + p_base, r0, Lr, row_stride, D),
                                       ttt::row_span(dgbuf + p_base, r0, Lr, row_stride, D),
                                       ttt::row_span(rbuf + p_ebase, r0, Lr, H, 1)};
        if constexpr (STAGE) {
            ttt::prefetch_spans<NT, kLpr>(rows6);
        } else {
            const ttt::RowSpan spans[8] = {rows6[0], rows6[1], rows6[2], rows6[3], rows6[4],
                                           rows6[5],
                                           ttt::row_span(dopbuf + p_base, r0, Lr, row_stride, D),
                                           ttt::row_span(eta + p_ebase, r0, Lr, H, 1)};
            ttt::prefetch_spans<NT, kLpr>(spans);
        }
    };
    auto stage_tiles = [&](long long r0, int Lr) {  // chunk rows r0 .. r0 + Lr - 1
        const long long o = p_base + r0 * row_stride;
        StagedF::copy(s_stdop, dopbuf + o, (int)row_stride, Lr, D,  // H D < 2^31
                      ttt::vec_rows_ok(dopbuf + p_base, row_stride, D));
        ttt::stage_scalars<BT, NT>(s_ste, eta + p_ebase + r0 * H, H, Lr);
    };
    if (gr.nc > 0) {
        const long long row0 = (gr.c0 + gr.nc - 1) * BT;
        const int L = (int)min((long long)BT, gr.seq.len - row0);
        ask_rows(row0, L);
        if constexpr (STAGE) stage_tiles(row0, L);
    }
    const long long i_ck0 = gr.slot * H + i_h;   // the state before the group
    const long long i_ck1 = i_ck0 + H;           // the slot after the group
    const long long o_a0 = (long long)a0 * D;   // the block's first state row
    ttt::load_state_rows<D_PAD, DA, NT>(s_W, ck + i_ck1 * DD + o_a0, rows, D);
    ttt::load_state_rows<D_PAD, DA, NT>(s_dW, dck + i_ck1 * DD + o_a0, rows, D);

    for (int j = gr.nc - 1; j >= 0; --j) {
        const long long row0 = (gr.c0 + j) * BT;
        const int L = (int)min((long long)BT, gr.seq.len - row0);
        if (j > 0) ask_rows(row0 - BT, BT);  // the next chunk of the walk (a full one)
        ttt::load_tile<DA, BT, NT>(s_q, q, p_base + a0, row0, L, row_stride, D - a0, scale);
        ttt::load_tile<DA, BT, NT>(s_k, k, p_base + a0, row0, L, row_stride, D - a0, 1.f);
        if constexpr (STAGE) {
            // this chunk's staged pieces -> the tiles (each thread its own), then the next's
            ttt::cp_async_wait_all();
            StagedF::to_tile(s_dop, s_stdop, 1.f);
            for (int i = tid; i < BT; i += NT) s_e[i] = s_ste[i];
            if (j > 0) stage_tiles(row0 - BT, BT);
        } else {
            ttt::load_tile<D_PAD, BT, NT>(s_dop, dopbuf, p_base, row0, L, row_stride, D, 1.f);
            ttt::load_eta<BT, NT>(s_e, eta, p_ebase, row0, L, H);
        }
        __syncthreads();
        const float e_l = s_e[L - 1];

        // row pass: g (s_g), dkh (s_dkh), dy w (registers), dv, dw / db partials
        float b_dyw[NPASS][PL];                                      // [passes, D] per lane
        bwd_grads_rows<T, D_PAD, BT, MMA, KEY>(b_dyw, b_dw, b_db, s_g, s_dkh, s_k, xbuf, k, v,
                                               dgbuf, rbuf, rlbuf, dv, b_w, b_b, p_base, p_ebase,
                                               row0, row_stride, L, H, D, a0, d1);
        __syncthreads();

        if constexpr (MMA) {
            // the state before the chunk; -e_j S_ij = -e_j g_i . do_pre_j (j >= i) -> s_S
            if (j == 0) {
                ttt::load_state_rows<D_PAD, DA, NT>(s_W, ck + i_ck0 * DD + o_a0, rows, D);
            } else {
                ttt::state_rows_update_mma<D_PAD, BT, NW, DA, LDH>(s_W, e_l, s_k, s_g, nullptr,
                                                                   nullptr, rows, D);
            }
            ttt::tri_dots_mma<D_PAD, BT, NW, false>(s_S, s_g, s_dop, L, 0.f, s_e, -1.f);
            __syncthreads();

            // dk - dy w = -(e S) q + dkh W^T - eta_l g dW^T -> s_g (after every warp's
            // products: they read g)
            ttt::mma_tiles<BT, DA, NW, true>(  // [BT, DA]: dk's columns a0 ..
                [&](float (&acc)[4], int m0, int n0) {
                    float acc2[4] = {0.f, 0.f, 0.f, 0.f};
                    ttt::mma_tile_acc(acc, s_S, LA, 1, s_q, LDH, 1, m0, n0, m0, BT);
                    ttt::mma_tile_acc(acc, s_dkh, LD, 1, s_W, 1, LD, m0, n0, 0, D_PAD);
                    ttt::mma_tile_acc(acc2, s_g, LD, 1, s_dW, 1, LD, m0, n0, 0, D_PAD);
#pragma unroll
                    for (int r = 0; r < 4; ++r) acc[r] -= e_l * acc2[r];
                },
                [&](float (&acc)[4], int m0, int n0) {
                    ttt::store_acc_tile<LD>(s_g, acc, m0, n0);
                });
            __syncthreads();

            // row pass: dk = dy w + the products; dW <- dW + q^T do_pre + k^T dkh meanwhile
#pragma unroll
            for (int u = 0; u < NPASS; ++u) {
                const int i = warp + NW * (sub + RPP * u);
                if (i >= L) continue;
                float b_a[PL];
                if constexpr (SPLIT == 1)
                    ttt::load_row<D_PAD, LPR>(b_a, s_g + i * LD, D_PAD, 1.f);
                else
                    ttt::load_row_part<D_PAD, DA, LPR>(b_a, s_g + i * LD, a0);
#pragma unroll
                for (int e = 0; e < PL; ++e) b_a[e] += b_dyw[u][e];
                ttt::store_row_cols<D_PAD, LPR, SPLIT == 1>(
                    dk + p_base + (row0 + i) * row_stride, b_a, a0, d1);
            }
            ttt::state_rows_update_mma<D_PAD, BT, NW, DA, LDH>(s_dW, 1.f, s_q, s_dop, s_k,
                                                               s_dkh, rows, D);
            __syncthreads();
        } else {  // SIMT (LPR = 32: one warp a row, b_dyw[ii] is row warp + ii NW's)
            // the state before the chunk; S = g do_pre^T (j >= i)
            if (j == 0) {
                ttt::load_state_rows<D_PAD, DA, NT>(s_W, ck + i_ck0 * DD + o_a0, rows, D);
            } else {
                ttt::state_rows_axpy<D_PAD, BT, NT, DA, LDH>(s_W, e_l, s_k, s_g, rows, D);
            }
            ttt::tri_dots<D_PAD, BT, NT, false>(s_S, s_g, s_dop, L, 0.f);
            __syncthreads();

            // row pass: dk = dy w - sum_{j >= i} e_j S_ij q_j + dkh W^T - eta_l g dW^T
#pragma unroll
            for (int ii = 0; ii < RW; ++ii) {
                const int i = warp + ii * NW;
                if (i >= L) continue;
                float b_a[P], b_c[P];
                ttt::row_times_state_rows_t<D_PAD, DA>(b_a, s_dkh + i * LD, s_W, a0);
                ttt::row_times_state_rows_t<D_PAD, DA>(b_c, s_g + i * LD, s_dW, a0);
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e, dl = d - a0;  // dl: its column in s_q
                    float acc = 0.f;
                    if (d < D && (SPLIT == 1 || (dl >= 0 && dl < DA))) {
                        for (int jj = i; jj < L; ++jj)
                            acc += s_e[jj] * s_S[i * LA + jj] * s_q[jj * LDH + dl];
                    }
                    b_a[e] += b_dyw[ii][e] - acc - e_l * b_c[e];
                }
                ttt::store_row_cols<D_PAD, 32, SPLIT == 1>(
                    dk + p_base + (row0 + i) * row_stride, b_a, a0, d1);
            }
            __syncthreads();

            // dW <- dW + q^T do_pre + k^T dkh
            ttt::state_rows_add2<D_PAD, BT, NT, DA, LDH>(s_dW, s_q, s_dop, s_k, s_dkh, rows, D);
            __syncthreads();
        }
    }

    // dw, db of the block's columns (s_q, s_k reused as [NW, LD])
    static_assert(NW * LD <= BT * LDH, "the partials need [NW, LD] of s_q and s_k");
    ttt::store_partials<D_PAD, NW, NT, LPR>(s_q, s_k, b_dw, b_db, dwp, dbp, (gid * H + i_h) * D,
                                            a0, d1);
}

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value,
          bool KEY = false>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kThreads,
                                  ttt::Traits<D_PAD, BT>::kGradsBlocks)
ttt_linear_bwd_grads(const ttt::BwdParams<T> p) {
    bwd_grads_kernel<T, D_PAD, BT, MMA, KEY>(
        p.q, p.k, p.v, p.eta, p.lnw, p.lnb, p.ck, p.dck, p.xbuf, p.rbuf, p.dopbuf, p.dgbuf, p.dk,
        p.dv, p.dwp, p.dbp, p.rlbuf, p.cu_seqlens, p.grp_offsets, p.grp_seq, p.scale, p.T_len, p.H,
        p.D, p.G, p.g_lo, p.g_hi, p.sync, p.mode, p.n_chains, p.wait_spins, p.smem_bytes);
}
