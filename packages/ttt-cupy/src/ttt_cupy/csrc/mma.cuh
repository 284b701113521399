// Tensor-core (tf32 mma.sync) tile passes and the register-resident chain state.
#pragma once

#include "rows.cuh"
#include "types.cuh"

namespace ttt {

// ---------------------------------------------------------------- tensor-core (tf32) tile passes
// The MMA instances' products (half inputs; float inputs keep the SIMT passes): a warp per
// 16 x 8 output tile, mma.sync m16n8k8 (sm_80+) on tf32 operands rounded from the fp32 shared
// tiles, fp32 accumulation. Fragments (PTX ISA, mma.m16n8k8 .tf32), g = lane >> 2, t = lane & 3:
//   A (16 x 8, row):  a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]
//   B (8 x 8, col):   b0 = B[t][g], b1 = B[t + 4][g]
//   C/D (16 x 8):     c0 = C[g][2t], c1 = C[g][2t + 1], c2 = C[g + 8][2t], c3 = C[g + 8][2t + 1]
// Padded columns and rows past the chunk are zero in the tiles: they add nothing.

template <typename T> struct is_half_type { static constexpr bool value = true; };
template <> struct is_half_type<float> { static constexpr bool value = false; };

// A kernel's launch check (MMA instances exist for half types only): traps on less shared
// memory than `bytes`, other than `threads` threads, D > D_PAD or G < 1.
template <typename T, int D_PAD, bool MMA, typename Params>
__device__ __forceinline__ void check_launch(const Params& p, unsigned long long bytes,
                                             int threads) {
    static_assert(!MMA || is_half_type<T>::value, "float inputs keep the SIMT fp32 path");
    if (p.smem_bytes < bytes || blockDim.x != threads || p.D > D_PAD || p.G < 1) __trap();
}

#if defined(__CUDA_ARCH__)
// x rounded to tf32 as cvt.rna (finite x) in one integer add: half a tf32 ulp added, and
// mma.sync ignores the 13 low bits of a .tf32 operand (CUTLASS's round_half_ulp_truncate).
__device__ __forceinline__ unsigned to_tf32(float x) { return __float_as_uint(x) + 0x1000u; }

// d += A B for one m16n8k8 tf32 tile (a warp-wide instruction: every lane must call it).
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4],
                                                 const unsigned (&b)[2]) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // the host launches the MMA instances on sm_80+ only
#endif
}
#endif  // without __CUDA_ARCH__ (the CPU emulation) the harness defines both functions

// EXACT: x comes from raw bf16 / fp16 inputs (at most 11 significant bits: already tf32) and
// passes unrounded; tiles of products (q * scale, g, ...) keep to_tf32.
template <bool EXACT>
__device__ __forceinline__ unsigned tf32_operand(float x) {
    if constexpr (EXACT) {
#if defined(__CUDA_ARCH__)
        return __float_as_uint(x);
#else
        unsigned u;
        std::memcpy(&u, &x, sizeof u);
        return u;
#endif
    } else {
        return to_tf32(x);
    }
}

// acc[j] += sum_k X(m, k) Y(k, n), k in [kbeg, kend) (a multiple of 16 long), for the NB
// 16 x 8 tiles at (m0, n0 + 8 j); X(m, k) = x[m xm + k xk], Y(k, n) = y[k yk + n yn] (the
// strides pick a tile or its transpose). Warp-wide; one A fragment read per k step for the NB
// products. The k order is permuted alike in A and B: per block of KB = 32 (or 16) columns,
// step j gives slot t column (KB/4) t + j and slot t + 4 column (KB/4) t + KB/8 + j, so that
// with row strides = 1 mod 32 lane (g, t) reads bank g + 8 t + j (no conflicts; the plain
// order has 4-way ones).
template <int KB, int NB>
__device__ __forceinline__ void mma_kblock(float (&acc)[NB][4], const float* x0, int xm, int xk,
                                           const float* y0, int yk, int ystep) {
#pragma unroll
    for (int j = 0; j < KB / 8; ++j) {
        const int ka = j, kb = KB / 8 + j;  // columns of slots t and t + 4, less (KB/4) t
        const unsigned a[4] = {to_tf32(x0[ka * xk]), to_tf32(x0[8 * xm + ka * xk]),
                               to_tf32(x0[kb * xk]), to_tf32(x0[8 * xm + kb * xk])};
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
            const unsigned b[2] = {to_tf32(y0[nb * ystep + ka * yk]),
                                   to_tf32(y0[nb * ystep + kb * yk])};
            mma_m16n8k8_tf32(acc[nb], a, b);
        }
    }
}

template <int NB, int UNROLL = 1>
__device__ __forceinline__ void mma_tiles_acc(float (&acc)[NB][4], const float* x, int xm,
                                              int xk, const float* y, int yk, int yn, int m0,
                                              int n0, int kbeg, int kend) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* xr = x + (m0 + g) * xm;  // A[g][slot t] = X(m0 + g, column of slot t)
    const float* yc = y + (n0 + g) * yn;  // B[slot t][g] = Y(column of slot t, n0 + g)
    int k = kbeg;
#pragma unroll UNROLL
    for (; k + 32 <= kend; k += 32)
        mma_kblock<32, NB>(acc, xr + (k + 8 * t) * xk, xm, xk, yc + (k + 8 * t) * yk, yk,
                           8 * yn);
    if (k < kend)  // kend - k == 16
        mma_kblock<16, NB>(acc, xr + (k + 4 * t) * xk, xm, xk, yc + (k + 4 * t) * yk, yk,
                           8 * yn);
}

// mma_tiles_acc of one tile.
__device__ __forceinline__ void mma_tile_acc(float (&acc)[4], const float* x, int xm, int xk,
                                             const float* y, int yk, int yn, int m0, int n0,
                                             int kbeg, int kend) {
    mma_tiles_acc<1, 2>(reinterpret_cast<float (&)[1][4]>(acc), x, xm, xk, y, yk, yn, m0, n0,
                        kbeg, kend);
}

// Four 16 x 8 accumulators side by side (a 16 x 32 block) regrouped within each quad: lane
// (g, t) gets out[h][c] = block[g + 8 h][8 t + c], which lane (g, c / 2) held as
// acc[t][2 h + c % 2]; a 4 x 4 transpose per (h, c % 2) in two xor-shuffle rounds. Row-major
// stores of out are then free of bank conflicts (the accumulator layout's are 4-way).
__device__ __forceinline__ void quad_transpose_4x4(float (&out)[2][8], const float (&acc)[4][4]) {
    const int t = threadIdx.x & 3;
    const bool hi2 = (t & 2) != 0, hi1 = (t & 1) != 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // r = 2 h + e: the entries acc[j][r], j < 4, of this lane
        // round 1 (xor 2): keep the columns j with bit 1 = t's, swap the others: then this
        // lane holds M[t][j], M[t ^ 2][j] for j in {t & 2, (t & 2) + 1}
        const float s0 = hi2 ? acc[0][r] : acc[2][r], s1 = hi2 ? acc[1][r] : acc[3][r];
        const float k0 = hi2 ? acc[2][r] : acc[0][r], k1 = hi2 ? acc[3][r] : acc[1][r];
        const float p0 = __shfl_xor_sync(0xffffffffu, s0, 2);  // M[t ^ 2][j0]
        const float p1 = __shfl_xor_sync(0xffffffffu, s1, 2);  // M[t ^ 2][j0 + 1]
        // round 2 (xor 1): column t stays, column t ^ 1 goes to lane t ^ 1
        const float own_t = hi1 ? k1 : k0, own_o = hi1 ? k0 : k1;    // M[t][t], M[t][t ^ 1]
        const float par_t = hi1 ? p1 : p0, par_o = hi1 ? p0 : p1;    // M[t ^ 2][t], [t ^ 1]
        const float q0 = __shfl_xor_sync(0xffffffffu, own_o, 1);     // M[t ^ 1][t]
        const float q1 = __shfl_xor_sync(0xffffffffu, par_o, 1);     // M[t ^ 3][t]
        // M[t'][t] for t' = t, t ^ 1, t ^ 2, t ^ 3 -> out[h][2 t' + e]
        const int h = r >> 1, e = r & 1;
        const float m_t[4] = {own_t, q0, par_t, q1};  // by t' ^ t = 0, 1, 2, 3
#pragma unroll
        for (int tp = 0; tp < 4; ++tp) {               // tp = t', x = t' ^ t
            const int x = tp ^ t;
            out[h][2 * tp + e] = x == 0 ? m_t[0] : x == 1 ? m_t[1] : x == 2 ? m_t[2] : m_t[3];
        }
    }
}

// One m16n8 accumulator (C/D layout above) into the fp32 tile s (row stride LD) at (m0, n0).
template <int LD>
__device__ __forceinline__ void store_acc_tile(float* s, const float (&acc)[4], int m0, int n0) {
    const int lane = threadIdx.x & 31;
    float* out = s + (m0 + (lane >> 2)) * LD + n0 + 2 * (lane & 3);
    out[0] = acc[0];
    out[1] = acc[1];
    out[8 * LD] = acc[2];
    out[8 * LD + 1] = acc[3];
}

// An [M, N] mma pass in blocks of NB 16 x 8 tiles side by side, block u to warp u % NW: per
// block the warp zeroes acc, runs body(acc, m0, n0) (acc[j]: the tile at (m0, n0 + 8 j)),
// then epi(acc[j], m0, n0 + 8 j), where lane (g, t) holds acc[j][r] = out[m0 + g + 8 (r >> 1),
// n0 + 8 j + 2 t + (r & 1)]. SYNCED: the epilogues run after a __syncthreads (every thread
// calls it), so the output may overwrite an operand; warps hold their accumulators meanwhile.
template <int M, int N, int NW, int NB, bool SYNCED = false, typename Body, typename Epi>
__device__ __forceinline__ void mma_blocks(Body body, Epi epi) {
    static_assert(N % (8 * NB) == 0, "mma_blocks: whole blocks");
    constexpr int NBN = N / (8 * NB), BLOCKS = (M / 16) * NBN;
    constexpr int BPW = SYNCED ? (BLOCKS + NW - 1) / NW : 1;  // blocks held per warp
    const int warp = threadIdx.x >> 5;
    if constexpr (SYNCED) {
        float acc[BPW][NB][4] = {};
#pragma unroll
        for (int v = 0; v < BPW; ++v) {
            const int u = warp + v * NW;
            if (u < BLOCKS) body(acc[v], (u / NBN) * 16, (u % NBN) * 8 * NB);
        }
        __syncthreads();
#pragma unroll
        for (int v = 0; v < BPW; ++v) {
            const int u = warp + v * NW;
            if (u >= BLOCKS) continue;
#pragma unroll
            for (int j = 0; j < NB; ++j) epi(acc[v][j], (u / NBN) * 16, (u % NBN) * 8 * NB + 8 * j);
        }
    } else {
        for (int u = warp; u < BLOCKS; u += NW) {
            const int m0 = (u / NBN) * 16, n0 = (u % NBN) * 8 * NB;
            float acc[NB][4] = {};
            body(acc, m0, n0);
#pragma unroll
            for (int j = 0; j < NB; ++j) epi(acc[j], m0, n0 + 8 * j);
        }
    }
}

// mma_blocks of single tiles: body(acc, m0, n0) with acc the 16 x 8 tile (mma_tile_acc calls).
template <int M, int N, int NW, bool SYNCED = false, typename Body, typename Epi>
__device__ __forceinline__ void mma_tiles(Body body, Epi epi) {
    mma_blocks<M, N, NW, 1, SYNCED>(
        [&](float (&acc)[1][4], int m0, int n0) { body(acc[0], m0, n0); }, epi);
}

// tri_dots on tensor cores, times sign and scale[j] (ROW_SCALE: scale[i]) when given.
template <int D_PAD, int BT, int NW, bool LOWER, bool ROW_SCALE = false>
__device__ __forceinline__ void tri_dots_mma(float* sOut, const float* sX, const float* sY,
                                             int L, float add, const float* scale = nullptr,
                                             float sign = 1.f) {
    constexpr int LD = D_PAD + 1, LA = BT + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    mma_tiles<BT, BT, NW>(
        [&](float (&acc)[4], int m0, int n0) {
            const bool skip = LOWER ? n0 > m0 + 15 : n0 + 7 < m0;  // tile outside the triangle
            if (!skip) mma_tile_acc(acc, sX, LD, 1, sY, 1, LD, m0, n0, 0, D_PAD);
        },
        [&](float (&acc)[4], int m0, int n0) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = m0 + g + 8 * (r >> 1), j = n0 + 2 * t + (r & 1);
                float val = 0.f;
                if (i < L && j < L && (LOWER ? j <= i : j >= i))
                    val = sign * (acc[r] + add) *
                          (scale != nullptr ? scale[ROW_SCALE ? i : j] : 1.f);
                sOut[i * LA + j] = val;
            }
        });
}

// The eta_l of row j's chunk in a block of chunks of BT rows (L valid; sE: per-row eta).
template <int BT>
__device__ __forceinline__ float chunk_eta_l(const float* sE, int j, int L) {
    return sE[min((j / BT + 1) * BT, L) - 1];
}

// A block of R rows (chunks of BT; fwd_out.cu): sM[t, j] = (q_t . k_j + 1) e_t for j <= t in
// t's chunk, (q_t . k_j + 1) eta_l(chunk of j) for j in an earlier chunk, else zero (t, j < L);
// sA (when given) [t, j] = q_t . k_j + 1 for j <= t < L. sM, sA [R, R + 1].
template <int D_PAD, int R, int BT, int NW>
__device__ __forceinline__ void block_dots_mma(float* sM, const float* sQ, const float* sK,
                                               int L, const float* sE, float* sA = nullptr) {
    constexpr int LD = D_PAD + 1, LM = R + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    mma_tiles<R, R, NW>(
        [&](float (&acc)[4], int m0, int n0) {
            if (n0 <= m0 + 15) mma_tile_acc(acc, sQ, LD, 1, sK, 1, LD, m0, n0, 0, D_PAD);
        },
        [&](float (&acc)[4], int m0, int n0) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = m0 + g + 8 * (r >> 1), j = n0 + 2 * t + (r & 1);
                const bool in = i < L && j <= i;
                const float a = in ? acc[r] + 1.f : 0.f;
                sM[i * LM + j] =
                    in ? a * (i / BT == j / BT ? sE[i] : chunk_eta_l<BT>(sE, j, L)) : 0.f;
                if (sA != nullptr) sA[i * LM + j] = a;
            }
        });
}

// state_rows_add2 on tensor cores, times c (X2 / Y2 may be null). BLOCKS (D_PAD >= 32): in
// 16 x 32 blocks; else a 16 x 8 tile at a time, with fewer registers.
template <int D_PAD, int BT, int NW, int M, int LDX, bool BLOCKS = true>
__device__ __forceinline__ void state_rows_update_mma(float* sW, float c, const float* sX1,
                                                      const float* sY1, const float* sX2,
                                                      const float* sY2, int rows, int D) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if constexpr (BLOCKS && D_PAD % 32 == 0) {
        // one X^T fragment read per k step for four products; the sums go into W through
        // quad_transpose_4x4's layout
        constexpr int BN = D_PAD / 32, NBLOCKS = (M / 16) * BN;
        for (int u = threadIdx.x >> 5; u < NBLOCKS; u += NW) {
            const int m0 = (u / BN) * 16, n0 = (u % BN) * 32;
            float acc[4][4] = {};
            mma_tiles_acc<4>(acc, sX1, 1, LDX, sY1, LD, 1, m0, n0, 0, BT);
            if (sX2 != nullptr)  // uniform over the block
                mma_tiles_acc<4>(acc, sX2, 1, LDX, sY2, LD, 1, m0, n0, 0, BT);
            float out[2][8];
            quad_transpose_4x4(out, acc);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int a = m0 + g + 8 * h;
#pragma unroll
                for (int cc = 0; cc < 8; ++cc) {
                    const int d = n0 + 8 * t + cc;
                    if (a < rows && d < D) sW[a * LD + d] += c * out[h][cc];
                }
            }
        }
    } else {
        mma_tiles<M, D_PAD, NW>(
            [&](float (&acc)[4], int m0, int n0) {  // X^T: X(a, i) = sX[i * LDX + a]
                mma_tile_acc(acc, sX1, 1, LDX, sY1, LD, 1, m0, n0, 0, BT);
                if (sX2 != nullptr)  // uniform over the block
                    mma_tile_acc(acc, sX2, 1, LDX, sY2, LD, 1, m0, n0, 0, BT);
            },
            [&](float (&acc)[4], int m0, int n0) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int a = m0 + g + 8 * (r >> 1), d = n0 + 2 * t + (r & 1);
                    if (a < rows && d < D) sW[a * LD + d] += c * acc[r];
                }
            });
    }
}

// state_rows_update_mma over the whole state.
template <int D_PAD, int BT, int NW, bool BLOCKS = true>
__device__ __forceinline__ void state_update_mma(float* sW, float c, const float* sX1,
                                                 const float* sY1, const float* sX2,
                                                 const float* sY2, int D) {
    state_rows_update_mma<D_PAD, BT, NW, D_PAD, D_PAD + 1, BLOCKS>(sW, c, sX1, sY1, sX2, sY2, D,
                                                                   D);
}

// sQ <- q W - e (A g) in place on tensor cores (o_pre - hb): sQ the q tile (scaled), sA
// [BT, BT + 1] the masked A, sE [BT] the per-row eta (!ROW_SCALE: sA holds e already, sE
// unused). SYNCED: every thread must call it.
template <int D_PAD, int BT, int NW, bool ROW_SCALE = true, int NB = 2>
__device__ __forceinline__ void out_pre_mma(float* sQ, const float* sW, const float* sA,
                                            const float* sG, const float* sE) {
    constexpr int LD = D_PAD + 1, LA = BT + 1;
    const int g = (threadIdx.x & 31) >> 2;
    mma_blocks<BT, D_PAD, NW, NB, true>(  // NB tiles side by side: one A read for NB products
        [&](float (&acc)[NB][4], int m0, int n0) {
            float acc2[NB][4] = {};
            mma_tiles_acc<NB>(acc, sQ, LD, 1, sW, LD, 1, m0, n0, 0, D_PAD);
            mma_tiles_acc<NB>(acc2, sA, LA, 1, sG, LD, 1, m0, n0, 0, m0 + 16);  // A is lower
#pragma unroll
            for (int j = 0; j < NB; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    acc[j][r] -= (ROW_SCALE ? sE[m0 + g + 8 * (r >> 1)] : 1.f) * acc2[j][r];
        },
        [&](float (&acc)[4], int m0, int n0) { store_acc_tile<LD>(sQ, acc, m0, n0); });
}

// The group kernels' dw, db partials: the lanes' sums (b_dw, b_db; LPR lanes a row) summed
// over the warp's lane groups, then over the warps in a fixed order through sA, sB (two free
// [NW, D_PAD + 1] areas), to dwp[o_p + d], dbp[o_p + d], d in [d0, d1). Every thread calls it.
template <int D_PAD, int NW, int NT, int LPR = 32, int P>
__device__ __forceinline__ void store_partials(float* sA, float* sB, const float (&b_dw)[P],
                                               const float (&b_db)[P], float* dwp, float* dbp,
                                               long long o_p, int d0, int d1) {
    constexpr int LD = D_PAD + 1;
    const int warp = threadIdx.x >> 5;
    float w_dw[P], w_db[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
        w_dw[e] = b_dw[e];
        w_db[e] = b_db[e];
#pragma unroll
        for (int m = 16; m >= LPR; m >>= 1) {  // the lane groups' sums, in a fixed order
            w_dw[e] += __shfl_xor_sync(0xffffffffu, w_dw[e], m);
            w_db[e] += __shfl_xor_sync(0xffffffffu, w_db[e], m);
        }
    }
    if ((threadIdx.x & 31) < LPR) {
        put_row<D_PAD, LPR>(sA + warp * LD, w_dw);
        put_row<D_PAD, LPR>(sB + warp * LD, w_db);
    }
    __syncthreads();
    for (int d = d0 + threadIdx.x; d < d1; d += NT) {
        float sw = 0.f, sb = 0.f;
        for (int w = 0; w < NW; ++w) {
            sw += sA[w * LD + d];
            sb += sB[w * LD + d];
        }
        dwp[o_p + d] = sw;
        dbp[o_p + d] = sb;
    }
}

// ---------------------------------------------------------------- register-resident chain state
// The chains' MMA instances keep the [D_PAD, D_PAD] state in registers as mma accumulators
// of its transpose (M = n, N = a): warp w owns columns n = 16 w .. 16 w + 15, and lane (g, t)
// holds per block J < D_PAD / 8
//   frag[J][c] = W[a][n],   n = 16 w + g + 8 (c >> 1),   a = state_col(8 J + 2 t + (c & 1)).
// The same registers are the A operand of W^T X^T (K = a; acc_as_a). state_col permutes a
// inside blocks of KB = min(D_PAD, 32) so that both products' B reads from a [BT, D_PAD + 1]
// tile are free of bank conflicts.
template <int D_PAD>
__device__ __forceinline__ int state_col(int j) {
    constexpr int KB = D_PAD < 32 ? D_PAD : 32;
    const int r = j % KB;  // r = 8 J + 2 t + e inside the block
    return j - r + (KB / 4) * ((r & 7) >> 1) + 2 * (r >> 3) + (r & 1);
}

// f(J, c, a, n) for every entry frag[J][c] = W[a][n] of this lane.
template <int D_PAD, typename F>
__device__ __forceinline__ void for_each_state_entry(F f) {
    const int lane = threadIdx.x & 31;
    const int n0 = 16 * (threadIdx.x >> 5) + (lane >> 2);
#pragma unroll
    for (int J = 0; J < D_PAD / 8; ++J)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            f(J, c, state_col<D_PAD>(8 * J + 2 * (lane & 3) + (c & 1)), n0 + 8 * (c >> 1));
}

// frag <- the state src [D, D], hb (columns n0, n0 + 8) <- srcb (zero when null).
template <int D_PAD>
__device__ __forceinline__ void load_state_frag(float (&frag)[D_PAD / 8][4], float (&hb)[2],
                                                const float* src, const float* srcb, int D) {
    const int n0 = 16 * (threadIdx.x >> 5) + ((threadIdx.x & 31) >> 2);
    for_each_state_entry<D_PAD>([&](int J, int c, int a, int n) {
        frag[J][c] = (src != nullptr && a < D && n < D) ? src[a * D + n] : 0.f;
    });
#pragma unroll
    for (int h = 0; h < 2; ++h)
        hb[h] = (srcb != nullptr && n0 + 8 * h < D) ? srcb[n0 + 8 * h] : 0.f;
}

// dst[a * D + n] = W[a][n] from frag; dstb[n] = hb (lanes t = 0) when dstb is given.
template <int D_PAD>
__device__ __forceinline__ void store_state_frag(float* dst, float* dstb,
                                                 const float (&frag)[D_PAD / 8][4],
                                                 const float (&hb)[2], int D) {
    const int lane = threadIdx.x & 31;
    const int n0 = 16 * (threadIdx.x >> 5) + (lane >> 2);
    for_each_state_entry<D_PAD>([&](int J, int c, int a, int n) {
        if (a < D && n < D) dst[a * D + n] = frag[J][c];
    });
    if (dstb != nullptr && (lane & 3) == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (n0 + 8 * h < D) dstb[n0 + 8 * h] = hb[h];
    }
}

// This lane's state columns n0, n0 + 8: whether each is < D, and head i_h's LayerNorm
// weight and bias there (zero past D).
__device__ __forceinline__ void state_cols_ln(bool (&ok)[2], float (&lw)[2], float (&lb)[2],
                                              const float* __restrict__ lnw,
                                              const float* __restrict__ lnb, int i_h, int D) {
    const int n0 = 16 * (threadIdx.x >> 5) + ((threadIdx.x & 31) >> 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        ok[h] = n0 + 8 * h < D;
        lw[h] = ok[h] ? lnw[(long long)i_h * D + n0 + 8 * h] : 0.f;
        lb[h] = ok[h] ? lnb[(long long)i_h * D + n0 + 8 * h] : 0.f;
    }
}

// An m16n8 accumulator as the A operand of a product over its 8 columns (k slots t, t + 4 =
// columns 2 t, 2 t + 1), times `mult`.
__device__ __forceinline__ void acc_as_a(unsigned (&a)[4], const float (&acc)[4], float mult) {
    a[0] = to_tf32(mult * acc[0]);
    a[1] = to_tf32(mult * acc[2]);
    a[2] = to_tf32(mult * acc[1]);
    a[3] = to_tf32(mult * acc[3]);
}

// out[i][c] = (X W)[t][n], t = 8 i + 2 t' + (c & 1), n = 16 w + g + 8 (c >> 1) (lane (g, t')):
// W^T X^T for a [BT, D_PAD + 1] tile sX (EXACT_X: tf32_operand).
template <int D_PAD, int BT, bool EXACT_X = false>
__device__ __forceinline__ void tile_times_state_frag(float (&out)[BT / 8][4],
                                                      const float (&frag)[D_PAD / 8][4],
                                                      const float* sX) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float odd[BT / 8][4];  // the odd blocks J accumulate apart: two chains of half the length
#pragma unroll
    for (int i = 0; i < BT / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) out[i][c] = odd[i][c] = 0.f;
#pragma unroll
    for (int J = 0; J < D_PAD / 8; ++J) {
        unsigned a[4];
        acc_as_a(a, frag[J], 1.f);
        const int col = state_col<D_PAD>(8 * J + 2 * t);
#pragma unroll
        for (int i = 0; i < BT / 8; ++i) {
            const float* x = sX + (8 * i + g) * LD + col;
            const unsigned b[2] = {tf32_operand<EXACT_X>(x[0]), tf32_operand<EXACT_X>(x[1])};
            mma_m16n8k8_tf32(J % 2 == 0 ? out[i] : odd[i], a, b);
        }
    }
#pragma unroll
    for (int i = 0; i < BT / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) out[i][c] += odd[i][c];
}

// frag (W) += mult Y^T X: y in tile_times_state_frag's output layout, X a [BT, D_PAD + 1]
// tile (EXACT_X as there).
template <int D_PAD, int BT, bool EXACT_X = false>
__device__ __forceinline__ void state_update_frag(float (&frag)[D_PAD / 8][4],
                                                  const float (&y)[BT / 8][4], float mult,
                                                  const float* sX) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < BT / 8; ++i) {
        unsigned a[4];
        acc_as_a(a, y[i], mult);
        const float* x0 = sX + (8 * i + 2 * t) * LD;
#pragma unroll
        for (int J = 0; J < D_PAD / 8; ++J) {
            const int col = state_col<D_PAD>(8 * J + g);
            const unsigned b[2] = {tf32_operand<EXACT_X>(x0[col]),
                                   tf32_operand<EXACT_X>(x0[LD + col])};
            mma_m16n8k8_tf32(frag[J], a, b);
        }
    }
}

// K floats moved as one shared-memory access (K = 2 or 4: ld/st.shared.v2 / .v4).
template <int K>
struct alignas(4 * K) FloatK {
    float v[K];
};

// Row sums over all columns of K quantities in the accumulator layout (lane (g, t): rows
// 8 i + 2 t + e): p[i][e][j], the lane's partial, becomes the row's total. A warp
// reduce-scatter, then per-warp partials through red ([NW][BT] x K floats) and one barrier
// (every thread calls it; red must not be read by a pending round).
template <int NW, int BT, int K>
__device__ __forceinline__ void frag_row_sums(float (&p)[BT / 8][2][K], float* red) {
    static_assert(K == 2 || K == 4, "K must be 2 or 4");
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, t0 = 2 * (lane & 3);
    FloatK<K>* rows = reinterpret_cast<FloatK<K>*>(red);
    // Over the 8 lanes g of a row group (xor 16, 8, 4): the V values v[f], f = (2 i + e) K + j,
    // halve each round, a lane keeping the half its bit picks plus the partner's copy of it
    // (7 V / 8 shuffles, not 3 V). It ends with the warp's sums of f = b2 V / 2 + b1 V / 4 +
    // b0 V / 8 + m (m < V / 8; b0 .. b2 = lane bits 2 .. 4), written to red.
    constexpr int V = BT / 8 * 2 * K;
    static_assert(V % 8 == 0, "frag_row_sums: a multiple of 8 values per lane");
    float v1[V / 2], v2[V / 4], v3[V / 8];
    {
        const bool b = (lane >> 4) & 1;
#pragma unroll
        for (int m = 0; m < V / 2; ++m) {
            const int lo = m, hi = m + V / 2;  // p[i][e][j] is v[(2 i + e) K + j]
            const float v_lo = p[lo / (2 * K)][lo / K % 2][lo % K];
            const float v_hi = p[hi / (2 * K)][hi / K % 2][hi % K];
            const float keep = b ? v_hi : v_lo, send = b ? v_lo : v_hi;
            v1[m] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
        }
    }
    {
        const bool b = (lane >> 3) & 1;
#pragma unroll
        for (int m = 0; m < V / 4; ++m) {
            const float keep = b ? v1[m + V / 4] : v1[m], send = b ? v1[m] : v1[m + V / 4];
            v2[m] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
        }
    }
    {
        const bool b = (lane >> 2) & 1;
#pragma unroll
        for (int m = 0; m < V / 8; ++m) {
            const float keep = b ? v2[m + V / 8] : v2[m], send = b ? v2[m] : v2[m + V / 8];
            v3[m] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
        }
    }
    const int f0 = ((lane >> 4) & 1) * (V / 2) + ((lane >> 3) & 1) * (V / 4) +
                   ((lane >> 2) & 1) * (V / 8);
#pragma unroll
    for (int m = 0; m < V / 8; ++m) {
        const int f = f0 + m, ie = f / K, j = f % K;  // ie = 2 i + e
        red[(wid * BT + 8 * (ie >> 1) + t0 + (ie & 1)) * K + j] = v3[m];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < BT / 8; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
            for (int j = 0; j < K; ++j) p[i][e][j] = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) {
                const FloatK<K> part = rows[w * BT + 8 * i + t0 + e];
#pragma unroll
                for (int j = 0; j < K; ++j) p[i][e][j] += part.v[j];
            }
        }
}

// f(i, c, t, n) for this lane's entries x[i][c] of a [BT, D_PAD] tile in the accumulator
// layout: row t = 8 i + 2 t' + (c & 1), column n = 16 w + g + 8 (c >> 1).
template <int NR, typename F>
__device__ __forceinline__ void for_each_frag_entry(F f) {
    const int lane = threadIdx.x & 31, t0 = 2 * (lane & 3);
    const int n0 = 16 * (threadIdx.x >> 5) + (lane >> 2);
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(i, c, 8 * i + t0 + (c & 1), n0 + 8 * (c >> 1));
}

// x[i][c] = rows[t rs + n] at this lane's entries (zero for t >= L or n >= D).
template <int BT, typename S>
__device__ __forceinline__ void load_frag_rows(float (&x)[BT / 8][4], const S* __restrict__ rows,
                                               int rs, int L, int D) {
    for_each_frag_entry<BT / 8>([&](int i, int c, int t, int n) {
        x[i][c] = (t < L && n < D) ? to_f32(rows[t * rs + n]) : 0.f;
    });
}

// load_frag_rows from a StagedRows tile ([BT, LDS], zero past its rows and columns).
template <int BT, int LDS, typename S>
__device__ __forceinline__ void frag_rows_from_smem(float (&x)[BT / 8][4], const S* s) {
    for_each_frag_entry<BT / 8>(
        [&](int i, int c, int t, int n) { x[i][c] = to_f32(s[t * LDS + n]); });
}

// Sum over this warp's 16 state columns (the lanes sharing t) of x0 + x1.
__device__ __forceinline__ float frag_col_sum(float x0, float x1) {
    float s = x0 + x1;
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    s += __shfl_xor_sync(0xffffffffu, s, 16);
    return s;
}

// f(i, e, t) for this lane's accumulator rows t = 8 i + 2 tq + e (entries x[i][e], x[i][e + 2]).
template <int NR, typename F>
__device__ __forceinline__ void for_each_frag_row(int tq, F f) {
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int e = 0; e < 2; ++e) f(i, e, 8 * i + 2 * tq + e);
}

// The mean and M2 of a row over this warp's valid columns (col_ok) into stat[slot].
__device__ __forceinline__ void warp_row_stats(FloatK<2>* stat, int slot, float x0, float x1,
                                               const bool (&col_ok)[2], float inv_cols) {
    const float m = frag_col_sum(x0, x1) * inv_cols;
    const float d0 = col_ok[0] ? x0 - m : 0.f, d1 = col_ok[1] ? x1 - m : 0.f;
    const float m2 = frag_col_sum(d0 * d0, d1 * d1);
    if (((threadIdx.x & 31) >> 2) == 0) stat[slot] = FloatK<2>{{m, m2}};
}

// Row t's mean and M2 over all D columns from the warps' warp_row_stats ([NW][BT]; cols[w]:
// warp w's valid columns), by Chan's formula.
template <int NW, int BT>
__device__ __forceinline__ float chan_mean(const FloatK<2>* stat, const float (&cols)[NW], int t,
                                           float inv_d, float& m2) {
    FloatK<2> st[NW];
    float mean = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        st[w] = stat[w * BT + t];
        mean += cols[w] * st[w].v[0];
    }
    mean *= inv_d;
    m2 = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        const float dm = st[w].v[0] - mean;
        m2 += st[w].v[1] + cols[w] * dm * dm;
    }
    return mean;
}

}  // namespace ttt
