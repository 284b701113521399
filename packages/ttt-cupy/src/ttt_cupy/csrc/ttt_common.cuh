// Chunked TTT-linear: what the five kernels share (SIMT fp32 passes, and the tf32 tensor-core
// tile passes of the kernels' MMA instances for half inputs, at the end of this file).
//
// Notation (per chunk of L <= BT valid rows; rows past the sequence's end are exactly zero and
// take no part in anything: the padding rule of docs/math.md; q is pre-multiplied by `scale`):
//
//   kh  = k W + hb,      xh = (kh - mean) r,   r = 1 / sqrt(var(kh) + eps)
//   y   = (xh w + b - v + k) w                                   (dl / dxh)
//   g   = r (y - mean(y) - xh mean(y xh))                        (dl / dkh of the inner loss)
//   A   = tril(q k^T) + tril(1),   o_pre = q W + hb - e (A g),   o = o_pre + LN(o_pre) w + b
//   W  <- W - eta_l k^T g,         hb <- hb - eta_l sum_i g_i
//
// with e the per-row eta and eta_l the eta of the chunk's last *valid* row. The backward of g
// for a cotangent dg (inner_grad_bwd_row):
//
//   dy  = r (dg - mean(dg) - xh mean(dg xh))
//   dxh = -r (dg mean(xh y) + y mean(dg xh)) + dy w^2,    dr = sum(dg g) / r
//   dkh = r (dxh - mean(dxh) - xh mean(dxh xh)) - dr r^2 xh / D
//
// Checkpoint *slots*: every sequence owns NG + 1 slots (NG = cdiv(chunks, G)); slot s < NG
// holds the fp32 state before chunk s * G and slot NG the final state. A *group* is the run of
// (at most) G chunks between two slots; groups are counted over the batch (grp_offsets [N + 1]
// gives each sequence's first group, grp_seq [groups] each group's sequence, varlen only).
//
// Saved activations (as in the Triton backend): fwd_chain writes xh and r of every valid row;
// the four other kernels read them and derive y and g row-locally (inner_grad_row): no kernel
// but fwd_chain computes k W or the LayerNorm of kh.
//
// Layout: q, k, v, o, do, dq, dk, dv are [B, T, H, D] in the input dtype T (float, __half or
// __nv_bfloat16); the fp32 work buffers xhat, do_pre, dg are [B, T, H, D] and r, eta, deta
// [B, T, H]; w, b [H, D] fp32; states [N, H, D, D] / [N, H, D] and slots [slots, H, D, D] /
// [slots, H, D] fp32. Global offsets are 64-bit. D <= D_PAD: padded columns are zero.
//
// Thread mappings: "row passes" give one warp a row (lane l holds columns l, l + 32, ...,
// kPerLane of them, in registers), or in the group kernels' MMA instances a group of
// Traits::kRowLanes lanes a row (row_col); "tile passes" give one thread an output element,
// or, in the MMA instances, one warp a 16 x 8 output tile or a block of them (mma_tiles,
// mma_blocks, at the end of this file).
// Shared-memory tiles are fp32 with rows padded by one float (no bank conflicts when lanes
// walk down a column). Per-kernel shared memory: Traits<D_PAD, BT>::k*Bytes (traits.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "traits.cuh"

namespace ttt {

// ---------------------------------------------------------------- conversions
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// The sum of x over a group of LPR consecutive lanes (LPR a power of two <= 32), in every lane
// of the group; every lane of the warp must call it (the xor shuffles stay inside the group).
template <int LPR = 32>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int m = LPR / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

__device__ __forceinline__ float warp_sum(float x) { return group_sum<32>(x); }

// ---------------------------------------------------------------- coordinates
struct Seq {
    long long bos;        // first row (over the batch's B * T rows)
    long long len;        // rows
    long long nc;         // chunks (a partial last chunk counts)
    long long slot_base;  // index of the sequence's first checkpoint slot
};

__device__ __forceinline__ Seq seq_coords(long long i_n, long long T_len, int BT, int G,
                                          const long long* __restrict__ cu_seqlens,
                                          const long long* __restrict__ grp_offsets) {
    Seq s;
    if (cu_seqlens != nullptr) {
        s.bos = cu_seqlens[i_n];
        s.len = cu_seqlens[i_n + 1] - s.bos;
        s.slot_base = grp_offsets[i_n] + i_n;
    } else {
        s.bos = i_n * T_len;
        s.len = T_len;
        s.slot_base = i_n * (((T_len + BT - 1) / BT + G - 1) / G + 1);
    }
    s.nc = (s.len + BT - 1) / BT;
    return s;
}

// Segments: the launcher may split a pass into launches over a range of groups [g_lo, g_hi)
// of every sequence (chunks [g_lo G, g_hi G)), so that the group-parallel kernels of one
// segment run beside the chain's next segment (placement.segment_plan). g_hi <= g_lo means
// the whole sequence (one launch).
struct ChunkRange {
    long long lo, hi;  // chunks [lo, hi) of the sequence
    bool skip;         // a segment after the sequence's end (the first segment, g_lo = 0,
                       // keeps an empty sequence: its final slot and state)
};

__device__ __forceinline__ ChunkRange chunk_range(const Seq& s, int G, long long g_lo,
                                                  long long g_hi) {
    if (g_hi <= g_lo) return ChunkRange{0, s.nc, false};
    const long long ng = (s.nc + G - 1) / G;
    const long long lo = g_lo >= ng ? s.nc : g_lo * G;
    const long long hi = g_hi >= ng ? s.nc : g_hi * G;
    return ChunkRange{lo, hi, g_lo > 0 && g_lo >= ng};
}

struct Group {
    Seq seq;
    long long gid;   // index over the batch's groups (slot - sequence index); nc <= 0: none
    long long c0;    // first chunk of the group (in its sequence)
    int nc;          // chunks in the group (1 .. G); 0: the block has no group (a segment's
                     // range past the end of its sequence)
    long long slot;  // slot of the state before chunk c0; slot + 1 is the state after the group
};

// Group j of sequence i_n (nc = 0 where the sequence has no group j).
__device__ __forceinline__ Group group_at(long long i_n, long long j, long long T_len, int BT,
                                          int G, const long long* __restrict__ cu_seqlens,
                                          const long long* __restrict__ grp_offsets) {
    const long long ng_fixed = ((T_len + BT - 1) / BT + G - 1) / G;  // (not varlen)
    Group g;
    g.seq = seq_coords(i_n, T_len, BT, G, cu_seqlens, grp_offsets);
    g.gid = (cu_seqlens != nullptr ? grp_offsets[i_n] : i_n * ng_fixed) + j;
    g.c0 = j * G;
    g.nc = (int)max(0LL, min((long long)G, g.seq.nc - g.c0));
    g.slot = g.seq.slot_base + j;
    return g;
}

// The group of a group-parallel block; x = its (group, head) index / H. One launch over every
// group (g_hi <= g_lo): x is the group's index over the batch. A segment [g_lo, g_hi): x =
// i_n (g_hi - g_lo) + (j - g_lo) for group j of sequence i_n, and nc = 0 where the sequence
// has no group j.
__device__ __forceinline__ Group group_coords(long long x, long long T_len, int BT, int G,
                                              const long long* __restrict__ cu_seqlens,
                                              const long long* __restrict__ grp_offsets,
                                              const int* __restrict__ grp_seq, long long g_lo,
                                              long long g_hi) {
    long long i_n, j;
    const long long ng_fixed = ((T_len + BT - 1) / BT + G - 1) / G;  // (not varlen)
    if (g_hi > g_lo) {
        i_n = x / (g_hi - g_lo);
        j = g_lo + x % (g_hi - g_lo);
    } else if (cu_seqlens != nullptr) {
        i_n = grp_seq[x];
        j = x - grp_offsets[i_n];
    } else {
        i_n = x / ng_fixed;
        j = x % ng_fixed;
    }
    return group_at(i_n, j, T_len, BT, G, cu_seqlens, grp_offsets);
}

// ---------------------------------------------------------------- overlapped passes
// The overlapped passes (placement.overlapped): a chain kernel and the group kernel that reads
// it run at the same time, on two streams, and a group block starts on its group as soon as
// the chain has finished that group, not after the whole chain: fwd_chain -> fwd_out (groups
// in order) and bwd_chain -> bwd_grads (groups from each sequence's end). They share one
// zeroed int32 buffer `sync`:
//
//   sync[kStarted]      chain blocks started        sync[kTicket]    group blocks started
//   sync[kOverflow]     tickets put back (below)    sync[kProgress + c] groups chain c finished
//   sync[kProgress + n_chains + i]  the tickets put back, in any order
//
// A chain block counts itself started first thing and, after each group (everything the
// group block reads stored; a barrier, then a release by thread 0), publishes how many
// groups it has finished. A group block takes the next ticket (group-major: the k-th group
// the chains finish is item k / n_chains of chain k % n_chains, so the earliest finished
// groups go first; bwd_grads: kGradsSplit tickets per item) and waits with an acquire for its
// group. It waits only for chain blocks that have started, i.e. hold a place on the GPU and
// will finish without anyone's help: if not all chain blocks have started after `wait_spins`
// naps (the group blocks came first and may be holding the places the chain needs), it puts
// its ticket back and ends. The launcher's cleanup launch (mode kCleanup, after both kernels)
// runs the tickets put back. So no wait depends on a block that is not running: no deadlock,
// whatever order the GPU places the blocks in (the launcher also holds the group kernel's
// stream until every chain block has started). The arithmetic of every block is that of the
// plain launches (bitwise; the group kernels read these buffers without the read-only path).
namespace overlap {
constexpr int kStarted = 0, kTicket = 1, kOverflow = 2, kProgress = 3;
constexpr int kPlain = 0, kOverlap = 1, kCleanup = 2;  // fwd_out's modes
}  // namespace overlap

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ int load_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void nap() { __nanosleep(256); }
#else  // the CPU emulation: blocks run one after the other, so plain accesses do
inline int load_acquire(const int* p) { return *p; }
inline void store_release(int* p, int v) { *p = v; }
inline int atomicAdd(int* p, int v) { const int old = *p; *p += v; return old; }
inline void nap() {}
#endif

// A chain block: counts itself started (thread 0; sync null: not overlapped).
__device__ __forceinline__ void overlap_chain_started(int* sync) {
    if (sync != nullptr && threadIdx.x == 0) atomicAdd(sync + overlap::kStarted, 1);
}

// A chain block: `groups` groups of chain `chain` are finished. Called after a barrier that
// follows every thread's last store of them (the barrier orders those stores before thread 0's
// release).
__device__ __forceinline__ void overlap_chain_progress(int* sync, long long chain, int groups) {
    if (sync != nullptr && threadIdx.x == 0)
        store_release(sync + overlap::kProgress + chain, groups);
}

// A fwd_out block's item (thread 0 only): its ticket (kOverlap), or the blockIdx.x-th item put
// back (kCleanup); -1: none (put back, or past the items put back).
__device__ __forceinline__ int overlap_claim(int* sync, int mode, long long n_chains,
                                             int wait_spins) {
    if (mode == overlap::kCleanup)
        return blockIdx.x < (unsigned)load_acquire(sync + overlap::kOverflow)
                   ? sync[overlap::kProgress + n_chains + blockIdx.x]
                   : -1;
    const int u = atomicAdd(sync + overlap::kTicket, 1);
    for (int s = 0; s < wait_spins && load_acquire(sync + overlap::kStarted) < n_chains; ++s)
        nap();
    if (load_acquire(sync + overlap::kStarted) < n_chains) {
        sync[overlap::kProgress + n_chains + atomicAdd(sync + overlap::kOverflow, 1)] = u;
        return -1;
    }
    return u;
}

// Thread 0 of a fwd_out block (kOverlap): waits until chain `chain` has finished `groups`
// groups (it has started: overlap_claim).
__device__ __forceinline__ void overlap_wait(const int* sync, long long chain, int groups) {
    while (load_acquire(sync + overlap::kProgress + chain) < groups) nap();
}

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

// One 128-byte line asked for into L1 (a hint: no effect on results). In the CPU emulation
// there is no cache: the harness's TTT_EMU_PREFETCH checks instead that the line is part of
// an array the kernel was given (a hint past an array's end is an indexing slip).
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

// Prefetch into L1 the cache lines of rows row0 .. row0 + L - 1 (rows row_stride elements apart)
// of `src`, n elements each: the sequential kernels ask for the next chunk's rows one step
// early, so that its loads hit L1 instead of waiting for device memory on the chain. A hint
// only (prefetch_line).
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

// Rows of one array for prefetch_spans: L rows of `bytes` bytes, the first at p, rows `stride`
// bytes apart.
struct RowSpan {
    const void* p;
    long long stride;
    int bytes;
    int L;
};

// The RowSpan of rows row0 .. row0 + L - 1 of src (rows row_stride elements apart), n elements
// each (p is only formed, not read, when L = 0).
template <typename S>
__device__ __forceinline__ RowSpan row_span(const S* src, long long row0, int L,
                                            long long row_stride, int n) {
    return RowSpan{src + row0 * row_stride, row_stride * (long long)sizeof(S),
                   n * (int)sizeof(S), L};
}

// prefetch_rows for several arrays at once (a hint only, as there): the block's threads share
// one flat range over every span's [rows x LPR] line slots, so a thread asks for about
// (all slots) / NT lines, where one prefetch_rows call per array costs every thread a pass
// with its own address arithmetic. LPR, line slots per row, must be at least
// (bytes + 126) / 128 + 1 for every span (a row need not start a 128-byte line); slots past
// a row's last line ask for nothing. (The CPU emulation checks every line against the arrays
// of the launch: prefetch_line.)
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

// A [BT, D_PAD] tile of the input dtype staged in registers, for the chains' tile of the next
// chunk: loaded at the start of a step, stored into the other half of a double-buffered fp32
// tile at its end. Thread x holds kVec = 16 / sizeof(T) consecutive columns c0 .. c0 + kVec - 1
// of row i for each of its kChunks pieces (piece u: index x + NT u, row-major over the
// [BT, D_PAD / kVec] pieces), as raw 16-byte words. With `vec` (the rows and src 16-byte
// aligned, D a multiple of kVec: vec_rows_ok) a piece is one predicated 16-byte load into
// zeroed registers, and nothing reads those registers before store(): the load's latency
// stays off the chain (unpacking right after the load made every step wait for device
// memory). Else element by element, packed at once (a slower path for unaligned rows). Zero
// past L rows and D columns.
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

// Whether StagedTile may load 16-byte pieces from a [.., rs]-strided array at p: p 16-byte
// aligned, rs and D multiples of 16 / sizeof(T) elements.
template <typename T>
__device__ __forceinline__ bool vec_rows_ok(const T* p, long long rs, int D) {
    constexpr int kVec = 16 / (int)sizeof(T);
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0 && rs % kVec == 0 &&
           D % kVec == 0;
}

// ---------------------------------------------------------------- asynchronous copies
// cp.async (sm_80+): BYTES (4 or 16) from global src into shared dst without passing through
// registers, so that no instruction waits for the data before cp_async_wait_all(); with
// !full the bytes are zero-filled and src is not read. A copy is complete for its own thread
// after cp_async_wait_all() and for the block after a barrier that follows it. The copies go
// through L1 (.ca), where prefetch hints may have put their lines. In the CPU emulation the
// harness's TTT_EMU_CP_ASYNC / TTT_EMU_CP_ASYNC_WAIT stand in for both (its destination
// turns to NaN at the copy and gets its data at the wait; sources are checked against the
// launch's arrays).
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

// Waits for this thread's cp_async copies (cp.async.wait_all).
__device__ __forceinline__ void cp_async_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#elif !defined(__CUDA_ARCH__)
    TTT_EMU_CP_ASYNC_WAIT();
#endif
}

// A [BT, D_PAD] tile of rows staged in shared memory by cp_async: copy() issues the copies of
// rows 0 .. L - 1 of src (row i at src + i * rs, n elements), zero past L rows and n columns,
// into s ([BT, kLd] elements of S: rows 16 bytes apart, kLd = D_PAD + kVec, which also keeps
// the mma accumulator layout's reads of 4 rows x 8 columns free of bank conflicts for 4-byte
// S). Thread x stages pieces x, x + NT, ... of kVec = 16 / sizeof(S) consecutive columns
// (row-major over [BT, D_PAD / kVec]): with `vec` (vec_rows_ok) one 16-byte copy each, else
// element by element (4-byte copies; 2-byte types by plain loads and stores, a slower path
// for unaligned rows). to_tile() converts the same pieces, so after cp_async_wait_all() a
// thread may convert what it staged without a barrier.
template <typename S, int D_PAD, int BT, int NT>
struct StagedRows {
    static constexpr int kVec = 16 / (int)sizeof(S);
    static constexpr int kLd = D_PAD + kVec;
    static constexpr int kPieces = D_PAD / kVec;  // per row
    static constexpr int kChunks = (BT * kPieces + NT - 1) / NT;
    static_assert(D_PAD % kVec == 0, "StagedRows: whole pieces per row");

    __device__ __forceinline__ static void copy(S* s, const S* __restrict__ src, int rs, int L,
                                                int n, bool vec) {
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
            const int idx = threadIdx.x + NT * u;
            if ((BT * kPieces) % NT != 0 && idx >= BT * kPieces) break;
            const int i = idx / kPieces, c0 = idx % kPieces * kVec;
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
        }
    }
    // out[i, c] = mult * s[i, c] for this thread's pieces, into a [BT, D_PAD + 1] fp32 tile
    __device__ __forceinline__ static void to_tile(float* out, const S* s, float mult) {
        constexpr int LD = D_PAD + 1;
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
            const int idx = threadIdx.x + NT * u;
            if ((BT * kPieces) % NT != 0 && idx >= BT * kPieces) break;
            const int i = idx / kPieces, c0 = idx % kPieces * kVec;
#pragma unroll
            for (int j = 0; j < kVec; ++j)
                out[i * LD + c0 + j] = to_f32(s[i * kLd + c0 + j]) * mult;
        }
    }
};

// s[i] = src[i * stride] for i < L, zero for L <= i < BT, by the block's NT threads
// (cp_async).
template <int BT, int NT>
__device__ __forceinline__ void stage_scalars(float* s, const float* __restrict__ src,
                                              long long stride, int L) {
#pragma unroll
    for (int i = threadIdx.x; i < BT; i += NT)
        cp_async<4>(s + i, i < L ? src + i * stride : src, i < L);
}

// M rows of a state: sW[a, d] = src[a * D + d] for a < rows, d < D (zero elsewhere or when src
// is null); sW [M, D_PAD + 1]. (bwd_grads' split blocks: src the first of their rows.)
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

// M rows of W += c X^T Y: sW[a, d] += c sum_i X[i, a] Y[i, d] for a < rows, d < D; sW
// [M, D_PAD + 1], X [BT, M] (row stride LDX), Y [BT, D_PAD] tiles, zero past the valid rows.
template <int D_PAD, int BT, int NT, int M = D_PAD, int LDX = D_PAD + 1>
__device__ __forceinline__ void state_rows_axpy(float* sW, float c, const float* sX,
                                                const float* sY, int rows, int D) {
    constexpr int LD = D_PAD + 1;
    for (int idx = threadIdx.x; idx < M * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        if (a < rows && d < D) {
            float acc = 0.f;
#pragma unroll 8
            for (int i = 0; i < BT; ++i) acc += sX[i * LDX + a] * sY[i * LD + d];
            sW[a * LD + d] += c * acc;
        }
    }
}

// W += c X^T Y (X, Y [BT, D_PAD] tiles, zero past the valid rows); hb += c sum_i Y_i when
// sHb is given.
template <int D_PAD, int BT, int NT>
__device__ __forceinline__ void state_axpy(float* sW, float* sHb, float c, const float* sX,
                                           const float* sY, int D) {
    constexpr int LD = D_PAD + 1;
    state_rows_axpy<D_PAD, BT, NT>(sW, c, sX, sY, D, D);
    if (sHb != nullptr) {
        for (int d = threadIdx.x; d < D; d += NT) {
            float acc = 0.f;
            for (int i = 0; i < BT; ++i) acc += sY[i * LD + d];
            sHb[d] += c * acc;
        }
    }
}

// M rows of W += X1^T Y1 + X2^T Y2 (the cotangent step): sW[a, d] for a < rows, d < D; sW
// [M, D_PAD + 1], X1, X2 [BT, M] (row stride LDX), Y1, Y2 [BT, D_PAD] tiles, zero past the
// valid rows.
template <int D_PAD, int BT, int NT, int M = D_PAD, int LDX = D_PAD + 1>
__device__ __forceinline__ void state_rows_add2(float* sW, const float* sX1, const float* sY1,
                                                const float* sX2, const float* sY2, int rows,
                                                int D) {
    constexpr int LD = D_PAD + 1;
    for (int idx = threadIdx.x; idx < M * D_PAD; idx += NT) {
        const int a = idx / D_PAD, d = idx % D_PAD;
        if (a < rows && d < D) {
            float acc = 0.f;
#pragma unroll 8
            for (int i = 0; i < BT; ++i)
                acc += sX1[i * LDX + a] * sY1[i * LD + d] + sX2[i * LDX + a] * sY2[i * LD + d];
            sW[a * LD + d] += acc;
        }
    }
}

// W += X1^T Y1 + X2^T Y2 (the cotangent step; [BT, D_PAD] tiles, zero past the valid rows).
template <int D_PAD, int BT, int NT>
__device__ __forceinline__ void state_add2(float* sW, const float* sX1, const float* sY1,
                                           const float* sX2, const float* sY2, int D) {
    state_rows_add2<D_PAD, BT, NT>(sW, sX1, sY1, sX2, sY2, D, D);
}

// sOut[i, j] = X_i . Y_j + add for the (i, j) with i, j < L and j <= i (LOWER) or j >= i
// (upper); zero elsewhere. X, Y [BT, D_PAD] tiles; sOut [BT, BT + 1].
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

// ---------------------------------------------------------------- row passes (LPR lanes a row)
// A row is held by a group of LPR consecutive lanes (LPR = 32 unless given: one warp a row;
// Traits::kRowLanes for the group kernels' MMA instances, where a warp takes 32 / LPR rows at
// once): lane l of its group (l = lane % LPR) holds columns d = l + LPR e, e < P =
// cdiv(D_PAD, LPR); columns >= D hold zero. Every lane of a warp must call the helpers that
// sum over a row (row_sum, row_dot and the passes built on them).

// This lane's column for element e of a row (see above).
template <int LPR = 32>
__device__ __forceinline__ int row_col(int e) {
    return (int)(threadIdx.x & (LPR - 1)) + LPR * e;
}

// x[e] = src[d] * mult for d < D, zero elsewhere (src: global or shared memory).
template <int D_PAD, int LPR = 32, typename S>
__device__ __forceinline__ void load_row(float (&x)[(D_PAD + LPR - 1) / LPR], const S* src, int D,
                                         float mult) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int d = row_col<LPR>(e);
        x[e] = d < D ? to_f32(src[d]) * mult : 0.f;
    }
}

// dst[d] = x[e] for d < D.
template <int D_PAD, int LPR = 32, typename S>
__device__ __forceinline__ void store_row(S* dst, const float (&x)[(D_PAD + LPR - 1) / LPR],
                                          int D) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int d = row_col<LPR>(e);
        if (d < D) dst[d] = from_f32<S>(x[e]);
    }
}

// x[e] = srow[d - a0] for the lane's columns d in [a0, a0 + M), zero elsewhere (a row of a
// [BT, M] part of a tile holding columns a0 .. a0 + M - 1).
template <int D_PAD, int M, int LPR = 32>
__device__ __forceinline__ void load_row_part(float (&x)[(D_PAD + LPR - 1) / LPR],
                                              const float* srow, int a0) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int dl = row_col<LPR>(e) - a0;
        x[e] = dl >= 0 && dl < M ? srow[dl] : 0.f;
    }
}

// dst[d] = x[e] for d in [d0, d1) (store_row for a range of columns).
template <int D_PAD, int LPR = 32, typename S>
__device__ __forceinline__ void store_row_part(S* dst, const float (&x)[(D_PAD + LPR - 1) / LPR],
                                               int d0, int d1) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int d = row_col<LPR>(e);
        if (d >= d0 && d < d1) dst[d] = from_f32<S>(x[e]);
    }
}

// A row of a shared tile: srow[d] = x[e] for every d < D_PAD (zeros included).
template <int D_PAD, int LPR = 32>
__device__ __forceinline__ void put_row(float* srow, const float (&x)[(D_PAD + LPR - 1) / LPR]) {
#pragma unroll
    for (int e = 0; e < (D_PAD + LPR - 1) / LPR; ++e) {
        const int d = row_col<LPR>(e);
        if (d < D_PAD) srow[d] = x[e];
    }
}

template <int D_PAD, int LPR = 32>
__device__ __forceinline__ void zero_row(float* srow) {
    for (int d = row_col<LPR>(0); d < D_PAD; d += LPR) srow[d] = 0.f;
}

template <int LPR = 32, int P>
__device__ __forceinline__ float row_dot(const float (&x)[P], const float (&y)[P]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) s += x[e] * y[e];
    return group_sum<LPR>(s);
}

template <int LPR = 32, int P>
__device__ __forceinline__ float row_sum(const float (&x)[P]) {
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) s += x[e];
    return group_sum<LPR>(s);
}

// out[d] = sum_a arow[a] M[a, d]   (arow: a shared row; M: a [D_PAD, D_PAD + 1] state)
template <int D_PAD>
__device__ __forceinline__ void row_times_state(float (&out)[(D_PAD + 31) / 32],
                                                const float* arow, const float* sM) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < (D_PAD + 31) / 32; ++e) {
        const int d = lane + 32 * e;
        float acc = 0.f;
        if (d < D_PAD) {
#pragma unroll 8
            for (int a = 0; a < D_PAD; ++a) acc += arow[a] * sM[a * LD + d];
        }
        out[e] = acc;
    }
}

// out[d] = sum_c arow[c] M[d, c]   (the row times M^T)
template <int D_PAD>
__device__ __forceinline__ void row_times_state_t(float (&out)[(D_PAD + 31) / 32],
                                                  const float* arow, const float* sM) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < (D_PAD + 31) / 32; ++e) {
        const int d = lane + 32 * e;
        float acc = 0.f;
        if (d < D_PAD) {
#pragma unroll 8
            for (int c = 0; c < D_PAD; ++c) acc += arow[c] * sM[d * LD + c];
        }
        out[e] = acc;
    }
}

// The row times M^T for M rows a0 .. a0 + M - 1 of a state (sM [M, D_PAD + 1]): out[d] =
// sum_c arow[c] M[d - a0, c] for d in [a0, a0 + M), zero for the lane's other columns.
template <int D_PAD, int M>
__device__ __forceinline__ void row_times_state_rows_t(float (&out)[(D_PAD + 31) / 32],
                                                       const float* arow, const float* sM,
                                                       int a0) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int e = 0; e < (D_PAD + 31) / 32; ++e) {
        const int dl = lane + 32 * e - a0;
        float acc = 0.f;
        if (dl >= 0 && dl < M) {
#pragma unroll 8
            for (int c = 0; c < D_PAD; ++c) acc += arow[c] * sM[dl * LD + c];
        }
        out[e] = acc;
    }
}

// In place: x <- LN(x) over the D valid columns (no affine); returns r = 1 / sqrt(var + eps).
template <int LPR = 32, int P>
__device__ __forceinline__ float layer_norm_row(float (&x)[P], int D, float eps) {
    const float inv_d = 1.f / (float)D;
    const float mean = row_sum<LPR>(x) * inv_d;
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < P; ++e) {
        x[e] = row_col<LPR>(e) < D ? x[e] - mean : 0.f;
        s += x[e] * x[e];
    }
    const float r = 1.f / sqrtf(group_sum<LPR>(s) * inv_d + eps);
#pragma unroll
    for (int e = 0; e < P; ++e) x[e] *= r;
    return r;
}

// g and y of a row from xh and r: y = (xh w + b - v + k) w, g = r (y - mean(y) - xh mean(y xh)).
template <int LPR = 32, int P>
__device__ __forceinline__ void inner_grad_row(float (&g)[P], float (&y)[P], const float (&xh)[P],
                                               float r, const float (&k)[P], const float (&v)[P],
                                               const float (&w)[P], const float (&b)[P], int D) {
    const float inv_d = 1.f / (float)D;
#pragma unroll
    for (int e = 0; e < P; ++e)
        y[e] = row_col<LPR>(e) < D ? (xh[e] * w[e] + b[e] - v[e] + k[e]) * w[e] : 0.f;
    const float ym = row_sum<LPR>(y) * inv_d;
    const float yx = row_dot<LPR>(y, xh) * inv_d;
#pragma unroll
    for (int e = 0; e < P; ++e)
        g[e] = row_col<LPR>(e) < D ? r * (y[e] - ym - xh[e] * yx) : 0.f;
}

// The row pass of the inner loss over one chunk (fwd_chain's SIMT instance): warp w takes rows
// w, w + NW, ... < BT. kh = k_i W + hb (a SIMT row product), then xh, r (LayerNorm) and g
// (inner_grad_row) into sG's row; rows >= L are zeroed. Writes xh of row i to xbuf (at
// p_base + (row0 + i) * row_stride) and r to rbuf (at p_ebase + (row0 + i) * H): the group
// kernels derive g from them (inner_grad_rows_saved); with OPTIONAL_SAVE, only when xbuf is
// not null (the fused forward without a backward). b_w, b_b: the LayerNorm weight and bias
// per lane.
template <int D_PAD, int BT, int NW, bool OPTIONAL_SAVE = false, typename T, int P>
__device__ __forceinline__ void inner_grad_rows(float* sG, const float* sK, const float* sW,
                                                const float* sHb, const T* __restrict__ v,
                                                const float (&b_w)[P], const float (&b_b)[P],
                                                long long p_base, long long p_ebase,
                                                long long row0, long long row_stride, int L,
                                                int H, int D, float eps, float* __restrict__ xbuf,
                                                float* __restrict__ rbuf) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31;
    for (int i = threadIdx.x >> 5; i < BT; i += NW) {
        if (i >= L) {
            zero_row<D_PAD>(sG + i * LD);
            continue;
        }
        const long long o_r = p_base + (row0 + i) * row_stride;
        float b_x[P], b_k[P], b_v[P], b_g[P], b_y[P];
        row_times_state<D_PAD>(b_x, sK + i * LD, sW);
#pragma unroll
        for (int e = 0; e < P; ++e) {
            const int d = lane + 32 * e;
            if (d < D) b_x[e] += sHb[d];
        }
        const float r = layer_norm_row(b_x, D, eps);
        load_row<D_PAD>(b_k, sK + i * LD, D, 1.f);
        load_row<D_PAD>(b_v, v + o_r, D, 1.f);
        inner_grad_row(b_g, b_y, b_x, r, b_k, b_v, b_w, b_b, D);
        put_row<D_PAD>(sG + i * LD, b_g);
        if (!OPTIONAL_SAVE || xbuf != nullptr) {
            store_row<D_PAD>(xbuf + o_r, b_x, D);
            if (lane == 0) rbuf[p_ebase + (row0 + i) * H] = r;
        }
    }
}

// g of a block's rows from the xh and r that fwd_chain.cu stored (fwd_out, bwd_local: no k W,
// no LayerNorm statistics): warp w takes rows w, w + NW, ... < BT, 32 / LPR of them at once
// (row w + NW (s + 32 / LPR u) to its lane group s in pass u); g_i = inner_grad_row(xh_i, r_i,
// k_i, v_i) into sG's row, with k from sK and xh_i, v_i, r_i from `src(i, ok, b_x, b_v)`: it
// loads xh and v into the lane's elements (zero past D, and everywhere for rows past L: !ok)
// and returns r (0 past L). Rows >= L so run the pass on zeros (every lane takes part in the
// row sums) and get g = 0. Row-local: no barrier between the rows. (Unrolling the passes, so
// that all their loads are in flight together, made ptxas spill more in bwd_local's and
// fwd_out's MMA instances at D_PAD 64 / 128, BT 16: not done.)
template <int D_PAD, int BT, int NW, int LPR, int P, typename Src>
__device__ __forceinline__ void inner_grad_rows_from(float* sG, const float* sK,
                                                     const float (&b_w)[P],
                                                     const float (&b_b)[P], int L, int D,
                                                     Src src) {
    constexpr int LD = D_PAD + 1, RPP = 32 / LPR;  // rows per warp pass
    static_assert(BT % (NW * RPP) == 0, "inner_grad_rows_from: whole passes");
    const int sub = (threadIdx.x & 31) / LPR;
    for (int i0 = threadIdx.x >> 5; i0 < BT; i0 += NW * RPP) {
        const int i = i0 + NW * sub;
        const bool ok = i < L;
        float b_x[P], b_k[P], b_v[P], b_g[P], b_y[P];
        const float r = src(i, ok, b_x, b_v);
        load_row<D_PAD, LPR>(b_k, sK + i * LD, ok ? D : 0, 1.f);
        inner_grad_row<LPR>(b_g, b_y, b_x, r, b_k, b_v, b_w, b_b, D);
        put_row<D_PAD, LPR>(sG + i * LD, b_g);
    }
}

// inner_grad_rows_from with xh, v, r from device memory: fwd_chain's xbuf, rbuf and v at
// block rows row0 + i.
template <int D_PAD, int BT, int NW, int LPR = 32, typename T, int P>
__device__ __forceinline__ void inner_grad_rows_saved(float* sG, const float* sK,
                                                      const T* __restrict__ v,
                                                      const float* xbuf, const float* rbuf,
                                                      const float (&b_w)[P],
                                                      const float (&b_b)[P], long long p_base,
                                                      long long p_ebase, long long row0,
                                                      long long row_stride, int L, int H,
                                                      int D) {
    inner_grad_rows_from<D_PAD, BT, NW, LPR>(
        sG, sK, b_w, b_b, L, D, [&](int i, bool ok, float (&b_x)[P], float (&b_v)[P]) {
            const long long o_r = p_base + (row0 + (ok ? i : 0)) * row_stride;
            load_row<D_PAD, LPR>(b_x, xbuf + o_r, ok ? D : 0, 1.f);
            load_row<D_PAD, LPR>(b_v, v + o_r, ok ? D : 0, 1.f);
            return ok ? rbuf[p_ebase + (row0 + i) * H] : 0.f;
        });
}

// inner_grad_rows_from with xh, v, r staged in shared memory (StagedRows): row i of v at
// sV + i * ldv, of xh at sX + i * ldx, r at sR[i].
template <int D_PAD, int BT, int NW, int LPR = 32, typename T, int P>
__device__ __forceinline__ void inner_grad_rows_staged(float* sG, const float* sK, const T* sV,
                                                       int ldv, const float* sX, int ldx,
                                                       const float* sR, const float (&b_w)[P],
                                                       const float (&b_b)[P], int L, int D) {
    inner_grad_rows_from<D_PAD, BT, NW, LPR>(
        sG, sK, b_w, b_b, L, D, [&](int i, bool ok, float (&b_x)[P], float (&b_v)[P]) {
            load_row<D_PAD, LPR>(b_x, sX + i * ldx, ok ? D : 0, 1.f);
            load_row<D_PAD, LPR>(b_v, sV + i * ldv, ok ? D : 0, 1.f);
            return ok ? sR[i] : 0.f;
        });
}

// o_pre of row i of a chunk (fwd_out, bwd_local), per lane: q_i W + hb - e_i sum_{j <= i}
// A_ij g_j, zero past D. MMA: q W - e (A g) was left in sQ's row by out_pre_mma, so only hb
// is added; else SIMT products (sA [BT, BT + 1] is the masked A, sE the per-row eta).
// (LPR: the row layout; SIMT takes one warp a row.)
template <int D_PAD, int BT, bool MMA, int LPR = 32, int P>
__device__ __forceinline__ void out_pre_row(float (&o)[P], int i, const float* sQ,
                                            const float* sW, const float* sA, const float* sG,
                                            const float* sHb, const float* sE, int D) {
    constexpr int LD = D_PAD + 1, LA = BT + 1;
    static_assert(MMA || LPR == 32, "the SIMT products take one warp a row");
    if constexpr (MMA)
        load_row<D_PAD, LPR>(o, sQ + i * LD, D_PAD, 1.f);
    else
        row_times_state<D_PAD>(o, sQ + i * LD, sW);
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const int d = row_col<LPR>(e);
        if (d >= D) {
            o[e] = 0.f;
            continue;
        }
        o[e] += sHb[d];
        if constexpr (!MMA) {
            float acc = 0.f;
            for (int jj = 0; jj <= i; ++jj) acc += sA[i * LA + jj] * sG[jj * LD + d];
            o[e] -= sE[i] * acc;
        }
    }
}

// The fused post norm-residual for one row (fwd_out): o <- o + LN(o) w + b.
template <int LPR = 32, int P>
__device__ __forceinline__ void post_norm_row(float (&o)[P], const float (&w)[P],
                                              const float (&b)[P], int D, float eps) {
    float n[P];
#pragma unroll
    for (int e = 0; e < P; ++e) n[e] = o[e];
    layer_norm_row<LPR>(n, D, eps);
#pragma unroll
    for (int e = 0; e < P; ++e) o[e] += n[e] * w[e] + b[e];
}

// The post norm-residual's backward for one row (bwd_local): o (o_pre in) becomes oh =
// LN(o_pre), dout (do in) becomes do_pre = do + r_o (do w - mean(do w) - oh mean(do w oh)),
// and the row's parts of dw (do oh) and db (do) are added to dw, db. Zero past D.
template <int LPR = 32, int P>
__device__ __forceinline__ void post_norm_bwd_row(float (&o)[P], float (&dout)[P],
                                                  const float (&w)[P], float (&dw)[P],
                                                  float (&db)[P], int D, float eps) {
    const float inv_d = 1.f / (float)D;
    const float ro = layer_norm_row<LPR>(o, D, eps);      // o <- oh
    float doh[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
        doh[e] = dout[e] * w[e];
        dw[e] += dout[e] * o[e];
        db[e] += dout[e];
    }
    const float m1 = row_sum<LPR>(doh) * inv_d;
    const float m2 = row_dot<LPR>(doh, o) * inv_d;
#pragma unroll
    for (int e = 0; e < P; ++e)
        dout[e] = row_col<LPR>(e) < D ? dout[e] + ro * (doh[e] - m1 - o[e] * m2) : 0.f;
}

// Backward of g(kh) for the cotangent dg: dkh and dy (see the top of this file).
template <int LPR = 32, int P>
__device__ __forceinline__ void inner_grad_bwd_row(float (&dkh)[P], float (&dy)[P],
                                                   const float (&dg)[P], const float (&xh)[P],
                                                   float r, const float (&y)[P],
                                                   const float (&g)[P], const float (&w)[P],
                                                   int D) {
    const float inv_d = 1.f / (float)D;
    const float a1 = row_sum<LPR>(dg) * inv_d;
    const float a2 = row_dot<LPR>(dg, xh) * inv_d;
    const float a3 = row_dot<LPR>(xh, y) * inv_d;
    const float dr = row_dot<LPR>(dg, g) * r * inv_d;  // dr r^2 / D with dr = sum(dg g) / r
    float dxh[P];
#pragma unroll
    for (int e = 0; e < P; ++e) {
        const bool m = row_col<LPR>(e) < D;
        dy[e] = m ? r * (dg[e] - a1 - xh[e] * a2) : 0.f;
        dxh[e] = m ? -r * (dg[e] * a3 + y[e] * a2) + dy[e] * (w[e] * w[e]) : 0.f;
    }
    const float c1 = row_sum<LPR>(dxh) * inv_d;
    const float c2 = row_dot<LPR>(dxh, xh) * inv_d;
#pragma unroll
    for (int e = 0; e < P; ++e)
        dkh[e] = row_col<LPR>(e) < D ? r * (dxh[e] - c1 - xh[e] * c2) - dr * xh[e] : 0.f;
}


// ---------------------------------------------------------------- tensor-core (tf32) tile passes
// Used by every kernel's MMA instance for half inputs (MMA = true); float inputs keep the SIMT
// passes above (float32-exact arithmetic). One warp computes one 16 x 8 output
// tile at a time with mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (sm_80+), operands
// read from the fp32 shared tiles and rounded to tf32 (to_tf32), fp32 accumulation. Fragment
// layout (PTX ISA, "Matrix Fragments for mma.m16n8k8" with .tf32), g = lane >> 2, t = lane & 3:
//   A (16 x 8, row):  a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]
//   B (8 x 8, col):   b0 = B[t][g], b1 = B[t + 4][g]
//   C/D (16 x 8):     c0 = C[g][2t], c1 = C[g][2t + 1], c2 = C[g + 8][2t], c3 = C[g + 8][2t + 1]
// Padded columns (>= D) and rows past the chunk's end are zero in the tiles, so they add
// nothing; results outside [D, D] are not written back to the state.

template <typename T> struct is_half_type { static constexpr bool value = true; };
template <> struct is_half_type<float> { static constexpr bool value = false; };

#if defined(__CUDA_ARCH__)
// x rounded to tf32, to nearest with ties away from zero (cvt.rna's rounding, for finite x):
// half a tf32 ulp (bit 12) is added to the bit pattern and mma.sync ignores the 13 low bits
// of a .tf32 operand (CUTLASS's round_half_ulp_truncate). One integer add, where cvt.rna
// takes several instructions on sm_90.
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

// An mma operand read from a tile of raw bf16 / fp16 inputs (converted to fp32: at most 11
// significant bits, so already a tf32 value) needs no rounding: EXACT passes its bits as they
// are, one integer add less per operand. Tiles of products (q * scale, g, ...) keep to_tf32.
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

// The warp tile of every mma pass: acc += sum_k X(m, k) Y(k, n) over k in [kbeg, kend) (a
// multiple of 16 long) for the 16 x 8 output tile at (m0, n0), with X(m, k) = x[m * xm + k * xk]
// and Y(k, n) = y[k * yk + n * yn] (the strides pick a tile or its transpose). Every lane of
// the warp must call it. The k order is permuted, the same way in A and B (the sum does not
// change): per block of KB = 32 (or 16) columns, mma step j gives slot t column (KB/4) t + j
// and slot t + 4 column (KB/4) t + KB/8 + j. With row strides = 1 mod 32 (D_PAD + 1, BT + 1
// for D_PAD, BT >= 32) lane (g, t) then reads bank g + 8 t + j: no bank conflicts in a 32
// block (2-way in a 16 block), where the plain order (slot t = column t) has 4-way conflicts.
template <int KB>
__device__ __forceinline__ void mma_kblock(float (&acc)[4], const float* x0, int xm, int xk,
                                           const float* y0, int yk) {
#pragma unroll
    for (int j = 0; j < KB / 8; ++j) {
        const int ka = j, kb = KB / 8 + j;  // columns of slots t and t + 4, less (KB/4) t
        const unsigned a[4] = {to_tf32(x0[ka * xk]), to_tf32(x0[8 * xm + ka * xk]),
                               to_tf32(x0[kb * xk]), to_tf32(x0[8 * xm + kb * xk])};
        const unsigned b[2] = {to_tf32(y0[ka * yk]), to_tf32(y0[kb * yk])};
        mma_m16n8k8_tf32(acc, a, b);
    }
}

__device__ __forceinline__ void mma_tile_acc(float (&acc)[4], const float* x, int xm, int xk,
                                             const float* y, int yk, int yn, int m0, int n0,
                                             int kbeg, int kend) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* xr = x + (m0 + g) * xm;  // A[g][slot t] = X(m0 + g, column of slot t)
    const float* yc = y + (n0 + g) * yn;  // B[slot t][g] = Y(column of slot t, n0 + g)
    int k = kbeg;
#pragma unroll 2
    for (; k + 32 <= kend; k += 32)
        mma_kblock<32>(acc, xr + (k + 8 * t) * xk, xm, xk, yc + (k + 8 * t) * yk, yk);
    if (k < kend)  // kend - k == 16
        mma_kblock<16>(acc, xr + (k + 4 * t) * xk, xm, xk, yc + (k + 4 * t) * yk, yk);
}

// mma_tile_acc for NB tiles side by side: acc[j] += the 16 x 8 output tile at (m0, n0 + 8 j),
// j < NB. Each k step reads the A fragment once for the NB products (NB times fewer A reads
// from shared memory than NB mma_tile_acc calls). Same k order as mma_kblock.
template <int KB, int NB>
__device__ __forceinline__ void mma_kblock_n(float (&acc)[NB][4], const float* x0, int xm,
                                             int xk, const float* y0, int yk, int ystep) {
#pragma unroll
    for (int j = 0; j < KB / 8; ++j) {
        const int ka = j, kb = KB / 8 + j;
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

template <int NB>
__device__ __forceinline__ void mma_tiles_acc(float (&acc)[NB][4], const float* x, int xm,
                                              int xk, const float* y, int yk, int yn, int m0,
                                              int n0, int kbeg, int kend) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float* xr = x + (m0 + g) * xm;
    const float* yc = y + (n0 + g) * yn;
    int k = kbeg;
#pragma unroll 1
    for (; k + 32 <= kend; k += 32)
        mma_kblock_n<32, NB>(acc, xr + (k + 8 * t) * xk, xm, xk, yc + (k + 8 * t) * yk, yk,
                             8 * yn);
    if (k < kend)  // kend - k == 16
        mma_kblock_n<16, NB>(acc, xr + (k + 4 * t) * xk, xm, xk, yc + (k + 4 * t) * yk, yk,
                             8 * yn);
}

// Four 16 x 8 accumulators side by side (a 16 x 32 block, acc[j] at columns 8 j ..) regrouped
// within each quad of lanes: lane (g, t) gets out[h][c] = block[g + 8 h][8 t + c] (h < 2,
// c < 8), which lane (g, c / 2) held as acc[t][2 h + c % 2]. Per (h, c % 2) a 4 x 4 transpose
// over the quad's lanes in two xor-shuffle rounds (lane bit 2, then bit 1). A row-major
// store of out then puts lane (g, t) on bank g + 8 t + c of rows 1 mod 32 apart: no bank
// conflicts, where the accumulator layout's stores are 4-way conflicted.
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

// Writes one m16n8 accumulator into the fp32 tile s (row stride LD) at (m0, n0), in the C/D
// fragment layout above: lane (g, t) holds C[g][2t], C[g][2t + 1], C[g + 8][2t], C[g + 8][2t + 1].
template <int LD>
__device__ __forceinline__ void store_acc_tile(float* s, const float (&acc)[4], int m0, int n0) {
    const int lane = threadIdx.x & 31;
    float* out = s + (m0 + (lane >> 2)) * LD + n0 + 2 * (lane & 3);
    out[0] = acc[0];
    out[1] = acc[1];
    out[8 * LD] = acc[2];
    out[8 * LD + 1] = acc[3];
}

// The [M, N] output of an mma pass in 16 x 8 tiles, tile u to warp u % NW: for
// each of its tiles a warp zeroes acc, runs body(acc, m0, n0) (mma_tile_acc calls) and then
// epi(acc, m0, n0), where lane (g, t) holds acc[r] = out[m0 + g + 8 (r >> 1), n0 + 2 t + (r & 1)].
template <int M, int N, int NW, typename Body, typename Epi>
__device__ __forceinline__ void mma_tiles(Body body, Epi epi) {
    constexpr int NTN = N / 8, TILES = (M / 16) * NTN;
    for (int u = threadIdx.x >> 5; u < TILES; u += NW) {
        const int m0 = (u / NTN) * 16, n0 = (u % NTN) * 8;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        body(acc, m0, n0);
        epi(acc, m0, n0);
    }
}

// mma_tiles whose epilogues run after a __syncthreads (every thread must call it): the output
// may overwrite an operand of the products. A warp holds its (at most ceil(TILES / NW))
// tiles' accumulators in registers meanwhile.
template <int M, int N, int NW, typename Body, typename Epi>
__device__ __forceinline__ void mma_tiles_synced(Body body, Epi epi) {
    constexpr int NTN = N / 8, TILES = (M / 16) * NTN, TPW = (TILES + NW - 1) / NW;
    const int warp = threadIdx.x >> 5;
    float acc[TPW][4];
#pragma unroll
    for (int v = 0; v < TPW; ++v) {
        const int u = warp + v * NW;
        acc[v][0] = acc[v][1] = acc[v][2] = acc[v][3] = 0.f;
        if (u < TILES) body(acc[v], (u / NTN) * 16, (u % NTN) * 8);
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < TPW; ++v) {
        const int u = warp + v * NW;
        if (u < TILES) epi(acc[v], (u / NTN) * 16, (u % NTN) * 8);
    }
}

// mma_tiles over blocks of NB tiles side by side: block u (16 x 8 NB at (m0, n0)) to warp
// u % NW; body(acc, m0, n0) fills acc[j], the tile at (m0, n0 + 8 j) (mma_tiles_acc calls:
// one A fragment read per k step for the NB products), then epi(acc[j], m0, n0 + 8 j) per tile.
// SYNCED: the epilogues run after a __syncthreads (every thread must call it), as in
// mma_tiles_synced.
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

// sOut[i, j] = sign (X_i . Y_j + add) for i, j < L and j <= i (LOWER) or j >= i (upper),
// times scale[j] (or scale[i]: ROW_SCALE) when given; zero elsewhere (tri_dots on tensor
// cores; X, Y [BT, D_PAD] tiles, sOut [BT, BT + 1]). The mma twin of tri_dots.
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


// The eta_l of row j's chunk in a block of several chunks of BT rows (fwd_out.cu,
// bwd_local.cu): eta at the chunk's last valid row (sE: the block's per-row eta, L valid rows;
// j < L).
template <int BT>
__device__ __forceinline__ float chunk_eta_l(const float* sE, int j, int L) {
    return sE[min((j / BT + 1) * BT, L) - 1];
}

// The group kernels' blocks of R rows (several chunks of BT rows; fwd_out.cu, bwd_local.cu):
// sM[t, j] = (q_t . k_j + 1) e_t for j <= t in t's chunk, (q_t . k_j + 1) eta_l(chunk of j)
// for j in an earlier chunk, zero elsewhere (t, j < L); with sA also sA[t, j] = q_t . k_j + 1
// for every j <= t < L (zero elsewhere). sE: each row's eta (zero past L); sM, sA [R, R + 1].
// Tensor cores; tiles wholly above the diagonal skip the product.
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

// M rows of W[a, d] += c (X1^T Y1 + X2^T Y2)[a, d] for a < rows, d < D (sW [M, D_PAD + 1];
// X* [BT, M] tiles of row stride LDX, Y* [BT, D_PAD] tiles, zero past the valid rows; X2 / Y2
// may be null). Tiles: (M / 16) x (D_PAD / 8), K = BT (or 2 BT). BLOCKS (at D_PAD >= 32): in
// 16 x 32 blocks, below; else one 16 x 8 tile at a time, with fewer registers (fwd_out: 64
// instead of 128 at D_PAD 64, chunk 16).
template <int D_PAD, int BT, int NW, int M, int LDX, bool BLOCKS = true>
__device__ __forceinline__ void state_rows_update_mma(float* sW, float c, const float* sX1,
                                                      const float* sY1, const float* sX2,
                                                      const float* sY2, int rows, int D) {
    constexpr int LD = D_PAD + 1;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if constexpr (BLOCKS && D_PAD % 32 == 0) {
        // 16 x 32 blocks, block u to warp u % NW: each k step reads X^T's fragment once for
        // four products (mma_tiles_acc), and the sums go into W through quad_transpose_4x4's
        // layout (row-major, free of bank conflicts) instead of the accumulators'
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

// W[a, d] += c (X1^T Y1 + X2^T Y2)[a, d] for a, d < D (X*, Y* [BT, D_PAD] tiles, zero past
// the valid rows; X2 / Y2 may be null). Tiles: (D_PAD / 16) x (D_PAD / 8), K = BT (or 2 BT).
template <int D_PAD, int BT, int NW, bool BLOCKS = true>
__device__ __forceinline__ void state_update_mma(float* sW, float c, const float* sX1,
                                                 const float* sY1, const float* sX2,
                                                 const float* sY2, int D) {
    state_rows_update_mma<D_PAD, BT, NW, D_PAD, D_PAD + 1, BLOCKS>(sW, c, sX1, sY1, sX2, sY2, D,
                                                                   D);
}

// sQ <- q W - e (A g) on tensor cores, in place (fwd_out and bwd_local's o_pre - hb): sQ the
// [BT, D_PAD] q tile (pre-scaled), sW the state, sA [BT, BT + 1] the masked A = tril(q k^T +
// 1), sG the g tile, sE [BT] the per-row eta. The products finish in every warp before the
// result overwrites q (mma_tiles_synced; every thread must call it).
//
// ROW_SCALE false: sA already holds e (and any other per-entry factor): sQ <- q W - A g, sE
// unused.
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

// The group kernels' dw, db partials: each warp's per-lane sums (b_dw, b_db, in the row layout
// of LPR lanes: its lane groups' sums are added first) summed over the warps in a fixed order
// (deterministic) through sA, sB (two free [NW, D_PAD + 1] areas of shared memory), written to
// dwp[o_p + d], dbp[o_p + d] for d in [d0, d1). Every thread must call it.
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

// hb[d] += c sum_i Y[i, d] for d < D (the bias step of state_axpy, on its own).
template <int D_PAD, int BT, int NT>
__device__ __forceinline__ void bias_axpy(float* sHb, float c, const float* sY, int D) {
    constexpr int LD = D_PAD + 1;
    for (int d = threadIdx.x; d < D; d += NT) {
        float acc = 0.f;
        for (int i = 0; i < BT; ++i) acc += sY[i * LD + d];
        sHb[d] += c * acc;
    }
}

// ---------------------------------------------------------------- register-resident chain state
// The chain kernels' MMA instances keep the [D_PAD, D_PAD] state in registers, as mma
// accumulators of its transpose (M = n, N = a): warp w owns the columns n = 16 w .. 16 w + 15
// of W, and lane (g, t) holds, per block J < D_PAD / 8 of 8 accumulator columns, 4 entries
//   frag[J][c] = W[a][n],   n = 16 w + g + 8 (c >> 1),   a = state_col(8 J + 2 t + (c & 1)).
// The same registers are the A operand of W^T X^T (K = a) when the k slots t / t + 4 of block J
// stand for the columns state_col(8 J + 2 t) / + 1: a = {c0, c2, c1, c3} (acc_as_a); so the
// state never goes through shared memory. state_col permutes a inside blocks of
// KB = min(D_PAD, 32) so that both products' B reads from a [BT, D_PAD + 1] tile are free of
// bank conflicts (lane (g, t) reads column KB/4 t + 2 J of row g, or column KB/4 (g >> 1) +
// 2 J + (g & 1) of row 2 t).
template <int D_PAD>
__device__ __forceinline__ int state_col(int j) {
    constexpr int KB = D_PAD < 32 ? D_PAD : 32;
    const int r = j % KB;  // r = 8 J + 2 t + e inside the block
    return j - r + (KB / 4) * ((r & 7) >> 1) + 2 * (r >> 3) + (r & 1);
}

// f(J, c, a, n) for every entry frag[J][c] of this lane, which holds W[a][n] (see above).
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

// frag <- the state src [D, D] (zero when null), in the layout above; hb (per lane: columns
// n, n + 8) <- srcb.
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

// This lane's two state columns n0, n0 + 8 of head i_h: whether each is a real column (< D)
// and the LayerNorm weight and bias there (zero for padded columns).
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

// An m16n8 accumulator (M = n, N = 8 columns) as the A operand of a product over those
// columns (k slots t, t + 4 = columns 2 t, 2 t + 1), times `mult`, rounded to tf32.
__device__ __forceinline__ void acc_as_a(unsigned (&a)[4], const float (&acc)[4], float mult) {
    a[0] = to_tf32(mult * acc[0]);
    a[1] = to_tf32(mult * acc[2]);
    a[2] = to_tf32(mult * acc[1]);
    a[3] = to_tf32(mult * acc[3]);
}

// out[i] (M = n: this warp's 16 state columns, N = t: rows 8 i .. 8 i + 7 of the tile) =
// W^T X^T, i.e. out[i][c] = (X W)[t][n] with t = 8 i + 2 t' + (c & 1), n = 16 w + g + 8 (c >> 1)
// (lane (g, t')). sX: a [BT, D_PAD + 1] fp32 tile. Tensor cores, tf32 operands (EXACT_X: sX
// holds tf32 values already, see tf32_operand).
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

// frag (W) += mult Y^T X over the tile's rows: Y^T given as accumulators y[i] in the layout of
// tile_times_state_frag's output (M = n, N = t), X a [BT, D_PAD + 1] fp32 tile (rows past the
// chunk's end zero). Tensor cores, tf32 operands (EXACT_X as in tile_times_state_frag).
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

// Row sums over all D_PAD columns of K (2 or 4) quantities for the rows of an accumulator
// layout (lane (g, t): rows 8 i + 2 t + e): p[i][e][j] holds the lane's partial (its two
// columns) and gets the row's total. Warp shuffles (a reduce-scatter), then per-warp partials
// through red ([NW][BT] x K floats, 4 K-byte aligned) and one barrier (every thread must call
// it; red must not be read by a pending round).
template <int NW, int BT, int K>
__device__ __forceinline__ void frag_row_sums(float (&p)[BT / 8][2][K], float* red) {
    static_assert(K == 2 || K == 4, "K must be 2 or 4");
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, t0 = 2 * (lane & 3);
    FloatK<K>* rows = reinterpret_cast<FloatK<K>*>(red);
    // Reduce-scatter over the 8 lanes g of a row group (lane bits 2..4): the V values v[f],
    // f = (2 i + e) K + j, halve at each of the three shuffle rounds (xor 16, 8, 4), each lane
    // keeping the half its bit picks and adding the partner's copy of it: V / 2 + V / 4 + V / 8
    // shuffles where a butterfly per value takes 3 V. The lane is left with the warp's sums of
    // f = b2 V / 2 + b1 V / 4 + b0 V / 8 + m (m < V / 8; b0, b1, b2 = lane bits 2, 3, 4),
    // which it writes to red.
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

// x[i][c] = rows[t * rs + n] at this lane's entries of a [BT, D_PAD] tile in the accumulator
// layout (t = 8 i + 2 t' + (c & 1), n = 16 w + g + 8 (c >> 1)), zero for t >= L or n >= D;
// rows: the chunk's first row, rs: the row stride (32-bit: a chunk spans < 2^31 elements).
template <int BT, typename S>
__device__ __forceinline__ void load_frag_rows(float (&x)[BT / 8][4], const S* __restrict__ rows,
                                               int rs, int L, int D) {
    const int lane = threadIdx.x & 31, t0 = 2 * (lane & 3);
    const int n0 = 16 * (threadIdx.x >> 5) + (lane >> 2);
#pragma unroll
    for (int i = 0; i < BT / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int t = 8 * i + t0 + (c & 1), n = n0 + 8 * (c >> 1);
            x[i][c] = (t < L && n < D) ? to_f32(rows[t * rs + n]) : 0.f;
        }
}

// load_frag_rows from a tile staged in shared memory (StagedRows: [BT, LDS], zero past the
// rows and columns it was given): x[i][c] = s[t * LDS + n] at this lane's entries.
template <int BT, int LDS, typename S>
__device__ __forceinline__ void frag_rows_from_smem(float (&x)[BT / 8][4], const S* s) {
    const int lane = threadIdx.x & 31, t0 = 2 * (lane & 3);
    const int n0 = 16 * (threadIdx.x >> 5) + (lane >> 2);
#pragma unroll
    for (int i = 0; i < BT / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            x[i][c] = to_f32(s[(8 * i + t0 + (c & 1)) * LDS + n0 + 8 * (c >> 1)]);
}

// Sum over this warp's 16 state columns (the lanes sharing t) of x0 + x1.
__device__ __forceinline__ float frag_col_sum(float x0, float x1) {
    float s = x0 + x1;
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    s += __shfl_xor_sync(0xffffffffu, s, 16);
    return s;
}

}  // namespace ttt
