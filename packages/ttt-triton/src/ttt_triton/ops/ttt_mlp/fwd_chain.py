r"""TTT-MLP forward: one program per (sequence, head) carries the inner MLP through the chunks
and writes every output.

Per chunk of ``L <= BT`` valid rows (``q`` scaled, ``e`` the per-row eta, ``e_last`` that of
the last valid row, ``l`` the per-key factor ``eta_key``, 1 without ``HAS_ETA_KEY``; ``P``
the causal mask ``[j <= i]``), at the state ``(W1 [D, F], b1, W2 [F, D], b2)`` the chunk
starts from:

.. math::

    Z_1 &= k W_1 + b_1,\quad X_2 = \mathrm{gelu}(Z_1),\quad
    g_2 = l \odot \partial\ell/\partial(X_2 W_2 + b_2),\quad
    g_1 = (g_2 W_2^\top) \odot \mathrm{gelu}'(Z_1)\\
    \bar X_2 &= \mathrm{gelu}\big(q W_1 + b_1 - (P \odot e\,(q k^\top + 1))\, g_1\big),\quad
    z = \bar X_2 W_2 + b_2 - (P \odot e\,(\bar X_2 X_2^\top + 1))\, g_2\\
    W_1 &\mathrel{-}= e_{last}\, k^\top g_1,\ b_1 \mathrel{-}= e_{last} \textstyle\sum_i g_{1,i},
    \quad W_2 \mathrel{-}= e_{last}\, X_2^\top g_2,\ b_2 \mathrel{-}= e_{last} \textstyle\sum_i g_{2,i}

with ``gelu`` the tanh approximation and ``ell`` the LayerNorm-L2 inner loss (its gradient as
TTT-Linear's, ``ttt_linear/common.py``); ``o`` is ``z`` in the output form ``OUTPUT``.

The state lives in global memory (fp32; the final-state tensors, or a scratch of their shape):
at D 64 and F 4D it is 128 KiB per chain, more than a program's registers. Each chunk
streams it in hidden blocks of ``BF`` columns of ``W1`` (rows of ``W2``) twice: the first
walk sums ``Z_2`` (``g_2`` needs every block), the second computes ``g_1``, ``\bar X_2`` and
the updates of its block, adding the block's share of ``z`` and ``\bar X_2 X_2^\top``, and
writes the block back. The chain's first chunk reads the initial state (zeros without
``USE_INITIAL``), so a call is one launch.
"""

import triton
import triton.language as tl

from ..ttt_linear.common import (
    inner_grad,
    last_row_eta,
    load_norm_params,
    mm,
    output_form,
    qk_plus_one,
    row_bases,
    row_offsets,
)

GELU_C = 0.7978845608028654        # sqrt(2 / pi)


@triton.jit
def gelu_and_slope(x):
    """gelu_tanh(x) = x s(2u), u = c (x + 0.044715 x^3), s the logistic function, and its
    derivative s + 2 x s (1 - s) u'."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    s = 1. / (1. + tl.exp(-2. * u))
    du = 0.7978845608028654 * (1. + 3. * 0.044715 * x * x)
    return x * s, s + 2. * x * s * (1. - s) * du


@triton.jit
def hidden_block(W1, b1, W2, i_nh, f0, F, D: tl.constexpr, o_d, m_d, BF: tl.constexpr,
                 HAS: tl.constexpr):
    """The state's hidden block ``f0 .. f0 + BF - 1`` of chain ``i_nh`` (int64): ``W1``
    columns [BD, BF], ``b1`` [BF] and ``W2`` rows [BF, BD] (fp32), their offsets and mask;
    zeros where not ``HAS``."""
    o_f = f0 + tl.arange(0, BF)                                            # [BF]
    m_f = o_f < F
    o_w1 = (i_nh * D + o_d[:, None]) * F + o_f[None, :]                    # [BD, BF]
    m_w1 = m_d[:, None] & m_f[None, :]
    o_w2 = (i_nh * F + o_f[:, None]) * D + o_d[None, :]                    # [BF, BD]
    m_w2 = m_f[:, None] & m_d[None, :]
    o_b1 = i_nh * F + o_f                                                  # [BF]
    if HAS:
        b_W1 = tl.load(W1 + o_w1, mask=m_w1, other=0.).to(tl.float32)
        b_b1 = tl.load(b1 + o_b1, mask=m_f, other=0.).to(tl.float32)
        b_W2 = tl.load(W2 + o_w2, mask=m_w2, other=0.).to(tl.float32)
    else:
        b_W1 = tl.where(m_w1, 0., 0.)
        b_b1 = tl.where(m_f, 0., 0.)
        b_W2 = tl.where(m_w2, 0., 0.)
    return b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2


@triton.jit
def block_of_chunk(W1, b1, W2, W1_0, b1_0, W2_0, first, i_nh, f0, F, D: tl.constexpr, o_d,
                   m_d, BF: tl.constexpr, USE_INITIAL: tl.constexpr):
    """:func:`hidden_block` of the state a chunk starts from: the working state, or for the
    chain's ``first`` chunk the initial one (zeros without ``USE_INITIAL``)."""
    if first:
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            W1_0, b1_0, W2_0, i_nh, f0, F, D, o_d, m_d, BF, USE_INITIAL)
    else:
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            W1, b1, W2, i_nh, f0, F, D, o_d, m_d, BF, True)
    return b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2


@triton.jit(do_not_specialize=["T", "F"])
def ttt_mlp_fwd_chain_kernel(
    q, k, v, eta, w, b,
    eta_key,            # [B, T, H, 1] per-key factor (when HAS_ETA_KEY)
    o,                  # [B, T, H, D] input dtype
    W1_0, b1_0, W2_0, b2_0,   # initial state [N, H, D, F], [N, H, 1, F], [N, H, F, D],
                              # [N, H, 1, D] fp32 (when USE_INITIAL)
    W1, b1, W2, b2,     # the working and final state, same shapes, fp32
    cu_seqlens,         # [N + 1] int64 (when IS_VARLEN)
    scale, eps,
    T, F,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BF: tl.constexpr,
    USE_INITIAL: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HALF: tl.constexpr,
    PREC: tl.constexpr,
    HAS_ETA_KEY: tl.constexpr,
    OUTPUT: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n * T
        seq_len = T
    NC = tl.cdiv(seq_len, BT)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_tril = o_t[:, None] >= o_t[None, :]                                  # [BT, BT] j <= i
    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    if USE_INITIAL:
        b_b2 = tl.load(b2_0 + i_nh * D + o_d, mask=m_d, other=0.).to(tl.float32)  # [BD]
    else:
        b_b2 = tl.zeros([BD], dtype=tl.float32)
    p_base, p_ebase = row_bases(bos, i_h, H, D)
    for i_c in range(0, NC):
        o_x, m_2d, o_e, m_t = row_offsets(p_base, i_c * BT, o_t, o_d, seq_len, m_d, H, D)
        r_q = tl.load(q + o_x, mask=m_2d, other=0.)                        # [BT, BD]
        r_k = tl.load(k + o_x, mask=m_2d, other=0.)                        # [BT, BD]
        b_k = r_k.to(tl.float32)
        b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)         # [BT, BD]
        b_qs = r_q.to(tl.float32) * scale                                  # [BT, BD]
        b_e = tl.load(eta + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
        b_el = last_row_eta(eta, p_ebase, i_c, seq_len, BT, H)
        first = i_c == 0

        # first walk: Z2 = gelu(k W1 + b1) W2 + b2, then g2
        b_z2 = tl.zeros([BT, BD], dtype=tl.float32)                        # [BT, BD]
        for f0 in range(0, F, BF):
            b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = block_of_chunk(
                W1, b1, W2, W1_0, b1_0, W2_0, first, i_nh, f0, F, D, o_d, m_d, BF,
                USE_INITIAL)
            b_x2, b_slope = gelu_and_slope(mm(b_k, b_W1, PREC) + b_b1[None, :])  # [BT, BF]
            b_z2 += mm(b_x2, b_W2, PREC)
        b_g2, b_xh2, b_r2, b_y2 = inner_grad(b_z2 + b_b2[None, :], b_k, b_v, b_w, b_b, m_2d, D, eps)
        if HAS_ETA_KEY:
            b_l = tl.load(eta_key + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)
            b_g2 = b_g2 * b_l[:, None]                                     # [BT, BD] l g2
        b_A1 = qk_plus_one(r_q, r_k.to(r_q.dtype), scale, HALF, PREC)      # [BT, BT]
        b_A1 = tl.where(m_tril, b_e[:, None], 0.) * b_A1

        # second walk: g1, X2bar and the update of each block
        b_z = tl.zeros([BT, BD], dtype=tl.float32)                         # [BT, BD]
        b_A2 = tl.zeros([BT, BT], dtype=tl.float32)                        # [BT, BT]
        for f0 in range(0, F, BF):
            b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = block_of_chunk(
                W1, b1, W2, W1_0, b1_0, W2_0, first, i_nh, f0, F, D, o_d, m_d, BF,
                USE_INITIAL)
            b_x2, b_slope = gelu_and_slope(mm(b_k, b_W1, PREC) + b_b1[None, :])
            b_g1 = mm(b_g2, tl.trans(b_W2), PREC) * b_slope                # [BT, BF]
            b_x2b, b_slope_b = gelu_and_slope(mm(b_qs, b_W1, PREC) + b_b1[None, :]
                                      - mm(b_A1, b_g1, PREC))              # [BT, BF]
            b_z += mm(b_x2b, b_W2, PREC)
            b_A2 += mm(b_x2b, tl.trans(b_x2), PREC)
            tl.store(W1 + o_w1, b_W1 - b_el * mm(tl.trans(b_k), b_g1, PREC), mask=m_w1)
            tl.store(b1 + o_b1, b_b1 - b_el * tl.sum(b_g1, 0), mask=m_f)
            tl.store(W2 + o_w2, b_W2 - b_el * mm(tl.trans(b_x2), b_g2, PREC), mask=m_w2)
        b_A2 = tl.where(m_tril, b_e[:, None], 0.) * (b_A2 + 1.)
        b_z = b_z + b_b2[None, :] - mm(b_A2, b_g2, PREC)                   # [BT, BD]
        b_b2 = b_b2 - b_el * tl.sum(b_g2, 0)
        b_o = output_form(b_z, r_q, b_w, b_b, m_2d, D, eps, OUTPUT)
        tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m_2d)
        tl.debug_barrier()          # the next chunk reads what other threads wrote
    tl.store(b2 + i_nh * D + o_d, b_b2, mask=m_d)
