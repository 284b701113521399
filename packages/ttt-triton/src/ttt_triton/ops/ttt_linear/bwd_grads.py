r"""Backward, parallel part 2: the gradients that need both the state and its cotangent.
One program per (group of G chunks, head) walks its chunks in reverse from the slot at
the group's end, where the forward chain stored the state ``W`` and the backward chain its
cotangent ``dW`` (``q`` pre-scaled, ``g`` from the stored ``xhat``/``r``):

.. math::

    W &\leftarrow W + \eta_{last}\, k^\top g, \quad hb \leftarrow hb + \eta_{last}
        \textstyle\sum_i g_i \qquad (\text{the state before the chunk})\\
    dg &= dg_{loc} - \eta_{last}\,(k\, dW + dhb) \;\to\; dkh, dy \text{ (common.py)}\\
    d\eta_{last} &\mathrel{+}= -\langle k\, dW, g\rangle - dhb \cdot \textstyle\sum_i g_i\\
    dk &= dP^\top q - \eta_{last}\, g\, dW^\top + dy\, w + dkh\, W^\top, \quad
        dP = -\mathrm{tril}(e \odot do_{pre} g^\top)\\
    dv &= -dy\, w, \quad dw \mathrel{+}= \textstyle\sum_i dy (2 \hat x w + b - v + k),
        \quad db \mathrel{+}= \textstyle\sum_i dy\, w\\
    dW &\leftarrow dW + q^\top do_{pre} + k^\top dkh, \qquad
        dhb \leftarrow dhb + \textstyle\sum_i do_{pre,i} + \textstyle\sum_i dkh_i

Stepping the state backwards re-adds the very updates the forward subtracted, starting
from an exact fp32 slot at most G - 1 chunks away; the group's first chunk takes its state
from its own slot.
"""

import triton
import triton.language as tl

from .common import group_coords, inner_grad_bwd, inner_grad_from_xhat, last_row_eta, row_offsets


@triton.jit(do_not_specialize=["T"])
def ttt_linear_bwd_grads_kernel(
    q, k, v, eta, w, b,
    ck, ckb,            # state slots (forward chain)
    dck, dckb,          # cotangent slots (backward chain)
    xbuf, rbuf, dopbuf, dgbuf,  # from bwd_local
    dk, dv,             # [B, T, H, D]
    deta,               # [B, T, H] fp32, last-row terms added here
    dwp, dbp,           # [groups, H, D] fp32 partials of dw, db
    cu_seqlens, grp_offsets, grp_seq,
    scale,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    G: tl.constexpr,
    IS_VARLEN: tl.constexpr,
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
    i_ck0 = slot * H + i_h
    i_ck = i_ck0 + H
    b_W = tl.load(ck + i_ck * D * D + o_dd, mask=m_dd, other=0.)           # [BD, BD]
    b_hb = tl.load(ckb + i_ck * D + o_d, mask=m_d, other=0.)               # [BD]
    b_dW = tl.load(dck + i_ck * D * D + o_dd, mask=m_dd, other=0.)         # [BD, BD]
    b_dhb = tl.load(dckb + i_ck * D + o_d, mask=m_d, other=0.)             # [BD]
    b_dw = tl.zeros([BD], dtype=tl.float32)                                # [BD]
    b_db = tl.zeros([BD], dtype=tl.float32)                                # [BD]

    p_base = (bos * H + i_h) * D
    p_ebase = bos * H + i_h
    for jr in range(0, nc):
        i_c = c0 + nc - 1 - jr
        o_x, m_2d, o_e, m_t = row_offsets(p_base, i_c * BT, o_t, o_d, seq_len, m_d, H, D)
        b_q = tl.load(q + o_x, mask=m_2d, other=0.).to(tl.float32) * scale  # [BT, BD]
        b_k = tl.load(k + o_x, mask=m_2d, other=0.).to(tl.float32)         # [BT, BD]
        b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)         # [BT, BD]
        b_xh = tl.load(xbuf + o_x, mask=m_2d, other=0.)                    # [BT, BD]
        b_r = tl.load(rbuf + p_ebase + o_e, mask=m_t, other=0.)            # [BT]
        b_dop = tl.load(dopbuf + o_x, mask=m_2d, other=0.)                 # [BT, BD]
        b_dgl = tl.load(dgbuf + o_x, mask=m_2d, other=0.)                  # [BT, BD]
        b_e = tl.load(eta + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
        L = tl.minimum(seq_len - i_c * BT, BT)
        m_last = o_t == L - 1                                              # [BT]
        b_el = last_row_eta(eta, p_ebase, i_c, seq_len, BT, H)

        b_g, b_y = inner_grad_from_xhat(b_xh, b_r, b_k, b_v, b_w, b_b, m_2d, D)
        # the state before this chunk: the exact slot for the group's first chunk (where a
        # zero initial state makes LayerNorm ill-conditioned), else one update undone
        if jr == nc - 1:
            b_W = tl.load(ck + i_ck0 * D * D + o_dd, mask=m_dd, other=0.)
            b_hb = tl.load(ckb + i_ck0 * D + o_d, mask=m_d, other=0.)
        else:
            b_W = b_W + b_el * tl.dot(tl.trans(b_k), b_g, input_precision=PREC)
            b_hb = b_hb + b_el * tl.sum(b_g, 0)

        b_kdW = tl.dot(b_k, b_dW, input_precision=PREC)                   # [BT, BD]
        b_dg = tl.where(m_2d, b_dgl - b_el * (b_kdW + b_dhb[None, :]), 0.)
        b_de_last = -tl.sum(tl.sum(b_kdW * b_g, 1), 0) - tl.sum(b_dhb * tl.sum(b_g, 0), 0)
        b_dkh, b_dy = inner_grad_bwd(b_dg, b_xh, b_r, b_y, b_g, b_w, m_2d, D)
        b_dyw = b_dy * b_w[None, :]                                        # [BT, BD]

        b_dS = tl.dot(b_dop, tl.trans(b_g), input_precision=PREC)         # [BT, BT]
        b_dP = tl.where(m_tril, -b_e[:, None] * b_dS, 0.)                  # [BT, BT]
        b_dk = tl.dot(tl.trans(b_dP), b_q, input_precision=PREC) \
            - b_el * tl.dot(b_g, tl.trans(b_dW), input_precision=PREC) \
            + tl.dot(b_dkh, tl.trans(b_W), input_precision=PREC) + b_dyw
        b_dw += tl.sum(b_dy * (2. * b_xh * b_w[None, :] + b_b[None, :] - b_v + b_k), 0)
        b_db += tl.sum(b_dyw, 0)

        tl.store(dk + o_x, b_dk.to(dk.dtype.element_ty), mask=m_2d)
        tl.store(dv + o_x, (-b_dyw).to(dv.dtype.element_ty), mask=m_2d)
        p_el = deta + p_ebase + o_e
        b_de = tl.load(p_el, mask=m_t & m_last, other=0.)
        tl.store(p_el, b_de + b_de_last, mask=m_t & m_last)

        b_dW += tl.dot(tl.trans(b_q), b_dop, input_precision=PREC) \
            + tl.dot(tl.trans(b_k), b_dkh, input_precision=PREC)
        b_dhb += tl.sum(b_dop, 0) + tl.sum(b_dkh, 0)

    o_p = (gid.to(tl.int64) * H + i_h) * D + o_d
    tl.store(dwp + o_p, b_dw, mask=m_d)
    tl.store(dbp + o_p, b_db, mask=m_d)
