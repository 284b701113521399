// Chunked TTT-linear kernels: ttt_linear_fwd<T, D_PAD, BT> and ttt_linear_bwd<T, D_PAD, BT>.
//
// The math, the memory layout and the shared-memory budget are documented at the top of
// ttt_linear.cuh. Templates only: the instances a process needs are compiled through
// NVRTC name expressions, e.g. "ttt_linear_fwd<__nv_bfloat16, 64, 16>" (ttt_cupy.compile).
#include "ttt_linear.cuh"

// ================================================================ forward
template <typename T, int D_PAD, int BT>
__global__ void __launch_bounds__(ttt::TttTraits<D_PAD, BT>::kThreads)
ttt_linear_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const float* __restrict__ eta,   // [B, T, H] fp32
               const float* __restrict__ lnw,   // [H, D] fp32
               const float* __restrict__ lnb,   // [H, D] fp32
               const float* __restrict__ h0,    // [N, H, D, D] fp32 or null
               const float* __restrict__ hb0,   // [N, H, D] fp32 or null
               T* __restrict__ o,               // [B, T, H, D]
               float* __restrict__ ht,          // [N, H, D, D] or null
               float* __restrict__ hbt,         // [N, H, D] or null
               float* __restrict__ ck,          // [NCK, H, D, D] or null (no checkpoints)
               float* __restrict__ ckb,         // [NCK, H, D]
               const long long* __restrict__ cu_seqlens,  // [N + 1] or null
               const long long* __restrict__ ck_offsets,  // [N + 1] or null
               float scale, float eps, long long T_len, int H, int D, int G,
               unsigned long long smem_bytes) {
    using Tr = ttt::TttTraits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps;
    constexpr int LD = Tr::kLdT, LW = Tr::kLdW, LA = Tr::kLdA;
    if (smem_bytes < Tr::kFwdBytes || blockDim.x != NT || D > D_PAD) __trap();

    extern __shared__ float smem[];
    float* sW = smem;                  // [D_PAD, LW]  state
    float* sHb = sW + Tr::kState;      // [D_PAD]      bias state
    float* sLw = sHb + D_PAD;          // [D_PAD]      LayerNorm weight
    float* sLb = sLw + D_PAD;          // [D_PAD]      LayerNorm bias
    float* sQ = sLb + D_PAD;           // [BT, LD]     q * scale
    float* sK = sQ + Tr::kTile;        // [BT, LD]     k
    float* sG = sK + Tr::kTile;        // [BT, LD]     g
    float* sX = sG + Tr::kTile;        // [BT, LD]     kh -> xh -> o
    float* sA = sX + Tr::kTile;        // [BT, LA]     tril(q k^T) + tril(1)
    float* sE = sA + Tr::kSquare;      // [BT]         eta (zero past the end)

    const int tid = threadIdx.x, warp = tid >> 5;
    const long long i_nh = blockIdx.x;
    const long long i_n = i_nh / H;
    const int i_h = (int)(i_nh % H);
    const ttt::SeqCoords sc = ttt::seq_coords(i_n, T_len, BT, G, cu_seqlens, ck_offsets);
    const long long NC = (sc.seq_len + BT - 1) / BT;
    const long long DD = (long long)D * D;

    ttt::load_state<D_PAD, NT>(sW, sHb, h0 != nullptr ? h0 + i_nh * DD : nullptr,
                               hb0 != nullptr ? hb0 + i_nh * D : nullptr, D);
    for (int d = tid; d < D_PAD; d += NT) {
        sLw[d] = d < D ? lnw[(long long)i_h * D + d] : 0.f;
        sLb[d] = d < D ? lnb[(long long)i_h * D + d] : 0.f;
    }
    __syncthreads();

    const long long row_stride = (long long)H * D;        // rows are H * D apart
    const long long p_base = (sc.bos * H + i_h) * D;      // row 0 of this (sequence, head)
    const long long p_ebase = sc.bos * H + i_h;           // eta rows are H apart
    for (long long i_c = 0; i_c < NC; ++i_c) {
        if (ck != nullptr && i_c % G == 0) {
            const long long i_ck = (sc.ck0 + i_c / G) * H + i_h;
            ttt::store_state<D_PAD, NT>(ck + i_ck * DD, ckb + i_ck * D, sW, sHb, D);
        }
        const long long row0 = i_c * BT;
        const int L = (int)min((long long)BT, sc.seq_len - row0);
        ttt::load_tile<D_PAD, BT, NT>(sQ, q, p_base, row0, L, row_stride, D, scale);
        ttt::load_tile<D_PAD, BT, NT>(sK, k, p_base, row0, L, row_stride, D, 1.f);
        for (int i = tid; i < BT; i += NT) sE[i] = i < L ? eta[p_ebase + (row0 + i) * H] : 0.f;
        __syncthreads();

        // kh = k W + hb -> sX;  A = tril(q k^T) + tril(1) -> sA
        ttt::kh_tile<D_PAD, BT, NT>(sX, sK, sW, sHb, L, D);
        for (int idx = tid; idx < BT * BT; idx += NT) {
            const int i = idx / BT, j = idx % BT;
            float a = 0.f;
            if (i < L && j <= i) {
#pragma unroll 8
                for (int x = 0; x < D_PAD; ++x) a += sQ[i * LD + x] * sK[j * LD + x];
                a += 1.f;
            }
            sA[i * LA + j] = a;
        }
        __syncthreads();

        // one warp per row: xh = LN(kh) (in sX), g -> sG
        for (int i = warp; i < BT; i += NW) {
            if (i < L) {
                ttt::inner_grad_row<D_PAD>(sX + i * LD, sG + i * LD, sK + i * LD,
                                           v + p_base + (row0 + i) * row_stride, sLw, sLb, D, eps);
            } else {
                for (int d = tid & 31; d < D_PAD; d += 32) sG[i * LD + d] = 0.f;
            }
        }
        __syncthreads();

        // o = q W + hb - eta * (A g) -> sX
        for (int idx = tid; idx < BT * D_PAD; idx += NT) {
            const int i = idx / D_PAD, d = idx % D_PAD;
            float val = 0.f;
            if (i < L && d < D) {
                float acc = 0.f, acc2 = 0.f;
#pragma unroll 8
                for (int a = 0; a < D_PAD; ++a) acc += sQ[i * LD + a] * sW[a * LW + d];
                for (int j = 0; j <= i; ++j) acc2 += sA[i * LA + j] * sG[j * LD + d];
                val = acc + sHb[d] - sE[i] * acc2;
            }
            sX[i * LD + d] = val;
        }
        __syncthreads();

        // state step; epilogue out = o + LN(o) * w + b (one warp per row)
        ttt::state_step<D_PAD, BT, NT>(sW, sHb, sK, sG, sE[L - 1], D);
        for (int i = warp; i < L; i += NW) {
            constexpr int P = Tr::kPerLane;
            const int lane = tid & 31;
            const float* xrow = sX + i * LD;
            float x[P];
            float s = 0.f;
#pragma unroll
            for (int e = 0; e < P; ++e) {
                const int d = lane + 32 * e;
                x[e] = d < D ? xrow[d] : 0.f;
                s += x[e];
            }
            const float mean = ttt::warp_sum(s) / (float)D;
            s = 0.f;
#pragma unroll
            for (int e = 0; e < P; ++e) {
                const int d = lane + 32 * e;
                const float xc = d < D ? x[e] - mean : 0.f;
                s += xc * xc;
            }
            const float r = 1.f / sqrtf(ttt::warp_sum(s) / (float)D + eps);
            T* orow = o + p_base + (row0 + i) * row_stride;
#pragma unroll
            for (int e = 0; e < P; ++e) {
                const int d = lane + 32 * e;
                if (d < D) orow[d] = ttt::from_f32<T>(x[e] + (x[e] - mean) * r * sLw[d] + sLb[d]);
            }
        }
        __syncthreads();
    }

    if (ht != nullptr) ttt::store_state<D_PAD, NT>(ht + i_nh * DD, hbt + i_nh * D, sW, sHb, D);
}

// ================================================================ backward
template <typename T, int D_PAD, int BT>
__global__ void __launch_bounds__(ttt::TttTraits<D_PAD, BT>::kThreads)
ttt_linear_bwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const float* __restrict__ eta,   // [B, T, H] fp32
               const float* __restrict__ lnw,   // [H, D] fp32
               const float* __restrict__ lnb,   // [H, D] fp32
               const T* __restrict__ dout,      // [B, T, H, D] cotangent of o
               const float* __restrict__ dht,   // [N, H, D, D] or null
               const float* __restrict__ dhbt,  // [N, H, D] or null
               const float* __restrict__ ck,    // checkpoints written by the forward
               const float* __restrict__ ckb,
               float* scr,                      // [N * H, SG, D, D] fp32 scratch (no
               float* scrb,                     // [N * H, SG, D]  __restrict__: read back)
               T* __restrict__ dq, T* __restrict__ dk, T* __restrict__ dv,
               float* __restrict__ deta,        // [B, T, H] fp32
               float* __restrict__ dh0,         // [N, H, D, D] or null
               float* __restrict__ dhb0,        // [N, H, D] or null
               float* __restrict__ dwp,         // [N, H, D] partials of dw
               float* __restrict__ dbp,         // [N, H, D] partials of db
               const long long* __restrict__ cu_seqlens,
               const long long* __restrict__ ck_offsets,
               float scale, float eps, long long T_len, int H, int D, int G, int SG,
               unsigned long long smem_bytes) {
    using Tr = ttt::TttTraits<D_PAD, BT>;
    constexpr int NT = Tr::kThreads, NW = Tr::kWarps, P = Tr::kPerLane;
    constexpr int LD = Tr::kLdT, LW = Tr::kLdW, LA = Tr::kLdA;
    if (smem_bytes < Tr::kBwdBytes || blockDim.x != NT || D > D_PAD) __trap();

    extern __shared__ float smem[];
    float* sW = smem;                  // [D_PAD, LW]  state before the chunk
    float* sdW = sW + Tr::kState;      // [D_PAD, LW]  cotangent of the state after the chunk
    float* sHb = sdW + Tr::kState;     // [D_PAD]
    float* sdHb = sHb + D_PAD;         // [D_PAD]
    float* sLw = sdHb + D_PAD;         // [D_PAD]
    float* sLb = sLw + D_PAD;          // [D_PAD]
    float* sQ = sLb + D_PAD;           // [BT, LD]  q * scale
    float* sK = sQ + Tr::kTile;        // [BT, LD]  k
    float* sDO = sK + Tr::kTile;       // [BT, LD]  do -> dop
    float* sX = sDO + Tr::kTile;       // [BT, LD]  kh -> xh -> dy
    float* sG = sX + Tr::kTile;        // [BT, LD]  g -> dw terms
    float* sT1 = sG + Tr::kTile;       // [BT, LD]  o_pre -> k dW -> dk (first terms)
    float* sDY = sT1 + Tr::kTile;      // [BT, LD]  do * oh -> dg -> dkh
    float* sA = sDY + Tr::kTile;       // [BT, LA]  tril(q k^T) + tril(1)
    float* sP = sA + Tr::kSquare;      // [BT, LA]  dA -> dP
    float* sE = sP + Tr::kSquare;      // [BT]      eta
    float* sR = sE + BT;               // [BT]      rstd of kh
    float* sDE = sR + BT;              // [BT]      deta (without the last-row term)
    float* sScal = sDE + BT;           // [4]       deta's last-row term

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const long long i_nh = blockIdx.x;
    const long long i_n = i_nh / H;
    const int i_h = (int)(i_nh % H);
    const ttt::SeqCoords sc = ttt::seq_coords(i_n, T_len, BT, G, cu_seqlens, ck_offsets);
    const long long NC = (sc.seq_len + BT - 1) / BT;
    const long long NG = (NC + G - 1) / G;
    const long long DD = (long long)D * D;

    ttt::load_state<D_PAD, NT>(sdW, sdHb, dht != nullptr ? dht + i_nh * DD : nullptr,
                               dhbt != nullptr ? dhbt + i_nh * D : nullptr, D);
    for (int d = tid; d < D_PAD; d += NT) {
        sLw[d] = d < D ? lnw[(long long)i_h * D + d] : 0.f;
        sLb[d] = d < D ? lnb[(long long)i_h * D + d] : 0.f;
    }
    float dw_acc = 0.f, db_acc = 0.f;   // column tid of dw, db (threads tid < D)

    const long long row_stride = (long long)H * D;
    const long long p_base = (sc.bos * H + i_h) * D;
    const long long p_ebase = sc.bos * H + i_h;
    float* p_scr = scr + i_nh * SG * DD;
    float* p_scrb = scrb + i_nh * SG * D;

    for (long long i_gr = 0; i_gr < NG; ++i_gr) {
        const long long i_g = NG - 1 - i_gr;
        const long long c0 = i_g * G;
        const int nc = (int)min((long long)G, NC - c0);
        // ---- recompute the states before chunks c0 .. c0 + nc - 1 into the scratch ----
        __syncthreads();  // the previous chunk's reads of sW / sHb are done
        const long long i_ck = (sc.ck0 + i_g) * H + i_h;
        ttt::load_state<D_PAD, NT>(sW, sHb, ck + i_ck * DD, ckb + i_ck * D, D);
        __syncthreads();
        ttt::store_state<D_PAD, NT>(p_scr, p_scrb, sW, sHb, D);
        for (int j = 1; j < nc; ++j) {
            const long long row0 = (c0 + j - 1) * BT;
            const int L = (int)min((long long)BT, sc.seq_len - row0);
            ttt::load_tile<D_PAD, BT, NT>(sK, k, p_base, row0, L, row_stride, D, 1.f);
            const float e_l = eta[p_ebase + (row0 + L - 1) * H];
            __syncthreads();
            ttt::kh_tile<D_PAD, BT, NT>(sX, sK, sW, sHb, L, D);
            __syncthreads();
            for (int i = warp; i < BT; i += NW) {
                if (i < L) {
                    ttt::inner_grad_row<D_PAD>(sX + i * LD, sG + i * LD, sK + i * LD,
                                               v + p_base + (row0 + i) * row_stride, sLw, sLb, D,
                                               eps);
                } else {
                    for (int d = lane; d < D_PAD; d += 32) sG[i * LD + d] = 0.f;
                }
            }
            __syncthreads();
            ttt::state_step<D_PAD, BT, NT>(sW, sHb, sK, sG, e_l, D);
            __syncthreads();
            ttt::store_state<D_PAD, NT>(p_scr + j * DD, p_scrb + (long long)j * D, sW, sHb, D);
        }
        __syncthreads();  // the scratch is written (global writes are visible block-wide)

        // ---- walk the group's chunks in reverse ----
        for (int jr = 0; jr < nc; ++jr) {
            const int j = nc - 1 - jr;
            const long long row0 = (c0 + j) * BT;
            const int L = (int)min((long long)BT, sc.seq_len - row0);
            ttt::load_state<D_PAD, NT>(sW, sHb, p_scr + j * DD, p_scrb + (long long)j * D, D);
            ttt::load_tile<D_PAD, BT, NT>(sQ, q, p_base, row0, L, row_stride, D, scale);
            ttt::load_tile<D_PAD, BT, NT>(sK, k, p_base, row0, L, row_stride, D, 1.f);
            ttt::load_tile<D_PAD, BT, NT>(sDO, dout, p_base, row0, L, row_stride, D, 1.f);
            for (int i = tid; i < BT; i += NT) sE[i] = i < L ? eta[p_ebase + (row0 + i) * H] : 0.f;
            __syncthreads();
            const float e_l = sE[L - 1];

            // P1: kh -> sX; A -> sA
            ttt::kh_tile<D_PAD, BT, NT>(sX, sK, sW, sHb, L, D);
            for (int idx = tid; idx < BT * BT; idx += NT) {
                const int i = idx / BT, jj = idx % BT;
                float a = 0.f;
                if (i < L && jj <= i) {
#pragma unroll 8
                    for (int x = 0; x < D_PAD; ++x) a += sQ[i * LD + x] * sK[jj * LD + x];
                    a += 1.f;
                }
                sA[i * LA + jj] = a;
            }
            __syncthreads();

            // P2: xh -> sX, g -> sG, rstd -> sR
            for (int i = warp; i < BT; i += NW) {
                if (i < L) {
                    const float r = ttt::inner_grad_row<D_PAD>(
                        sX + i * LD, sG + i * LD, sK + i * LD,
                        v + p_base + (row0 + i) * row_stride, sLw, sLb, D, eps);
                    if (lane == 0) sR[i] = r;
                } else {
                    for (int d = lane; d < D_PAD; d += 32) sG[i * LD + d] = 0.f;
                    if (lane == 0) sR[i] = 0.f;
                }
            }
            __syncthreads();

            // P3: o_pre = q W + hb - eta * (A g) -> sT1; db += sum_i do
            for (int idx = tid; idx < BT * D_PAD; idx += NT) {
                const int i = idx / D_PAD, d = idx % D_PAD;
                float val = 0.f;
                if (i < L && d < D) {
                    float acc = 0.f, acc2 = 0.f;
#pragma unroll 8
                    for (int a = 0; a < D_PAD; ++a) acc += sQ[i * LD + a] * sW[a * LW + d];
                    for (int jj = 0; jj <= i; ++jj) acc2 += sA[i * LA + jj] * sG[jj * LD + d];
                    val = acc + sHb[d] - sE[i] * acc2;
                }
                sT1[i * LD + d] = val;
            }
            if (tid < D) {
                for (int i = 0; i < BT; ++i) db_acc += sDO[i * LD + tid];
            }
            __syncthreads();

            // P4: post norm-residual backward, one warp per row: do * oh -> sDY, dop -> sDO
            for (int i = warp; i < BT; i += NW) {
                if (i >= L) {
                    for (int d = lane; d < D_PAD; d += 32) sDY[i * LD + d] = 0.f;
                    continue;
                }
                float x[P], dd[P];
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e;
                    x[e] = d < D ? sT1[i * LD + d] : 0.f;
                    dd[e] = d < D ? sDO[i * LD + d] : 0.f;
                    s += x[e];
                }
                const float mean = ttt::warp_sum(s) / (float)D;
                s = 0.f;
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e;
                    x[e] = d < D ? x[e] - mean : 0.f;
                    s += x[e] * x[e];
                }
                const float ro = 1.f / sqrtf(ttt::warp_sum(s) / (float)D + eps);
                float m1 = 0.f, m2 = 0.f;
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e;
                    x[e] *= ro;                                       // oh
                    const float doh = d < D ? dd[e] * sLw[d] : 0.f;
                    m1 += doh;
                    m2 += doh * x[e];
                }
                m1 = ttt::warp_sum(m1) / (float)D;
                m2 = ttt::warp_sum(m2) / (float)D;
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e;
                    if (d < D_PAD) {
                        float dop = 0.f, dwt = 0.f;
                        if (d < D) {
                            const float doh = dd[e] * sLw[d];
                            dop = dd[e] + ro * (doh - m1 - x[e] * m2);
                            dwt = dd[e] * x[e];
                        }
                        sDO[i * LD + d] = dop;
                        sDY[i * LD + d] = dwt;
                    }
                }
            }
            __syncthreads();

            // P5: k dW -> sT1; dA = dop g^T -> sP; dw += sum_i do * oh
            for (int idx = tid; idx < BT * D_PAD; idx += NT) {
                const int i = idx / D_PAD, c = idx % D_PAD;
                float acc = 0.f;
                if (i < L && c < D) {
#pragma unroll 8
                    for (int a = 0; a < D_PAD; ++a) acc += sK[i * LD + a] * sdW[a * LW + c];
                }
                sT1[i * LD + c] = acc;
            }
            for (int idx = tid; idx < BT * BT; idx += NT) {
                const int i = idx / BT, jj = idx % BT;
                float acc = 0.f;
                if (i < L && jj <= i) {
#pragma unroll 8
                    for (int c = 0; c < D_PAD; ++c) acc += sDO[i * LD + c] * sG[jj * LD + c];
                }
                sP[i * LA + jj] = acc;
            }
            if (tid < D) {
                for (int i = 0; i < BT; ++i) dw_acc += sDY[i * LD + tid];
            }
            __syncthreads();

            // P6: dg -> sDY; deta rows -> sDE and dA -> dP (in place); deta's last-row term
            for (int idx = tid; idx < BT * D_PAD; idx += NT) {
                const int i = idx / D_PAD, d = idx % D_PAD;
                float val = 0.f;
                if (i < L && d < D) {
                    float acc = 0.f;
                    for (int jj = i; jj < L; ++jj) acc += sA[jj * LA + i] * (sE[jj] * sDO[jj * LD + d]);
                    val = -acc - e_l * sT1[i * LD + d] - e_l * sdHb[d];
                }
                sDY[i * LD + d] = val;
            }
            if (tid < BT) {
                const int i = tid;
                float de = 0.f;
                for (int jj = 0; jj <= i; ++jj) {
                    const float da = sP[i * LA + jj];
                    de -= sA[i * LA + jj] * da;
                    sP[i * LA + jj] = -sE[i] * da;
                }
                sDE[i] = de;
            }
            if (warp == 0) {
                float s = 0.f;
                for (int idx = lane; idx < BT * D_PAD; idx += 32) {
                    const int i = idx / D_PAD, d = idx % D_PAD;
                    s += sT1[i * LD + d] * sG[i * LD + d];
                }
                for (int d = lane; d < D_PAD; d += 32) {
                    float gs = 0.f;
                    for (int i = 0; i < BT; ++i) gs += sG[i * LD + d];
                    s += sdHb[d] * gs;
                }
                s = ttt::warp_sum(s);
                if (lane == 0) sScal[0] = -s;
            }
            __syncthreads();

            // P7a: deta; dq = scale (dop W^T + dP k); dP^T q - e_l g dW^T -> sT1
            for (int i = tid; i < L; i += NT)
                deta[p_ebase + (row0 + i) * H] = sDE[i] + (i == L - 1 ? sScal[0] : 0.f);
            for (int idx = tid; idx < BT * D_PAD; idx += NT) {
                const int i = idx / D_PAD, d = idx % D_PAD;
                if (i < L && d < D) {
                    float acc = 0.f, acc2 = 0.f;
#pragma unroll 8
                    for (int c = 0; c < D_PAD; ++c) acc += sDO[i * LD + c] * sW[d * LW + c];
                    for (int jj = 0; jj <= i; ++jj) acc2 += sP[i * LA + jj] * sK[jj * LD + d];
                    dq[p_base + (row0 + i) * row_stride + d] = ttt::from_f32<T>(scale * (acc + acc2));
                }
            }
            for (int idx = tid; idx < BT * D_PAD; idx += NT) {
                const int i = idx / D_PAD, a = idx % D_PAD;
                float val = 0.f;
                if (i < L && a < D) {
                    float acc = 0.f, acc2 = 0.f;
                    for (int jj = i; jj < L; ++jj) acc += sP[jj * LA + i] * sQ[jj * LD + a];
#pragma unroll 8
                    for (int c = 0; c < D_PAD; ++c) acc2 += sG[i * LD + c] * sdW[a * LW + c];
                    val = acc - e_l * acc2;
                }
                sT1[i * LD + a] = val;
            }
            __syncthreads();

            // P7b: backward of g(kh, v, k, w, b), one warp per valid row:
            //      dkh -> sDY, dy -> sX, dy * (2 xh w + b - v + k) -> sG, dv -> global
            for (int i = warp; i < L; i += NW) {
                const T* vrow = v + p_base + (row0 + i) * row_stride;
                const float r = sR[i];
                float dg[P], xh[P], y[P], u[P];
                float a1 = 0.f, a2 = 0.f, a3 = 0.f, dr = 0.f;
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e;
                    dg[e] = xh[e] = y[e] = u[e] = 0.f;
                    if (d < D) {
                        dg[e] = sDY[i * LD + d];
                        xh[e] = sX[i * LD + d];
                        u[e] = sLb[d] - ttt::to_f32(vrow[d]) + sK[i * LD + d];
                        y[e] = (xh[e] * sLw[d] + u[e]) * sLw[d];
                        dr += dg[e] * sG[i * LD + d];
                    }
                    a1 += dg[e];
                    a2 += dg[e] * xh[e];
                    a3 += xh[e] * y[e];
                }
                a1 = ttt::warp_sum(a1) / (float)D;
                a2 = ttt::warp_sum(a2) / (float)D;
                a3 = ttt::warp_sum(a3) / (float)D;
                dr = ttt::warp_sum(dr) / r;
                float dy[P], dxh[P];
                float c1 = 0.f, c2 = 0.f;
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e;
                    dy[e] = dxh[e] = 0.f;
                    if (d < D) {
                        dy[e] = r * (dg[e] - a1 - xh[e] * a2);
                        dxh[e] = -r * (dg[e] * a3 + y[e] * a2) + dy[e] * (sLw[d] * sLw[d]);
                    }
                    c1 += dxh[e];
                    c2 += dxh[e] * xh[e];
                }
                c1 = ttt::warp_sum(c1) / (float)D;
                c2 = ttt::warp_sum(c2) / (float)D;
                const float rr = dr * r * r / (float)D;
                T* dvrow = dv + p_base + (row0 + i) * row_stride;
#pragma unroll
                for (int e = 0; e < P; ++e) {
                    const int d = lane + 32 * e;
                    if (d < D) {
                        sDY[i * LD + d] = r * (dxh[e] - c1 - xh[e] * c2) - rr * xh[e];
                        sX[i * LD + d] = dy[e];
                        sG[i * LD + d] = dy[e] * (2.f * xh[e] * sLw[d] + u[e]);
                        dvrow[d] = ttt::from_f32<T>(-dy[e] * sLw[d]);
                    }
                }
            }
            __syncthreads();

            // P8: dk = sT1 + dy w + dkh W^T; dw, db, dhb, dW += q^T dop + k^T dkh
            for (int idx = tid; idx < BT * D_PAD; idx += NT) {
                const int i = idx / D_PAD, a = idx % D_PAD;
                if (i < L && a < D) {
                    float acc = 0.f;
#pragma unroll 8
                    for (int c = 0; c < D_PAD; ++c) acc += sDY[i * LD + c] * sW[a * LW + c];
                    const float val = sT1[i * LD + a] + sX[i * LD + a] * sLw[a] + acc;
                    dk[p_base + (row0 + i) * row_stride + a] = ttt::from_f32<T>(val);
                }
            }
            if (tid < D) {
                float sdop = 0.f, sdkh = 0.f;
                for (int i = 0; i < L; ++i) {
                    dw_acc += sG[i * LD + tid];
                    db_acc += sX[i * LD + tid] * sLw[tid];
                    sdop += sDO[i * LD + tid];
                    sdkh += sDY[i * LD + tid];
                }
                sdHb[tid] += sdop + sdkh;
            }
            for (int idx = tid; idx < D_PAD * D_PAD; idx += NT) {
                const int a = idx / D_PAD, c = idx % D_PAD;
                if (a < D && c < D) {
                    float acc = 0.f;
#pragma unroll 8
                    for (int i = 0; i < BT; ++i)
                        acc += sQ[i * LD + a] * sDO[i * LD + c] + sK[i * LD + a] * sDY[i * LD + c];
                    sdW[a * LW + c] += acc;
                }
            }
            __syncthreads();
        }
    }

    __syncthreads();
    if (dh0 != nullptr) ttt::store_state<D_PAD, NT>(dh0 + i_nh * DD, dhb0 + i_nh * D, sdW, sdHb, D);
    if (tid < D) {
        dwp[i_nh * D + tid] = dw_acc;
        dbp[i_nh * D + tid] = db_acc;
    }
}
