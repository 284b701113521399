// Backward, parallel part 1: ttt_linear_bwd_local<T, D_PAD, BT, MMA, OUT>. Everything that needs
// the forward state but not its cotangent; one block per (group of G chunks, head), replayed
// from its slot as in fwd_out.cu (ttt_common.cuh):
//
//   y = (xh w + b - v + k) w,  g = r (y - mean(y) - xh mean(y xh))   (xh, r from fwd_chain.cu)
//   o_pre = q W + hb - e (A g)
//   do_pre = do + r_o (doh - mean(doh) - oh mean(doh oh)),  doh = do w,  oh = LN(o_pre)
//   dS = do_pre g^T,   dP = -tril(e dS),   dq = scale (do_pre W^T + dP k)
//   deta_i = -sum_j A_ij dS_ij                      (the last-row term comes in bwd_chain.cu)
//   dg_loc = -A^T (e do_pre)
//   dw += sum_i do oh,  db += sum_i do              (post norm-residual part)
//
// for OUT = kOutNorm; kOutQuery: do_pre without the leading do, and dq += do; kOutRaw: do_pre
// = do, no dw / db part. The dw / db partials go per block to [groups, H, D].
//
// MMA (half inputs): blocks of R = Traits::kOutRows rows, M, W0, hb0 as in fwd_out.cu:
//
//   o_pre = q W0 + hb0 - M g,    dS = do_pre g^T (every j <= t of the block)
//   dP'[t, j] = -(e_t dS_tj) in t's chunk, -(eta_l(chunk of j) dS_tj) for earlier chunks
//   dq = scale (do_pre W0^T + dP' k)  (the earlier chunks' state steps folded into dP')
//   deta_t = -sum_{j <= t in t's chunk} A_tj dS_tj,  dg_loc = -(e A)^T do_pre within chunks
//
// on tensor cores; the next block's q, k, do, eta (kLocalStage; kLocalStageSaved: xh, v, r)
// come by cp.async, other rows via L1 a block ahead.
#include "ttt_common.cuh"

namespace ttt {

// Both instances' parameters: the kernel's shared memory and BwdParams' fields (restrict:
// no aliasing, the read-only path), and the kernel's arguments for them.
#define TTT_BWD_LOCAL_PARAMS                                                                      \
    float* smem, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,       \
    const float* __restrict__ eta, const float* __restrict__ lnw, const float* __restrict__ lnb,  \
    const T* __restrict__ dout, const float* __restrict__ ck, const float* __restrict__ ckb,      \
    const float* __restrict__ xbuf, const float* __restrict__ rbuf, float* __restrict__ dopbuf,   \
    float* __restrict__ dgbuf, T* __restrict__ dq, float* __restrict__ deta,                      \
    float* __restrict__ dwp, float* __restrict__ dbp, const long long* __restrict__ cu_seqlens,   \
    const long long* __restrict__ grp_offsets, const int* __restrict__ grp_seq, float scale,      \
    float eps, long long T_len, int H, int D, int G, long long g_lo, long long g_hi
#define TTT_BWD_LOCAL_ARGS(p)                                                                     \
    smem, p.q, p.k, p.v, p.eta, p.lnw, p.lnb, p.dout, p.ck, p.ckb, p.xbuf, p.rbuf, p.dopbuf,      \
    p.dgbuf, p.dq, p.deta, p.dwp_local, p.dbp_local, p.cu_seqlens, p.grp_offsets, p.grp_seq,      \
    p.scale, p.eps, p.T_len, p.H, p.D, p.G, p.g_lo, p.g_hi

template <typename T, int D_PAD, int BT, int OUT>
__device__ __forceinline__ void bwd_local_tc(TTT_BWD_LOCAL_PARAMS) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int R = Tr::kOutRows, NT = Tr::kThreads, NW = Tr::kWarps;
    constexpr int LD = Tr::kLd, LA = R + 1;
    static_assert(R % BT == 0 && R % 16 == 0, "a block of rows holds whole chunks");
    // the row passes: LPR lanes a row, RPP rows per warp pass, PL row elements per lane
    constexpr int LPR = Tr::template kRowLanes<R>, RPP = 32 / LPR;
    constexpr int PL = (D_PAD + LPR - 1) / LPR;
    static_assert(R % (NW * RPP) == 0, "bwd_local: whole row passes");
    float* s_W = smem;                 // [D_PAD, LD]  state before the block
    float* s_hb = s_W + Tr::kState;    // [D_PAD]
    float* s_q = s_hb + D_PAD;         // [R, LD]      q * scale -> q W0 - M g
    float* s_k = s_q + R * LD;         // [R, LD]      k
    float* s_do = s_k + R * LD;        // [R, LD]      do -> do_pre
    float* s_g = s_do + R * LD;        // [R, LD]      g -> eta_l g
    // the stage: the next block's q, k, do (raw T) and eta by cp.async
    constexpr bool STAGE = Tr::kLocalStage;
    float* s_stq = smem + Tr::kLocalStageOffset;  // [R, D_PAD + 4] floats each
    float* s_stk = s_stq + R * (D_PAD + 4);
    float* s_stdo = s_stk + R * (D_PAD + 4);
    float* s_ste = s_stdo + R * (D_PAD + 4);      // [R]
    // ... and (kLocalStageSaved) the g row pass's xh, v (raw T) and r
    constexpr bool STAGE_SAVED = Tr::kLocalStageSaved;
    float* s_stx = s_ste + R;                     // [R, D_PAD + 4] floats each
    float* s_stv = s_stx + R * (D_PAD + 4);
    float* s_str = s_stv + R * (D_PAD + 4);       // [R]
    using Staged = StagedRows<T, D_PAD, R, NT>;
    using StagedX = StagedRows<float, D_PAD, R, NT>;
    float* s_A = s_g + R * LD;         // [R, LA]      q k^T + 1 (j <= t) -> e A within chunks
    float* s_P = s_A + R * LA;         // [R, LA]      M -> dS -> dP'
    float* s_e = s_P + R * LA;         // [R]          eta (zero past the end)

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g4 = lane >> 2, t4 = lane & 3, sub = lane / LPR;
    const int i_h = (int)(blockIdx.x % H);
    const Group gr = group_coords(blockIdx.x / H, T_len, BT, G, cu_seqlens, grp_offsets,
                                  grp_seq, g_lo, g_hi);
    if (gr.nc <= 0) return;  // a segment past the end of this sequence
    const long long DD = (long long)D * D;
    const long long row_stride = (long long)H * D;
    const long long p_base = (gr.seq.bos * H + i_h) * D, p_ebase = gr.seq.bos * H + i_h;
    const long long g_row0 = gr.c0 * BT;                                  // the group's rows:
    const int rows = (int)min((long long)gr.nc * BT, gr.seq.len - g_row0);  // g_row0 + [0, rows)

    float b_w[PL], b_b[PL];                                          // [D] per lane
    load_ln_rows<D_PAD, LPR>(b_w, b_b, lnw, lnb, i_h, D);
    float b_dw[PL] = {}, b_db[PL] = {};                              // this lane's partials
    // a block's unstaged rows asked into L1 in one pass, a block early
    constexpr int kLpr = (D_PAD * 4 + 126) / 128 + 1;  // line slots of an fp32 row
    auto ask_rows = [&](long long row0, int L) {
        const RowSpan rows3[3] = {row_span(xbuf + p_base, row0, L, row_stride, D),
                                  row_span(v + p_base, row0, L, row_stride, D),
                                  row_span(rbuf + p_ebase, row0, L, H, 1)};
        if constexpr (STAGE_SAVED) {  // every row comes by cp.async (stage_*)
            (void)rows3;
        } else if constexpr (STAGE) {  // the tiles' rows come by cp.async (stage_tiles)
            prefetch_spans<NT, kLpr>(rows3);
        } else {
            const RowSpan spans[6] = {rows3[0], rows3[1], rows3[2],
                                      row_span(q + p_base, row0, L, row_stride, D),
                                      row_span(k + p_base, row0, L, row_stride, D),
                                      row_span(dout + p_base, row0, L, row_stride, D)};
            prefetch_spans<NT, kLpr>(spans);
        }
    };
    auto stage_tiles = [&](long long row0, int L) {  // block rows row0 .. row0 + L - 1
        const long long o = p_base + row0 * row_stride;
        const int rs = (int)row_stride;  // H D < 2^31
        Staged::copy(reinterpret_cast<T*>(s_stq), q + o, rs, L, D,
                     vec_rows_ok(q + p_base, row_stride, D));
        Staged::copy(reinterpret_cast<T*>(s_stk), k + o, rs, L, D,
                     vec_rows_ok(k + p_base, row_stride, D));
        Staged::copy(reinterpret_cast<T*>(s_stdo), dout + o, rs, L, D,
                     vec_rows_ok(dout + p_base, row_stride, D));
        stage_scalars<R, NT>(s_ste, eta + p_ebase + row0 * H, H, L);
    };
    auto stage_saved = [&](long long row0, int L) {  // the g row pass's rows
        const long long o = p_base + row0 * row_stride;
        const int rs = (int)row_stride;
        StagedX::copy(s_stx, xbuf + o, rs, L, D, vec_rows_ok(xbuf + p_base, row_stride, D));
        Staged::copy(reinterpret_cast<T*>(s_stv), v + o, rs, L, D,
                     vec_rows_ok(v + p_base, row_stride, D));
        stage_scalars<R, NT>(s_str, rbuf + p_ebase + row0 * H, H, L);
    };
    if (rows > 0) {
        ask_rows(g_row0, min(R, rows));
        if constexpr (STAGE) stage_tiles(g_row0, min(R, rows));
        if constexpr (STAGE_SAVED) stage_saved(g_row0, min(R, rows));
    }
    load_slot<D_PAD, NT>(s_W, s_hb, ck, ckb, gr.slot * H + i_h, DD, D);

    for (int b0 = 0; b0 < rows; b0 += R) {
        const long long row0 = g_row0 + b0;
        const int L = min(R, rows - b0);
        if (b0 + R < rows) ask_rows(row0 + R, min(R, rows - b0 - R));  // the next block's
        if constexpr (STAGE) {
            // this block's staged pieces -> the tiles (each thread its own: no barrier), then
            // the next block's copies
            cp_async_wait_all();
            Staged::to_tile(s_q, reinterpret_cast<const T*>(s_stq), scale);
            Staged::to_tile(s_k, reinterpret_cast<const T*>(s_stk), 1.f);
            Staged::to_tile(s_do, reinterpret_cast<const T*>(s_stdo), 1.f);
            for (int i = tid; i < R; i += NT) s_e[i] = s_ste[i];
            if (b0 + R < rows) stage_tiles(row0 + R, min(R, rows - b0 - R));
        } else {
            load_tile<D_PAD, R, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
            load_tile<D_PAD, R, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
            load_tile<D_PAD, R, NT>(s_do, dout, p_base, row0, L, row_stride, D, 1.f);
            load_eta<R, NT>(s_e, eta, p_ebase, row0, L, H);
        }
        __syncthreads();

        // A -> s_A, M -> s_P (tensor cores); row pass: g from xh, r, k, v -> s_g
        block_dots_mma<D_PAD, R, BT, NW>(s_P, s_q, s_k, L, s_e, s_A);
        if constexpr (STAGE_SAVED) {
            inner_grad_rows_staged<D_PAD, R, NW, LPR>(s_g, s_k, reinterpret_cast<const T*>(s_stv),
                                                      Staged::kLd, s_stx, StagedX::kLd, s_str,
                                                      b_w, b_b, L, D);
        } else {
            inner_grad_rows_saved<D_PAD, R, NW, LPR>(s_g, s_k, v, xbuf, rbuf, b_w, b_b, p_base,
                                                     p_ebase, row0, row_stride, L, H, D);
        }
        __syncthreads();
        if constexpr (STAGE_SAVED) {  // every warp is past its xh, v, r: the next block's
            if (b0 + R < rows) stage_saved(row0 + R, min(R, rows - b0 - R));
        }

        // q W0 - M g -> s_q (after every warp's products: they read q)
        out_pre_mma<D_PAD, R, NW, false>(s_q, s_W, s_P, s_g, nullptr);
        __syncthreads();

        // row pass: o_pre -> post norm-residual backward -> do_pre (s_do; dopbuf); dw, db.
        // Row warp + NW (sub + RPP u) in pass u; rows >= L run on zeros and store nothing
        for (int i0 = warp; i0 < R; i0 += NW * RPP) {
            const int i = i0 + NW * sub;
            const bool ok = i < L;
            float b_o[PL] = {}, b_do[PL] = {};
            if (ok) {
                out_pre_row<D_PAD, R, true, LPR>(b_o, i, s_q, s_W, s_A, s_g, s_hb, s_e, D);
                load_row<D_PAD, LPR>(b_do, s_do + i * LD, D, 1.f);
            }
            post_norm_bwd_row<LPR, OUT>(b_o, b_do, b_w, b_dw, b_db, D, eps);
            if (!ok) continue;
            put_row<D_PAD, LPR>(s_do + i * LD, b_do);
            store_row<D_PAD, LPR>(dopbuf + p_base + (row0 + i) * row_stride, b_do, D);
        }
        __syncthreads();

        // dS = do_pre g^T (every j <= t) -> s_P
        tri_dots_mma<D_PAD, R, NW, true>(s_P, s_do, s_g, L, 0.f);
        __syncthreads();

        // deta_t = -sum_{j <= t in t's chunk} A_tj dS_tj; dS -> dP' and A -> e A (zero across
        // chunks) in place, a row each; g's rows *= their chunk's eta_l (for the state step)
        for (int i = tid; i < L; i += NT) {
            const int c0 = (i / BT) * BT;  // first row of i's chunk
            const float ei = s_e[i];
            float de = 0.f;
            for (int jj = 0; jj <= i; ++jj) {
                const float ds = s_P[i * LA + jj], a = s_A[i * LA + jj];
                const bool same = jj >= c0;
                if (same) de -= a * ds;
                s_P[i * LA + jj] = -(same ? ei : chunk_eta_l<BT>(s_e, jj, L)) * ds;
                s_A[i * LA + jj] = same ? ei * a : 0.f;
            }
            deta[p_ebase + (row0 + i) * H] = de;
        }
        for (int idx = tid; idx < L * D_PAD; idx += NT) {
            const int i = idx / D_PAD;
            s_g[i * LD + idx % D_PAD] *= chunk_eta_l<BT>(s_e, i, L);
        }
        __syncthreads();

        // dq = scale (do_pre W0^T + dP' k);  dg_loc = -(e A)^T do_pre   (tensor cores)
        mma_blocks<R, D_PAD, NW, 2>(  // pairs of tiles: one A read for two products
            [&](float (&acc)[2][4], int m0, int n0) {
                float acc2[2][4] = {};
                mma_tiles_acc<2>(acc, s_do, LD, 1, s_W, 1, LD, m0, n0, 0, D_PAD);
                mma_tiles_acc<2>(acc, s_P, LA, 1, s_k, LD, 1, m0, n0, 0, m0 + 16);
                mma_tiles_acc<2>(acc2, s_A, 1, LA, s_do, LD, 1, m0, n0, m0, R);
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int i = m0 + g4 + 8 * (r >> 1), d = n0 + 8 * j + 2 * t4 + (r & 1);
                        if (i < L && d < D) {
                            const long long o_x = p_base + (row0 + i) * row_stride + d;
                            if constexpr (OUT == kOutQuery)  // q is the residual: + do
                                dq[o_x] = from_f32<T>(scale * acc[j][r] + to_f32(dout[o_x]));
                            else
                                dq[o_x] = from_f32<T>(scale * acc[j][r]);
                            dgbuf[o_x] = -acc2[j][r];
                        }
                    }
            },
            [](float (&)[4], int, int) {});
        __syncthreads();

        // W0 <- W0 - k^T (eta_l g), hb0 <- hb0 - sum_j (eta_l g)_j
        state_update_mma<D_PAD, R, NW>(s_W, -1.f, s_k, s_g, nullptr, nullptr, D);
        bias_axpy<D_PAD, R, NT>(s_hb, -1.f, s_g, D);
        __syncthreads();
    }

    // dw, db: the warps' partials summed in a fixed order (s_q, s_k reused as [NW, LD])
    store_partials<D_PAD, NW, NT, LPR>(s_q, s_k, b_dw, b_db, dwp, dbp, (gr.gid * H + i_h) * D, 0,
                                       D);
}

template <typename T, int D_PAD, int BT, int OUT>
__device__ __forceinline__ void bwd_local_simt(TTT_BWD_LOCAL_PARAMS) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane;
    constexpr int LD = Tr::kLd, LA = Tr::kLdA;
    float* s_W = smem;                 // [D_PAD, LD]  state before the chunk
    float* s_hb = s_W + Tr::kState;    // [D_PAD]
    float* s_q = s_hb + D_PAD;         // [BT, LD]     q * scale
    float* s_k = s_q + Tr::kTile;      // [BT, LD]     k
    float* s_do = s_k + Tr::kTile;     // [BT, LD]     do -> do_pre
    float* s_g = s_do + Tr::kTile;     // [BT, LD]     g
    float* s_A = s_g + Tr::kTile;      // [BT, LA]     tril(q k^T) + tril(1)
    float* s_P = s_A + Tr::kSquare;    // [BT, LA]     dS -> dP
    float* s_e = s_P + Tr::kSquare;    // [BT]         eta (zero past the end)

    const int tid = threadIdx.x, warp = tid >> 5;
    const int i_h = (int)(blockIdx.x % H);
    const Group gr = group_coords(blockIdx.x / H, T_len, BT, G, cu_seqlens, grp_offsets,
                                  grp_seq, g_lo, g_hi);
    if (gr.nc <= 0) return;  // a segment past the end of this sequence
    const long long DD = (long long)D * D;

    float b_w[P], b_b[P];                                            // [D] per lane
    load_ln_rows<D_PAD>(b_w, b_b, lnw, lnb, i_h, D);
    float b_dw[P] = {}, b_db[P] = {};                                // this warp's partials
    load_slot<D_PAD, NT>(s_W, s_hb, ck, ckb, gr.slot * H + i_h, DD, D);

    const long long row_stride = (long long)H * D;
    const long long p_base = (gr.seq.bos * H + i_h) * D, p_ebase = gr.seq.bos * H + i_h;
    for (int j = 0; j < gr.nc; ++j) {
        const SimtChunk ch = replay_chunk_simt<D_PAD, BT, NT, NW, true>(
            gr, j, s_q, s_k, s_do, s_A, s_g, s_e, q, k, dout, v, eta, xbuf, rbuf, b_w, b_b,
            p_base, p_ebase, row_stride, H, D, scale);

        // row pass: o_pre -> post norm-residual backward -> do_pre (s_do; dopbuf); dw, db
        for (int i = warp; i < ch.L; i += NW) {
            float b_o[P], b_do[P];
            out_pre_row<D_PAD, BT, false>(b_o, i, s_q, s_W, s_A, s_g, s_hb, s_e, D);
            load_row<D_PAD>(b_do, s_do + i * LD, D, 1.f);
            post_norm_bwd_row<32, OUT>(b_o, b_do, b_w, b_dw, b_db, D, eps);
            put_row<D_PAD>(s_do + i * LD, b_do);
            store_row<D_PAD>(dopbuf + p_base + (ch.row0 + i) * row_stride, b_do, D);
        }
        __syncthreads();

        // dS = do_pre g^T (lower triangle) -> s_P
        tri_dots<D_PAD, BT, NT, true>(s_P, s_do, s_g, ch.L, 0.f);
        __syncthreads();

        // deta_i = -sum_j A_ij dS_ij; dP = -tril(e dS) in place (one thread a row)
        for (int i = tid; i < ch.L; i += NT) {
            float de = 0.f;
            for (int jj = 0; jj <= i; ++jj) {
                const float ds = s_P[i * LA + jj];
                de -= s_A[i * LA + jj] * ds;
                s_P[i * LA + jj] = -s_e[i] * ds;
            }
            deta[p_ebase + (ch.row0 + i) * H] = de;
        }
        __syncthreads();

        // dq = scale (do_pre W^T + dP k);  dg_loc = -A^T (e do_pre)   (tile passes)
        for (int idx = tid; idx < BT * D_PAD; idx += NT) {
            const int i = idx / D_PAD, d = idx % D_PAD;
            if (i < ch.L && d < D) {
                float acc = 0.f, acc2 = 0.f, acc3 = 0.f;
#pragma unroll 8
                for (int c = 0; c < D_PAD; ++c) acc += s_do[i * LD + c] * s_W[d * LD + c];
                for (int jj = 0; jj <= i; ++jj) acc2 += s_P[i * LA + jj] * s_k[jj * LD + d];
                for (int jj = i; jj < ch.L; ++jj)
                    acc3 += s_A[jj * LA + i] * (s_e[jj] * s_do[jj * LD + d]);
                const long long o_x = p_base + (ch.row0 + i) * row_stride + d;
                if constexpr (OUT == kOutQuery)  // q is the residual: + do
                    dq[o_x] = from_f32<T>(scale * (acc + acc2) + to_f32(dout[o_x]));
                else
                    dq[o_x] = from_f32<T>(scale * (acc + acc2));
                dgbuf[o_x] = -acc3;
            }
        }
        __syncthreads();

        state_axpy<D_PAD, BT, NT>(s_W, s_hb, -ch.e_l, s_k, s_g, D);
        __syncthreads();
    }

    // dw, db: the warps' partials summed in a fixed order (s_q, s_k reused as [NW, LD])
    store_partials<D_PAD, NW, NT>(s_q, s_k, b_dw, b_db, dwp, dbp, (gr.gid * H + i_h) * D, 0, D);
}

}  // namespace ttt

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value,
          int OUT = ttt::kOutNorm>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kThreads)
ttt_linear_bwd_local(const ttt::BwdParams<T> p) {
    using Tr = ttt::Traits<D_PAD, BT>;
    ttt::check_launch<T, D_PAD, MMA>(p, MMA ? Tr::kBwdLocalTcBytes : Tr::kBwdLocalBytes,
                                     Tr::kThreads);
    extern __shared__ float smem[];
    if constexpr (MMA)
        ttt::bwd_local_tc<T, D_PAD, BT, OUT>(TTT_BWD_LOCAL_ARGS(p));
    else
        ttt::bwd_local_simt<T, D_PAD, BT, OUT>(TTT_BWD_LOCAL_ARGS(p));
}
