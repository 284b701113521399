// Block-wide SIMT tile passes over fp32 shared-memory tiles.
#pragma once

#include "types.cuh"

namespace ttt {

// ---------------------------------------------------------------- block-wide tile passes
// s[i, d] = src[base + (row0 + i) * row_stride + d] * mult for i < L, d < D; zero elsewhere.
template <int D_PAD, int BT, int NT, typename S>
__device__ __forceinline__ void load_tile(float* s, const S* __restrict__ src, long long base,
                                          long long row0, int L, long long row_stride, int D,
                                          float mult) {
    constexpr int LD = D_PAD + 1;
    for (int idx = threadIdx.x; idx < BT * D_PAD; idx += NT) {
        const int i = idx / D_PAD, d = idx % D_PAD;
        float val = 0.f;
        if (i < L && d < D) val = to_f32(src[base + (row0 + i) * row_stride + d]) * mult;
        s[i * LD + d] = val;
    }
}

// One 128-byte line asked into L1 (a hint). The CPU emulation's TTT_EMU_PREFETCH checks that
// the line lies in an array of the launch.
__device__ __forceinline__ void prefetch_line(unsigned long long line) {
#if defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L1 [%0];" ::"l"(__cvta_generic_to_global(
        reinterpret_cast<const void*>(line))));
#elif defined(TTT_EMU_PREFETCH)
    TTT_EMU_PREFETCH(line);
#else
    (void)line;
#endif
}

// The lines of rows row0 .. row0 + L - 1 of src (row_stride apart, n elements each) into L1:
// the chains ask for the next chunk's rows a step early.
template <int NT, typename S>
__device__ __forceinline__ void prefetch_rows(const S* src, long long row0, int L,
                                              long long row_stride, int n) {
    constexpr int kMaxLines = 4;  // a row of <= 128 fp32 spans at most 5 lines; 4 + the tail
    for (int idx = threadIdx.x; idx < L * (kMaxLines + 1); idx += NT) {
        const int i = idx / (kMaxLines + 1), c = idx % (kMaxLines + 1);
        const char* row = reinterpret_cast<const char*>(src + (row0 + i) * row_stride);
        const unsigned long long first = reinterpret_cast<unsigned long long>(row) & ~127ull;
        const unsigned long long last =
            (reinterpret_cast<unsigned long long>(row) + n * sizeof(S) - 1) & ~127ull;
        const unsigned long long line = first + 128ull * c;
        if (line <= last) prefetch_line(line);
    }
}

// L rows of `bytes` bytes, the first at p, `stride` bytes apart (prefetch_spans).
struct RowSpan {
    const void* p;
    long long stride;
    int bytes;
    int L;
};

// The RowSpan of rows row0 .. row0 + L - 1 of src (row_stride elements apart, n each).
template <typename S>
__device__ __forceinline__ RowSpan row_span(const S* src, long long row0, int L,
                                            long long row_stride, int n) {
    return RowSpan{src + row0 * row_stride, row_stride * (long long)sizeof(S),
                   n * (int)sizeof(S), L};
}

// prefetch_rows for several arrays in one flat range over every span's [rows x LPR] line
// slots shared by the block's threads (one pass, not one per array). LPR >= (bytes + 126) /
// 128 + 1 for every span (a row need not start a line); slots past a row's end ask nothing.
template <int NT, int LPR, int N>
__device__ __forceinline__ void prefetch_spans(const RowSpan (&s)[N]) {
    int idx = threadIdx.x;  // this thread's next slot, counted from the current span's start
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int cnt = s[k].L * LPR;
#pragma unroll 1
        for (; idx < cnt; idx += NT) {
            const int i = idx / LPR, c = idx - i * LPR;
            const unsigned long long row = reinterpret_cast<unsigned long long>(s[k].p) +
                                           (unsigned long long)(i * s[k].stride);
            const unsigned long long line = (row & ~127ull) + 128ull * c;
            if (line <= ((row + s[k].bytes - 1) & ~127ull)) prefetch_line(line);
        }
        idx -= cnt;
    }
}

// s[i] = eta[ebase + (row0 + i) * H] for i < L, zero elsewhere.
template <int BT, int NT>
__device__ __forceinline__ void load_eta(float* s, const float* __restrict__ eta, long long ebase,
                                         long long row0, int L, int H) {
    for (int i = threadIdx.x; i < BT; i += NT) s[i] = i < L ? eta[ebase + (row0 + i) * H] : 0.f;
}

// A [BT, D_PAD] tile of the input dtype staged in registers: the chains load the next chunk's
// at a step's start and store it into the other half of a double-buffered fp32 tile at its
// end. Thread x holds pieces x + NT u of kVec = 16 / sizeof(T) columns as raw 16-byte words;
// with `vec` (vec_rows_ok) a piece is one 16-byte load that nothing reads before store(), so
// its latency stays off the chain; else element by element. Zero past L rows and D columns.
template <typename T, int D_PAD, int BT, int NT>
struct StagedTile {
    static constexpr int kVec = 16 / (int)sizeof(T);
    static constexpr int kPieces = D_PAD / kVec;           // pieces per row
    static constexpr int kChunks = BT * kPieces / NT;      // pieces per thread
    static_assert(D_PAD % kVec == 0 && (BT * kPieces) % NT == 0, "StagedTile: tile shape");
    struct alignas(16) Raw {
        unsigned w[4];
    };
    struct alignas(16) Piece {
        T v[kVec];
    };
    static_assert(sizeof(Raw) == 16 && sizeof(Piece) == 16, "StagedTile: 16-byte pieces");
    Raw r[kChunks];

    __device__ __forceinline__ static int row(int u) { return (threadIdx.x + NT * u) / kPieces; }
    __device__ __forceinline__ static int col(int u) {
        return (threadIdx.x + NT * u) % kPieces * kVec;
    }
    // rows 0 .. L - 1 of src (row i at src + i * rs)
    __device__ __forceinline__ void load(const T* __restrict__ src, int rs, int L, int D,
                                         bool vec) {
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
            const int i = row(u), c0 = col(u);
            if (vec) {
                Raw x = {{0u, 0u, 0u, 0u}};
                if (i < L && c0 < D) x = *reinterpret_cast<const Raw*>(src + i * rs + c0);
                r[u] = x;
            } else {
                Piece p;
#pragma unroll
                for (int j = 0; j < kVec; ++j)
                    p.v[j] = i < L && c0 + j < D ? src[i * rs + c0 + j] : from_f32<T>(0.f);
                memcpy(&r[u], &p, sizeof p);
            }
        }
    }
    // s[i, c] = mult * tile[i, c] into a [BT, D_PAD + 1] fp32 tile (every entry written)
    __device__ __forceinline__ void store(float* s, float mult) const {
        constexpr int LD = D_PAD + 1;
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
            Piece p;
            memcpy(&p, &r[u], sizeof p);
#pragma unroll
            for (int j = 0; j < kVec; ++j) s[row(u) * LD + col(u) + j] = to_f32(p.v[j]) * mult;
        }
    }
};

// Whether rows rs apart from p take 16-byte pieces: p aligned, rs and D multiples of kVec.
template <typename T>
__device__ __forceinline__ bool vec_rows_ok(const T* p, long long rs, int D) {
    constexpr int kVec = 16 / (int)sizeof(T);
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0 && rs % kVec == 0 &&
           D % kVec == 0;
}

}  // namespace ttt
