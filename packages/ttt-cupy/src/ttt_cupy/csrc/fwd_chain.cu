// Forward, sequential part: ttt_linear_fwd_chain<T, D_PAD, BT, MMA>. Carries the state through
// the chunks, nothing else.
//
// One block per (sequence, head), chunks in order (notation in ttt_common.cuh):
//
//   kh = k W + hb  ->  g (inner-loss gradient)  ->  W <- W - eta_l k^T g,  hb <- hb - eta_l sum_i g_i
//
// The block writes g (fp32) of every valid row for fwd_out.cu, the fp32 state into checkpoint
// slot s before chunk s * G, and the final state into the sequence's last slot (and into
// ht / hbt when given). The outputs (which need q) are left to the group-parallel fwd_out.cu.
// Each step asks for the next chunk's rows of k, v and eta into L1 (prefetch_rows).
//
// Per chunk: a row pass (one warp a row: kh = k_i W + hb, LayerNorm, g) then a tile pass for
// the state step. Shared memory: W, hb, K, G (Traits::kFwdChainBytes).
//
// MMA (default: true for __half / __nv_bfloat16, must be false for float): the two products
// k W ([BT, D] x [D, D]) and k^T g ([D, BT] x [BT, D]) run on tensor cores (mma.sync m16n8k8,
// tf32 operands, fp32 accumulation; ttt_common.cuh), as the Triton backend does for half
// inputs; k W goes through the G tile (kh is staged there, then each row's g overwrites it).
// With MMA = false (float inputs, or TTT_CUPY_MMA=0) every product is SIMT fp32. The MMA path passed the conformance suite on an H200 (580de07, again at 80e4f48).
#include "ttt_common.cuh"

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kThreads)
ttt_linear_fwd_chain(const T* __restrict__ k, const T* __restrict__ v,
                     const float* __restrict__ eta,   // [B, T, H] fp32
                     const float* __restrict__ lnw,   // [H, D] fp32
                     const float* __restrict__ lnb,   // [H, D] fp32
                     const float* __restrict__ h0,    // [N, H, D, D] fp32 or null
                     const float* __restrict__ hb0,   // [N, H, D] fp32 or null
                     float* __restrict__ ht,          // [N, H, D, D] or null
                     float* __restrict__ hbt,         // [N, H, D] or null (with ht)
                     float* __restrict__ ck,          // [slots, H, D, D] state slots
                     float* __restrict__ ckb,         // [slots, H, D]
                     float* __restrict__ gbuf,        // [B, T, H, D] fp32: g of every valid row
                     const long long* __restrict__ cu_seqlens,   // [N + 1] or null
                     const long long* __restrict__ grp_offsets,  // [N + 1] or null (varlen)
                     float eps, long long T_len, int H, int D, int G,
                     unsigned long long smem_bytes) {
    static_assert(!MMA || ttt::is_half_type<T>::value, "float inputs keep the SIMT fp32 path");
    using Tr = ttt::Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane, LD = Tr::kLd;
    if (smem_bytes < Tr::kFwdChainBytes || blockDim.x != NT || D > D_PAD || G < 1) __trap();

    extern __shared__ float smem[];
    float* s_W = smem;                 // [D_PAD, LD]  state
    float* s_hb = s_W + Tr::kState;    // [D_PAD]      bias state
    float* s_k = s_hb + D_PAD;         // [BT, LD]     k
    float* s_g = s_k + Tr::kTile;      // [BT, LD]     g

    const long long i_nh = blockIdx.x;
    const long long i_n = i_nh / H;
    const int i_h = (int)(i_nh % H);
    const ttt::Seq sq = ttt::seq_coords(i_n, T_len, BT, G, cu_seqlens, grp_offsets);
    const long long DD = (long long)D * D;

    float b_w[P], b_b[P];                                            // [D] per lane
    ttt::load_row<D_PAD>(b_w, lnw + (long long)i_h * D, D, 1.f);
    ttt::load_row<D_PAD>(b_b, lnb + (long long)i_h * D, D, 1.f);
    ttt::load_state<D_PAD, NT>(s_W, s_hb, h0 != nullptr ? h0 + i_nh * DD : nullptr,
                               hb0 != nullptr ? hb0 + i_nh * D : nullptr, D);
    __syncthreads();

    const long long row_stride = (long long)H * D;       // rows are H * D apart
    const long long p_base = (sq.bos * H + i_h) * D;     // row 0 of this (sequence, head)
    const long long p_ebase = sq.bos * H + i_h;          // eta rows are H apart
    for (long long i_c = 0; i_c < sq.nc; ++i_c) {
        if (i_c % G == 0) {
            const long long i_ck = (sq.slot_base + i_c / G) * H + i_h;
            ttt::store_state<D_PAD, NT>(ck + i_ck * DD, ckb + i_ck * D, s_W, s_hb, D);
        }
        const long long row0 = i_c * BT;
        const int L = (int)min((long long)BT, sq.len - row0);
        ttt::load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
        const float e_l = eta[p_ebase + (row0 + L - 1) * H];
        if (i_c + 1 < sq.nc) {  // the next chunk's rows into L1 while this one computes
            const long long row0n = row0 + BT;
            const int Ln = (int)min((long long)BT, sq.len - row0n);
            ttt::prefetch_rows<NT>(k + p_base, row0n, Ln, row_stride, D);
            ttt::prefetch_rows<NT>(v + p_base, row0n, Ln, row_stride, D);
            ttt::prefetch_rows<NT>(eta + p_ebase, row0n + Ln - 1, 1, H, 1);
        }
        __syncthreads();

        if constexpr (MMA) {  // kh - hb = k W into s_g (tensor cores)
            ttt::tile_times_state_mma<D_PAD, BT, NW>(s_g, s_k, s_W);
            __syncthreads();
        }

        // row pass: kh -> xh, r -> g (s_g, gbuf)
        ttt::inner_grad_rows<D_PAD, BT, NW, MMA>(s_g, s_k, s_W, s_hb, v, b_w, b_b, p_base,
                                                 p_ebase, row0, row_stride, L, H, D, eps,
                                                 gbuf, nullptr, nullptr);
        __syncthreads();

        // W <- W - eta_l k^T g, hb <- hb - eta_l sum_i g_i
        if constexpr (MMA) {
            ttt::state_update_mma<D_PAD, BT, NW>(s_W, -e_l, s_k, s_g, nullptr, nullptr, D);
            ttt::bias_axpy<D_PAD, BT, NT>(s_hb, -e_l, s_g, D);
        } else {
            ttt::state_axpy<D_PAD, BT, NT>(s_W, s_hb, -e_l, s_k, s_g, D);
        }
        __syncthreads();
    }

    const long long i_ck = (sq.slot_base + (sq.nc + G - 1) / G) * H + i_h;
    ttt::store_state<D_PAD, NT>(ck + i_ck * DD, ckb + i_ck * D, s_W, s_hb, D);
    if (ht != nullptr) ttt::store_state<D_PAD, NT>(ht + i_nh * DD, hbt + i_nh * D, s_W, s_hb, D);
}
