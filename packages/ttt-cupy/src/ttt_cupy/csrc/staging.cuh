// Staging rows into shared memory: cp.async and register-staged loads.
#pragma once

#include "types.cuh"

namespace ttt {

// ---------------------------------------------------------------- asynchronous copies
// cp.async (sm_80+, through L1): BYTES (4 or 16) from global src to shared dst, bypassing
// registers; !full zero-fills and reads nothing. Complete for its thread after
// cp_async_wait_all(), for the block after a barrier that follows. The CPU emulation's
// TTT_EMU_CP_ASYNC(_WAIT) NaN-fill dst until the wait and check src against the launch's arrays.
template <int BYTES>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool full) {
    static_assert(BYTES == 4 || BYTES == 16, "cp_async: 4 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    const unsigned long long s = __cvta_generic_to_global(src);
    const int n = full ? BYTES : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(d), "l"(s),
                 "n"(BYTES), "r"(n)
                 : "memory");
#elif defined(__CUDA_ARCH__)
    __trap();  // the host launches the instances that stage rows on sm_80+ only
#else
    TTT_EMU_CP_ASYNC(dst, src, BYTES, full);
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#elif !defined(__CUDA_ARCH__)
    TTT_EMU_CP_ASYNC_WAIT();
#endif
}

// A [BT, D_PAD] tile of rows staged in shared memory by cp_async: copy() stages rows
// 0 .. L - 1 of src (row i at src + i rs, n elements; zero past them) into s ([BT, kLd]
// elements of S, kLd = D_PAD + kVec: 16-byte rows, and conflict-free accumulator-layout reads
// for 4-byte S). Thread x stages pieces x, x + NT, ... of kVec = 16 / sizeof(S) columns: with
// `vec` (vec_rows_ok) one 16-byte copy each, else element by element (2-byte types by plain
// loads). to_tile() converts the same pieces: after cp_async_wait_all() no barrier is needed.
template <typename S, int D_PAD, int BT, int NT>
struct StagedRows {
    static constexpr int kVec = 16 / (int)sizeof(S);
    static constexpr int kLd = D_PAD + kVec;
    static constexpr int kPieces = D_PAD / kVec;  // per row
    static constexpr int kChunks = (BT * kPieces + NT - 1) / NT;
    static_assert(D_PAD % kVec == 0, "StagedRows: whole pieces per row");

    // f(i, c0) for this thread's pieces (row i, columns c0 .. c0 + kVec - 1)
    template <typename F>
    __device__ __forceinline__ static void for_each_piece(F f) {
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
            const int idx = threadIdx.x + NT * u;
            if ((BT * kPieces) % NT != 0 && idx >= BT * kPieces) break;
            f(idx / kPieces, idx % kPieces * kVec);
        }
    }
    __device__ __forceinline__ static void copy(S* s, const S* __restrict__ src, int rs, int L,
                                                int n, bool vec) {
        for_each_piece([&](int i, int c0) {
            S* d = s + i * kLd + c0;
            if (vec) {
                const bool ok = i < L && c0 < n;
                cp_async<16>(d, ok ? src + i * rs + c0 : src, ok);
            } else {
#pragma unroll
                for (int j = 0; j < kVec; ++j) {
                    const bool ok = i < L && c0 + j < n;
                    if constexpr (sizeof(S) == 4)
                        cp_async<4>(d + j, ok ? src + i * rs + c0 + j : src, ok);
                    else
                        d[j] = ok ? src[i * rs + c0 + j] : from_f32<S>(0.f);
                }
            }
        });
    }
    // out[i, c] = mult * s[i, c] for this thread's pieces, into a [BT, D_PAD + 1] fp32 tile
    __device__ __forceinline__ static void to_tile(float* out, const S* s, float mult) {
        for_each_piece([&](int i, int c0) {
#pragma unroll
            for (int j = 0; j < kVec; ++j)
                out[i * (D_PAD + 1) + c0 + j] = to_f32(s[i * kLd + c0 + j]) * mult;
        });
    }
};

// s[i] = src[i * stride] for i < L, zero for L <= i < BT (cp_async).
template <int BT, int NT>
__device__ __forceinline__ void stage_scalars(float* s, const float* __restrict__ src,
                                              long long stride, int L) {
#pragma unroll
    for (int i = threadIdx.x; i < BT; i += NT)
        cp_async<4>(s + i, i < L ? src + i * stride : src, i < L);
}

// M rows of a state: sW[a, d] = src[a * D + d] for a < rows, d < D (zero elsewhere or when src
// is null); sW [M, D_PAD + 1].
template <int D_PAD, int M, int NT>
__device__ __forceinline__ void load_state_rows(float* sW, const float* src, int rows, int D) {
    constexpr int LD = D_PAD + 1;
    for (int idx = threadIdx.x; idx < M * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        sW[a * LD + d] = (src != nullptr && a < rows && d < D) ? src[a * D + d] : 0.f;
    }
}

// sW[a, d] = src[a * D + d] (zero outside [D, D] or when src is null); sHb likewise when given.
template <int D_PAD, int NT>
__device__ __forceinline__ void load_state(float* sW, float* sHb, const float* src,
                                           const float* srcb, int D) {
    load_state_rows<D_PAD, D_PAD, NT>(sW, src, D, D);
    if (sHb != nullptr) {
        for (int d = threadIdx.x; d < D_PAD; d += NT)
            sHb[d] = (srcb != nullptr && d < D) ? srcb[d] : 0.f;
    }
}

// load_state from slot i_ck of ck, ckb ([slots, H, D, D], [slots, H, D]; DD = D * D).
template <int D_PAD, int NT>
__device__ __forceinline__ void load_slot(float* sW, float* sHb, const float* ck,
                                          const float* ckb, long long i_ck, long long DD, int D) {
    load_state<D_PAD, NT>(sW, sHb, ck + i_ck * DD, ckb + i_ck * D, D);
}

// dst[a * D + d] = sW[a, d]; dstb[d] = sHb[d] when dstb is given.
template <int D_PAD, int NT>
__device__ __forceinline__ void store_state(float* dst, float* dstb, const float* sW,
                                            const float* sHb, int D) {
    constexpr int LD = D_PAD + 1;
    for (int idx = threadIdx.x; idx < D_PAD * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        if (a < D && d < D) dst[a * D + d] = sW[a * LD + d];
    }
    if (dstb != nullptr) {
        for (int d = threadIdx.x; d < D; d += NT) dstb[d] = sHb[d];
    }
}

// M rows of W += c sum_i term(i, a, d): sW[a, d] for a < rows, d < D (sW [M, D_PAD + 1]).
template <int D_PAD, int BT, int NT, int M, typename Term>
__device__ __forceinline__ void state_rows_step(float* sW, float c, int rows, int D, Term term) {
    constexpr int LD = D_PAD + 1;
    for (int idx = threadIdx.x; idx < M * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        if (a < rows && d < D) {
            float acc = 0.f;
#pragma unroll 8
            for (int i = 0; i < BT; ++i) acc += term(i, a, d);
            sW[a * LD + d] += c * acc;
        }
    }
}

// M rows of W += c X^T Y: X [BT, M] (row stride LDX), Y [BT, D_PAD] tiles, zero past the
// valid rows.
template <int D_PAD, int BT, int NT, int M = D_PAD, int LDX = D_PAD + 1>
__device__ __forceinline__ void state_rows_axpy(float* sW, float c, const float* sX,
                                                const float* sY, int rows, int D) {
    state_rows_step<D_PAD, BT, NT, M>(sW, c, rows, D, [&](int i, int a, int d) {
        return sX[i * LDX + a] * sY[i * (D_PAD + 1) + d];
    });
}

// hb[d] += c sum_i Y[i, d] for d < D.
template <int D_PAD, int BT, int NT>
__device__ __forceinline__ void bias_axpy(float* sHb, float c, const float* sY, int D) {
    constexpr int LD = D_PAD + 1;
    for (int d = threadIdx.x; d < D; d += NT) {
        float acc = 0.f;
        for (int i = 0; i < BT; ++i) acc += sY[i * LD + d];
        sHb[d] += c * acc;
    }
}

// W += c X^T Y (X, Y [BT, D_PAD] tiles, zero past the valid rows); hb likewise when given.
template <int D_PAD, int BT, int NT>
__device__ __forceinline__ void state_axpy(float* sW, float* sHb, float c, const float* sX,
                                           const float* sY, int D) {
    state_rows_axpy<D_PAD, BT, NT>(sW, c, sX, sY, D, D);
    if (sHb != nullptr) bias_axpy<D_PAD, BT, NT>(sHb, c, sY, D);
}

// M rows of W += X1^T Y1 + X2^T Y2 (the cotangent step; tiles as state_rows_axpy's).
template <int D_PAD, int BT, int NT, int M = D_PAD, int LDX = D_PAD + 1>
__device__ __forceinline__ void state_rows_add2(float* sW, const float* sX1, const float* sY1,
                                                const float* sX2, const float* sY2, int rows,
                                                int D) {
    constexpr int LD = D_PAD + 1;
    state_rows_step<D_PAD, BT, NT, M>(sW, 1.f, rows, D, [&](int i, int a, int d) {
        return sX1[i * LDX + a] * sY1[i * LD + d] + sX2[i * LDX + a] * sY2[i * LD + d];
    });
}

// sOut[i, j] = X_i . Y_j + add for i, j < L and j <= i (LOWER) or j >= i, else zero (X, Y
// [BT, D_PAD] tiles; sOut [BT, BT + 1]).
template <int D_PAD, int BT, int NT, bool LOWER>
__device__ __forceinline__ void tri_dots(float* sOut, const float* sX, const float* sY, int L,
                                         float add) {
    constexpr int LD = D_PAD + 1, LA = BT + 1;
    for (int idx = threadIdx.x; idx < BT * BT; idx += NT) {
        const int i = idx / BT, j = idx % BT;
        float acc = 0.f;
        if (i < L && j < L && (LOWER ? j <= i : j >= i)) {
#pragma unroll 8
            for (int c = 0; c < D_PAD; ++c) acc += sX[i * LD + c] * sY[j * LD + c];
            acc += add;
        }
        sOut[i * LA + j] = acc;
    }
}

}  // namespace ttt
