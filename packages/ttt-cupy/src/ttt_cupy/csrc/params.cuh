// The kernels' one argument, a struct per pass passed by value (ttt_cupy/params.py mirrors the
// layouts): pointers (null: an absent tensor), then 8-byte, then 4-byte scalars, no padding.
// Shapes: B, T, H, D as the inputs, N sequences, `slots` slots, `groups` groups.
#pragma once

namespace ttt {

// fwd_chain (and its fused instance) and fwd_out.
template <typename T>
struct FwdParams {
    const T* q;                       // [B, T, H, D] (the chain reads it when fused)
    const T* k;
    const T* v;
    const float* eta;                 // [B, T, H] fp32
    const float* lnw;                 // [H, D] fp32
    const float* lnb;                 // [H, D] fp32
    const float* h0;                  // [N, H, D, D] fp32 or null
    const float* hb0;                 // [N, H, D] fp32 or null
    float* ht;                        // [N, H, D, D] or null
    float* hbt;                       // [N, H, D] or null (with ht)
    float* ck;                        // [slots, H, D, D] state slots (null: fused, no backward)
    float* ckb;                       // [slots, H, D]
    float* xbuf;                      // [B, T, H, D] fp32 xhat of valid rows
    float* rbuf;                      // [B, T, H] fp32 r of valid rows (eta_key: l r)
    T* o;                             // [B, T, H, D]
    const float* ekey;                // [B, T, H] fp32 eta_key (KEY) or null
    float* rlbuf;                     // [B, T, H] fp32 the LayerNorm's r (KEY) or null
    const long long* cu_seqlens;      // [N + 1] or null
    const long long* grp_offsets;     // [N + 1] or null (varlen)
    const int* grp_seq;               // [groups] or null (varlen)
    int* sync;                        // null (kPlain) or the overlapped pass's buffer
    long long T_len;
    long long g_lo, g_hi;             // the launch's groups of each sequence ((0, 0): all)
    long long n_chains;               // N H (group kernels: kOverlap, kCleanup)
    unsigned long long smem_bytes;    // the launch's dynamic shared memory
    float scale, eps;
    int H, D, G;
    int mode;                         // group kernels: overlap::kPlain / kOverlap / kCleanup
    int wait_spins;                   // naps to wait for the chain blocks to start (kOverlap)
};

// bwd_local, bwd_chain (and its fused instance) and bwd_grads.
template <typename T>
struct BwdParams {
    const T* q;                       // [B, T, H, D]
    const T* k;
    const T* v;
    const T* dout;                    // [B, T, H, D] cotangent of o
    const float* eta;                 // [B, T, H] fp32
    const float* lnw;                 // [H, D] fp32
    const float* lnb;                 // [H, D] fp32
    const float* ck;                  // [slots, H, D, D] state slots
    const float* ckb;                 // [slots, H, D]
    const float* xbuf;                // [B, T, H, D] fp32 xhat
    const float* rbuf;                // [B, T, H] fp32 r
    const float* rlbuf;               // [B, T, H] fp32 the LayerNorm's r (KEY) or null
    float* dopbuf;                    // [B, T, H, D] fp32 do_pre
    float* dgbuf;                     // [B, T, H, D] fp32 dg_loc, then the full dg
    T* dq;                            // [B, T, H, D]
    T* dk;                            // [B, T, H, D] or null (no bwd_grads work)
    T* dv;
    float* deta;                      // [B, T, H] fp32
    float* dwp_local;                 // [groups, H, D] bwd_local's partials of dw
    float* dbp_local;                 // [groups, H, D] ... of db
    float* dwp;                       // [groups, H, D] bwd_grads' (or the fused chain's)
    float* dbp;
    const float* dht;                 // [N, H, D, D] or null
    const float* dhbt;                // [N, H, D] or null
    float* dck;                       // [slots, H, D, D] slot cotangents
    float* dckb;                      // [slots, H, D] (of hb)
    float* dh0;                       // [N, H, D, D] or null
    float* dhb0;                      // [N, H, D] or null (with dh0)
    float* dkey;                      // [B, T, H] fp32 deta_key (KEY) or null
    const long long* cu_seqlens;      // [N + 1] or null
    const long long* grp_offsets;     // [N + 1] or null (varlen)
    const int* grp_seq;               // [groups] or null (varlen)
    int* sync;                        // null or the overlapped backward's buffer
    long long T_len;
    long long g_lo, g_hi;
    long long n_chains;
    unsigned long long smem_bytes;
    float scale, eps;
    int H, D, G;
    int mode;
    int wait_spins;
};

// fwd_decode: eta, w, b and eta_key of type P (float, or T: native_params).
template <typename T, typename P>
struct DecodeParams {
    const T* q;                       // [B, T, H, D]
    const T* k;
    const T* v;
    const P* eta;                     // [B, T, H]
    const P* lnw;                     // [H, D]
    const P* lnb;                     // [H, D]
    const P* ekey;                    // [B, T, H] eta_key (KEY) or null
    const float* h0;                  // [N, H, D, D] fp32 or null
    const float* hb0;                 // [N, H, D] fp32 or null
    float* ht;                        // [N, H, D, D] or null
    float* hbt;                       // [N, H, D] or null (with ht)
    T* o;                             // [B, T, H, D]
    const long long* cu_seqlens;      // [N + 1] or null
    long long T_len;
    unsigned long long smem_bytes;
    float scale, eps;
    int H, D;
    int rows;                         // the most rows of a sequence: shared memory for that many
};

}  // namespace ttt
