// Forward, parallel part: ttt_linear_fwd_out<T, D_PAD, BT, MMA, OUT>. The outputs, one block
// per (group of G chunks, head), replayed from the group's slot; g comes back row-locally
// from the saved xh, r' (ttt_common.cuh):
//
//   y     = (xh w + b - v + k) w,     g = r' (y - mean(y) - xh mean(y xh))
//   A     = tril(q k^T) + tril(1)                                  [BT, BT]
//   o_pre = q W + hb - e (A g),       o = o_pre + LN(o_pre) w + b  (or OUT's form)
//   W    <- W - eta_l k^T g,          hb <- hb - eta_l sum_i g_i
//
// Blocks come from group_block (overlap.cuh). SIMT: chunk by chunk. MMA (half inputs): blocks
// of R = Traits::kOutRows rows, with W0, hb0 the state before the block, c(t) the chunk of row t:
//
//   M[t, j] = (q_t . k_j + 1) e_t          j <= t in the same chunk
//           = (q_t . k_j + 1) eta_l(c(j))  j in an earlier chunk of the block,  else 0
//   o_pre   = q W0 + hb0 - M g
//   W0     <- W0 - k^T (eta_l g),  hb0 <- hb0 - sum_j eta_l(c(j)) g_j     (rows scaled)
//
// on tensor cores; the next block's rows come by cp.async (kOutStage) or via L1 a block ahead.
#include "ttt_common.cuh"

namespace ttt {

// Both instances' parameters: the kernel's shared memory, FwdParams' fields (ck, ckb, xbuf,
// rbuf, written by fwd_chain beside it when overlapped, not __restrict__: not read through
// the read-only path) and the block's group and head; the kernel's arguments for them.
#define TTT_FWD_OUT_PARAMS                                                                        \
    float* smem, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,       \
    const float* __restrict__ eta, const float* __restrict__ lnw, const float* __restrict__ lnb,  \
    const float* ck, const float* ckb, const float* xbuf, const float* rbuf, T* __restrict__ o,   \
    float scale, float eps, long long T_len, int H, int D, int G, const Group& gr, int i_h
#define TTT_FWD_OUT_ARGS(p)                                                                       \
    smem, p.q, p.k, p.v, p.eta, p.lnw, p.lnb, p.ck, p.ckb, p.xbuf, p.rbuf, p.o, p.scale, p.eps,   \
    p.T_len, p.H, p.D, p.G, gr, i_h

template <typename T, int D_PAD, int BT, int OUT>
__device__ __forceinline__ void fwd_out_tc(TTT_FWD_OUT_PARAMS) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int R = Tr::kOutRows, NT = Tr::kThreads, NW = Tr::kWarps;
    constexpr int LD = Tr::kLd;
    static_assert(R % BT == 0 && R % 16 == 0, "a block of rows holds whole chunks");
    float* s_W = smem;                 // [D_PAD, LD]  state before the block
    float* s_hb = s_W + Tr::kState;    // [D_PAD]
    float* s_q = s_hb + D_PAD;         // [R, LD]      q * scale -> q W - M g
    float* s_k = s_q + R * LD;         // [R, LD]      k
    float* s_g = s_k + R * LD;         // [R, LD]      g -> eta_l g
    float* s_M = s_g + R * LD;         // [R, R + 1]   M
    float* s_e = s_M + R * (R + 1);    // [R]          eta (zero past the end)
    // the stage: the next block's q, k, v (raw T), xh, r and eta by cp.async
    constexpr bool STAGE = Tr::kOutStage;
    constexpr int kRaw = Tr::template kOutStageRaw<(int)sizeof(T)>;
    T* s_stq = reinterpret_cast<T*>(smem + Tr::kOutStageOffset);  // [R, D_PAD + 16 / TS]
    T* s_stk = reinterpret_cast<T*>(smem + Tr::kOutStageOffset + kRaw);
    T* s_stv = reinterpret_cast<T*>(smem + Tr::kOutStageOffset + 2 * kRaw);
    float* s_stx = smem + Tr::kOutStageOffset + 3 * kRaw;         // [R, D_PAD + 4]
    float* s_str = s_stx + R * (D_PAD + 4);                       // [R]
    float* s_ste = s_str + R;                                     // [R]
    using StagedT = StagedRows<T, D_PAD, R, NT>;
    using StagedX = StagedRows<float, D_PAD, R, NT>;

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long DD = (long long)D * D;
    const long long row_stride = (long long)H * D;
    const long long p_base = (gr.seq.bos * H + i_h) * D, p_ebase = gr.seq.bos * H + i_h;
    const long long g_row0 = gr.c0 * BT;                                  // the group's rows:
    const int rows = (int)min((long long)gr.nc * BT, gr.seq.len - g_row0);  // g_row0 + [0, rows)

    // the row passes: LPR lanes a row, RPP rows per warp pass, PL row elements per lane
    constexpr int LPR = Tr::template kRowLanes<R>, RPP = 32 / LPR;
    constexpr int PL = (D_PAD + LPR - 1) / LPR;
    static_assert(R % (NW * RPP) == 0, "fwd_out: whole row passes");
    const int sub = lane / LPR;
    float b_w[PL], b_b[PL];                                          // [D] per lane
    load_ln_rows<D_PAD, LPR>(b_w, b_b, lnw, lnb, i_h, D);
    // unstaged: a block's rows asked into L1 in one pass, a block early
    constexpr int kLpr = (D_PAD * 4 + 126) / 128 + 1;  // line slots of an fp32 row
    auto ask_rows = [&](long long row0, int L) {
        const RowSpan spans[5] = {row_span(q + p_base, row0, L, row_stride, D),
                                  row_span(k + p_base, row0, L, row_stride, D),
                                  row_span(xbuf + p_base, row0, L, row_stride, D),
                                  row_span(v + p_base, row0, L, row_stride, D),
                                  row_span(rbuf + p_ebase, row0, L, H, 1)};
        prefetch_spans<NT, kLpr>(spans);
    };
    // staged: rows row0 .. row0 + L - 1 in two parts, the tiles' (q, k, eta) once each thread
    // has converted its pieces, the g row pass's (xh, v, r) after that pass's barrier
    const int rs = (int)row_stride;  // H D < 2^31
    const bool vq = vec_rows_ok(q + p_base, row_stride, D);
    const bool vk = vec_rows_ok(k + p_base, row_stride, D);
    const bool vv = vec_rows_ok(v + p_base, row_stride, D);
    const bool vx = vec_rows_ok(xbuf + p_base, row_stride, D);
    auto stage_tiles = [&](long long row0, int L) {
        const long long o = p_base + row0 * row_stride;
        StagedT::copy(s_stq, q + o, rs, L, D, vq);
        StagedT::copy(s_stk, k + o, rs, L, D, vk);
        stage_scalars<R, NT>(s_ste, eta + p_ebase + row0 * H, H, L);
    };
    auto stage_saved = [&](long long row0, int L) {
        const long long o = p_base + row0 * row_stride;
        StagedT::copy(s_stv, v + o, rs, L, D, vv);
        StagedX::copy(s_stx, xbuf + o, rs, L, D, vx);
        stage_scalars<R, NT>(s_str, rbuf + p_ebase + row0 * H, H, L);
    };
    if (rows > 0) {
        if constexpr (STAGE) {
            stage_tiles(g_row0, min(R, rows));
            stage_saved(g_row0, min(R, rows));
        } else {
            ask_rows(g_row0, min(R, rows));
        }
    }
    load_slot<D_PAD, NT>(s_W, s_hb, ck, ckb, gr.slot * H + i_h, DD, D);

    for (int b0 = 0; b0 < rows; b0 += R) {
        const long long row0 = g_row0 + b0;
        const int L = min(R, rows - b0);
        const bool more = b0 + R < rows;  // a next block
        if constexpr (STAGE) {
            // this block's staged q, k, eta -> the tiles (each thread its own pieces), then
            // the next block's copies; the barrier below publishes xh, v, r
            cp_async_wait_all();
            StagedT::to_tile(s_q, s_stq, scale);
            StagedT::to_tile(s_k, s_stk, 1.f);
            for (int i = threadIdx.x; i < R; i += NT) s_e[i] = s_ste[i];
            if (more) stage_tiles(row0 + R, min(R, rows - b0 - R));
        } else {
            if (more) ask_rows(row0 + R, min(R, rows - b0 - R));  // the next block's
            load_tile<D_PAD, R, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
            load_tile<D_PAD, R, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
            load_eta<R, NT>(s_e, eta, p_ebase, row0, L, H);
        }
        __syncthreads();

        // M -> s_M (tensor cores); row pass: g from xh, r, k, v -> s_g (zero past L)
        block_dots_mma<D_PAD, R, BT, NW>(s_M, s_q, s_k, L, s_e);
        if constexpr (STAGE) {
            inner_grad_rows_staged<D_PAD, R, NW, LPR>(s_g, s_k, s_stv, StagedT::kLd, s_stx,
                                                      StagedX::kLd, s_str, b_w, b_b, L, D);
        } else {
            inner_grad_rows_saved<D_PAD, R, NW, LPR>(s_g, s_k, v, xbuf, rbuf, b_w, b_b, p_base,
                                                     p_ebase, row0, row_stride, L, H, D);
        }
        __syncthreads();
        if constexpr (STAGE) {  // every warp is past its xh, v, r: the next block's copies
            if (more) stage_saved(row0 + R, min(R, rows - b0 - R));
        }
        // q W0 - M g -> s_q (after every warp's products: they read q)
        out_pre_mma<D_PAD, R, NW, false>(s_q, s_W, s_M, s_g, nullptr);
        __syncthreads();

        // row pass: o_pre = (q W0 - M g) + hb0, the output form -> o; g's row *= eta_l. Row
        // warp + NW (sub + RPP u) in pass u; rows >= L run on zeros and store nothing
        for (int i0 = warp; i0 < R; i0 += NW * RPP) {
            const int i = i0 + NW * sub;
            const bool ok = i < L;
            float b_o[PL];
            if (ok) {
                out_pre_row<D_PAD, R, true, LPR>(b_o, i, s_q, s_W, s_M, s_g, s_hb, s_e, D);
            } else {
#pragma unroll
                for (int e = 0; e < PL; ++e) b_o[e] = 0.f;
            }
            output_row<OUT, LPR>(b_o, b_w, b_b, D, eps,
                                 q + p_base + (row0 + (ok ? i : 0)) * row_stride, ok);
            if (!ok) continue;
            store_row<D_PAD, LPR>(o + p_base + (row0 + i) * row_stride, b_o, D);
            const float el = chunk_eta_l<BT>(s_e, i, L);
            for (int d = row_col<LPR>(0); d < D_PAD; d += LPR) s_g[i * LD + d] *= el;
        }
        __syncthreads();

        // W0 <- W0 - k^T (eta_l g), hb0 <- hb0 - sum_j (eta_l g)_j
        state_update_mma<D_PAD, R, NW>(s_W, -1.f, s_k, s_g, nullptr, nullptr, D);
        bias_axpy<D_PAD, R, NT>(s_hb, -1.f, s_g, D);
        __syncthreads();
    }
}

template <typename T, int D_PAD, int BT, int OUT>
__device__ __forceinline__ void fwd_out_simt(TTT_FWD_OUT_PARAMS) {
    using Tr = Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane;
    float* s_W = smem;                 // [D_PAD, LD]  state before the chunk
    float* s_hb = s_W + Tr::kState;    // [D_PAD]
    float* s_q = s_hb + D_PAD;         // [BT, LD]     q * scale
    float* s_k = s_q + Tr::kTile;      // [BT, LD]     k
    float* s_g = s_k + Tr::kTile;      // [BT, LD]     g
    float* s_A = s_g + Tr::kTile;      // [BT, LA]     tril(q k^T) + tril(1)
    float* s_e = s_A + Tr::kSquare;    // [BT]         eta (zero past the end)

    const int warp = threadIdx.x >> 5;
    const long long DD = (long long)D * D;

    float b_w[P], b_b[P];                                            // [D] per lane
    load_ln_rows<D_PAD>(b_w, b_b, lnw, lnb, i_h, D);
    load_slot<D_PAD, NT>(s_W, s_hb, ck, ckb, gr.slot * H + i_h, DD, D);

    const long long row_stride = (long long)H * D;
    const long long p_base = (gr.seq.bos * H + i_h) * D, p_ebase = gr.seq.bos * H + i_h;
    for (int j = 0; j < gr.nc; ++j) {
        const SimtChunk ch = replay_chunk_simt<D_PAD, BT, NT, NW>(
            gr, j, s_q, s_k, nullptr, s_A, s_g, s_e, q, k, static_cast<const T*>(nullptr), v,
            eta, xbuf, rbuf, b_w, b_b, p_base, p_ebase, row_stride, H, D, scale);

        // row pass: o_pre = q W + hb - e (A g), then the post norm-residual -> o
        output_rows_simt<D_PAD, BT, NW, OUT>(o, q, s_q, s_W, s_A, s_g, s_hb, s_e, b_w, b_b,
                                             p_base, ch.row0, row_stride, ch.L, D, eps, warp);
        __syncthreads();

        state_axpy<D_PAD, BT, NT>(s_W, s_hb, -ch.e_l, s_k, s_g, D);
        __syncthreads();
    }
}

}  // namespace ttt

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value,
          int OUT = ttt::kOutNorm>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kThreads,
                                  MMA ? ttt::Traits<D_PAD, BT>::kOutBlocks : 1)
ttt_linear_fwd_out(const ttt::FwdParams<T> p) {
    using Tr = ttt::Traits<D_PAD, BT>;
    constexpr unsigned long long kTcBytes = 4ull * Tr::template kFwdOutTcFloatsT<(int)sizeof(T)>;
    ttt::check_launch<T, D_PAD, MMA>(p, MMA ? kTcBytes : Tr::kFwdOutBytes, Tr::kThreads);
    extern __shared__ float smem[];
    int i_h, a0;
    ttt::Group gr;
    static __shared__ int s_item;
    if (!ttt::group_block<1, D_PAD, false>(i_h, a0, gr, s_item, p.sync, p.mode, p.n_chains,
                                           p.wait_spins, p.T_len, p.H, BT, p.G, p.cu_seqlens,
                                           p.grp_offsets, p.grp_seq, p.g_lo, p.g_hi))
        return;
    if constexpr (MMA)
        ttt::fwd_out_tc<T, D_PAD, BT, OUT>(TTT_FWD_OUT_ARGS(p));
    else
        ttt::fwd_out_simt<T, D_PAD, BT, OUT>(TTT_FWD_OUT_ARGS(p));
}
