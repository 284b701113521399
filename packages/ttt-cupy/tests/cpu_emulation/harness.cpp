// CPU emulation of the CUDA kernels in ttt_cupy/csrc (a test harness, not package code).
//
// Every CUDA thread of a block is a std::thread; __syncthreads is a block-wide std::barrier,
// __shfl_xor_sync an exchange through a per-warp buffer between two warp barriers. Blocks
// run one after the other and share one static "shared memory" buffer, NaN-poisoned before
// each block. It drives the five kernels of csrc/ (emu_<kernel> entry points, called in the
// launcher's order by test_cpu_emulation.py). Only T = float is exposed (the fake
// cuda_fp16.h / cuda_bf16.h store floats).
#include <algorithm>
#include <barrier>
#include <iterator>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3_ { unsigned x = 0, y = 0, z = 0; };
thread_local dim3_ threadIdx, blockIdx, blockDim;
static std::barrier<>* g_block_barrier = nullptr;
static std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
static float g_shfl[1024];
alignas(16) float smem[1 << 17];  // 512 KiB, more than any instance needs (checked below)

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline void __trap() { std::fprintf(stderr, "__trap\n"); std::abort(); }
inline float __shfl_xor_sync(unsigned, float x, int m) {
    const unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
    g_shfl[t] = x;
    g_warp_barriers[w]->arrive_and_wait();
    const float y = g_shfl[w * 32 + (lane ^ m)];
    g_warp_barriers[w]->arrive_and_wait();
    return y;
}
using std::min;
using std::max;

#include "fwd_chain.cu"
#include "fwd_out.cu"
#include "bwd_local.cu"
#include "bwd_chain.cu"
#include "bwd_grads.cu"

static void launch(long long grid, int nt, const std::function<void()>& body) {
    for (long long b = 0; b < grid; ++b) {
        std::barrier<> block(nt);
        g_block_barrier = &block;
        g_warp_barriers.clear();
        for (int w = 0; w < (nt + 31) / 32; ++w)
            g_warp_barriers.emplace_back(std::make_unique<std::barrier<>>(32));
        // poison shared memory: a kernel reading what it did not write sees NaNs
        std::fill(std::begin(smem), std::end(smem), std::nanf(""));
        std::vector<std::thread> threads;
        for (int t = 0; t < nt; ++t)
            threads.emplace_back([&, t, b] {
                threadIdx.x = t;
                blockIdx.x = (unsigned)b;
                blockDim.x = nt;
                body();
            });
        for (auto& th : threads) th.join();
    }
}

using i64 = long long;
using cf = const float*;
using ci64 = const long long*;

// One entry point per kernel: emu_<kernel>(dp, bt, grid, <the kernel's arguments but smem>);
// returns 1 when no instance of (dp, bt) is built here.
#define INSTANCES(X) X(16, 16) X(16, 32) X(16, 64) X(32, 16) X(32, 32) X(64, 16) X(64, 32) \
    X(128, 16) X(128, 32)

#define ENTRY(NAME, BYTES, PARAMS, ARGS)                                                     \
    template <int DP, int BT>                                                                \
    static void NAME##_t(i64 grid, PARAMS) {                                                 \
        using Tr = ttt::Traits<DP, BT>;                                                      \
        static_assert(Tr::BYTES <= sizeof(smem), "the emulated shared memory is too small"); \
        launch(grid, Tr::kThreads, [&] { ttt_linear_##NAME<float, DP, BT>(ARGS, Tr::BYTES); }); \
    }                                                                                        \
    extern "C" int emu_##NAME(int dp, int bt, i64 grid, PARAMS) {                            \
        INSTANCES(DISPATCH_ONE_##NAME)                                                       \
        return 1;                                                                            \
    }

#define P_(...) __VA_ARGS__

#define FWD_CHAIN_PARAMS cf k, cf v, cf eta, cf w, cf b, cf h0, cf hb0, float* ht, float* hbt, \
    float* ck, float* ckb, float* gbuf, ci64 cu, ci64 go, float eps, i64 T, int H, int D, int G
#define FWD_CHAIN_ARGS k, v, eta, w, b, h0, hb0, ht, hbt, ck, ckb, gbuf, cu, go, eps, T, H, D, G
#define DISPATCH_ONE_fwd_chain(DP, BT) \
    if (dp == DP && bt == BT) return fwd_chain_t<DP, BT>(grid, FWD_CHAIN_ARGS), 0;
ENTRY(fwd_chain, kFwdChainBytes, P_(FWD_CHAIN_PARAMS), P_(FWD_CHAIN_ARGS))

#define FWD_OUT_PARAMS cf q, cf k, cf eta, cf w, cf b, cf ck, cf ckb, cf gbuf, float* o, ci64 cu, \
    ci64 go, const int* gs, float scale, float eps, i64 T, int H, int D, int G
#define FWD_OUT_ARGS q, k, eta, w, b, ck, ckb, gbuf, o, cu, go, gs, scale, eps, T, H, D, G
#define DISPATCH_ONE_fwd_out(DP, BT) \
    if (dp == DP && bt == BT) return fwd_out_t<DP, BT>(grid, FWD_OUT_ARGS), 0;
ENTRY(fwd_out, kFwdOutBytes, P_(FWD_OUT_PARAMS), P_(FWD_OUT_ARGS))

#define BWD_LOCAL_PARAMS cf q, cf k, cf v, cf eta, cf w, cf b, cf dout, cf ck, cf ckb, \
    float* xbuf, float* rbuf, float* dopbuf, float* dgbuf, float* dq, float* deta, float* dwp, \
    float* dbp, ci64 cu, ci64 go, const int* gs, float scale, float eps, i64 T, int H, int D, int G
#define BWD_LOCAL_ARGS q, k, v, eta, w, b, dout, ck, ckb, xbuf, rbuf, dopbuf, dgbuf, dq, deta, \
    dwp, dbp, cu, go, gs, scale, eps, T, H, D, G
#define DISPATCH_ONE_bwd_local(DP, BT) \
    if (dp == DP && bt == BT) return bwd_local_t<DP, BT>(grid, BWD_LOCAL_ARGS), 0;
ENTRY(bwd_local, kBwdLocalBytes, P_(BWD_LOCAL_PARAMS), P_(BWD_LOCAL_ARGS))

#define BWD_CHAIN_PARAMS cf q, cf k, cf v, cf eta, cf w, cf b, cf xbuf, cf rbuf, cf dopbuf, \
    float* dgbuf, float* deta, cf dht, cf dhbt, float* dck, float* dh0, float* dhb0, ci64 cu, \
    ci64 go, float scale, i64 T, int H, int D, int G
#define BWD_CHAIN_ARGS q, k, v, eta, w, b, xbuf, rbuf, dopbuf, dgbuf, deta, dht, dhbt, dck, dh0, \
    dhb0, cu, go, scale, T, H, D, G
#define DISPATCH_ONE_bwd_chain(DP, BT) \
    if (dp == DP && bt == BT) return bwd_chain_t<DP, BT>(grid, BWD_CHAIN_ARGS), 0;
ENTRY(bwd_chain, kBwdChainBytes, P_(BWD_CHAIN_PARAMS), P_(BWD_CHAIN_ARGS))

#define BWD_GRADS_PARAMS cf q, cf k, cf v, cf eta, cf w, cf b, cf ck, cf dck, cf xbuf, cf rbuf, \
    cf dopbuf, cf dgbuf, float* dk, float* dv, float* dwp, float* dbp, ci64 cu, ci64 go, \
    const int* gs, float scale, i64 T, int H, int D, int G
#define BWD_GRADS_ARGS q, k, v, eta, w, b, ck, dck, xbuf, rbuf, dopbuf, dgbuf, dk, dv, dwp, dbp, \
    cu, go, gs, scale, T, H, D, G
#define DISPATCH_ONE_bwd_grads(DP, BT) \
    if (dp == DP && bt == BT) return bwd_grads_t<DP, BT>(grid, BWD_GRADS_ARGS), 0;
ENTRY(bwd_grads, kBwdGradsBytes, P_(BWD_GRADS_PARAMS), P_(BWD_GRADS_ARGS))
