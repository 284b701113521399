// CPU emulation of the CUDA kernels in ttt_cupy/csrc (a test harness, not package code).
//
// Every CUDA thread of a block is a std::thread; __syncthreads is a block-wide std::barrier,
// __shfl_xor_sync an exchange through a per-warp buffer between two warp barriers. Blocks
// run one after the other and share one static "shared memory" buffer. Only T = float is
// exposed (the fake cuda_fp16.h / cuda_bf16.h store floats).
#include <algorithm>
#include <barrier>
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
alignas(16) float smem[1 << 17];  // 512 KiB, more than any instance needs

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

#include "ttt_linear.cu"

static void launch(int grid, int nt, const std::function<void()>& body) {
    for (int b = 0; b < grid; ++b) {
        std::barrier<> block(nt);
        g_block_barrier = &block;
        g_warp_barriers.clear();
        for (int w = 0; w < (nt + 31) / 32; ++w)
            g_warp_barriers.emplace_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> threads;
        for (int t = 0; t < nt; ++t)
            threads.emplace_back([&, t, b] {
                threadIdx.x = t;
                blockIdx.x = b;
                blockDim.x = nt;
                body();
            });
        for (auto& th : threads) th.join();
    }
}

template <int DP, int BT>
static void fwd_t(int grid, const float* q, const float* k, const float* v, const float* eta,
                  const float* w, const float* b, const float* h0, const float* hb0, float* o,
                  float* ht, float* hbt, float* ck, float* ckb, const long long* cu,
                  const long long* cko, float scale, float eps, long long T, int H, int D, int G) {
    using Tr = ttt::TttTraits<DP, BT>;
    launch(grid, Tr::kThreads, [&] {
        ttt_linear_fwd<float, DP, BT>(q, k, v, eta, w, b, h0, hb0, o, ht, hbt, ck, ckb, cu, cko,
                                      scale, eps, T, H, D, G, Tr::kFwdBytes);
    });
}

template <int DP, int BT>
static void bwd_t(int grid, const float* q, const float* k, const float* v, const float* eta,
                  const float* w, const float* b, const float* dout, const float* dht,
                  const float* dhbt, const float* ck, const float* ckb, float* scr, float* scrb,
                  float* dq, float* dk, float* dv, float* deta, float* dh0, float* dhb0,
                  float* dwp, float* dbp, const long long* cu, const long long* cko, float scale,
                  float eps, long long T, int H, int D, int G, int SG) {
    using Tr = ttt::TttTraits<DP, BT>;
    launch(grid, Tr::kThreads, [&] {
        ttt_linear_bwd<float, DP, BT>(q, k, v, eta, w, b, dout, dht, dhbt, ck, ckb, scr, scrb,
                                      dq, dk, dv, deta, dh0, dhb0, dwp, dbp, cu, cko, scale, eps,
                                      T, H, D, G, SG, Tr::kBwdBytes);
    });
}

#define DISPATCH(FN, ...)                                                               \
    if (dp == 16 && bt == 16) return FN<16, 16>(__VA_ARGS__), 0;                       \
    if (dp == 32 && bt == 16) return FN<32, 16>(__VA_ARGS__), 0;                       \
    if (dp == 32 && bt == 32) return FN<32, 32>(__VA_ARGS__), 0;                       \
    if (dp == 64 && bt == 16) return FN<64, 16>(__VA_ARGS__), 0;                       \
    if (dp == 128 && bt == 16) return FN<128, 16>(__VA_ARGS__), 0;                     \
    return 1;

extern "C" int emu_fwd(int dp, int bt, int grid, const float* q, const float* k, const float* v,
                       const float* eta, const float* w, const float* b, const float* h0,
                       const float* hb0, float* o, float* ht, float* hbt, float* ck, float* ckb,
                       const long long* cu, const long long* cko, float scale, float eps,
                       long long T, int H, int D, int G) {
    DISPATCH(fwd_t, grid, q, k, v, eta, w, b, h0, hb0, o, ht, hbt, ck, ckb, cu, cko, scale, eps,
             T, H, D, G)
}

extern "C" int emu_bwd(int dp, int bt, int grid, const float* q, const float* k, const float* v,
                       const float* eta, const float* w, const float* b, const float* dout,
                       const float* dht, const float* dhbt, const float* ck, const float* ckb,
                       float* scr, float* scrb, float* dq, float* dk, float* dv, float* deta,
                       float* dh0, float* dhb0, float* dwp, float* dbp, const long long* cu,
                       const long long* cko, float scale, float eps, long long T, int H, int D,
                       int G, int SG) {
    DISPATCH(bwd_t, grid, q, k, v, eta, w, b, dout, dht, dhbt, ck, ckb, scr, scrb, dq, dk, dv,
             deta, dh0, dhb0, dwp, dbp, cu, cko, scale, eps, T, H, D, G, SG)
}
