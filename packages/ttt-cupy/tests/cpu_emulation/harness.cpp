// CPU emulation of the CUDA kernels in ttt_cupy/csrc (a test harness, not package code).
//
// Every CUDA thread of a block is a fiber (its own stack, all on the calling OS thread,
// switched only at barriers); __syncthreads is a block-wide barrier, __shfl_xor_sync
// an exchange through a per-warp buffer between two warp barriers. A fiber waiting at a
// barrier yields to the scheduler, which resumes the block's fibers round by round (see
// fiber::run). Blocks run one after the other and share one static "shared memory" buffer,
// NaN-poisoned before each block. It drives the five kernels of csrc/ (emu_<kernel> entry
// points, called in the launcher's order by test_cpu_emulation.py), fwd_chain's fused
// instances (emu_fwd_chain_fused*) and fwd_decode (emu_fwd_decode; T = P = the fake half types
// in emu_fwd_decode_half, _bf16). Otherwise only T = float is exposed (the fake cuda_fp16.h /
// cuda_bf16.h store floats), plus the tensor-core instances of all five kernels
// (emu_<kernel>_mma: T = the fake __half, which holds a float, and MMA = true) with an
// emulated mma.sync (below).
//
// The build compiles the file once per part (-DEMU_PART=0 and 1, at once) and links the parts
// into one library: part 0 holds the harness's own entry points and the forward kernels',
// part 1 the backward kernels'; their state is shared (inline variables). Without EMU_PART
// the file holds everything.
#ifdef EMU_PART
#define EMU_IN_PART(p) (EMU_PART == (p))
#else
#define EMU_IN_PART(p) 1
#endif
#undef _FORTIFY_SOURCE  // (its longjmp check rejects a jump to another stack: a fiber's)
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <iterator>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

struct dim3_ { unsigned x = 0, y = 0, z = 0; };
inline dim3_ threadIdx, blockIdx, blockDim;  // threadIdx: the running fiber's (set by resume)

namespace fiber {
constexpr std::size_t kStackBytes = 256 << 10;
struct Barrier;
// A fiber starts on its stack through ucontext (makecontext, setcontext), then switches with
// _setjmp / _longjmp: they leave the signal mask alone, where swapcontext would save and
// restore it with a system call at every switch.
struct Fiber {
    ucontext_t ctx;   // its start
    jmp_buf resume;   // where it waits (after its start)
    bool started, done;
    const Barrier* block_wait;  // the block barrier it waits at (null: none) ...
    unsigned block_phase;       // ... in this phase of it
};
inline jmp_buf g_scheduler;
inline std::vector<Fiber> g_fibers;
inline std::unique_ptr<char[]> g_stacks;      // uninitialised: pages are touched on use only
inline std::size_t g_stack_count = 0;
inline const std::function<void()>* g_body = nullptr;

// Back to the scheduler; it resumes this fiber on a later round.
inline void yield() {
    if (!_setjmp(g_fibers[threadIdx.x].resume)) _longjmp(g_scheduler, 1);
}

// std::barrier's contract for fibers: arrive, then wait until all n have arrived. A block
// barrier (block = true) tells the scheduler which fibers wait at it.
struct Barrier {
    unsigned n = 0, count = 0, phase = 0;
    bool block = false;
    void arrive_and_wait() {
        const unsigned phase0 = phase;
        if (++count == n) {
            count = 0;
            ++phase;
            return;
        }
        Fiber& f = g_fibers[threadIdx.x];
        if (block) f.block_wait = this, f.block_phase = phase0;
        while (phase == phase0) yield();
        f.block_wait = nullptr;
    }
};

// Whether fiber t can go on: not finished and not waiting at a block barrier still closed.
inline bool runnable(int t) {
    const Fiber& f = g_fibers[t];
    return !f.done && !(f.block_wait != nullptr && f.block_wait->phase == f.block_phase);
}

static void entry() {
    (*g_body)();
    g_fibers[threadIdx.x].done = true;
    _longjmp(g_scheduler, 1);              // back to the scheduler, never to return here
}

// Runs fiber t until it yields or ends.
static void resume(int t) {
    Fiber& f = g_fibers[t];
    threadIdx.x = t;
    if (_setjmp(g_scheduler)) return;
    if (f.started) _longjmp(f.resume, 1);
    f.started = true;
    setcontext(&f.ctx);
}

// Runs body on nt fibers (threadIdx.x = 0 .. nt - 1) until all of them return.
static void run(int nt, const std::function<void()>& body) {
    if (g_stack_count < (std::size_t)nt) {
        g_stacks.reset(new char[kStackBytes * nt]);
        g_stack_count = nt;
    }
    g_body = &body;
    g_fibers.assign(nt, Fiber{});
    for (int t = 0; t < nt; ++t) {
        Fiber& f = g_fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = g_stacks.get() + kStackBytes * t;
        f.ctx.uc_stack.ss_size = kStackBytes;
        f.ctx.uc_link = nullptr;           // (entry never returns)
        makecontext(&f.ctx, entry, 0);
    }
    // Each round runs the warps one after the other, each until all its threads have ended
    // or wait at a block barrier (threads of a warp in turn, from warp barrier to warp
    // barrier), so that one warp gets as far ahead of the others as a GPU may let it. Rounds
    // alternate between ascending and descending order (of warps, and of threads in a warp),
    // so that a read of another thread's write with no barrier between them runs before that
    // write in one of the two orders (and reads NaN-poisoned or stale shared memory), and a
    // write (or an asynchronous copy) into memory another warp still reads runs before it.
    const int nw = (nt + 31) / 32;
    for (int live = nt, round = 0; live > 0; ++round) {
        const bool down = round % 2;
        for (int j = 0; j < nw; ++j) {
            const int w = down ? nw - 1 - j : j, lo = 32 * w, hi = std::min(nt, lo + 32);
            for (long long pass = 0, again = 1; again; ++pass) {
                if (pass > (1ll << 24)) {
                    std::fprintf(stderr, "emulation: warp %d makes no progress\n", w);
                    std::abort();
                }
                again = 0;
                for (int i = lo; i < hi; ++i) {
                    const int t = down ? hi - 1 - (i - lo) : i;
                    if (!runnable(t)) continue;
                    resume(t);
                    again = 1;
                }
            }
        }
        live = 0;
        for (int t = 0; t < nt; ++t) live += !g_fibers[t].done;
    }
}
}  // namespace fiber

inline fiber::Barrier g_block_barrier;
inline fiber::Barrier g_warp_barriers[32];
inline float g_shfl[1024];
alignas(16) inline float smem[1 << 17];  // 512 KiB, more than any instance needs (checked)

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
inline void __syncthreads() { g_block_barrier.arrive_and_wait(); }
inline void __trap() { std::fprintf(stderr, "__trap\n"); std::abort(); }
inline float __shfl_xor_sync(unsigned, float x, int m) {
    const unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
    g_shfl[t] = x;
    g_warp_barriers[w].arrive_and_wait();
    const float y = g_shfl[w * 32 + (lane ^ m)];
    g_warp_barriers[w].arrive_and_wait();
    return y;
}
using std::min;
using std::max;
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

// The tensor-core path of the kernels (MMA = true): ttt_common.cuh leaves to_tf32 and
// mma_m16n8k8_tf32 to us when __CUDA_ARCH__ is not defined. mma_m16n8k8_tf32 is warp-wide like
// the PTX instruction: every lane puts its fragments into its warp's A (16 x 8) and B (8 x 8)
// with the PTX ISA's m16n8k8 .tf32 layout (g = lane / 4, t = lane % 4: a0 A[g][t],
// a1 A[g+8][t], a2 A[g][t+4], a3 A[g+8][t+4]; b0 B[t][g], b1 B[t+4][g]), then each lane adds
// its own accumulator elements (c0 C[g][2t], c1 C[g][2t+1], c2 C[g+8][2t], c3 C[g+8][2t+1]).
// to_tf32 keeps fp32 exactly (g_tf32_round = 0: checks the index math) or rounds to tf32 like
// cvt.rna (to nearest, ties away from zero; g_tf32_round = 1).
inline int g_tf32_round = 0;
inline float g_mma_a[32][16][8], g_mma_b[32][8][8];  // per warp
namespace ttt {
inline unsigned to_tf32(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    if (g_tf32_round && std::isfinite(x)) u = (u + 0x1000u) & 0xffffe000u;
    return u;
}
inline float tf32_value(unsigned u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
inline void mma_m16n8k8_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    const unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
    const int g = lane / 4, tq = lane % 4;
    float(&A)[16][8] = g_mma_a[w];
    float(&B)[8][8] = g_mma_b[w];
    A[g][tq] = tf32_value(a[0]);
    A[g + 8][tq] = tf32_value(a[1]);
    A[g][tq + 4] = tf32_value(a[2]);
    A[g + 8][tq + 4] = tf32_value(a[3]);
    B[tq][g] = tf32_value(b[0]);
    B[tq + 4][g] = tf32_value(b[1]);
    g_warp_barriers[w].arrive_and_wait();
    for (int r = 0; r < 4; ++r) {
        const int row = g + 8 * (r / 2), col = 2 * tq + r % 2;
        float acc = d[r];
        for (int k = 0; k < 8; ++k) acc += A[row][k] * B[k][col];
        d[r] = acc;
    }
    g_warp_barriers[w].arrive_and_wait();  // (every lane has read A and B)
}
}  // namespace ttt

// Prefetch hints (ttt_common.cuh's prefetch_line): each line a kernel asks for must overlap
// one of the arrays it was given, registered by emu_add_buffer before the launch; the others
// are counted as strays (a hint past an array's end: an indexing slip the GPU would not
// report).
struct EmuBuffer {
    unsigned long long lo, hi;
};
inline std::vector<EmuBuffer> g_buffers;
inline long long g_prefetches = 0, g_prefetch_strays = 0;
inline void emu_prefetch(unsigned long long line) {
    ++g_prefetches;
    for (const EmuBuffer& b : g_buffers)
        if (line < b.hi && line + 128 > b.lo) return;
    ++g_prefetch_strays;
}
#define TTT_EMU_PREFETCH(line) emu_prefetch(line)

// Asynchronous copies (ttt_common.cuh's cp_async): on the GPU the bytes land at some time
// between the copy and its thread's cp_async_wait_all. Here the destination turns to NaN at
// the copy (a thread still reading what was there, with no barrier between, sees NaN) and
// gets its data only at the wait (a read before the wait, or before the barrier after it for
// other threads, sees NaN too). Every full copy's source must lie inside one of the launch's
// arrays (strays are counted), and a block must wait for all its copies before it ends
// (leftovers are counted).
struct EmuCopy {
    void* dst;
    const void* src;
    int bytes;
    bool full;
};
inline std::vector<EmuCopy> g_copies[1024];  // per thread of the running block
inline long long g_copy_count = 0, g_copy_strays = 0, g_copy_leftovers = 0;
inline void emu_cp_async(void* dst, const void* src, int bytes, bool full) {
    ++g_copy_count;
    if (full) {
        const unsigned long long lo = reinterpret_cast<unsigned long long>(src);
        bool inside = false;
        for (const EmuBuffer& b : g_buffers) inside |= lo >= b.lo && lo + bytes <= b.hi;
        g_copy_strays += !inside;
    }
    std::memset(dst, 0xff, bytes);  // all-ones words: NaN as float
    g_copies[threadIdx.x].push_back(EmuCopy{dst, src, bytes, full});
}
inline void emu_cp_async_wait() {
    for (const EmuCopy& c : g_copies[threadIdx.x]) {
        if (c.full)
            std::memcpy(c.dst, c.src, c.bytes);
        else
            std::memset(c.dst, 0, c.bytes);
    }
    g_copies[threadIdx.x].clear();
}
#define TTT_EMU_CP_ASYNC(dst, src, bytes, full) emu_cp_async(dst, src, bytes, full)
#define TTT_EMU_CP_ASYNC_WAIT() emu_cp_async_wait()

#if EMU_IN_PART(0)
extern "C" void emu_clear_buffers() {
    g_buffers.clear();
    g_prefetches = g_prefetch_strays = 0;
    g_copy_count = g_copy_strays = g_copy_leftovers = 0;
}
extern "C" long long emu_async_copies() { return g_copy_count; }
extern "C" long long emu_async_strays() { return g_copy_strays; }
extern "C" long long emu_async_leftovers() { return g_copy_leftovers; }
extern "C" void emu_add_buffer(const void* p, long long bytes) {
    const unsigned long long lo = reinterpret_cast<unsigned long long>(p);
    g_buffers.push_back(EmuBuffer{lo, lo + (unsigned long long)bytes});
}
extern "C" long long emu_prefetches() { return g_prefetches; }
extern "C" long long emu_prefetch_strays() { return g_prefetch_strays; }
#endif

#include "fwd_chain.cu"
#include "fwd_decode.cu"
#include "fwd_out.cu"
#include "bwd_local.cu"
#include "bwd_chain.cu"
#include "bwd_grads.cu"

static void launch(long long grid, int nt, const std::function<void()>& body) {
    if (nt > 1024) __trap();
    blockDim.x = nt;
    for (long long b = 0; b < grid; ++b) {
        g_block_barrier = fiber::Barrier{(unsigned)nt};
        g_block_barrier.block = true;
        for (int w = 0; w < (nt + 31) / 32; ++w) g_warp_barriers[w] = fiber::Barrier{32};
        // poison shared memory: a kernel reading what it did not write sees NaNs
        std::fill(std::begin(smem), std::end(smem), std::nanf(""));
        blockIdx.x = (unsigned)b;
        fiber::run(nt, body);
        for (int t = 0; t < nt; ++t) {  // copies the block never waited for
            g_copy_leftovers += (long long)g_copies[t].size();
            g_copies[t].clear();
        }
    }
}

using i64 = long long;

// The (D_PAD, BT) instances built here.
#define INSTANCES(X) X(16, 16) X(16, 32) X(16, 64) X(32, 16) X(32, 32) X(64, 16) X(64, 32) \
    X(128, 16) X(128, 32) X(128, 64)

// The variant the entry points run (emu_set_variant: eta_key given, the output form OUT), as
// the kernels' KEY and OUT template arguments (each kernel takes those it has; the others are
// ignored). Every (D_PAD, BT) has the default variant; the others are built only where
// kAllVariants (chunk 16 up to D_PAD 64, and D_PAD 128 at chunk 64: each D_PAD, the split
// bwd_grads): they make up most of the build time.
inline int g_key = 0, g_out = 0;
#if EMU_IN_PART(0)
extern "C" void emu_set_variant(int key, int out) { g_key = key, g_out = out; }
#endif
template <bool V> using Key = std::integral_constant<bool, V>;
template <int V> using Out = std::integral_constant<int, V>;
template <int DP, int BT>
constexpr bool kAllVariants = (BT == 16 && DP <= 64) || (DP == 128 && BT == 64);
template <typename F>
static void every_variant(F&& f) {  // f(Key, Out) of the variant g_key, g_out asks for
    auto outs = [&](auto key) {
        if (g_out == ttt::kOutQuery) return f(key, Out<ttt::kOutQuery>{});
        if (g_out == ttt::kOutRaw) return f(key, Out<ttt::kOutRaw>{});
        return f(key, Out<ttt::kOutNorm>{});
    };
    if (g_key)
        outs(Key<true>{});
    else
        outs(Key<false>{});
}
template <int DP, int BT, typename F>
static int with_variant(F&& f) {  // 1: the variant has no instance here
    if constexpr (!kAllVariants<DP, BT>) {
        if (g_key || g_out != ttt::kOutNorm) return 1;
        f(Key<false>{}, Out<ttt::kOutNorm>{});
    } else {
        every_variant(f);
    }
    return 0;
}

// f(DP, BT) as integral constants for the (dp, bt) asked for; 1 where none is built.
template <typename F>
static int with_shape(int dp, int bt, F&& f) {
#define EMU_SHAPE(DP, BT) \
    if (dp == DP && bt == BT) \
        return f(std::integral_constant<int, DP>{}, std::integral_constant<int, BT>{});
    INSTANCES(EMU_SHAPE)
#undef EMU_SHAPE
    return 1;
}

// The argument struct the caller packed (ttt_cupy.params, csrc/params.cuh) as the instance's
// type: T = float, or the fake __half (a float in a struct: the same layout, the float arrays
// read as they are); its smem_bytes the instance's need.
template <typename S, typename From>
static S params_as(const void* from, unsigned long long smem_bytes) {
    static_assert(sizeof(S) == sizeof(From), "one layout for every T");
    S p;
    std::memcpy(&p, from, sizeof p);
    p.smem_bytes = smem_bytes;
    return p;
}

// One entry point per kernel family: emu_<NAME>(dp, bt, grid, params), params pointing at the
// pass's struct (FwdParams or BwdParams of float); returns 1 when no instance of (dp, bt) and
// the variant (above) is built here. KERNEL<T, DP, BT, ARGS> runs on NT threads with BYTES of
// shared memory (Tr: its Traits; KEY, OUT: the variant).
#define ENTRY(NAME, S, T, NT, BYTES, MAX_DP, KERNEL, ...)                                    \
    extern "C" int emu_##NAME(int dp, int bt, i64 grid, const void* params) {                \
        return with_shape(dp, bt, [&](auto dp_c, auto bt_c) {                                \
            constexpr int DP = decltype(dp_c)::value, BT = decltype(bt_c)::value;            \
            using Tr = ttt::Traits<DP, BT>;                                                  \
            if constexpr (DP > MAX_DP) {                                                     \
                return 1;                                                                    \
            } else {                                                                         \
                constexpr unsigned long long bytes = BYTES;                                  \
                static_assert(bytes <= sizeof(smem), "the emulated shared memory is too small"); \
                const auto p = params_as<ttt::S<T>, ttt::S<float>>(params, bytes);           \
                return with_variant<DP, BT>([&](auto key, auto out) {                        \
                    constexpr bool KEY = decltype(key)::value;                               \
                    constexpr int OUT = decltype(out)::value;                                \
                    (void)KEY, (void)OUT;                                                    \
                    launch(grid, Tr::NT, [&] { KERNEL<T, DP, BT, __VA_ARGS__>(p); });        \
                });                                                                          \
            }                                                                                \
        });                                                                                  \
    }

// The SIMT instances (T = float) and the tensor-core ones (_mma: T = the fake __half, MMA =
// true, with the emulated mma.sync above), side by side: ENTRIES gives the two their threads
// (kThreads; NT_MMA), shared memory (BYTES; BYTES_MMA) and template arguments after MMA.
// fwd_chain's fused instances (_fused: they write o; ck, ckb, xbuf, rbuf all null for a forward
// without backward) and bwd_chain's (ttt_linear_bwd_chain_fused: bwd_grads' work in the chain;
// MMA only, D_PAD <= 64). The stand-in half has 4 bytes: fwd_out's staged rows take more room
// than a real half's.
#define ENTRIES(NAME, S, NT_MMA, BYTES, BYTES_MMA, KERNEL, ...)                               \
    ENTRY(NAME, S, float, kThreads, BYTES, 128, KERNEL, false, __VA_ARGS__)                   \
    ENTRY(NAME##_mma, S, __half, NT_MMA, BYTES_MMA, 128, KERNEL, true, __VA_ARGS__)

#if EMU_IN_PART(0)
ENTRIES(fwd_chain, FwdParams, kTcThreads, Tr::kFwdChainBytes, Tr::kFwdChainTcBytes,
        ttt_linear_fwd_chain, false, KEY)
ENTRIES(fwd_chain_fused, FwdParams, kTcThreads, Tr::kFwdChainFusedBytes,
        Tr::kFwdChainFusedTcBytes, ttt_linear_fwd_chain, true, KEY, OUT)
ENTRIES(fwd_out, FwdParams, kThreads, Tr::kFwdOutBytes,
        4ull * Tr::template kFwdOutTcFloatsT<sizeof(__half)>, ttt_linear_fwd_out, OUT)
#endif
#if EMU_IN_PART(1)
ENTRIES(bwd_local, BwdParams, kThreads, Tr::kBwdLocalBytes, Tr::kBwdLocalTcBytes,
        ttt_linear_bwd_local, OUT)
ENTRIES(bwd_chain, BwdParams, kTcThreads, Tr::kBwdChainBytes, Tr::kBwdChainTcBytes,
        ttt_linear_bwd_chain, KEY)
ENTRY(bwd_chain_fused_mma, BwdParams, __half, kTcThreads, Tr::kBwdChainFusedTcBytes, 64,
      ttt_linear_bwd_chain_fused, true, KEY)
ENTRIES(bwd_grads, BwdParams, kThreads, Tr::kBwdGradsBytes, Tr::kBwdGradsBytes,
        ttt_linear_bwd_grads, KEY)
#endif

// fwd_decode (a short generation step: no chunk size, bt ignored), every variant at every D_PAD
// (the kernel is small); its shared memory for the struct's rows, as the launcher sizes it.
// emu_fwd_decode: T = P = float. emu_fwd_decode_half, emu_fwd_decode_bf16: T = P = the fake
// __half / __nv_bfloat16, the instance that reads eta, w, b and eta_key in the input type (the
// launcher's native_params).
template <typename T>
static int fwd_decode_entry(int dp, i64 grid, const void* params) {
    static_assert(sizeof(T) == sizeof(float), "the stand-in types hold a float");
    auto run = [&](auto dp_c) {
        constexpr int DP = decltype(dp_c)::value;
        using Tr = ttt::DecodeTraits<DP>;
        ttt::DecodeParams<float, float> given;
        std::memcpy(&given, params, sizeof given);
        const unsigned long long bytes = (unsigned long long)given.rows * Tr::kRowBytes;
        if (bytes > sizeof(smem)) __trap();  // (more than the emulated shared memory)
        const auto p = params_as<ttt::DecodeParams<T, T>, ttt::DecodeParams<float, float>>(
            params, bytes);
        every_variant([&](auto key, auto out) {
            constexpr bool KEY = decltype(key)::value;
            constexpr int OUT = decltype(out)::value;
            launch(grid, Tr::kThreads, [&] { ttt_linear_fwd_decode<T, DP, KEY, OUT, T>(p); });
        });
        return 0;
    };
    if (dp == 16) return run(std::integral_constant<int, 16>{});
    if (dp == 32) return run(std::integral_constant<int, 32>{});
    if (dp == 64) return run(std::integral_constant<int, 64>{});
    if (dp == 128) return run(std::integral_constant<int, 128>{});
    return 1;
}
#if EMU_IN_PART(0)
extern "C" int emu_fwd_decode(int dp, int, i64 grid, const void* params) {
    return fwd_decode_entry<float>(dp, grid, params);
}
// emu_set_tf32_round(1) rounds the mma operands to tf32 (the GPU's arithmetic), 0 keeps them
// fp32 (the index math alone).
extern "C" void emu_set_tf32_round(int on) { g_tf32_round = on; }
#endif
#if EMU_IN_PART(1)  // (the half instances: in the other part, which builds at the same time)
extern "C" int emu_fwd_decode_half(int dp, int, i64 grid, const void* params) {
    return fwd_decode_entry<__half>(dp, grid, params);
}
extern "C" int emu_fwd_decode_bf16(int dp, int, i64 grid, const void* params) {
    return fwd_decode_entry<__nv_bfloat16>(dp, grid, params);
}
#endif
