r"""Backward, parallel part 1: everything that needs the forward state but not the state's
cotangent. One program per (group of G chunks, head) walks its group forwards in blocks of
``BS`` rows (``BS / BT`` chunks) from the group's checkpoint slot. The forward chain stored
``xhat`` and ``r`` of every row, so ``g`` is row-local (common.py) and, as in
``fwd_out.py``, the outputs are linear in stored tiles. With ``W, hb`` the state before the
block, ``q`` pre-scaled, ``A = q k^\top + 1``, ``P`` the eta mask of ``fwd_out.py``
(``\eta_j`` for an earlier chunk, ``e_i`` on and below the diagonal of the same chunk) and
``P^=`` its same-chunk part:

.. math::

    &o_{pre} = q W + hb - (P \odot A)\, g\\
    &do_{pre} = do + r_o (d\hat o - \overline{d\hat o} - \hat o\, \overline{d\hat o\, \hat o}),
        \quad d\hat o = do \odot w \quad (\text{post norm-residual})\\
    &\quad (\text{``query\_residual'': without the first } do \text{ and } dq
        \mathrel{+}= do; \text{ ``raw'': } do_{pre} = do)\\
    &dS = do_{pre}\, g^\top, \quad dq = \mathrm{scale}\,(do_{pre} W^\top
        - (P \odot dS)\, k), \quad d\eta_i = -\textstyle\sum_{j \le i,\ \text{same chunk}}
        A_{ij} dS_{ij}\\
    &dg_{loc} = -(P^= \odot A)^\top do_{pre}\\
    &W \leftarrow W - (\eta \odot k)^\top g, \qquad hb \leftarrow hb - \textstyle\sum_j \eta_j g_j

(``dq`` takes the earlier chunks' updates of ``W`` through ``P``; their cotangents of ``g``
and of the last-row eta travel through the state's cotangent, in ``bwd_chain.py``). It
writes ``dq`` (final), ``deta`` (final except the last-row term, added by
``bwd_grads.py``, or by ``bwd_chain.py`` when it is fused), the post-norm part of ``dw``/``db`` (per-program partials), and for the
later kernels ``do_pre`` and ``dg_loc`` (fp32).

With ``HAS_ETA_KEY``, ``g`` is scaled by the per-key factor ``l`` row by row (``dg_loc`` is
the cotangent of the scaled ``g``). ``NEED_*`` leave out the gradients autograd does not
ask for, and without ``STORE_BUFS`` (no later kernel runs: ``dq`` alone) the buffers.
"""

import triton
import triton.language as tl

from .common import (
    block_qkg,
    block_rows,
    group_start,
    mm,
    mm_acc,
    post_norm,
    post_norm_bwd,
    qk_plus_one,
    store_norm_partials,
)


@triton.jit(do_not_specialize=["T"])
def ttt_linear_bwd_local_kernel(
    # the tensors (common.py's table), offsets, scalars and T; then the constexprs
    q, k, v, eta, w, b, do, eta_key, ck, ckb, xbuf, rbuf, dopbuf, dgbuf, dq, deta, dwp, dbp,
    cu_seqlens, grp_offsets, grp_seq, scale, eps, T,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
    G: tl.constexpr, IS_VARLEN: tl.constexpr, HALF: tl.constexpr, PREC: tl.constexpr,
    HAS_ETA_KEY: tl.constexpr, OUTPUT: tl.constexpr, NEED_DQ: tl.constexpr, NEED_DETA: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, STORE_BUFS: tl.constexpr,
):
    (gid, i_h, seq_len, o_s, o_d, m_d, m_same, m_prev, b_w, b_b, b_W, b_hb, p_base, p_ebase,
     r_beg, r_end) = group_start(w, b, ck, ckb, cu_seqlens, grp_offsets, grp_seq, T, H, D, BT,
                                 BS, BD, G, IS_VARLEN)
    b_dw = tl.zeros([BD], dtype=tl.float32)                                # [BD]
    b_db = tl.zeros([BD], dtype=tl.float32)                                # [BD]
    for r0 in range(r_beg, r_end, BS):
        o_x, o_e, m_2d, m_t, _, b_e, b_el = block_rows(eta, p_base, p_ebase, r0, o_s, o_d,
                                                       m_d, seq_len, H, D, BT)
        r_q, r_k, b_g = block_qkg(q, k, v, xbuf, rbuf, eta_key, o_x, o_e, m_2d, m_t, b_w, b_b,
                                  D, HAS_ETA_KEY)                          # [BS, BD] each
        b_k = r_k.to(tl.float32)                                           # [BS, BD]

        # the forward of the block
        b_A = qk_plus_one(r_q, r_k, scale, HALF, PREC)                    # [BS, BS]
        b_Ps = tl.where(m_same, b_e[:, None], 0.)                          # [BS, BS]
        b_P = tl.where(m_prev, b_el[None, :], b_Ps)                        # [BS, BS]
        b_q = r_q.to(tl.float32) * scale                                   # [BS, BD]
        b_o = mm(b_q, b_W, PREC) + b_hb[None, :]                           # [BS, BD]
        b_o = mm_acc(-(b_P * b_A), b_g, b_o, PREC)

        # post norm-residual backward
        b_do = tl.load(do + o_x, mask=m_2d, other=0.).to(tl.float32)       # [BS, BD]
        if OUTPUT == "raw":
            b_dop = b_do                                                   # [BS, BD]
        else:
            b_on, b_oh, b_ro = post_norm(b_o, b_o, b_w, b_b, m_2d, D, eps)
            if NEED_DW:
                b_dw += tl.sum(b_do * b_oh, 0)
            if NEED_DB:
                b_db += tl.sum(b_do, 0)
            b_dop = post_norm_bwd(b_do, b_oh, b_ro, b_w, m_2d, D, OUTPUT)  # [BS, BD]

        # h-cotangent-free gradients
        b_dS = mm(b_dop, tl.trans(b_g), PREC)                              # [BS, BS]
        if NEED_DETA:
            b_de = -tl.sum(tl.where(m_same, b_A * b_dS, 0.), 1)            # [BS]
        if STORE_BUFS:
            b_dgl = -mm(tl.trans(b_Ps * b_A), b_dop, PREC)                 # [BS, BD]
        if NEED_DQ:
            b_dq = mm(b_dop, tl.trans(b_W), PREC)                          # [BS, BD]
            b_dq = mm_acc(-(b_P * b_dS), b_k, b_dq, PREC)
            if OUTPUT == "query_residual":    # + the unscaled q's residual term
                tl.store(dq + o_x, (b_dq * scale + b_do).to(dq.dtype.element_ty), mask=m_2d)
            else:
                tl.store(dq + o_x, (b_dq * scale).to(dq.dtype.element_ty), mask=m_2d)
        if NEED_DETA:
            tl.store(deta + o_e, b_de, mask=m_t)
        if STORE_BUFS:
            tl.store(dopbuf + o_x, b_dop, mask=m_2d)
            tl.store(dgbuf + o_x, b_dgl, mask=m_2d)

        # k again (a cache hit) rather than a copy kept live through the block
        b_ke = tl.load(k + o_x, mask=m_2d, other=0.).to(tl.float32) * -b_el[:, None]
        b_W = mm_acc(tl.trans(b_ke), b_g, b_W, PREC)
        b_hb = b_hb - tl.sum(b_g * b_el[:, None], 0)

    store_norm_partials(dwp, dbp, gid.to(tl.int64) * H + i_h, b_dw, b_db, o_d, m_d, 0, D,
                        NEED_DW, NEED_DB)
