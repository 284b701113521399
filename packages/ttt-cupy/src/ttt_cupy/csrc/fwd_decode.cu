// Forward of a short generation step: ttt_linear_fwd_decode<T, D_PAD, KEY, OUT, P>. No
// backward; one block per (sequence, head), all L <= `rows` rows at once against the state
// W, hb before them (ttt_common.cuh; q~ = scale q, e_i row i's eta, l_i its eta_key or 1):
//
//   kh_i = k_i W + hb  ->  xh_i, r_i  ->  g_i = l_i r_i (y_i - mean(y_i) - xh_i mean(y_i xh_i))
//   o_pre_i = q~_i W + hb - e_i sum_{j <= i} (q~_i . k_j + 1) g_j
//           ( = q~_i (W - e_i A_i) + hb - e_i a_i,  A_i = sum_{j <= i} k_j^T g_j,  a_i = sum g_j)
//   o_i = o_pre_i in the output form OUT
//   W <- W - e_{L-1} sum_j k_j^T g_j,   hb <- hb - e_{L-1} sum_j g_j     (L = 0: as they were)
//
// The state stays in registers (DecodeTraits): thread (warp w, lane l) holds column
// c = w (32 / R) + l / R of W, rows a = V (p + R s) + j (part p = l % R, s < E / V, j < V).
// The rows' k, q, v, kh (then g), q~ W + hb sit in shared memory as [rows, D_PAD] fp32 tiles;
// the row passes run a warp a row. eta, w, b, eta_key are read in their type P, widened exactly.
#include "ttt_common.cuh"

namespace ttt {

// A thread's column and row part.
struct DecodeSlot {
    int c, p;
};

// The state row of entry V s + j of a thread of part p.
template <int D_PAD>
__device__ __forceinline__ int decode_row(int p, int s, int j) {
    using Tr = DecodeTraits<D_PAD>;
    return Tr::kVec * (p + Tr::kParts * s) + j;
}

// W[V s + j] = src[a D + c] (a = decode_row), hb = bsrc[c]; zero outside D x D or when null.
template <int D_PAD>
__device__ __forceinline__ void load_state_slot(
    float (&W)[DecodeTraits<D_PAD>::kEntries], float& hb, const float* __restrict__ src,
    const float* __restrict__ bsrc, DecodeSlot t, int D) {
    constexpr int V = DecodeTraits<D_PAD>::kVec;
#pragma unroll
    for (int s = 0; s < DecodeTraits<D_PAD>::kEntries / V; ++s)
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int a = decode_row<D_PAD>(t.p, s, j);
            W[V * s + j] = src != nullptr && a < D && t.c < D ? src[a * D + t.c] : 0.f;
        }
    hb = bsrc != nullptr && t.c < D ? bsrc[t.c] : 0.f;
}

// dst[a D + c] = W[V s + j], bdst[c] = hb (part 0) inside D x D.
template <int D_PAD>
__device__ __forceinline__ void store_state_slot(
    float* __restrict__ dst, float* __restrict__ bdst,
    const float (&W)[DecodeTraits<D_PAD>::kEntries], float hb, DecodeSlot t, int D) {
    constexpr int V = DecodeTraits<D_PAD>::kVec;
    if (t.c >= D) return;
#pragma unroll
    for (int s = 0; s < DecodeTraits<D_PAD>::kEntries / V; ++s)
#pragma unroll
        for (int j = 0; j < V; ++j) {
            const int a = decode_row<D_PAD>(t.p, s, j);
            if (a < D) dst[a * D + t.c] = W[V * s + j];
        }
    if (t.p == 0) bdst[t.c] = hb;
}

// This thread's part of x W[:, c] for a shared row x (the caller sums the R parts).
template <int D_PAD>
__device__ __forceinline__ float row_times_slot(const float* xrow,
                                                const float (&W)[DecodeTraits<D_PAD>::kEntries],
                                                int p) {
    constexpr int V = DecodeTraits<D_PAD>::kVec;
    float acc = 0.f;
#pragma unroll
    for (int s = 0; s < DecodeTraits<D_PAD>::kEntries / V; ++s) {
        const FloatK<V> x = *reinterpret_cast<const FloatK<V>*>(xrow + decode_row<D_PAD>(p, s, 0));
#pragma unroll
        for (int j = 0; j < V; ++j) acc += x.v[j] * W[V * s + j];
    }
    return acc;
}

// The step's L rows into shared memory: k, q (as given), v [L, D_PAD] (zero past D), eta and
// (KEY) eta_key [L], all fp32.
template <int D_PAD, bool KEY, typename T, typename S>
__device__ __forceinline__ void load_decode_rows(
    float* s_k, float* s_q, float* s_v, float* s_e, float* s_l, const T* __restrict__ q,
    const T* __restrict__ k, const T* __restrict__ v, const S* __restrict__ eta,
    const S* __restrict__ ekey, long long p_base, long long p_ebase, long long row_stride, int L,
    int H, int D) {
    constexpr int NT = DecodeTraits<D_PAD>::kThreads;
    for (int idx = threadIdx.x; idx < L * D_PAD; idx += NT) {
        const int i = idx / D_PAD, d = idx % D_PAD;
        const long long off = p_base + i * row_stride + d;
        const bool ok = d < D;
        s_k[idx] = ok ? to_f32(k[off]) : 0.f;
        s_q[idx] = ok ? to_f32(q[off]) : 0.f;
        s_v[idx] = ok ? to_f32(v[off]) : 0.f;
    }
    for (int i = threadIdx.x; i < L; i += NT) {
        s_e[i] = to_f32(eta[p_ebase + (long long)i * H]);
        if constexpr (KEY) s_l[i] = to_f32(ekey[p_ebase + (long long)i * H]);
    }
}

// g of row i (one warp) in place of its kh in s_x (KEY: l = s_l[i]); lnw, lnb: the head's.
template <int D_PAD, bool KEY, typename S>
__device__ __forceinline__ void decode_grad_row(
    float* s_x, const float* s_k, const float* s_v, const float* s_l, int i,
    const S* __restrict__ lnw, const S* __restrict__ lnb, int D, float eps) {
    constexpr int P = (D_PAD + 31) / 32;
    float x[P], kr[P], vr[P], g[P], y[P], b_w[P], b_b[P];
    load_row<D_PAD>(b_w, lnw, D, 1.f);
    load_row<D_PAD>(b_b, lnb, D, 1.f);
    load_row<D_PAD>(x, s_x + i * D_PAD, D, 1.f);
    const float r_ln = layer_norm_row(x, D, eps);
    const float r = KEY ? r_ln * s_l[i] : r_ln;
    load_row<D_PAD>(kr, s_k + i * D_PAD, D, 1.f);
    load_row<D_PAD>(vr, s_v + i * D_PAD, D, 1.f);
    inner_grad_row(g, y, x, r, kr, vr, b_w, b_b, D);
    put_row<D_PAD>(s_x + i * D_PAD, g);  // (the lane's own elements: no hazard)
}

// o of row i (one warp): o_pre = (q~ W + hb)_i - e_i sum_{j <= i} (q~_i . k_j + 1) g_j, then the
// output form (lnw, lnb as in decode_grad_row), stored to orow.
template <int D_PAD, int OUT, typename T, typename S>
__device__ __forceinline__ void decode_out_row(
    T* __restrict__ orow, const float* s_q, const float* s_k, const float* s_g, const float* s_o,
    const float* s_e, int i, const S* __restrict__ lnw, const S* __restrict__ lnb, float scale,
    int D, float eps) {
    constexpr int P = (D_PAD + 31) / 32;
    float qs[P], acc[P] = {}, o[P], b_w[P], b_b[P];
    load_row<D_PAD>(qs, s_q + i * D_PAD, D, scale);
    for (int j = 0; j <= i; ++j) {
        float kj[P], gj[P];
        load_row<D_PAD>(kj, s_k + j * D_PAD, D, 1.f);
        load_row<D_PAD>(gj, s_g + j * D_PAD, D, 1.f);
        const float a = row_dot(qs, kj) + 1.f;
#pragma unroll
        for (int e = 0; e < P; ++e) acc[e] += a * gj[e];
    }
    load_row<D_PAD>(o, s_o + i * D_PAD, D, 1.f);
#pragma unroll
    for (int e = 0; e < P; ++e) o[e] -= s_e[i] * acc[e];
    load_row<D_PAD>(b_w, lnw, D, 1.f);
    load_row<D_PAD>(b_b, lnb, D, 1.f);
    output_row<OUT>(o, b_w, b_b, D, eps, s_q + i * D_PAD, true);  // (q as given)
    store_row<D_PAD>(orow, o, D);
}

// W, hb <- W - e_{L-1} sum_i k_i^T g_i, hb - e_{L-1} sum_i g_i over this thread's entries, V
// at a time over the rows (few of k's rows in registers at once).
template <int D_PAD>
__device__ __forceinline__ void decode_state_step(float (&W)[DecodeTraits<D_PAD>::kEntries],
                                                  float& hb, const float* s_k, const float* s_g,
                                                  const float* s_e, int L, DecodeSlot t) {
    constexpr int V = DecodeTraits<D_PAD>::kVec;
    if (L == 0) return;
    const float ne = -s_e[L - 1];
#pragma unroll
    for (int s = 0; s < DecodeTraits<D_PAD>::kEntries / V; ++s) {
        const float* kcol = s_k + decode_row<D_PAD>(t.p, s, 0);
        for (int i = 0; i < L; ++i) {  // W[a, c] += (-e g_i[c]) k_i[a]
            const float m = ne * s_g[i * D_PAD + t.c];
            const FloatK<V> x = *reinterpret_cast<const FloatK<V>*>(kcol + i * D_PAD);
#pragma unroll
            for (int j = 0; j < V; ++j) W[V * s + j] += m * x.v[j];
        }
    }
    float hs = 0.f;
    for (int i = 0; i < L; ++i) hs += s_g[i * D_PAD + t.c];
    hb += ne * hs;
}

}  // namespace ttt

template <typename T, int D_PAD, bool KEY, int OUT, typename P>
__device__ __forceinline__ void fwd_decode_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const P* __restrict__ eta, const P* __restrict__ lnw, const P* __restrict__ lnb,
    const P* __restrict__ ekey, const float* __restrict__ h0, const float* __restrict__ hb0,
    float* __restrict__ ht, float* __restrict__ hbt, T* __restrict__ o,
    const long long* __restrict__ cu_seqlens, float scale, float eps, long long T_len, int H,
    int D, int rows, unsigned long long smem_bytes) {
    using namespace ttt;
    using Tr = DecodeTraits<D_PAD>;
    constexpr int NW = Tr::kWarps, R = Tr::kParts;
    if (smem_bytes < (unsigned long long)rows * Tr::kRowBytes || blockDim.x != Tr::kThreads ||
        D > D_PAD || rows < 1)
        __trap();
    extern __shared__ float smem[];
    float* s_k = smem;                 // [rows, D_PAD]  k
    float* s_q = s_k + rows * D_PAD;   // [rows, D_PAD]  q as given (unscaled)
    float* s_v = s_q + rows * D_PAD;   // [rows, D_PAD]  v
    float* s_x = s_v + rows * D_PAD;   // [rows, D_PAD]  kh, then g
    float* s_o = s_x + rows * D_PAD;   // [rows, D_PAD]  q~ W + hb
    float* s_e = s_o + rows * D_PAD;   // [rows]         eta
    float* s_l = s_e + rows;           // [rows]         eta_key (KEY)

    const long long i_nh = blockIdx.x, i_n = i_nh / H;
    const int i_h = (int)(i_nh % H);
    const long long bos = cu_seqlens != nullptr ? cu_seqlens[i_n] : i_n * T_len;
    const long long len = cu_seqlens != nullptr ? cu_seqlens[i_n + 1] - bos : T_len;
    if (len > rows) __trap();
    const int L = (int)len;
    const long long row_stride = (long long)H * D, DD = (long long)D * D;
    const long long p_base = (bos * H + i_h) * D, p_ebase = bos * H + i_h;

    const int lane = threadIdx.x & 31;
    const DecodeSlot t{(int)(threadIdx.x >> 5) * (32 / R) + lane / R, lane % R};
    float W[Tr::kEntries], hb;  // the thread's entries of the state
    load_state_slot<D_PAD>(W, hb, h0 != nullptr ? h0 + i_nh * DD : nullptr,
                           hb0 != nullptr ? hb0 + i_nh * D : nullptr, t, D);
    load_decode_rows<D_PAD, KEY>(s_k, s_q, s_v, s_e, s_l, q, k, v, eta, ekey, p_base, p_ebase,
                                 row_stride, L, H, D);
    __syncthreads();

    // kh_i = k_i W + hb -> s_x, q~_i W + hb -> s_o (part 0 of each column writes)
    for (int i = 0; i < L; ++i) {
        const float kw = group_sum<R>(row_times_slot<D_PAD>(s_k + i * D_PAD, W, t.p));
        const float qw = group_sum<R>(row_times_slot<D_PAD>(s_q + i * D_PAD, W, t.p));
        if (t.p == 0) {
            s_x[i * D_PAD + t.c] = kw + hb;
            s_o[i * D_PAD + t.c] = scale * qw + hb;
        }
    }
    __syncthreads();

    const int wid = threadIdx.x >> 5;
    const P* w_h = lnw + (long long)i_h * D;
    const P* b_h = lnb + (long long)i_h * D;
    for (int i = wid; i < L; i += NW)  // g_i over kh_i
        decode_grad_row<D_PAD, KEY>(s_x, s_k, s_v, s_l, i, w_h, b_h, D, eps);
    __syncthreads();

    if (ht != nullptr) {  // the state first: its registers are free for the output rows
        decode_state_step<D_PAD>(W, hb, s_k, s_x, s_e, L, t);
        store_state_slot<D_PAD>(ht + i_nh * DD, hbt + i_nh * D, W, hb, t, D);
    }
    for (int i = wid; i < L; i += NW)  // o_i (both read the tiles only: no barrier between)
        decode_out_row<D_PAD, OUT>(o + p_base + i * row_stride, s_q, s_k, s_x, s_o, s_e, i, w_h,
                                   b_h, scale, D, eps);
}

template <typename T, int D_PAD, bool KEY = false, int OUT = ttt::kOutNorm, typename P = float>
__global__ void __launch_bounds__(ttt::DecodeTraits<D_PAD>::kThreads)
ttt_linear_fwd_decode(const ttt::DecodeParams<T, P> p) {
    fwd_decode_kernel<T, D_PAD, KEY, OUT, P>(
        p.q, p.k, p.v, p.eta, p.lnw, p.lnb, p.ekey, p.h0, p.hb0, p.ht, p.hbt, p.o, p.cu_seqlens,
        p.scale, p.eps, p.T_len, p.H, p.D, p.rows, p.smem_bytes);
}
