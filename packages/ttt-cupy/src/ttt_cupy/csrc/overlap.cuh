// The cross-stream protocol of the overlapped passes.
#pragma once

#include "types.cuh"

namespace ttt {

// ---------------------------------------------------------------- overlapped passes
// The overlapped passes (placement.overlapped): a chain kernel and its group kernel (fwd_chain ->
// fwd_out; bwd_chain -> bwd_grads, from each sequence's end) run at once on two streams,
// sharing one zeroed int32 buffer `sync`:
//
//   sync[kStarted]      chain blocks started        sync[kTicket]    group blocks started
//   sync[kOverflow]     tickets put back (below)    sync[kProgress + c] groups chain c finished
//   sync[kProgress + n_chains + i]  the tickets put back, in any order
//
// A chain block counts itself started and, after each group (a barrier, then a release by
// thread 0), publishes its finished groups. A group block takes the next ticket (group-major:
// item u is group u / n_chains of chain u % n_chains; bwd_grads: kGradsSplit tickets an item)
// and waits with an acquire for its group, but only once every chain block has started: after
// `wait_spins` naps without that it puts its ticket back for the launcher's cleanup launch
// (kCleanup). So no wait depends on a block that is not running; the arithmetic is that of
// the plain launches (the group kernels read these buffers without the read-only path).
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

// A chain block: `groups` groups of chain `chain` are finished (after a barrier that follows
// every thread's last store of them).
__device__ __forceinline__ void overlap_chain_progress(int* sync, long long chain, int groups) {
    if (sync != nullptr && threadIdx.x == 0)
        store_release(sync + overlap::kProgress + chain, groups);
}

// A group block's item (thread 0): its ticket (kOverlap), or the blockIdx.x-th item put back
// (kCleanup); -1: none.
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

// A group block's (group, head) and, of SPLIT blocks per (group, head), its first state row a0
// (rows DA apart): kPlain from blockIdx.x over the segment, else from its ticket t: item
// u = t / SPLIT, group k = u / n_chains of chain u % n_chains (REVERSE: from the sequence's
// end), waited for in kOverlap. s_ticket: the kernel's static __shared__ int. False: nothing
// to do.
template <int SPLIT, int DA, bool REVERSE>
__device__ __forceinline__ bool group_block(
    int& i_h, int& a0, Group& gr, int& s_ticket, int* sync, int mode, long long n_chains,
    int wait_spins, long long T_len, int H, int BT, int G, const long long* __restrict__ cu_seqlens,
    const long long* __restrict__ grp_offsets, const int* __restrict__ grp_seq, long long g_lo,
    long long g_hi) {
    if (mode == overlap::kPlain) {
        const unsigned i_b = blockIdx.x / SPLIT;
        a0 = (int)(blockIdx.x % SPLIT) * DA;
        i_h = (int)(i_b % H);
        gr = group_coords(i_b / H, T_len, BT, G, cu_seqlens, grp_offsets, grp_seq, g_lo, g_hi);
        return gr.nc > 0;  // (not a segment past the end of this sequence)
    }
    if (threadIdx.x == 0) s_ticket = overlap_claim(sync, mode, n_chains, wait_spins);
    __syncthreads();
    const int t = s_ticket, nch = (int)n_chains;  // (32-bit: int32 tickets)
    if (t < 0) return false;  // put back, or no item
    const int u = t / SPLIT, c = u % nch, k = u / nch;
    a0 = (t % SPLIT) * DA;
    i_h = c % H;
    if constexpr (REVERSE) {
        const Seq sq = seq_coords(c / H, T_len, BT, G, cu_seqlens, grp_offsets);
        const long long j = (sq.nc + G - 1) / G - 1 - k;
        if (j < 0) return false;  // the sequence has no such group
        gr = group_at(c / H, j, T_len, BT, G, cu_seqlens, grp_offsets);
    } else {
        gr = group_at(c / H, k, T_len, BT, G, cu_seqlens, grp_offsets);
        if (gr.nc <= 0) return false;  // the sequence has no group k
    }
    if (mode == overlap::kOverlap) {  // thread 0 waits until chain c has finished group k
        if (threadIdx.x == 0)
            while (load_acquire(sync + overlap::kProgress + c) < k + 1) nap();
        __syncthreads();
    }
    return true;
}

}  // namespace ttt
