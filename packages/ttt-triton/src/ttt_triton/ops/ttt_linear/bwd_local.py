r"""Backward, parallel part 1: everything that needs the forward state but not the state's
cotangent. One program per (group of G chunks, head), replaying the group from its
checkpoint slot (``q`` pre-scaled, ``A = tril(q k^T) + tril(1)``, ``e`` per-row eta):

.. math::

    &kh, \hat x, r, y, g \text{ as in the forward;}\quad
        o_{pre} = q W + hb - e \odot (A g)\\
    &do_{pre} = do + r_o (d\hat o - \overline{d\hat o} - \hat o\, \overline{d\hat o\, \hat o}),
        \quad d\hat o = do \odot w \quad (\text{post norm-residual})\\
    &dS = do_{pre}\, g^\top, \quad dP = -\mathrm{tril}(e \odot dS), \quad
        dq = \mathrm{scale}\,(do_{pre} W^\top + dP\, k), \quad
        d\eta_i = -\textstyle\sum_j A_{ij} dS_{ij}\\
    &dg_{loc} = -A^\top (e \odot do_{pre})

It writes ``dq`` (final), ``deta`` (final except the last-row term, added by
``bwd_chain.py``), the post-norm part of ``dw``/``db`` (per-program partials), and for the
later kernels ``xhat``, ``r``, ``do_pre`` and ``dg_loc`` (fp32).
"""

import triton
import triton.language as tl

from .common import (
    group_coords,
    inner_grad,
    last_row_eta,
    post_norm,
    post_norm_bwd,
    qk_tril,
    row_offsets,
)


@triton.jit(do_not_specialize=["T"])
def ttt_linear_bwd_local_kernel(
    q, k, v, eta, w, b, do,
    ck, ckb,            # checkpoint slots of the forward chain
    xbuf, rbuf,         # [B * T, H, D], [B * T, H] fp32: xhat and r
    dopbuf, dgbuf,      # [B * T, H, D] fp32: do_pre and dg_loc
    dq,                 # [B, T, H, D]
    deta,               # [B, T, H] fp32
    dwp, dbp,           # [groups, H, D] fp32 partials of dw, db
    cu_seqlens, grp_offsets, grp_seq,
    scale, eps,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    G: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HALF: tl.constexpr,
    PREC: tl.constexpr,
):
    gid, i_h = tl.program_id(0), tl.program_id(1)
    i_n, bos, seq_len, c0, nc, slot = group_coords(gid, cu_seqlens, grp_offsets, grp_seq,
                                                   T, BT, G, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_dd = m_d[:, None] & m_d[None, :]
    o_dd = o_d[:, None] * D + o_d[None, :]                                 # [BD, BD]
    m_tril = o_t[:, None] >= o_t[None, :]                                  # [BT, BT]

    b_w = tl.load(w + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    b_b = tl.load(b + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    i_ck = slot * H + i_h
    b_W = tl.load(ck + i_ck * D * D + o_dd, mask=m_dd, other=0.)           # [BD, BD]
    b_hb = tl.load(ckb + i_ck * D + o_d, mask=m_d, other=0.)               # [BD]
    b_dw = tl.zeros([BD], dtype=tl.float32)                                # [BD]
    b_db = tl.zeros([BD], dtype=tl.float32)                                # [BD]

    p_base = (bos * H + i_h) * D
    p_ebase = bos * H + i_h
    for j in range(0, nc):
        i_c = c0 + j
        o_x, m_2d, o_e, m_t = row_offsets(p_base, i_c * BT, o_t, o_d, seq_len, m_d, H, D)
        r_q = tl.load(q + o_x, mask=m_2d, other=0.)                        # [BT, BD]
        r_k = tl.load(k + o_x, mask=m_2d, other=0.)                        # [BT, BD]
        b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)         # [BT, BD]
        b_do = tl.load(do + o_x, mask=m_2d, other=0.).to(tl.float32)       # [BT, BD]
        b_e = tl.load(eta + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
        b_el = last_row_eta(eta, p_ebase, i_c, seq_len, BT, H)
        b_q = r_q.to(tl.float32) * scale                                   # [BT, BD]
        b_k = r_k.to(tl.float32)                                           # [BT, BD]

        # the forward of the chunk
        b_kh = tl.dot(b_k, b_W, input_precision=PREC) + b_hb[None, :]     # [BT, BD]
        b_g, b_xh, b_rstd, b_y = inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps)
        b_A = qk_tril(r_q, r_k, m_tril, scale, HALF, PREC)                 # [BT, BT]
        b_o = tl.dot(b_q, b_W, input_precision=PREC) + b_hb[None, :]      # [BT, BD]
        b_o = b_o - b_e[:, None] * tl.dot(b_A, b_g, input_precision=PREC)

        # post norm-residual backward
        b_on, b_oh, b_ro = post_norm(b_o, b_w, b_b, m_2d, D, eps)
        b_dw += tl.sum(b_do * b_oh, 0)
        b_db += tl.sum(b_do, 0)
        b_dop = post_norm_bwd(b_do, b_oh, b_ro, b_w, m_2d, D)              # [BT, BD]

        # h-cotangent-free gradients
        b_dS = tl.dot(b_dop, tl.trans(b_g), input_precision=PREC)         # [BT, BT]
        b_de = -tl.sum(b_A * b_dS, 1)                                      # [BT]
        b_dP = tl.where(m_tril, -b_e[:, None] * b_dS, 0.)                  # [BT, BT]
        b_dq = tl.dot(b_dop, tl.trans(b_W), input_precision=PREC) \
            + tl.dot(b_dP, b_k, input_precision=PREC)                     # [BT, BD]
        b_dgl = -tl.dot(tl.trans(b_A), b_e[:, None] * b_dop, input_precision=PREC)

        tl.store(dq + o_x, (b_dq * scale).to(dq.dtype.element_ty), mask=m_2d)
        tl.store(deta + p_ebase + o_e, b_de, mask=m_t)
        tl.store(xbuf + o_x, b_xh, mask=m_2d)
        tl.store(rbuf + p_ebase + o_e, b_rstd, mask=m_t)
        tl.store(dopbuf + o_x, b_dop, mask=m_2d)
        tl.store(dgbuf + o_x, b_dgl, mask=m_2d)

        b_W = b_W - b_el * tl.dot(tl.trans(b_k), b_g, input_precision=PREC)
        b_hb = b_hb - b_el * tl.sum(b_g, 0)

    o_p = (gid.to(tl.int64) * H + i_h) * D + o_d
    tl.store(dwp + o_p, b_dw, mask=m_d)
    tl.store(dbp + o_p, b_db, mask=m_d)
