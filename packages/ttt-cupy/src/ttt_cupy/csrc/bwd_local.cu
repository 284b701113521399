// Backward, parallel part 1: ttt_linear_bwd_local<T, D_PAD, BT>. Everything that needs the
// forward state but not the state's cotangent; one block per (group of G chunks, head),
// replaying its group from its checkpoint slot (notation in ttt_common.cuh):
//
//   kh, xh, r, y, g as in the forward;     o_pre = q W + hb - e (A g)
//   do_pre = do + r_o (doh - mean(doh) - oh mean(doh oh)),  doh = do w,  oh = LN(o_pre)
//   dS = do_pre g^T,   dP = -tril(e dS),   dq = scale (do_pre W^T + dP k)
//   deta_i = -sum_j A_ij dS_ij                      (the last-row term comes in bwd_chain.cu)
//   dg_loc = -A^T (e do_pre)
//   dw += sum_i do oh,  db += sum_i do              (post norm-residual part)
//
// It writes dq (final), deta (final except the last-row term), the dw / db partials of the
// block ([groups, H, D]: deterministic, summed in torch), and for the later kernels xhat, r,
// do_pre and dg_loc (fp32). Shared memory: W, hb, Q, K, DO, G, A, dS/dP, eta
// (Traits::kBwdLocalBytes).
#include "ttt_common.cuh"

template <typename T, int D_PAD, int BT>
__global__ void __launch_bounds__(ttt::Traits<D_PAD, BT>::kThreads)
ttt_linear_bwd_local(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     const float* __restrict__ eta,    // [B, T, H] fp32
                     const float* __restrict__ lnw,    // [H, D] fp32
                     const float* __restrict__ lnb,    // [H, D] fp32
                     const T* __restrict__ dout,       // [B, T, H, D] cotangent of o
                     const float* __restrict__ ck,     // [slots, H, D, D] state slots
                     const float* __restrict__ ckb,    // [slots, H, D]
                     float* __restrict__ xbuf,         // [B, T, H, D] fp32 xhat
                     float* __restrict__ rbuf,         // [B, T, H] fp32 r
                     float* __restrict__ dopbuf,       // [B, T, H, D] fp32 do_pre
                     float* __restrict__ dgbuf,        // [B, T, H, D] fp32 dg_loc
                     T* __restrict__ dq,               // [B, T, H, D]
                     float* __restrict__ deta,         // [B, T, H] fp32
                     float* __restrict__ dwp,          // [groups, H, D] partials of dw
                     float* __restrict__ dbp,          // [groups, H, D] partials of db
                     const long long* __restrict__ cu_seqlens,   // [N + 1] or null
                     const long long* __restrict__ grp_offsets,  // [N + 1] or null (varlen)
                     const int* __restrict__ grp_seq,            // [groups] or null (varlen)
                     float scale, float eps, long long T_len, int H, int D, int G,
                     unsigned long long smem_bytes) {
    using Tr = ttt::Traits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane;
    constexpr int LD = Tr::kLd, LA = Tr::kLdA;
    if (smem_bytes < Tr::kBwdLocalBytes || blockDim.x != NT || D > D_PAD || G < 1) __trap();

    extern __shared__ float smem[];
    float* s_W = smem;                 // [D_PAD, LD]  state before the chunk
    float* s_hb = s_W + Tr::kState;    // [D_PAD]
    float* s_q = s_hb + D_PAD;         // [BT, LD]     q * scale
    float* s_k = s_q + Tr::kTile;      // [BT, LD]     k
    float* s_do = s_k + Tr::kTile;     // [BT, LD]     do -> do_pre
    float* s_g = s_do + Tr::kTile;     // [BT, LD]     g
    float* s_A = s_g + Tr::kTile;      // [BT, LA]     tril(q k^T) + tril(1)
    float* s_P = s_A + Tr::kSquare;    // [BT, LA]     dS -> dP
    float* s_e = s_P + Tr::kSquare;    // [BT]         eta (zero past the end)

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const long long gid = blockIdx.x / H;
    const int i_h = (int)(blockIdx.x % H);
    const ttt::Group gr = ttt::group_coords(gid, T_len, BT, G, cu_seqlens, grp_offsets, grp_seq);
    const long long DD = (long long)D * D;

    float b_w[P], b_b[P];                                            // [D] per lane
    ttt::load_row<D_PAD>(b_w, lnw + (long long)i_h * D, D, 1.f);
    ttt::load_row<D_PAD>(b_b, lnb + (long long)i_h * D, D, 1.f);
    float b_dw[P], b_db[P];                                          // this warp's partials
#pragma unroll
    for (int e = 0; e < P; ++e) b_dw[e] = b_db[e] = 0.f;
    const long long i_ck = gr.slot * H + i_h;
    ttt::load_state<D_PAD, NT>(s_W, s_hb, ck + i_ck * DD, ckb + i_ck * D, D);

    const long long row_stride = (long long)H * D;
    const long long p_base = (gr.seq.bos * H + i_h) * D;
    const long long p_ebase = gr.seq.bos * H + i_h;
    for (int j = 0; j < gr.nc; ++j) {
        const long long row0 = (gr.c0 + j) * BT;
        const int L = (int)min((long long)BT, gr.seq.len - row0);
        ttt::load_tile<D_PAD, BT, NT>(s_q, q, p_base, row0, L, row_stride, D, scale);
        ttt::load_tile<D_PAD, BT, NT>(s_k, k, p_base, row0, L, row_stride, D, 1.f);
        ttt::load_tile<D_PAD, BT, NT>(s_do, dout, p_base, row0, L, row_stride, D, 1.f);
        ttt::load_eta<BT, NT>(s_e, eta, p_ebase, row0, L, H);
        __syncthreads();
        const float e_l = s_e[L - 1];

        // A -> s_A (tile pass); row pass: kh -> xh, r, g (s_g; xbuf, rbuf)
        ttt::tri_dots<D_PAD, BT, NT, true>(s_A, s_q, s_k, L, 1.f);
        for (int i = warp; i < BT; i += NW) {
            if (i >= L) {
                ttt::zero_row<D_PAD>(s_g + i * LD);
                continue;
            }
            const long long o_r = p_base + (row0 + i) * row_stride;
            float b_x[P], b_k[P], b_v[P], b_g[P], b_y[P];
            ttt::row_times_state<D_PAD>(b_x, s_k + i * LD, s_W);
#pragma unroll
            for (int e = 0; e < P; ++e) {
                const int d = lane + 32 * e;
                if (d < D) b_x[e] += s_hb[d];
            }
            const float r = ttt::layer_norm_row(b_x, D, eps);
            ttt::load_row<D_PAD>(b_k, s_k + i * LD, D, 1.f);
            ttt::load_row<D_PAD>(b_v, v + o_r, D, 1.f);
            ttt::inner_grad_row(b_g, b_y, b_x, r, b_k, b_v, b_w, b_b, D);
            ttt::put_row<D_PAD>(s_g + i * LD, b_g);
            ttt::store_row<D_PAD>(xbuf + o_r, b_x, D);
            if (lane == 0) rbuf[p_ebase + (row0 + i) * H] = r;
        }
        __syncthreads();

        // row pass: o_pre -> post norm-residual backward -> do_pre (s_do; dopbuf); dw, db
        for (int i = warp; i < L; i += NW) {
            float b_o[P], b_do[P];
            ttt::row_times_state<D_PAD>(b_o, s_q + i * LD, s_W);
            ttt::load_row<D_PAD>(b_do, s_do + i * LD, D, 1.f);
#pragma unroll
            for (int e = 0; e < P; ++e) {
                const int d = lane + 32 * e;
                float acc = 0.f;
                if (d < D) {
                    for (int jj = 0; jj <= i; ++jj) acc += s_A[i * LA + jj] * s_g[jj * LD + d];
                    b_o[e] += s_hb[d] - s_e[i] * acc;
                } else {
                    b_o[e] = 0.f;
                }
            }
            const float ro = ttt::layer_norm_row(b_o, D, eps);      // b_o <- oh
            float b_doh[P];
#pragma unroll
            for (int e = 0; e < P; ++e) {
                b_doh[e] = b_do[e] * b_w[e];
                b_dw[e] += b_do[e] * b_o[e];
                b_db[e] += b_do[e];
            }
            const float m1 = ttt::row_sum(b_doh) / (float)D;
            const float m2 = ttt::row_dot(b_doh, b_o) / (float)D;
#pragma unroll
            for (int e = 0; e < P; ++e)
                b_do[e] = lane + 32 * e < D ? b_do[e] + ro * (b_doh[e] - m1 - b_o[e] * m2) : 0.f;
            ttt::put_row<D_PAD>(s_do + i * LD, b_do);
            ttt::store_row<D_PAD>(dopbuf + p_base + (row0 + i) * row_stride, b_do, D);
        }
        __syncthreads();

        // dS = do_pre g^T (lower triangle) -> s_P
        ttt::tri_dots<D_PAD, BT, NT, true>(s_P, s_do, s_g, L, 0.f);
        __syncthreads();

        // deta_i = -sum_j A_ij dS_ij; dP = -tril(e dS) in place (one thread a row)
        for (int i = tid; i < L; i += NT) {
            float de = 0.f;
            for (int jj = 0; jj <= i; ++jj) {
                const float ds = s_P[i * LA + jj];
                de -= s_A[i * LA + jj] * ds;
                s_P[i * LA + jj] = -s_e[i] * ds;
            }
            deta[p_ebase + (row0 + i) * H] = de;
        }
        __syncthreads();

        // dq = scale (do_pre W^T + dP k);  dg_loc = -A^T (e do_pre)   (tile passes)
        for (int idx = tid; idx < BT * D_PAD; idx += NT) {
            const int i = idx / D_PAD, d = idx % D_PAD;
            if (i < L && d < D) {
                float acc = 0.f, acc2 = 0.f, acc3 = 0.f;
#pragma unroll 8
                for (int c = 0; c < D_PAD; ++c) acc += s_do[i * LD + c] * s_W[d * LD + c];
                for (int jj = 0; jj <= i; ++jj) acc2 += s_P[i * LA + jj] * s_k[jj * LD + d];
                for (int jj = i; jj < L; ++jj)
                    acc3 += s_A[jj * LA + i] * (s_e[jj] * s_do[jj * LD + d]);
                const long long o_x = p_base + (row0 + i) * row_stride + d;
                dq[o_x] = ttt::from_f32<T>(scale * (acc + acc2));
                dgbuf[o_x] = -acc3;
            }
        }
        __syncthreads();

        ttt::state_axpy<D_PAD, BT, NT>(s_W, s_hb, -e_l, s_k, s_g, D);
        __syncthreads();
    }

    // dw, db: the warps' partials summed in a fixed order (s_q, s_k reused as [NW, LD])
    ttt::put_row<D_PAD>(s_q + warp * LD, b_dw);
    ttt::put_row<D_PAD>(s_k + warp * LD, b_db);
    __syncthreads();
    for (int d = tid; d < D; d += NT) {
        float sw = 0.f, sb = 0.f;
        for (int w = 0; w < NW; ++w) {
            sw += s_q[w * LD + d];
            sb += s_k[w * LD + d];
        }
        const long long o_p = (gid * H + i_h) * D + d;
        dwp[o_p] = sw;
        dbp[o_p] = sb;
    }
}
