r"""Device helpers of the TTT-MLP kernels: the chain's coordinates, a chunk's inputs, the
state's hidden blocks and the two walks over them that make one chunk's forward step.

Per chunk of ``L <= BT`` valid rows (``q`` scaled, ``e`` the per-row eta, ``e_last`` that of
the last valid row, ``l`` the per-key factor ``eta_key``, 1 without ``HAS_ETA_KEY``; ``P``
the causal mask ``[j <= i]``), at the state ``(W1 [D, F], b1, W2 [F, D], b2)`` the chunk
starts from:

.. math::

    Z_1 &= k W_1 + b_1,\quad X_2 = \mathrm{gelu}(Z_1),\quad
    g_2 = l \odot \partial\ell/\partial(X_2 W_2 + b_2),\quad
    g_1 = (g_2 W_2^\top) \odot \mathrm{gelu}'(Z_1)\\
    A_1 &= P \odot e\,(q k^\top + 1),\quad
    \bar Z_1 = q W_1 + b_1 - A_1 g_1,\quad \bar X_2 = \mathrm{gelu}(\bar Z_1)\\
    A_2 &= P \odot e\,(\bar X_2 X_2^\top + 1),\quad z = \bar X_2 W_2 + b_2 - A_2 g_2\\
    W_1 &\mathrel{-}= e_{last}\, k^\top g_1,\ b_1 \mathrel{-}= e_{last} \textstyle\sum_i g_{1,i},
    \quad W_2 \mathrel{-}= e_{last}\, X_2^\top g_2,\ b_2 \mathrel{-}= e_{last} \textstyle\sum_i g_{2,i}

with ``gelu`` the tanh approximation and ``ell`` the LayerNorm-L2 inner loss (its gradient as
TTT-Linear's, ``ttt_linear/common.py``); ``o`` is ``z`` in the output form ``OUTPUT``.

A state is four fp32 tensors indexed by a state index ``idx``: ``W1 [idx, D, F]``,
``b1 [idx, F]``, ``W2 [idx, F, D]``, ``b2 [idx, D]`` (the final-state tensors, checkpoint
slots, the backward's scratch). It is too big for a program's registers (128 KiB at D 64,
F 4D), so a chunk streams it in hidden blocks of ``BF`` columns of ``W1`` (rows of ``W2``):
:func:`first_walk` sums ``Z_2`` (``g_2`` needs every block), :func:`second_walk` computes
each block's ``g_1``, its share of ``z`` and of ``\bar X_2 X_2^\top``, and writes the
block's update.
"""

import triton
import triton.language as tl

from ..ttt_linear.common import (
    inner_grad,
    last_row_eta,
    load_norm_params,
    mm,
    qk_plus_one,
    row_bases,
    row_offsets,
)


@triton.jit
def gelu_and_slope(x):
    """gelu_tanh(x) = x s(2u), u = c (x + 0.044715 x^3), s the logistic function, and its
    derivative s + 2 x s (1 - s) u'."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    s = 1. / (1. + tl.exp(-2. * u))
    du = 0.7978845608028654 * (1. + 3. * 0.044715 * x * x)
    return x * s, s + 2. * x * s * (1. - s) * du


@triton.jit
def gelu_slope_and_curve(x):
    """gelu_tanh's first and second derivatives at x (:func:`gelu_and_slope`'s notation,
    s' = 2 s (1 - s) u'): s + x s' and 2 s' + 2 x (s' (1 - 2 s) u' + s (1 - s) u'')."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    s = 1. / (1. + tl.exp(-2. * u))
    du = 0.7978845608028654 * (1. + 3. * 0.044715 * x * x)
    ddu = 0.7978845608028654 * 6. * 0.044715 * x
    ds = 2. * s * (1. - s) * du
    return s + x * ds, 2. * ds + 2. * x * (ds * (1. - 2. * s) * du + s * (1. - s) * ddu)


@triton.jit
def chain_rows(cu_seqlens, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(i_nh, i_h, bos, seq_len, NC) of this program's chain (one per (sequence, head)):
    its index (int64), head, first row, length and chunk count."""
    i_nh = tl.program_id(0).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        seq_len = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n * T
        seq_len = T
    return i_nh, i_h, bos, seq_len, tl.cdiv(seq_len, BT)


@triton.jit
def chain_start(w, b, cu_seqlens, T, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                BD: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What a chain's program starts from: :func:`chain_rows` but the first row, a chunk's
    row offsets ``o_t``, the head dim's ``o_d`` and mask ``m_d``, the causal mask ``m_tril``
    [BT, BT], the norm parameters and the row bases (``row_bases``)."""
    i_nh, i_h, bos, seq_len, NC = chain_rows(cu_seqlens, T, H, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_tril = o_t[:, None] >= o_t[None, :]                                  # [BT, BT] j <= i
    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    p_base, p_ebase = row_bases(bos, i_h, H, D)
    return i_nh, i_h, seq_len, NC, o_t, o_d, m_d, m_tril, b_w, b_b, p_base, p_ebase


@triton.jit
def chunk_inputs(q, k, v, eta, eta_key, p_base, p_ebase, i_c, o_t, o_d, m_d, seq_len, scale,
                 H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                 HAS_ETA_KEY: tl.constexpr):
    """Chunk ``i_c``'s offsets and masks (``row_offsets``), its raw q and k tiles, q scaled,
    k and v (fp32 [BT, BD]), the per-row eta ``e`` [BT], the last valid row's ``e_last`` and
    the per-key factor ``l`` [BT] (ones without ``HAS_ETA_KEY``); zero past the end."""
    o_x, m_2d, o_e, m_t = row_offsets(p_base, i_c * BT, o_t, o_d, seq_len, m_d, H, D)
    r_q = tl.load(q + o_x, mask=m_2d, other=0.)                            # [BT, BD]
    r_k = tl.load(k + o_x, mask=m_2d, other=0.)                            # [BT, BD]
    b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)             # [BT, BD]
    b_e = tl.load(eta + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
    b_el = last_row_eta(eta, p_ebase, i_c, seq_len, BT, H)
    if HAS_ETA_KEY:
        b_l = tl.load(eta_key + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
    else:
        b_l = tl.where(m_t, 1., 1.)
    return (o_x, m_2d, o_e, m_t, r_q, r_k, r_q.to(tl.float32) * scale, r_k.to(tl.float32),
            b_v, b_e, b_el, b_l)


@triton.jit
def hidden_block(W1, b1, W2, idx, f0, F, D: tl.constexpr, o_d, m_d, BF: tl.constexpr,
                 HAS: tl.constexpr):
    """The hidden block ``f0 .. f0 + BF - 1`` of state ``idx`` (int64): ``W1`` columns
    [BD, BF], ``b1`` [BF] and ``W2`` rows [BF, BD] (fp32), their offsets and masks; zeros
    where not ``HAS``."""
    o_f = f0 + tl.arange(0, BF)                                            # [BF]
    m_f = o_f < F
    o_w1 = (idx * D + o_d[:, None]) * F + o_f[None, :]                     # [BD, BF]
    m_w1 = m_d[:, None] & m_f[None, :]
    o_w2 = (idx * F + o_f[:, None]) * D + o_d[None, :]                     # [BF, BD]
    m_w2 = m_f[:, None] & m_d[None, :]
    o_b1 = idx * F + o_f                                                   # [BF]
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
def source_block(W1_0, b1_0, W2_0, W1, b1, W2, first, idx, f0, F, D: tl.constexpr, o_d, m_d,
                 BF: tl.constexpr, HAS_0: tl.constexpr):
    """:func:`hidden_block` of state ``idx`` in ``W1, b1, W2``, or where ``first`` (a chain's
    first chunk) in ``W1_0, b1_0, W2_0`` (zeros without ``HAS_0``)."""
    if first:
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            W1_0, b1_0, W2_0, idx, f0, F, D, o_d, m_d, BF, HAS_0)
    else:
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            W1, b1, W2, idx, f0, F, D, o_d, m_d, BF, True)
    return b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2


@triton.jit
def copy_blocks(W1_0, b1_0, W2_0, W1, b1, W2, first, idx, cW1, cb1, cW2, i_dst, F,
                D: tl.constexpr, o_d, m_d, BF: tl.constexpr, HAS_0: tl.constexpr):
    """The source state's (:func:`source_block`) ``W1, b1, W2`` into state ``i_dst`` of
    ``cW1, cb1, cW2`` (``b2`` is the caller's)."""
    for f0 in range(0, F, BF):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = source_block(
            W1_0, b1_0, W2_0, W1, b1, W2, first, idx, f0, F, D, o_d, m_d, BF, HAS_0)
        tl.store(cW1 + (i_dst - idx) * D * F + o_w1, b_W1, mask=m_w1)
        tl.store(cb1 + (i_dst - idx) * F + o_b1, b_b1, mask=m_f)
        tl.store(cW2 + (i_dst - idx) * D * F + o_w2, b_W2, mask=m_w2)


@triton.jit
def first_walk(W1_0, b1_0, W2_0, W1, b1, W2, first, idx, F, b_b2, b_k, b_v, b_l, b_w, b_b,
               m_2d, eps, D: tl.constexpr, o_d, m_d, BT: tl.constexpr, BD: tl.constexpr,
               BF: tl.constexpr, HAS_0: tl.constexpr, PREC: tl.constexpr):
    """``Z_2`` over every hidden block of the source state (:func:`source_block`), then
    ``(g2, g2u, xhat, r, y)``: ``g2 = l g2u`` with ``g2u`` the inner loss's gradient and
    ``xhat, r, y`` its LayerNorm's (``inner_grad``)."""
    b_z2 = tl.zeros([BT, BD], dtype=tl.float32)                            # [BT, BD]
    for f0 in range(0, F, BF):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = source_block(
            W1_0, b1_0, W2_0, W1, b1, W2, first, idx, f0, F, D, o_d, m_d, BF, HAS_0)
        b_x2, b_s1 = gelu_and_slope(mm(b_k, b_W1, PREC) + b_b1[None, :])   # [BT, BF]
        b_z2 += mm(b_x2, b_W2, PREC)
    b_g2u, b_xh, b_r, b_y = inner_grad(b_z2 + b_b2[None, :], b_k, b_v, b_w, b_b, m_2d, D, eps)
    return b_g2u * b_l[:, None], b_g2u, b_xh, b_r, b_y


@triton.jit
def attention_like(r_q, r_k, b_e, m_tril, scale, HALF: tl.constexpr, PREC: tl.constexpr):
    """``A_1 = P e (q k^T + 1)`` [BT, BT] (q scaled)."""
    b_A1 = qk_plus_one(r_q, r_k.to(r_q.dtype), scale, HALF, PREC)          # [BT, BT]
    return tl.where(m_tril, b_e[:, None], 0.) * b_A1


@triton.jit
def second_walk(W1_0, b1_0, W2_0, W1, b1, W2, dW1, db1, dW2, first, idx, idx_dst, F, b_k,
                b_qs, b_g2, b_A1, b_el, D: tl.constexpr, o_d, m_d, BT: tl.constexpr,
                BD: tl.constexpr, BF: tl.constexpr, HAS_0: tl.constexpr,
                WITH_OUT: tl.constexpr, STORE: tl.constexpr, PREC: tl.constexpr):
    """Each hidden block's ``g_1`` and update of the source state (:func:`source_block`),
    written to state ``idx_dst`` of ``dW1, db1, dW2`` (with ``STORE``); with ``WITH_OUT``,
    returns
    ``(sum_j \\bar X_{2,j} W_{2,j}, sum_j \\bar X_{2,j} X_{2,j}^T)`` ([BT, BD], [BT, BT];
    zeros without)."""
    b_z = tl.zeros([BT, BD], dtype=tl.float32)                             # [BT, BD]
    b_M2 = tl.zeros([BT, BT], dtype=tl.float32)                            # [BT, BT]
    for f0 in range(0, F, BF):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = source_block(
            W1_0, b1_0, W2_0, W1, b1, W2, first, idx, f0, F, D, o_d, m_d, BF, HAS_0)
        b_x2, b_s1 = gelu_and_slope(mm(b_k, b_W1, PREC) + b_b1[None, :])   # [BT, BF]
        b_g1 = mm(b_g2, tl.trans(b_W2), PREC) * b_s1                       # [BT, BF]
        if WITH_OUT:
            b_x2b, b_s1b = gelu_and_slope(mm(b_qs, b_W1, PREC) + b_b1[None, :]
                                          - mm(b_A1, b_g1, PREC))          # [BT, BF]
            if STORE or BT > 16:
                b_z += mm(b_x2b, b_W2, PREC)
                b_M2 += mm(b_x2b, tl.trans(b_x2), PREC)
            else:
                # the [BT, BT] product first: Triton gives a loop's chained tile products
                # (mma v2) the warps of the last one, along its rows where its tile is at
                # least as tall as wide. With the [16, 16] one last, all 8 warps held every
                # whole tile (8 copies; ptxas spilled): the backward at bf16, chunk 16 ran
                # 13% (head dim 64) and 3% (128) slower on an H100. At chunk 32 the order
                # below ran 21% slower at head dim 128 (bf16), so longer chunks keep the
                # other. With STORE the update's products come last anyway.
                b_M2 += mm(b_x2b, tl.trans(b_x2), PREC)
                b_z += mm(b_x2b, b_W2, PREC)
        if STORE:
            d_w = (idx_dst - idx) * D * F
            d_b1 = (idx_dst - idx) * F
            tl.store(dW1 + d_w + o_w1, b_W1 - b_el * mm(tl.trans(b_k), b_g1, PREC), mask=m_w1)
            tl.store(db1 + d_b1 + o_b1, b_b1 - b_el * tl.sum(b_g1, 0), mask=m_f)
            tl.store(dW2 + d_w + o_w2, b_W2 - b_el * mm(tl.trans(b_x2), b_g2, PREC), mask=m_w2)
    return b_z, b_M2
