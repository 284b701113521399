r"""Forward, parallel part: the outputs, one program per (group of G chunks, head).

Each program starts from its group's checkpoint slot and replays the state update with the
``g`` the chain kernel stored (no LayerNorm on this path), writing per chunk (``q``
pre-scaled, ``e`` the per-row eta):

.. math::

    o_{pre} &= q W + hb - e \odot \big((\mathrm{tril}(q k^\top) + \mathrm{tril}(1))\, g\big)\\
    o &= o_{pre} + \mathrm{LN}(o_{pre})\, w + b\\
    W &\leftarrow W - \eta_{last}\, k^\top g, \qquad hb \leftarrow hb - \eta_{last} \textstyle\sum_i g_i

Groups are independent, so this kernel fills the GPU however few (sequence, head) pairs
there are.
"""

import triton
import triton.language as tl

from .common import group_coords, last_row_eta, post_norm, qk_tril, row_offsets


@triton.jit(do_not_specialize=["T"])
def ttt_linear_fwd_out_kernel(
    q, k, eta, w, b,
    ck, ckb,            # checkpoint slots of the chain kernel
    gbuf,               # [B * T, H, D] fp32 g
    o,                  # [B, T, H, D] input dtype
    cu_seqlens, grp_offsets,
    grp_seq,            # [groups] int32 sequence of each group (when IS_VARLEN)
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

    p_base = (bos * H + i_h) * D
    p_ebase = bos * H + i_h
    for j in range(0, nc):
        i_c = c0 + j
        o_x, m_2d, o_e, m_t = row_offsets(p_base, i_c * BT, o_t, o_d, seq_len, m_d, H, D)
        r_q = tl.load(q + o_x, mask=m_2d, other=0.)                        # [BT, BD]
        r_k = tl.load(k + o_x, mask=m_2d, other=0.)                        # [BT, BD]
        b_g = tl.load(gbuf + o_x, mask=m_2d, other=0.)                     # [BT, BD]
        b_e = tl.load(eta + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
        b_el = last_row_eta(eta, p_ebase, i_c, seq_len, BT, H)

        b_A = qk_tril(r_q, r_k, m_tril, scale, HALF, PREC)                 # [BT, BT]
        b_q = r_q.to(tl.float32) * scale                                   # [BT, BD]
        b_o = tl.dot(b_q, b_W, input_precision=PREC) + b_hb[None, :]      # [BT, BD]
        b_o = b_o - b_e[:, None] * tl.dot(b_A, b_g, input_precision=PREC)
        b_o, b_oh, b_ro = post_norm(b_o, b_w, b_b, m_2d, D, eps)
        tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m_2d)

        b_k = r_k.to(tl.float32)
        b_W = b_W - b_el * tl.dot(tl.trans(b_k), b_g, input_precision=PREC)
        b_hb = b_hb - b_el * tl.sum(b_g, 0)
