r"""Backward, parallel part 1: everything that needs the forward state but not the state's
cotangent. One program per (group of G chunks, head) walks its group from its checkpoint
slot in blocks of ``BS`` rows (``BS / BT`` chunks). Per block, with ``W, hb`` the state
before it, ``q`` pre-scaled, ``e`` the per-row eta, ``\eta_j`` the eta of the last valid
row of row ``j``'s chunk and ``P`` the mask of ``fwd_out.py``:

1. chunk by chunk (the only sequential part): ``kh = k W_c + hb_c``, the LayerNorm
   ``\hat x, r`` and ``g`` as in the forward, then the state update; ``\hat x`` and ``r``
   go to their buffers, ``g`` to the ``dg_loc`` buffer as scratch for step 2;
2. on the whole block:

.. math::

    o_{pre} &= q W + hb - (P \odot A)\, g, \quad A = q k^\top + 1\\
    do_{pre} &= do + r_o (d\hat o - \overline{d\hat o} - \hat o\,
        \overline{d\hat o\, \hat o}), \quad d\hat o = do \odot w
        \quad (\text{post norm-residual})\\
    dS &= do_{pre}\, g^\top, \quad
        dq = \mathrm{scale}\,\big(do_{pre} W^\top - (P \odot dS)\, k\big), \quad
        d\eta_i = -\textstyle\sum_{j \le i,\ c_j = c_i} A_{ij} dS_{ij}\\
    dg_{loc} &= -\big([c_i = c_j,\ j \le i]\, A \odot e\big)^\top do_{pre}

(``dq`` gathers the intra-chunk term and the updates of the earlier chunks in the block;
``dg_loc`` is only the intra-chunk part, the rest reaches ``g`` through the state's
cotangent in ``bwd_chain.py``). It writes ``dq`` (final), ``deta`` (final except the
last-row term, added by ``bwd_chain.py``), the post-norm part of ``dw``/``db``
(per-program partials), and for the later kernels ``xhat``, ``r``, ``do_pre`` and
``dg_loc`` (fp32).
"""

import triton
import triton.language as tl

from .common import (
    block_rows,
    group_coords,
    inner_grad,
    last_row_eta,
    post_norm,
    post_norm_bwd,
    row_offsets,
)


@triton.jit(do_not_specialize=["T"])
def ttt_linear_bwd_local_kernel(
    q, k, v, eta, w, b, do,
    ck, ckb,            # checkpoint slots of the forward chain
    xbuf, rbuf,         # [B * T, H, D], [B * T, H] fp32: xhat and r
    dopbuf, dgbuf,      # [B * T, H, D] fp32: do_pre and dg_loc (g as scratch first)
    dq,                 # [B, T, H, D]
    deta,               # [B, T, H] fp32
    dwp, dbp,           # [groups, H, D] fp32 partials of dw, db
    cu_seqlens, grp_offsets, grp_seq,
    scale, eps,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
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
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_dd = m_d[:, None] & m_d[None, :]
    o_dd = o_d[:, None] * D + o_d[None, :]                                 # [BD, BD]
    o_c = o_s // BT                                                        # [BS] chunk in block
    m_same = (o_c[:, None] == o_c[None, :]) & (o_s[:, None] >= o_s[None, :])  # [BS, BS]
    m_prev = o_c[:, None] > o_c[None, :]                                   # [BS, BS]

    b_w = tl.load(w + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    b_b = tl.load(b + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    i_ck = slot * H + i_h
    b_W = tl.load(ck + i_ck * D * D + o_dd, mask=m_dd, other=0.)           # [BD, BD]
    b_hb = tl.load(ckb + i_ck * D + o_d, mask=m_d, other=0.)               # [BD]
    b_dw = tl.zeros([BD], dtype=tl.float32)                                # [BD]
    b_db = tl.zeros([BD], dtype=tl.float32)                                # [BD]

    p_base = (bos * H + i_h) * D
    p_ebase = bos * H + i_h
    r_end = tl.minimum((c0 + nc) * BT, seq_len)
    for r0 in range(c0 * BT, r_end, BS):
        b_Ws = b_W                                                         # [BD, BD]
        b_hbs = b_hb                                                       # [BD]
        # 1. the block's chunks one after the other: xhat, r and g (g into dgbuf)
        for rc in range(r0, tl.minimum(r0 + BS, r_end), BT):
            o_x, m_2d, o_e, m_t = row_offsets(p_base, rc, o_t, o_d, seq_len, m_d, H, D)
            b_k = tl.load(k + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_el = last_row_eta(eta, p_ebase, rc // BT, seq_len, BT, H)
            b_kh = tl.dot(b_k, b_W, input_precision=PREC) + b_hb[None, :]  # [BT, BD]
            b_g, b_xh, b_rstd, b_y = inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps)
            tl.store(xbuf + o_x, b_xh, mask=m_2d)
            tl.store(rbuf + p_ebase + o_e, b_rstd, mask=m_t)
            tl.store(dgbuf + o_x, b_g, mask=m_2d)
            b_W = b_W - b_el * tl.dot(tl.trans(b_k), b_g, input_precision=PREC)
            b_hb = b_hb - b_el * tl.sum(b_g, 0)
        tl.debug_barrier()   # g of the whole block, stored by other threads, is read next

        # 2. the block at once
        o_x, m_2d, m_t, b_e, b_el = block_rows(eta, p_base, p_ebase, r0, o_s, o_d, m_d,
                                               seq_len, H, D, BT)
        o_e = p_ebase + (r0 + o_s).to(tl.int64) * H
        r_q = tl.load(q + o_x, mask=m_2d, other=0.)                        # [BS, BD]
        r_k = tl.load(k + o_x, mask=m_2d, other=0.)                        # [BS, BD]
        b_g = tl.load(dgbuf + o_x, mask=m_2d, other=0.)                    # [BS, BD]
        b_do = tl.load(do + o_x, mask=m_2d, other=0.).to(tl.float32)       # [BS, BD]
        if HALF:
            b_A = tl.dot(r_q, tl.trans(r_k))                               # [BS, BS]
        else:
            b_A = tl.dot(r_q, tl.trans(r_k), input_precision=PREC)
        b_A = b_A * scale + 1.
        b_P = tl.where(m_prev, b_el[None, :], tl.where(m_same, b_e[:, None], 0.))  # [BS, BS]
        b_q = r_q.to(tl.float32) * scale                                   # [BS, BD]
        b_o = tl.dot(b_q, b_Ws, input_precision=PREC) + b_hbs[None, :] \
            - tl.dot(b_P * b_A, b_g, input_precision=PREC)                # [BS, BD]
        # post norm-residual backward
        b_on, b_oh, b_ro = post_norm(b_o, b_w, b_b, m_2d, D, eps)
        b_dw += tl.sum(b_do * b_oh, 0)
        b_db += tl.sum(b_do, 0)
        b_dop = post_norm_bwd(b_do, b_oh, b_ro, b_w, m_2d, D)              # [BS, BD]
        # state-cotangent-free gradients
        b_dS = tl.dot(b_dop, tl.trans(b_g), input_precision=PREC)         # [BS, BS]
        b_Al = tl.where(m_same, b_A, 0.)                                   # [BS, BS]
        b_de = -tl.sum(b_Al * b_dS, 1)                                     # [BS]
        b_dq = tl.dot(b_dop, tl.trans(b_Ws), input_precision=PREC) \
            - tl.dot(b_P * b_dS, r_k.to(tl.float32), input_precision=PREC)  # [BS, BD]
        b_dgl = -tl.dot(tl.trans(b_Al * b_e[:, None]), b_dop, input_precision=PREC)
        tl.store(dq + o_x, (b_dq * scale).to(dq.dtype.element_ty), mask=m_2d)
        tl.store(deta + o_e, b_de, mask=m_t)
        tl.store(dopbuf + o_x, b_dop, mask=m_2d)
        tl.debug_barrier()   # every thread has read its g before dg_loc overwrites it
        tl.store(dgbuf + o_x, b_dgl, mask=m_2d)

    o_p = (gid.to(tl.int64) * H + i_h) * D + o_d
    tl.store(dwp + o_p, b_dw, mask=m_d)
    tl.store(dbp + o_p, b_db, mask=m_d)
