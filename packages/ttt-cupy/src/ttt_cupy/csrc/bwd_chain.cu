// Backward, sequential part: ttt_linear_bwd_chain<T, D_PAD, BT, MMA>. Carries the state's
// cotangent back through the chunks.
//
// One block per (sequence, head), chunks in reverse, with dW = dL/dW' and dhb = dL/dhb' the
// cotangents of the state *after* the chunk. g comes back from the stored xhat and r
// (row-local); dg_loc and do_pre were stored by bwd_local.cu (notation in ttt_common.cuh):
//
//   u   = k dW + dhb,      dg = dg_loc - eta_l u   ->  dkh (inner_grad_bwd_row)
//   dW <- dW + q^T do_pre + k^T dkh,     dhb <- dhb + sum_i do_pre_i + sum_i dkh_i
//
// The full dg replaces dg_loc in its buffer, and the last-row term of deta,
//
//   deta_last += -sum_i <u_i, g_i>,
//
// is added where bwd_local.cu left the rest. The cotangent of checkpoint slot s (the state
// before chunk s * G; the last slot is the final state) goes to dck for bwd_grads.cu, and
// slot 0's to dh0 / dhb0 when given. Per chunk: a row pass (u, g, dg, dkh) and a tile pass
// (the dW step); each step asks for the previous chunk's rows into L1 (prefetch_rows) and
// reads deta's last row early, so that no load from device memory waits on the chain.
// Shared memory: dW, dhb, Q, K, DOP, DKH, row sums (Traits::kBwdChainBytes).
//
// MMA (default: true for __half / __nv_bfloat16, must be false for float): the products
// k dW ([BT, D] x [D, D]) and q^T do_pre + k^T dkh ([D, BT] x [BT, D], one accumulator) run
// on tensor cores (mma.sync m16n8k8, tf32 operands, fp32 accumulation; ttt_common.cuh), as
// the Triton backend does for half inputs; k dW goes through the DKH tile (u - dhb is staged
// there, then each row's dkh overwrites it). With MMA = false (float inputs, or
// TTT_CUPY_MMA=0) every product is SIMT fp32. The MMA path passed the conformance suite on an H200 (580de07, again at 80e4f48).
#include "ttt_common.cuh"

template <typename T, int D_PAD, int BT, bool MMA = ttt::is_half_type<T>::value>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kThreads)
ttt_linear_bwd_chain(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const float* __restrict__ eta,     // [B, T, H] fp32
                     const float* __restrict__ lnw,     // [H, D] fp32
                     const float* __restrict__ lnb,     // [H, D] fp32
                     const float* __restrict__ xbuf,    // [B, T, H, D] fp32 xhat
                     const float* __restrict__ rbuf,    // [B, T, H] fp32 r
                     const float* __restrict__ dopbuf,  // [B, T, H, D] fp32 do_pre
                     float* __restrict__ dgbuf,         // dg_loc in, the full dg out
                     float* __restrict__ deta,          // [B, T, H]: += the last-row terms
                     const float* __restrict__ dht,     // [N, H, D, D] or null
                     const float* __restrict__ dhbt,    // [N, H, D] or null
                     float* __restrict__ dck,           // [slots, H, D, D] slot cotangents
                     float* __restrict__ dh0,           // [N, H, D, D] or null
                     float* __restrict__ dhb0,          // [N, H, D] or null (with dh0)
                     const long long* __restrict__ cu_seqlens,   // [N + 1] or null
                     const long long* __restrict__ grp_offsets,  // [N + 1] or null (varlen)
                     float scale, long long T_len, int H, int D, int G,
                     unsigned long long smem_bytes) {
    static_assert(!MMA || ttt::is_half_type<T>::value, "float inputs keep the SIMT fp32 path");
    using Tr = ttt::Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane, LD = Tr::kLd;
    if (smem_bytes < Tr::kBwdChainBytes || blockDim.x != NT || D > D_PAD || G < 1) __trap();

    extern __shared__ float smem[];
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
    const ttt::Seq sq = ttt::seq_coords(i_n, T_len, BT, G, cu_seqlens, grp_offsets);
    const long long DD = (long long)D * D;

    float b_w[P], b_b[P];                                            // [D] per lane
    ttt::load_row<D_PAD>(b_w, lnw + (long long)i_h * D, D, 1.f);
    ttt::load_row<D_PAD>(b_b, lnb + (long long)i_h * D, D, 1.f);
    ttt::load_state<D_PAD, NT>(s_dW, s_dhb, dht != nullptr ? dht + i_nh * DD : nullptr,
                               dhbt != nullptr ? dhbt + i_nh * D : nullptr, D);
    __syncthreads();
    {
        const long long i_ck = (sq.slot_base + (sq.nc + G - 1) / G) * H + i_h;
        ttt::store_state<D_PAD, NT>(dck + i_ck * DD, nullptr, s_dW, nullptr, D);
    }

    const long long row_stride = (long long)H * D;
    const long long p_base = (sq.bos * H + i_h) * D;
    const long long p_ebase = sq.bos * H + i_h;
    for (long long i_c = sq.nc - 1; i_c >= 0; --i_c) {
        const long long row0 = i_c * BT;
        const int L = (int)min((long long)BT, sq.len - row0);
        ttt::load_tile<D_PAD, BT, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
        ttt::load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
        ttt::load_tile<D_PAD, BT, NT>(s_dop, dopbuf, p_base, row0, L, row_stride, D, 1.f);
        const float e_l = eta[p_ebase + (row0 + L - 1) * H];
        const float deta_l = tid == 0 ? deta[p_ebase + (row0 + L - 1) * H] : 0.f;  // used last
        if (i_c > 0) {  // the previous chunk's rows into L1 while this one computes
            const long long row0p = row0 - BT;  // a full chunk
            ttt::prefetch_rows<NT>(q + p_base, row0p, BT, row_stride, D);
            ttt::prefetch_rows<NT>(k + p_base, row0p, BT, row_stride, D);
            ttt::prefetch_rows<NT>(v + p_base, row0p, BT, row_stride, D);
            ttt::prefetch_rows<NT>(xbuf + p_base, row0p, BT, row_stride, D);
            ttt::prefetch_rows<NT>(dopbuf + p_base, row0p, BT, row_stride, D);
            ttt::prefetch_rows<NT>(dgbuf + p_base, row0p, BT, row_stride, D);
            ttt::prefetch_rows<NT>(rbuf + p_ebase, row0p, BT, H, 1);
            ttt::prefetch_rows<NT>(eta + p_ebase, row0p + BT - 1, 1, H, 1);
            ttt::prefetch_rows<NT>(deta + p_ebase, row0p + BT - 1, 1, H, 1);
        }
        __syncthreads();

        if constexpr (MMA) {  // u - dhb = k dW into s_dkh (tensor cores)
            ttt::tile_times_state_mma<D_PAD, BT, NW>(s_dkh, s_k, s_dW);
            __syncthreads();
        }

        // row pass: u = k dW + dhb; g from xhat; dg = dg_loc - eta_l u -> dgbuf; dkh -> s_dkh
        for (int i = warp; i < BT; i += NW) {
            if (i >= L) {
                ttt::zero_row<D_PAD>(s_dkh + i * LD);
                continue;
            }
            const long long o_r = p_base + (row0 + i) * row_stride;
            float b_u[P], b_xh[P], b_k[P], b_v[P], b_g[P], b_y[P], b_dg[P], b_dkh[P], b_dy[P];
            if constexpr (MMA)
                ttt::load_row<D_PAD>(b_u, s_dkh + i * LD, D_PAD, 1.f);  // this warp's row only
            else
                ttt::row_times_state<D_PAD>(b_u, s_k + i * LD, s_dW);
#pragma unroll
            for (int e = 0; e < P; ++e) {
                const int d = lane + 32 * e;
                b_u[e] = d < D ? b_u[e] + s_dhb[d] : 0.f;
            }
            const float r = rbuf[p_ebase + (row0 + i) * H];
            ttt::load_row<D_PAD>(b_xh, xbuf + o_r, D, 1.f);
            ttt::load_row<D_PAD>(b_k, s_k + i * LD, D, 1.f);
            ttt::load_row<D_PAD>(b_v, v + o_r, D, 1.f);
            ttt::inner_grad_row(b_g, b_y, b_xh, r, b_k, b_v, b_w, b_b, D);
            ttt::load_row<D_PAD>(b_dg, dgbuf + o_r, D, 1.f);
#pragma unroll
            for (int e = 0; e < P; ++e) b_dg[e] -= e_l * b_u[e];
            const float s = ttt::row_dot(b_u, b_g);
            ttt::inner_grad_bwd_row(b_dkh, b_dy, b_dg, b_xh, r, b_y, b_g, b_w, D);
            ttt::store_row<D_PAD>(dgbuf + o_r, b_dg, D);
            ttt::put_row<D_PAD>(s_dkh + i * LD, b_dkh);
            if (lane == 0) s_s[i] = s;
        }
        __syncthreads();

        // dW += q^T do_pre + k^T dkh; dhb += sum_i do_pre_i + sum_i dkh_i; deta's last row
        if constexpr (MMA)
            ttt::state_update_mma<D_PAD, BT, NW>(s_dW, 1.f, s_q, s_dop, s_k, s_dkh, D);
        else
            ttt::state_add2<D_PAD, BT, NT>(s_dW, s_q, s_dop, s_k, s_dkh, D);
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
            const long long i_ck = (sq.slot_base + i_c / G) * H + i_h;
            ttt::store_state<D_PAD, NT>(dck + i_ck * DD, nullptr, s_dW, nullptr, D);
        }
    }

    if (dh0 != nullptr) ttt::store_state<D_PAD, NT>(dh0 + i_nh * DD, dhb0 + i_nh * D, s_dW, s_dhb, D);
}
