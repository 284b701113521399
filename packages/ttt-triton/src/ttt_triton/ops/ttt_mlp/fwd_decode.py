r"""TTT-MLP forward of a generation step: every sequence holds at most one token, no backward.

One program per (sequence, head). With one row, the chunk's tile products (``common.py``)
become products of that row with the state's hidden blocks, in fp32 without dot
instructions, so no padded chunk is computed (``q`` scaled, ``e`` the row's eta, ``l`` its
per-key factor, 1 without ``HAS_ETA_KEY``):

.. math::

    Z_1 &= k W_1 + b_1,\quad X_2 = \mathrm{gelu}(Z_1),\quad
    g_2 = l\, \partial\ell/\partial(X_2 W_2 + b_2),\quad
    g_1 = (g_2 W_2^\top) \odot \mathrm{gelu}'(Z_1)\\
    \bar Z_1 &= q W_1 + b_1 - e\,(q \cdot k + 1)\, g_1,\quad \bar X_2 = \mathrm{gelu}(\bar Z_1),
    \quad z = \bar X_2 W_2 + b_2 - e\,(\bar X_2 \cdot X_2 + 1)\, g_2\\
    W_1 &\mathrel{-}= e\, k^\top g_1,\ b_1 \mathrel{-}= e\, g_1,\quad
    W_2 \mathrel{-}= e\, X_2^\top g_2,\ b_2 \mathrel{-}= e\, g_2

and ``o`` is ``z`` in the output form ``OUTPUT``. The first walk over the hidden blocks sums
``Z_2``; the second computes each block's ``g_1``, its share of ``z`` and of
``\bar X_2 \cdot X_2``, and writes the block's update. The products with ``W_2`` are kept
as [BF, BD] tiles of per-unit terms and summed over the hidden units once, after each walk:
a block's work then sums across warps only for ``k W_1`` and ``q W_1`` (sm_90: a quarter
fewer barriers and a tenth fewer instructions per block than summing each block's share).
The first walk keeps ``Z_1`` in the final ``b_1`` until the second reads it back and writes
the update there (no second ``k W_1``: H100, bf16, H 16, D 64, a step in a CUDA graph
24.9 -> 22.5 us at B 4, 208 -> 192 us at B 64). A packed sequence of no token passes its
state through (``e`` is zero there).

With fewer chains than SMs a chain's state streams through one SM, block after block, while
others idle; in a CUDA graph (where launches cost little) the step then splits its hidden
blocks over S programs per chain, in three launches: ``ttt_mlp_step_z2_kernel`` (each split's share of ``X_2 W_2``),
``ttt_mlp_step_update_kernel`` (the shares summed, ``g_2``, each split's walk 2 and its
shares of ``\bar X_2 W_2`` and ``\bar X_2 \cdot X_2``) and ``ttt_mlp_step_out_kernel``
(``z`` and ``o``). The same products as the one-launch kernel, summed in another order.
"""

import triton
import triton.language as tl

from ..ttt_linear.common import inner_grad, load_norm_params, output_form
from .common import chain_rows, gelu_and_slope, hidden_block


@triton.jit
def row_times(b_x, b_M):
    """The row ``b_x`` [1, K] times the tile ``b_M`` [K, N]: [1, N]."""
    return tl.sum(tl.trans(b_x) * b_M, 0)[None, :]


@triton.jit
def step_row(q, k, v, eta, eta_key, cu_seqlens, T, H: tl.constexpr, D: tl.constexpr,
             BD: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_ETA_KEY: tl.constexpr):
    """This program's (sequence, head) ``i_nh`` (``program_id(0)``), head, ``o_d``, ``m_d``,
    the row's mask ``m_x`` [1, BD] (none without a token), offsets ``p_e`` (its scalars) and
    ``p_x`` [1, BD], raw ``q``, fp32 ``k``, ``v``, its eta ``e`` (0 without a token) and
    per-key factor ``l`` (1 without ``HAS_ETA_KEY``)."""
    i_nh, i_h, bos, seq_len, _nc = chain_rows(cu_seqlens, T, H, 1, IS_VARLEN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    has_row = seq_len > 0
    m_x = m_d[None, :] & (tl.zeros([1, BD], dtype=tl.int32) < seq_len)     # [1, BD]
    p_e = tl.where(has_row, bos, 0) * H + i_h     # (no row: any row's scalars, unused)
    p_x = p_e * D + o_d[None, :]                                           # [1, BD]
    r_q = tl.load(q + p_x, mask=m_x, other=0.)                             # [1, BD]
    b_k = tl.load(k + p_x, mask=m_x, other=0.).to(tl.float32)              # [1, BD]
    b_v = tl.load(v + p_x, mask=m_x, other=0.).to(tl.float32)              # [1, BD]
    b_e = tl.where(has_row, tl.load(eta + p_e).to(tl.float32), 0.)
    if HAS_ETA_KEY:
        b_l = tl.load(eta_key + p_e).to(tl.float32)
    else:
        b_l = 1.
    return i_nh, i_h, o_d, m_d, m_x, p_e, p_x, r_q, b_k, b_v, b_e, b_l


@triton.jit
def initial_b2(b2_0, i_nh, D: tl.constexpr, o_d, m_d, BD: tl.constexpr,
               USE_INITIAL: tl.constexpr):
    """The initial ``b_2`` of state ``i_nh`` [1, BD] (zeros without ``USE_INITIAL``)."""
    if USE_INITIAL:
        return tl.load(b2_0 + i_nh * D + o_d, mask=m_d, other=0.)[None, :]
    return tl.zeros([1, BD], dtype=tl.float32)


@triton.jit
def z2_walk(b_k, W1_0, b1_0, W2_0, b1, i_nh, f_lo, f_hi, F, D: tl.constexpr, o_d, m_d,
            BD: tl.constexpr, BF: tl.constexpr, USE_INITIAL: tl.constexpr):
    """The first walk over the hidden blocks ``f_lo .. f_hi - 1``: ``X_2 W_2`` summed over
    them ([1, BD]); each block's ``Z_1`` kept in the final ``b1`` for :func:`update_walk`."""
    b_z2p = tl.zeros([BF, BD], dtype=tl.float32)     # [BF, BD] X2 W2, summed over BF after
    for f0 in tl.range(f_lo, f_hi, BF, num_stages=2):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            W1_0, b1_0, W2_0, i_nh, f0, F, D, o_d, m_d, BF, USE_INITIAL)
        b_z1 = row_times(b_k, b_W1) + b_b1[None, :]                        # [1, BF]
        tl.store(b1 + o_b1[None, :], b_z1, mask=m_f[None, :])   # (until walk 2's update)
        b_x2, _s1 = gelu_and_slope(b_z1)                                   # [1, BF]
        b_z2p += tl.trans(b_x2) * b_W2
    return tl.sum(b_z2p, 0)[None, :]                                       # [1, BD]


@triton.jit
def update_walk(b_k, b_qs, b_g2, b_a1, b_e, W1_0, b1_0, W2_0, W1, b1, W2, i_nh, f_lo, f_hi,
                F, D: tl.constexpr, o_d, m_d, BD: tl.constexpr, BF: tl.constexpr,
                USE_INITIAL: tl.constexpr):
    r"""The second walk over the hidden blocks ``f_lo .. f_hi - 1``: each block's ``g_1``
    (its ``Z_1`` from :func:`z2_walk`), update and share of ``\bar X_2 W_2`` ([1, BD]) and of
    ``\bar X_2 \cdot X_2`` (a scalar), both summed over the blocks."""
    b_zp = tl.zeros([BF, BD], dtype=tl.float32)      # [BF, BD] X2bar W2, summed after
    b_m2p = tl.zeros([1, BF], dtype=tl.float32)      # [1, BF] X2bar X2, summed after
    for f0 in tl.range(f_lo, f_hi, BF, num_stages=2):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            W1_0, b1_0, W2_0, i_nh, f0, F, D, o_d, m_d, BF, USE_INITIAL)
        b_z1 = tl.load(b1 + o_b1[None, :], mask=m_f[None, :], other=0.)    # [1, BF] walk 1's
        b_x2, b_s1 = gelu_and_slope(b_z1)                                  # [1, BF]
        b_g1 = tl.sum(b_g2 * b_W2, 1)[None, :] * b_s1                      # [1, BF]
        b_x2b, _s1b = gelu_and_slope(row_times(b_qs, b_W1) + b_b1[None, :] - b_a1 * b_g1)
        b_zp += tl.trans(b_x2b) * b_W2
        b_m2p += b_x2b * b_x2
        tl.store(W1 + o_w1, b_W1 - b_e * tl.trans(b_k) * b_g1, mask=m_w1)
        tl.store(b1 + o_b1, b_b1 - b_e * tl.sum(b_g1, 0), mask=m_f)
        tl.store(W2 + o_w2, b_W2 - b_e * tl.trans(b_x2) * b_g2, mask=m_w2)
    return tl.sum(b_zp, 0)[None, :], tl.sum(b_m2p)


@triton.jit
def split_sum(part, i_nh, S, o_d, BD: tl.constexpr):
    """The ``S`` splits' [1, BD] shares of chain ``i_nh`` in ``part`` [N * H, S, BD], summed."""
    b_sum = tl.zeros([1, BD], dtype=tl.float32)
    for i in range(0, S):
        b_sum += tl.load(part + (i_nh * S + i) * BD + o_d[None, :])
    return b_sum


@triton.jit(do_not_specialize=["T", "F"])
def ttt_mlp_fwd_decode_kernel(
    q, k, v, eta, w, b,
    eta_key,            # [B, T, H, 1] per-key factor (when HAS_ETA_KEY)
    o,                  # [B, T, H, D] input dtype
    W1_0, b1_0, W2_0, b2_0,   # initial state (when USE_INITIAL), fp32, as fwd_chain's
    W1, b1, W2, b2,           # the final state, same shapes, fp32
    cu_seqlens,         # [N + 1] int64 (when IS_VARLEN)
    scale, eps,
    T, F,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    USE_INITIAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_ETA_KEY: tl.constexpr,
    OUTPUT: tl.constexpr,
):
    """The whole step, one program per (sequence, head)."""
    i_nh, i_h, o_d, m_d, m_x, p_e, p_x, r_q, b_k, b_v, b_e, b_l = step_row(
        q, k, v, eta, eta_key, cu_seqlens, T, H, D, BD, IS_VARLEN, HAS_ETA_KEY)
    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    b_b2 = initial_b2(b2_0, i_nh, D, o_d, m_d, BD, USE_INITIAL)
    b_z2 = z2_walk(b_k, W1_0, b1_0, W2_0, b1, i_nh, 0, F, F, D, o_d, m_d, BD, BF,
                   USE_INITIAL)
    tl.debug_barrier()                        # walk 2's threads read what others stored
    b_g2 = inner_grad(b_z2 + b_b2, b_k, b_v, b_w, b_b, m_x, D, eps)[0] * b_l  # [1, BD]
    b_qs = r_q.to(tl.float32) * scale                                      # [1, BD]
    b_a1 = b_e * (tl.sum(b_qs * b_k) + 1.)
    b_zq, b_m2 = update_walk(b_k, b_qs, b_g2, b_a1, b_e, W1_0, b1_0, W2_0, W1, b1, W2, i_nh,
                             0, F, F, D, o_d, m_d, BD, BF, USE_INITIAL)
    b_z = b_zq + b_b2 - b_e * (b_m2 + 1.) * b_g2                           # [1, BD]
    b_o = output_form(b_z, r_q, b_w, b_b, m_x, D, eps, OUTPUT)
    tl.store(o + p_x, b_o.to(o.dtype.element_ty), mask=m_x)
    tl.store(b2 + i_nh * D + o_d[None, :], b_b2 - b_e * b_g2, mask=m_d[None, :])


@triton.jit(do_not_specialize=["T", "F", "FS"])
def ttt_mlp_step_z2_kernel(
    q, k, v, eta, eta_key,
    W1_0, b1_0, W2_0,   # initial state (when USE_INITIAL)
    b1,                 # the final b1: each block's Z1 until the update kernel's
    z2_part,            # [N * H, S, BD] fp32: each split's X2 W2
    cu_seqlens, T, F, FS,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    USE_INITIAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_ETA_KEY: tl.constexpr,
):
    """Split step, first launch: program (chain, s) walks hidden units s FS .. s FS + FS - 1."""
    i_nh, _h, o_d, m_d, _m, _pe, _px, _q, b_k, _v, _e, _l = step_row(
        q, k, v, eta, eta_key, cu_seqlens, T, H, D, BD, IS_VARLEN, HAS_ETA_KEY)
    i_s, S = tl.program_id(1), tl.num_programs(1)
    f_lo = i_s * FS
    b_part = z2_walk(b_k, W1_0, b1_0, W2_0, b1, i_nh, f_lo, tl.minimum(f_lo + FS, F), F, D,
                     o_d, m_d, BD, BF, USE_INITIAL)                        # [1, BD]
    tl.store(z2_part + (i_nh * S + i_s) * BD + o_d[None, :], b_part)


@triton.jit(do_not_specialize=["T", "F", "FS"])
def ttt_mlp_step_update_kernel(
    q, k, v, eta, w, b, eta_key,
    W1_0, b1_0, W2_0, b2_0,   # initial state (when USE_INITIAL)
    W1, b1, W2, b2,           # the final state
    z2_part,            # [N * H, S, BD] the first launch's
    z_part, m_part,     # [N * H, S, BD], [N * H, S]: each split's X2bar W2 and X2bar X2
    g2_out,             # [N * H, BD] the row's g2
    cu_seqlens, scale, eps, T, F, FS,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    USE_INITIAL: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_ETA_KEY: tl.constexpr,
):
    """Split step, second launch: program (chain, s) sums the splits' ``X_2 W_2``, takes
    ``g_2`` and updates its hidden units; split 0 also writes ``b_2`` and ``g_2``."""
    i_nh, i_h, o_d, m_d, m_x, _pe, _px, r_q, b_k, b_v, b_e, b_l = step_row(
        q, k, v, eta, eta_key, cu_seqlens, T, H, D, BD, IS_VARLEN, HAS_ETA_KEY)
    i_s, S = tl.program_id(1), tl.num_programs(1)
    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    b_b2 = initial_b2(b2_0, i_nh, D, o_d, m_d, BD, USE_INITIAL)
    b_z2 = split_sum(z2_part, i_nh, S, o_d, BD)                            # [1, BD]
    b_g2 = inner_grad(b_z2 + b_b2, b_k, b_v, b_w, b_b, m_x, D, eps)[0] * b_l  # [1, BD]
    b_qs = r_q.to(tl.float32) * scale                                      # [1, BD]
    b_a1 = b_e * (tl.sum(b_qs * b_k) + 1.)
    f_lo = i_s * FS
    b_zq, b_m2 = update_walk(b_k, b_qs, b_g2, b_a1, b_e, W1_0, b1_0, W2_0, W1, b1, W2, i_nh,
                             f_lo, tl.minimum(f_lo + FS, F), F, D, o_d, m_d, BD, BF,
                             USE_INITIAL)
    tl.store(z_part + (i_nh * S + i_s) * BD + o_d[None, :], b_zq)
    tl.store(m_part + i_nh * S + i_s, b_m2)
    if i_s == 0:
        tl.store(b2 + i_nh * D + o_d[None, :], b_b2 - b_e * b_g2, mask=m_d[None, :])
        tl.store(g2_out + i_nh * BD + o_d[None, :], b_g2)


@triton.jit(do_not_specialize=["T", "S"])
def ttt_mlp_step_out_kernel(
    q, k, v, eta, w, b, eta_key, o, b2_0,
    z_part, m_part, g2,   # the update launch's
    cu_seqlens, eps, T, S,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    USE_INITIAL: tl.constexpr, IS_VARLEN: tl.constexpr, OUTPUT: tl.constexpr,
):
    """Split step, last launch: the splits' shares summed into ``z``, ``o`` in its form."""
    i_nh, i_h, o_d, m_d, m_x, _pe, p_x, r_q, _k, _v, b_e, _l = step_row(
        q, k, v, eta, eta_key, cu_seqlens, T, H, D, BD, IS_VARLEN, False)
    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    b_zq = split_sum(z_part, i_nh, S, o_d, BD)                             # [1, BD]
    b_m2 = 0.
    for i in range(0, S):
        b_m2 += tl.load(m_part + i_nh * S + i)
    b_g2 = tl.load(g2 + i_nh * BD + o_d[None, :])                          # [1, BD]
    b_b2 = initial_b2(b2_0, i_nh, D, o_d, m_d, BD, USE_INITIAL)
    b_z = b_zq + b_b2 - b_e * (b_m2 + 1.) * b_g2                           # [1, BD]
    b_o = output_form(b_z, r_q, b_w, b_b, m_x, D, eps, OUTPUT)
    tl.store(o + p_x, b_o.to(o.dtype.element_ty), mask=m_x)
