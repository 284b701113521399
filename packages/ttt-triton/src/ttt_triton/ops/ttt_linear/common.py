r"""Device helpers shared by the chunked TTT-linear kernels: coordinates, loads, and the
per-row math of the inner loss and its backward.

Notation (per chunk of ``L <= BT`` valid rows; rows past the sequence end are zero):

.. math::

    kh &= k W + hb, \qquad \hat x = (kh - \mu)\,r, \quad r = 1/\sqrt{\sigma^2 + \epsilon}\\
    y &= (\hat x \odot w + b - v + k) \odot w\\
    g &= r\,(y - \overline{y} - \hat x\,\overline{y \hat x})

``g`` is the gradient of the inner loss ``1/2 ||LN(kh) w + b - (v - k)||^2`` w.r.t. ``kh``.

Checkpoint *slots*: every sequence owns ``NG + 1`` slots (``NG = cdiv(chunks, G)``); slot
``s < NG`` holds the state before chunk ``s * G`` and slot ``NG`` the final state. A
*group* is the run of ``G`` chunks between two slots.
"""

import os

import triton
import triton.language as tl


@triton.jit
def seq_coords(i_n, cu_seqlens, grp_offsets, T, BT: tl.constexpr, G: tl.constexpr,
               IS_VARLEN: tl.constexpr):
    """(bos, seq_len, NC, slot_base) of sequence ``i_n``: first row (int64), length, chunk
    count and index of its first checkpoint slot."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        slot_base = tl.load(grp_offsets + i_n).to(tl.int64) + i_n
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        slot_base = i_n.to(tl.int64) * (tl.cdiv(tl.cdiv(T, BT), G) + 1)
    seq_len = (eos - bos).to(tl.int32)
    NC = tl.cdiv(seq_len, BT)
    return bos, seq_len, NC, slot_base


@triton.jit
def group_coords(gid, cu_seqlens, grp_offsets, grp_seq, T, BT: tl.constexpr,
                 G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(i_n, bos, seq_len, c0, nc, slot) of group ``gid`` (counted over the batch): its
    sequence, that sequence's first row and length, the group's first chunk, its chunk
    count (<= G) and the slot holding the state before chunk ``c0``."""
    if IS_VARLEN:
        i_n = tl.load(grp_seq + gid)
        j = gid - tl.load(grp_offsets + i_n).to(tl.int32)
    else:
        NGs = tl.cdiv(tl.cdiv(T, BT), G)
        i_n = gid // NGs
        j = gid % NGs
    bos, seq_len, NC, slot_base = seq_coords(i_n, cu_seqlens, grp_offsets, T, BT, G,
                                             IS_VARLEN)
    c0 = j * G
    nc = tl.minimum(NC - c0, G)
    return i_n, bos, seq_len, c0, nc, slot_base + j


@triton.jit
def row_offsets(p_base, r0, o_t, o_d, seq_len, m_d, H: tl.constexpr, D: tl.constexpr):
    """Offsets [BT, BD] of the rows r0 .. r0 + BT - 1 of one (sequence, head) in a
    [rows, H, D] tensor whose row 0 is at ``p_base``, with the mask of valid rows/cols, and
    the per-row offsets [BT] (relative to the sequence's first row) for [rows, H] tensors."""
    o_r = r0 + o_t                                                         # [BT]
    m_t = o_r < seq_len
    m_2d = m_t[:, None] & m_d[None, :]                                     # [BT, BD]
    o_x = p_base + o_r.to(tl.int64)[:, None] * (H * D) + o_d[None, :]      # [BT, BD]
    return o_x, m_2d, o_r.to(tl.int64) * H, m_t


@triton.jit
def last_row_eta(eta, p_ebase, c, seq_len, BT: tl.constexpr, H: tl.constexpr):
    """eta of the last valid row of chunk ``c`` (always an in-bounds row)."""
    r_last = tl.minimum((c + 1) * BT, seq_len) - 1
    return tl.load(eta + p_ebase + r_last.to(tl.int64) * H).to(tl.float32)


# Several row sums in one reduction (one round of shuffles / shared memory) on a GPU. The
# interpreter runs tl.reduce's combine function element by element in Python, which is
# ~10x slower than tl.sum: there the same sums are taken one by one.
ONE_ROUND: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _add5(a0, a1, a2, a3, a4, b0, b1, b2, b3, b4):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4


@triton.jit
def row_sums2(x0, x1):
    if ONE_ROUND:
        s0, s1 = tl.reduce((x0, x1), 1, _add2)
    else:
        s0 = tl.sum(x0, 1)
        s1 = tl.sum(x1, 1)
    return s0, s1


@triton.jit
def row_sums4(x0, x1, x2, x3):
    if ONE_ROUND:
        s0, s1, s2, s3 = tl.reduce((x0, x1, x2, x3), 1, _add4)
    else:
        s0 = tl.sum(x0, 1)
        s1 = tl.sum(x1, 1)
        s2 = tl.sum(x2, 1)
        s3 = tl.sum(x3, 1)
    return s0, s1, s2, s3


@triton.jit
def row_sums5(x0, x1, x2, x3, x4):
    if ONE_ROUND:
        s0, s1, s2, s3, s4 = tl.reduce((x0, x1, x2, x3, x4), 1, _add5)
    else:
        s0 = tl.sum(x0, 1)
        s1 = tl.sum(x1, 1)
        s2 = tl.sum(x2, 1)
        s3 = tl.sum(x3, 1)
        s4 = tl.sum(x4, 1)
    return s0, s1, s2, s3, s4


@triton.jit
def inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D: tl.constexpr, eps):
    """g, xhat, r, y of kh (see the module docstring); zero outside ``m_2d``.

    Two rounds of row reductions on the chain: the mean, then one ``tl.reduce`` for the
    variance and the two means g needs, written with ``xc = kh - mean`` (still centred) and
    ``c = (b - v + k) w`` (known before kh): ``y = xhat w^2 + c``,
    ``mean(y) = r mean(xc w^2) + mean(c)``, ``mean(y xhat) = r^2 mean(xc^2 w^2) +
    r mean(xc c)``."""
    b_w2 = (b_w * b_w)[None, :]                                            # [1, BD]
    b_c = tl.where(m_2d, (b_b[None, :] - b_v + b_k) * b_w[None, :], 0.)    # [BT, BD]
    b_cm = tl.sum(b_c, 1) / D                                              # [BT]
    b_mean = tl.sum(tl.where(m_2d, b_kh, 0.), 1) / D                       # [BT]
    b_xc = tl.where(m_2d, b_kh - b_mean[:, None], 0.)                      # [BT, BD]
    b_xc2 = b_xc * b_xc
    b_s2, b_sw, b_s2w, b_sc = row_sums4(b_xc2, b_xc * b_w2, b_xc2 * b_w2, b_xc * b_c)
    b_rstd = 1. / tl.sqrt(b_s2 / D + eps)                                  # [BT]
    b_xh = b_xc * b_rstd[:, None]                                          # [BT, BD]
    b_ym = b_rstd * b_sw / D + b_cm                                        # [BT]
    b_yx = b_rstd * b_rstd * b_s2w / D + b_rstd * b_sc / D                 # [BT]
    b_y = b_xh * b_w2 + b_c                                                # [BT, BD]
    b_g = b_rstd[:, None] * (b_y - b_ym[:, None] - b_xh * b_yx[:, None])   # [BT, BD]
    return tl.where(m_2d, b_g, 0.), b_xh, b_rstd, b_y


@triton.jit
def inner_grad_from_xhat(b_xh, b_rstd, b_k, b_v, b_w, b_b, m_2d, D: tl.constexpr):
    """g and y from a stored xhat and r (rows with r = 0 give g = 0)."""
    b_y = (b_xh * b_w[None, :] + b_b[None, :] - b_v + b_k) * b_w[None, :]  # [BT, BD]
    b_y = tl.where(m_2d, b_y, 0.)
    b_sy, b_syx = row_sums2(b_y, b_y * b_xh)                               # [BT]
    b_g = b_rstd[:, None] * (b_y - (b_sy / D)[:, None] - b_xh * (b_syx / D)[:, None])
    return tl.where(m_2d, b_g, 0.), b_y


@triton.jit
def inner_grad_bwd(b_dg, b_xh, b_rstd, b_y, b_g, b_w, m_2d, D: tl.constexpr):
    r"""Backward of g(kh, v, k) for a cotangent dg [BT, BD]: returns (dkh, dy) with dy the
    cotangent of y (so dv = -dy w, and dk, dw, db get dy-terms from the caller).

    .. math::
        dy &= r (dg - \overline{dg} - \hat x\, \overline{dg\, \hat x}),\quad
        d\hat x = -r (dg\, \overline{\hat x y} + y\, \overline{dg\, \hat x}) + dy\, w^2,
        \quad dr = \textstyle\sum dg\, g / r\\
        dkh &= r (d\hat x - \overline{d\hat x} - \hat x\, \overline{d\hat x\, \hat x})
            - dr\, r^2 \hat x / D

    The row means of dxhat are expanded into means of dg against fixed vectors, so all
    five reductions that involve dg happen in one round (``row_sums5``):
    ``mean(dxh) = r (mean(w^2 dg) - a3 a1 - ym a2 - mean(w^2) a1 - mean(w^2 xh) a2)`` and
    ``mean(dxh xh) = r (mean(w^2 xh dg) - 2 a3 a2 - mean(w^2 xh) a1 - mean(w^2 xh^2) a2)``
    with ``a1 = mean(dg)``, ``a2 = mean(dg xh)``, ``a3 = mean(xh y)``, ``ym = mean(y)``.
    """
    b_w2 = (b_w * b_w)[None, :]                                            # [1, BD]
    b_wxh = b_w2 * b_xh                                                    # [BT, BD]
    # row constants: independent of dg
    b_a3 = tl.sum(b_xh * b_y, 1) / D                                       # [BT]
    b_ym = tl.sum(b_y, 1) / D
    b_wx1 = tl.sum(b_wxh, 1) / D
    b_wx2 = tl.sum(b_wxh * b_xh, 1) / D
    b_W2 = tl.sum(b_w * b_w, 0) / D                                        # scalar
    # the one round of reductions that involves dg
    b_s1, b_s2, b_sg, b_sw, b_swx = row_sums5(b_dg, b_dg * b_xh, b_dg * b_g, b_dg * b_w2,
                                              b_dg * b_wxh)
    b_a1 = b_s1 / D                                                        # [BT]
    b_a2 = b_s2 / D
    b_r = b_rstd[:, None]                                                  # [BT, 1]
    b_dy = tl.where(m_2d, b_r * (b_dg - b_a1[:, None] - b_xh * b_a2[:, None]), 0.)
    b_dxh = -b_r * (b_dg * b_a3[:, None] + b_y * b_a2[:, None]) + b_dy * b_w2
    b_c1 = b_rstd * (b_sw / D - b_a3 * b_a1 - b_ym * b_a2 - b_W2 * b_a1 - b_wx1 * b_a2)
    b_c2 = b_rstd * (b_swx / D - 2. * b_a3 * b_a2 - b_wx1 * b_a1 - b_wx2 * b_a2)
    b_dkh = b_r * (b_dxh - b_c1[:, None] - b_xh * b_c2[:, None]) \
        - (b_sg * b_rstd / D)[:, None] * b_xh
    return tl.where(m_2d, b_dkh, 0.), b_dy


@triton.jit
def post_norm(b_o, b_w, b_b, m_2d, D: tl.constexpr, eps):
    """The fused post norm-residual: o + LN(o) w + b (LayerNorm over D, no affine);
    returns it with LN(o) and its r."""
    b_mean = tl.sum(tl.where(m_2d, b_o, 0.), 1) / D                        # [BT]
    b_xc = tl.where(m_2d, b_o - b_mean[:, None], 0.)                       # [BT, BD]
    b_ro = 1. / tl.sqrt(tl.sum(b_xc * b_xc, 1) / D + eps)                  # [BT]
    b_oh = b_xc * b_ro[:, None]                                            # [BT, BD]
    return b_o + b_oh * b_w[None, :] + b_b[None, :], b_oh, b_ro


@triton.jit
def post_norm_bwd(b_do, b_oh, b_ro, b_w, m_2d, D: tl.constexpr):
    """Cotangent of the pre-norm output: do + r (do w - mean(do w) - oh mean(do w oh))."""
    b_doh = b_do * b_w[None, :]                                            # [BT, BD]
    b_m1 = tl.sum(b_doh, 1) / D
    b_m2 = tl.sum(b_doh * b_oh, 1) / D
    b_dop = b_do + b_ro[:, None] * (b_doh - b_m1[:, None] - b_oh * b_m2[:, None])
    return tl.where(m_2d, b_dop, 0.)


@triton.jit
def qk_tril(r_q, r_k, m_tril, scale, HALF: tl.constexpr, PREC: tl.constexpr):
    """A = tril(scale q k^T) + tril(1) [BT, BT] from the raw input tiles (half inputs: a
    half-precision dot with fp32 accumulation, exact products)."""
    if HALF:
        b_A = tl.dot(r_q, tl.trans(r_k))
    else:
        b_A = tl.dot(r_q, tl.trans(r_k), input_precision=PREC)
    return tl.where(m_tril, b_A * scale + 1., 0.)
