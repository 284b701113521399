r"""Forward, parallel part: the outputs, one program per (group of G chunks, head).

The chain kernel stored ``xhat`` and ``r`` of every row, so ``g`` is row-local (common.py)
and inside a group the outputs are linear in
what is stored and need no chunk-by-chunk replay. The program walks its group in blocks
of ``BS`` rows (``BS / BT`` chunks), starting from the group's checkpoint slot. With
``W, hb`` the state before the block, ``q`` pre-scaled, ``e`` the per-row eta and
``\eta_j`` the eta of the last valid row of row ``j``'s chunk:

.. math::

    o_{pre} &= q W + hb - (P \odot (q k^\top + 1))\, g, \qquad
    P_{ij} = \begin{cases} \eta_j & \text{chunk}(j) < \text{chunk}(i)\\
                           e_i & \text{chunk}(j) = \text{chunk}(i),\ j \le i\\
                           0 & \text{otherwise}\end{cases}\\
    o &= o_{pre} + \mathrm{LN}(o_{pre})\, w + b \quad (\text{or another ``OUTPUT`` form,
        common.py})\\
    W &\leftarrow W - (\eta \odot k)^\top g, \qquad hb \leftarrow hb - \textstyle\sum_j \eta_j g_j

with ``g`` scaled by the per-key factor ``l`` row by row under ``HAS_ETA_KEY`` (the
chunk-by-chunk state updates of the rows before row ``i`` in the block, folded into
one masked ``[BS, BS]`` product). Groups are independent, so this kernel fills the GPU
however few (sequence, head) pairs there are; blocks of ``BS = 64`` rows give the tensor
cores ``[64, 64]`` tiles instead of ``[16, 64]`` ones.
"""

import triton
import triton.language as tl

from .common import (
    block_qkg,
    block_rows,
    group_start,
    mm,
    output_form,
    qk_plus_one,
)


@triton.jit(do_not_specialize=["T"])
def ttt_linear_fwd_out_kernel(
    # the tensors (common.py's table), offsets, scalars and T; then the constexprs
    q, k, v, eta, w, b, eta_key, ck, ckb, xbuf, rbuf, o,
    cu_seqlens, grp_offsets, grp_seq, scale, eps, T,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
    G: tl.constexpr, IS_VARLEN: tl.constexpr, HALF: tl.constexpr, PREC: tl.constexpr,
    HAS_ETA_KEY: tl.constexpr, OUTPUT: tl.constexpr,
):
    (_gid, _i_h, seq_len, o_s, o_d, m_d, m_same, m_prev, b_w, b_b, b_W, b_hb, p_base, p_ebase,
     r_beg, r_end) = group_start(w, b, ck, ckb, cu_seqlens, grp_offsets, grp_seq, T, H, D, BT,
                                 BS, BD, G, IS_VARLEN)
    for r0 in range(r_beg, r_end, BS):
        o_x, o_e, m_2d, m_t, _, b_e, b_el = block_rows(eta, p_base, p_ebase, r0, o_s, o_d,
                                                       m_d, seq_len, H, D, BT)
        r_q, r_k, b_g = block_qkg(q, k, v, xbuf, rbuf, eta_key, o_x, o_e, m_2d, m_t, b_w, b_b,
                                  D, HAS_ETA_KEY)                          # [BS, BD] each

        b_A = qk_plus_one(r_q, r_k, scale, HALF, PREC)                    # [BS, BS]
        b_P = tl.where(m_prev, b_el[None, :], tl.where(m_same, b_e[:, None], 0.))
        b_A = b_P * b_A                                                    # [BS, BS]
        b_q = r_q.to(tl.float32) * scale                                  # [BS, BD]
        b_o = mm(b_q, b_W, PREC) + b_hb[None, :] \
            - mm(b_A, b_g, PREC)                                           # [BS, BD]
        b_o = output_form(b_o, r_q, b_w, b_b, m_2d, D, eps, OUTPUT)
        tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m_2d)

        b_ke = r_k.to(tl.float32) * b_el[:, None]                          # [BS, BD]
        b_W = b_W - mm(tl.trans(b_ke), b_g, PREC)
        b_hb = b_hb - tl.sum(b_g * b_el[:, None], 0)
