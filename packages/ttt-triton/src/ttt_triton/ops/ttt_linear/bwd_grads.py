r"""Backward, parallel part 2: dk, dv and the inner-loss part of dw, db. One program per
(group of G chunks, head) walks its group backwards in blocks of ``BS`` rows (``BS / BT``
chunks). The backward chain stored every row's full ``dg`` (the cotangent of ``g``), so
``dkh, dy`` are row-local (common.py) and everything here is linear in stored tiles:

.. math::

    dk &= dy\, w + C_q\, q + C_k\, k + dkh\, W^\top - \eta \odot (g\, dW^\top)\\
    (C_q)_{ij} &= -\big([c_j = c_i,\ j \ge i]\, e_j + [c_j > c_i]\, \eta_i\big)\,
        (g_i \cdot do_{pre,j})\\
    (C_k)_{ij} &= -[c_j < c_i]\, \eta_j\, (dkh_i \cdot g_j) - [c_j > c_i]\, \eta_i\,
        (g_i \cdot dkh_j)\\
    d\eta_{last} &\mathrel{+}= -\textstyle\sum_{i \in \text{chunk}} s_i
        \ (s \text{ the per-row sums of bwd\_chain.py}), \quad
    dv = -dy\, w, \quad dw \mathrel{+}= \textstyle\sum_i dy (2 \hat x w + b - v + k),
        \quad db \mathrel{+}= \textstyle\sum_i dy\, w

with ``c_i`` row ``i``'s chunk, ``e`` the per-row eta, ``\eta_i`` the eta of the last valid
row of row ``i``'s chunk, ``q`` pre-scaled, ``W`` the state before the block and ``dW`` the
cotangent of the state after it. ``C_q`` carries the intra-chunk term ``dP^\top q`` and the
cotangents ``q^\top do_{pre}`` of the later chunks in the block, ``C_k`` the updates of the
earlier chunks to ``W`` and the cotangents ``k^\top dkh`` of the later ones. Between
blocks:

.. math::

    W \leftarrow W + (\eta \odot k)^\top g \quad (\text{undoing the block's updates}),
    \qquad dW \leftarrow dW + q^\top do_{pre} + k^\top dkh

With ``HAS_ETA_KEY``, ``g`` above is scaled by the per-key factor ``l`` row by row and the
stored ``dg`` is already the cotangent of the unscaled ``g`` (``bwd_chain.py``), which the
inner-grad backward takes as is. ``NEED_*`` leave out the gradients autograd does not ask
for (without ``NEED_DK`` no state, cotangent or product is touched). The state walk starts
from the slots at the group's end (state from the forward chain, cotangent from
the backward chain); the group's first block takes its state from its own exact slot
(stepping back all the way to a zero initial state is ill-conditioned in float32).
"""

import triton
import triton.language as tl

from .common import (
    block_rows,
    dim_offsets,
    group_coords,
    inner_grad_bwd,
    inner_grad_from_xhat,
    inner_norm_grads,
    key_scaled,
    load_norm_params,
    mm,
    mm_acc,
    row_bases,
    split_cols,
    store_norm_partials,
)


@triton.jit(do_not_specialize=["T"])
def ttt_linear_bwd_grads_kernel(
    # the tensors (common.py's table), offsets, scalars and T; then the constexprs
    q, k, v, eta, w, b, eta_key, ck, dck, xbuf, rbuf, dopbuf, dgbuf, desum, dk, dv, deta, dwp, dbp,
    cu_seqlens, grp_offsets, grp_seq, scale, T,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
    G: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
    HAS_ETA_KEY: tl.constexpr, NEED_DK: tl.constexpr, NEED_DV: tl.constexpr,
    NEED_DETA: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
):
    gid, i_h = tl.program_id(0), tl.program_id(1)
    # SPLIT programs per (group, head), program i_p owning the columns o_k of k (the rows of
    # W, dW): dk's columns and the state's rows are independent given the row-local tiles
    BK: tl.constexpr = BD // SPLIT
    o_s = tl.arange(0, BS)
    if SPLIT == 1:
        i_p = 0
        m_own = o_s >= 0            # [BS] rows whose dv, deta terms this program writes
    else:
        i_p = tl.program_id(2)
        m_own = (o_s * 0 + i_p) == 0
    o_k = i_p * BK + tl.arange(0, BK)                                      # [BK]
    m_k = o_k < D
    i_n, bos, seq_len, c0, nc, slot = group_coords(gid, cu_seqlens, grp_offsets, grp_seq,
                                                   T, BT, G, IS_VARLEN)
    o_d, m_d, _, _ = dim_offsets(D, BD)
    o_c = o_s // BT                                                        # [BS] chunk in block
    m_same = (o_c[:, None] == o_c[None, :]) & (o_s[:, None] <= o_s[None, :])  # [BS, BS] j >= i
    m_later = o_c[:, None] < o_c[None, :]                                  # [BS, BS] c_j > c_i
    m_earlier = o_c[:, None] > o_c[None, :]                                # [BS, BS] c_j < c_i

    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    i_ck0 = slot * H + i_h
    i_ck = i_ck0 + H
    # W^T, so that dkh W^T needs no transpose of a computed tile (fewer registers)
    o_ddt = o_d[:, None] + o_k[None, :] * D                                # [BD, BK]
    m_ddt = m_d[:, None] & m_k[None, :]
    o_dd = o_k[:, None] * D + o_d[None, :]                                 # [BK, BD]
    m_dd = m_k[:, None] & m_d[None, :]
    if NEED_DK:
        b_Wt = tl.load(ck + i_ck * D * D + o_ddt, mask=m_ddt, other=0.)    # [BD, BK]
        b_dW = tl.load(dck + i_ck * D * D + o_dd, mask=m_dd, other=0.)     # [BK, BD]
    b_dw = tl.zeros([BD], dtype=tl.float32)                                # [BD]
    b_db = tl.zeros([BD], dtype=tl.float32)                                # [BD]

    p_base, p_ebase = row_bases(bos, i_h, H, D)
    r_beg = c0 * BT
    n_blk = tl.cdiv(tl.minimum((c0 + nc) * BT, seq_len) - r_beg, BS)
    for jr in range(0, n_blk):
        r0 = r_beg + (n_blk - 1 - jr) * BS
        o_x, o_e, m_2d, m_t, m_last, b_e, b_el = block_rows(
            eta, p_base, p_ebase, r0, o_s, o_d, m_d, seq_len, H, D, BT)
        if NEED_DETA:
            # the last-row terms of deta, from the backward chain
            b_rs = tl.load(desum + o_e, mask=m_t, other=0.)                # [BS]
            b_dl = -tl.sum(tl.where(o_c[:, None] == o_c[None, :], b_rs[None, :], 0.), 1)
            m_last = m_last & m_own
            tl.store(deta + o_e, tl.load(deta + o_e, mask=m_last, other=0.) + b_dl,
                     mask=m_last)
        # row-local: g, y, then dkh, dy from the full dg; dv, dw, db
        b_k = tl.load(k + o_x, mask=m_2d, other=0.).to(tl.float32)         # [BS, BD]
        b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)         # [BS, BD]
        b_xh = tl.load(xbuf + o_x, mask=m_2d, other=0.)                    # [BS, BD]
        b_r = tl.load(rbuf + o_e, mask=m_t, other=0.)                      # [BS]
        b_dg = tl.load(dgbuf + o_x, mask=m_2d, other=0.)                   # [BS, BD]
        b_g, b_y = inner_grad_from_xhat(b_xh, b_r, b_k, b_v, b_w, b_b, m_2d, D)
        b_dkh, b_dy = inner_grad_bwd(b_dg, b_xh, b_r, b_y, b_g, b_w, m_2d, D)
        b_g = key_scaled(b_g, eta_key, o_e, m_t, HAS_ETA_KEY)              # [BS, BD]
        b_dyw, b_dw, b_db = inner_norm_grads(b_dy, b_xh, b_k, b_v, b_w, b_b, b_dw, b_db,
                                             NEED_DW, NEED_DB)            # [BS, BD], [BD]
        if NEED_DV:
            tl.store(dv + o_x, (-b_dyw).to(dv.dtype.element_ty), mask=m_2d & m_own[:, None])
        if NEED_DK:
            if SPLIT == 1:
                o_xk, m_2dk, b_kk = o_x, m_2d, b_k                         # [BS, BD]
                b_dk = b_dyw
            else:
                o_xk = p_base + (r0 + o_s).to(tl.int64)[:, None] * (H * D) + o_k[None, :]
                m_2dk = m_t[:, None] & m_k[None, :]                        # [BS, BK]
                b_kk = tl.load(k + o_xk, mask=m_2dk, other=0.).to(tl.float32)  # [BS, BK]
                b_dk = split_cols(b_dyw, i_p, SPLIT)                       # [BS, BK]

            # the state before the block
            if jr == n_blk - 1:
                b_Wt = tl.load(ck + i_ck0 * D * D + o_ddt, mask=m_ddt, other=0.)
            else:
                b_Wt = mm_acc(tl.trans(b_g * b_el[:, None]), b_kk, b_Wt, PREC)
            # dk in accumulated parts
            b_dk = mm_acc(b_dkh, b_Wt, b_dk, PREC)                         # [BS, BK]
            b_dk = mm_acc(b_g * -b_el[:, None], tl.trans(b_dW), b_dk, PREC)
            b_S2 = mm(b_g, tl.trans(b_dkh), PREC)                          # [BS, BS]
            b_Ck = -tl.where(m_earlier, b_el[None, :] * tl.trans(b_S2), 0.) \
                - tl.where(m_later, b_el[:, None] * b_S2, 0.)              # [BS, BS]
            b_dk = mm_acc(b_Ck, b_kk, b_dk, PREC)
            b_q = tl.load(q + o_xk, mask=m_2dk, other=0.).to(tl.float32) * scale  # [BS, BK]
            b_dop = tl.load(dopbuf + o_x, mask=m_2d, other=0.)             # [BS, BD]
            b_S1 = mm(b_g, tl.trans(b_dop), PREC)                          # [BS, BS]
            b_Cq = -tl.where(m_same, b_e[None, :],
                             tl.where(m_later, b_el[:, None], 0.)) * b_S1  # [BS, BS]
            b_dk = mm_acc(b_Cq, b_q, b_dk, PREC)
            tl.store(dk + o_xk, b_dk.to(dk.dtype.element_ty), mask=m_2dk)
            # the cotangent of the state before the block
            b_dW = mm_acc(tl.trans(b_q), b_dop, b_dW, PREC)
            b_dW = mm_acc(tl.trans(b_kk), b_dkh, b_dW, PREC)

    store_norm_partials(dwp, dbp, gid.to(tl.int64) * H + i_h, b_dw, b_db, o_d, m_d, i_p, D,
                        NEED_DW, NEED_DB)
