// Forward, parallel part: ttt_linear_fwd_out<T, D_PAD, BT>. The outputs, one block per
// (group of G chunks, head).
//
// fwd_chain.cu stored xh and r of every row and the state before every group, so a group
// replays its chunks from its slot without recomputing k W or the LayerNorm: g comes back
// row-locally from xh, r, k, v (inner_grad_rows_saved; notation in ttt_common.cuh):
//
//   y     = (xh w + b - v + k) w,     g = r (y - mean(y) - xh mean(y xh))
//   A     = tril(q k^T) + tril(1)                                  [BT, BT]
//   o_pre = q W + hb - e (A g),       o = o_pre + LN(o_pre) w + b   (fused post norm-residual)
//   W    <- W - eta_l k^T g,          hb <- hb - eta_l sum_i g_i
//
// Groups are independent, so this kernel fills the GPU however few (sequence, head) pairs
// there are. It walks chunk by chunk (blocks of BT rows): in SIMT arithmetic that is the
// cheapest block (per row 2 D^2 + BT D multiply-adds); larger row blocks only pay with tensor
// cores. The g row pass shares its phase with q k^T (no barrier of its own). Shared memory:
// W, hb, Q, K, G, A, eta (Traits::kFwdOutBytes).
//
// MMA (default: true for __half / __nv_bfloat16, must be false for float): q k^T, q W + A g
// ([BT, D] x [D, D] and [BT, BT] x [BT, D], one tile pass whose result replaces q in its
// tile) and the state step k^T g run on tensor cores (mma.sync m16n8k8, tf32 operands, fp32
// accumulation; ttt_common.cuh); the row pass then only adds hb and does the post norm. The
// MMA instance asks for each chunk's stored rows (xh, v, r) into L1 before its tile loads (the
// first chunk's before the state load), so that the g row pass after the barrier and q k^T
// finds them there: their latency overlaps the tile loads and the barrier instead of following
// them. (Loading them into registers instead, all of a warp's rows or only its first, took
// ptxas from 62 to 78-80 registers with spills at D_PAD 64, BT 16; the SIMT instance keeps
// the plain loads: the prefetch cost it 8-16 registers.) With
// MMA = false (float inputs, or TTT_CUPY_MMA=0) every product is SIMT fp32. The MMA path
// passed the conformance suite on an H200 (580de07, 80e4f48, and with g from the saved xh, r
// at 3eb0127).
#include "ttt_common.cuh"

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kThreads)
ttt_linear_fwd_out(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                   const float* __restrict__ eta,    // [B, T, H] fp32
                   const float* __restrict__ lnw,    // [H, D] fp32
                   const float* __restrict__ lnb,    // [H, D] fp32
                   const float* __restrict__ ck,     // [slots, H, D, D] state slots
                   const float* __restrict__ ckb,    // [slots, H, D]
                   const float* __restrict__ xbuf,   // [B, T, H, D] fp32 xh (fwd_chain)
                   const float* __restrict__ rbuf,   // [B, T, H] fp32 r (fwd_chain)
                   T* __restrict__ o,                // [B, T, H, D]
                   const long long* __restrict__ cu_seqlens,   // [N + 1] or null
                   const long long* __restrict__ grp_offsets,  // [N + 1] or null (varlen)
                   const int* __restrict__ grp_seq,            // [groups] or null (varlen)
                   float scale, float eps, long long T_len, int H, int D, int G,
                   unsigned long long smem_bytes) {
    static_assert(!MMA || ttt::is_half_type<T>::value, "float inputs keep the SIMT fp32 path");
    using Tr = ttt::Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane;
    constexpr int LD = Tr::kLd;
    if (smem_bytes < Tr::kFwdOutBytes || blockDim.x != NT || D > D_PAD || G < 1) __trap();

    extern __shared__ float smem[];
    float* s_W = smem;                 // [D_PAD, LD]  state before the chunk
    float* s_hb = s_W + Tr::kState;    // [D_PAD]
    float* s_q = s_hb + D_PAD;         // [BT, LD]     q * scale
    float* s_k = s_q + Tr::kTile;      // [BT, LD]     k
    float* s_g = s_k + Tr::kTile;      // [BT, LD]     g
    float* s_A = s_g + Tr::kTile;      // [BT, LA]     tril(q k^T) + tril(1)
    float* s_e = s_A + Tr::kSquare;    // [BT]         eta (zero past the end)

    const int warp = threadIdx.x >> 5;
    const long long gid = blockIdx.x / H;
    const int i_h = (int)(blockIdx.x % H);
    const ttt::Group gr = ttt::group_coords(gid, T_len, BT, G, cu_seqlens, grp_offsets, grp_seq);
    const long long DD = (long long)D * D;

    float b_w[P], b_b[P];                                            // [D] per lane
    ttt::load_row<D_PAD>(b_w, lnw + (long long)i_h * D, D, 1.f);
    ttt::load_row<D_PAD>(b_b, lnb + (long long)i_h * D, D, 1.f);
    // MMA: chunk jj's stored rows (xh, v, r; the g row pass reads them after the barrier and
    // q k^T) asked for into L1 before its tile loads, the first chunk's before the state load
    auto ask_rows = [&](int jj) {
        const long long rs = (long long)H * D, pb = (gr.seq.bos * H + i_h) * D;
        const long long row0n = (gr.c0 + jj) * BT;
        const int Ln = (int)min((long long)BT, gr.seq.len - row0n);
        ttt::prefetch_rows<NT>(xbuf + pb, row0n, Ln, rs, D);
        ttt::prefetch_rows<NT>(v + pb, row0n, Ln, rs, D);
        ttt::prefetch_rows<NT>(rbuf + gr.seq.bos * H + i_h, row0n, Ln, H, 1);
    };
    if constexpr (MMA) {
        if (gr.nc > 0) ask_rows(0);
    }
    const long long i_ck = gr.slot * H + i_h;
    ttt::load_state<D_PAD, NT>(s_W, s_hb, ck + i_ck * DD, ckb + i_ck * D, D);

    const long long row_stride = (long long)H * D;
    const long long p_base = (gr.seq.bos * H + i_h) * D;
    const long long p_ebase = gr.seq.bos * H + i_h;
    for (int j = 0; j < gr.nc; ++j) {
        const long long row0 = (gr.c0 + j) * BT;
        const int L = (int)min((long long)BT, gr.seq.len - row0);
        if constexpr (MMA) {
            if (j > 0) ask_rows(j);  // before the tile loads and the barrier
        }
        ttt::load_tile<D_PAD, BT, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
        ttt::load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
        ttt::load_eta<BT, NT>(s_e, eta, p_ebase, row0, L, H);
        __syncthreads();
        const float e_l = s_e[L - 1];

        if constexpr (MMA) {
            // A -> s_A (tensor cores); row pass: g from xh, r, k, v -> s_g
            ttt::tri_dots_mma<D_PAD, BT, NW, true>(s_A, s_q, s_k, L, 1.f);
            ttt::inner_grad_rows_saved<D_PAD, BT, NW>(s_g, s_k, v, xbuf, rbuf, b_w, b_b, p_base,
                                                      p_ebase, row0, row_stride, L, H, D);
            __syncthreads();
            // q W - e (A g) -> s_q (after every warp's products: they read q)
            ttt::out_pre_mma<D_PAD, BT, NW>(s_q, s_W, s_A, s_g, s_e);
            __syncthreads();

            // row pass: o_pre = (q W - e (A g)) + hb, then the post norm-residual -> o
            for (int i = warp; i < L; i += NW) {
                float b_o[P];
                ttt::out_pre_row<D_PAD, BT, true>(b_o, i, s_q, s_W, s_A, s_g, s_hb, s_e, D);
                ttt::post_norm_row(b_o, b_w, b_b, D, eps);
                ttt::store_row<D_PAD>(o + p_base + (row0 + i) * row_stride, b_o, D);
            }
            __syncthreads();

            ttt::state_update_mma<D_PAD, BT, NW>(s_W, -e_l, s_k, s_g, nullptr, nullptr, D);
            ttt::bias_axpy<D_PAD, BT, NT>(s_hb, -e_l, s_g, D);
            __syncthreads();
            continue;
        }

        // A -> s_A (tile pass); row pass: g from xh, r, k, v -> s_g
        ttt::tri_dots<D_PAD, BT, NT, true>(s_A, s_q, s_k, L, 1.f);
        ttt::inner_grad_rows_saved<D_PAD, BT, NW>(s_g, s_k, v, xbuf, rbuf, b_w, b_b, p_base,
                                                  p_ebase, row0, row_stride, L, H, D);
        __syncthreads();

        // row pass: o_pre = q W + hb - e (A g), then the post norm-residual -> o
        for (int i = warp; i < L; i += NW) {
            float b_o[P];
            ttt::out_pre_row<D_PAD, BT, false>(b_o, i, s_q, s_W, s_A, s_g, s_hb, s_e, D);
            ttt::post_norm_row(b_o, b_w, b_b, D, eps);
            ttt::store_row<D_PAD>(o + p_base + (row0 + i) * row_stride, b_o, D);
        }
        __syncthreads();

        ttt::state_axpy<D_PAD, BT, NT>(s_W, s_hb, -e_l, s_k, s_g, D);
        __syncthreads();
    }
}
