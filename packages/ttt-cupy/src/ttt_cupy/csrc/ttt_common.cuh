// Chunked TTT-linear: what the five kernels share (SIMT fp32 passes, and the tf32 tensor-core
// tile passes of the kernels' MMA instances for half inputs), one header per concern.
//
// Notation (per chunk of L <= BT valid rows; rows past the sequence's end are exactly zero and
// take no part in anything: the padding rule of docs/math.md; q is pre-multiplied by `scale`):
//
//   kh  = k W + hb,      xh = (kh - mean) r,   r = 1 / sqrt(var(kh) + eps)
//   y   = (xh w + b - v + k) w                                   (dl / dxh)
//   g   = l r (y - mean(y) - xh mean(y xh))                      (l dl / dkh of the inner loss)
//   A   = tril(q k^T) + tril(1),   o_pre = q W + hb - e (A g)
//   o   = o_pre + LN(o_pre) w + b  |  q / scale + LN(o_pre) w + b  |  o_pre     (OUT)
//   W  <- W - eta_l k^T g,         hb <- hb - eta_l sum_i g_i
//
// with e the per-row eta, eta_l the eta of the chunk's last *valid* row and l the row's
// eta_key (KEY instances; l = 1 otherwise), and the output form OUT (norm_residual,
// query_residual: q as given, raw; types.cuh). The backward of g for a cotangent dg
// (inner_grad_bwd_row; r' = l r, g / l = r (y - ..)):
//
//   dy  = r' (dg - mean(dg) - xh mean(dg xh))
//   dxh = -r' (dg mean(xh y) + y mean(dg xh)) + dy w^2,    dr = sum(dg g) / r
//   dkh = r (dxh - mean(dxh) - xh mean(dxh xh)) - dr r^2 xh / D,   dl = sum(dg g / l)
//
// Checkpoint *slots*: every sequence owns NG + 1 slots (NG = cdiv(chunks, G)); slot s < NG
// holds the fp32 state before chunk s * G and slot NG the final state. A *group* is the run of
// (at most) G chunks between two slots; groups are counted over the batch (grp_offsets [N + 1]
// gives each sequence's first group, grp_seq [groups] each group's sequence, varlen only).
//
// Saved activations: fwd_chain writes xh and g's factor r' = l r of every valid row (rbuf;
// KEY: the LayerNorm's r to rlbuf); the other kernels derive y and g from them row-locally
// (inner_grad_row), so fwd_out and bwd_local need no KEY instance.
//
// Layout: q, k, v, o, do, dq, dk, dv are [B, T, H, D] in the input dtype T (float, __half or
// __nv_bfloat16); the fp32 work buffers xhat, do_pre, dg are [B, T, H, D] and r, eta, deta
// [B, T, H]; w, b [H, D] fp32; states [N, H, D, D] / [N, H, D] and slots [slots, H, D, D] /
// [slots, H, D] fp32. Global offsets are 64-bit. D <= D_PAD: padded columns are zero.
//
// Row passes give a row to a warp or a group of lanes (rows.cuh); tile passes an output
// element to a thread, or a 16 x 8 tile to a warp (mma.cuh). Shared-memory tiles are fp32 with
// rows padded by one float (no bank conflicts down a column); sizes: Traits (traits.cuh).
#pragma once

#include "params.cuh"
#include "types.cuh"
#include "overlap.cuh"
#include "tiles.cuh"
#include "staging.cuh"
#include "rows.cuh"
#include "mma.cuh"
