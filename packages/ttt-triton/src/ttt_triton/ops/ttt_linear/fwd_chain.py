r"""Forward, sequential part: carry the state through the chunks (and, when ``FUSE_OUT``,
write the outputs on the way).

One program per (sequence, head). The only work on the chain from one chunk to the next:

.. math::

    kh = k W + hb \;\to\; g \text{ (inner-loss gradient, see common.py)} \;\to\;
    W \leftarrow W - \eta_{last}\, k^\top g, \quad hb \leftarrow hb - \eta_{last} \textstyle\sum_i g_i

with ``eta_last`` the eta of the chunk's last valid row and, with ``HAS_ETA_KEY``, ``g``
scaled row by row by the per-key factor ``l`` (``eta_key``; ``xhat`` and ``r`` stay
unscaled). The program writes ``xhat`` and ``r`` (fp32; ``g`` is row-local in them) for the
output kernel and the backward, the fp32 state into checkpoint slot ``s`` before chunk
``s * G`` and the final state into the last slot (and into ``ht``/``hbt`` when asked). The outputs
(which need ``q``) are left to the parallel kernel in ``fwd_out.py``. The next chunk's
``k``, ``v`` and ``eta_last`` are loaded one step early so their latency leaves the chain.

With ``FUSE_OUT`` the program also writes each chunk's outputs from the state before the
chunk (``q`` pre-scaled, ``e`` the per-row eta):

.. math::

    o_{pre} = q W + hb - (P \odot (q k^\top + 1))\, g, \quad P_{ij} = [j \le i]\, e_i,
    \qquad o = o_{pre} + \mathrm{LN}(o_{pre})\, w + b

(the ``"norm_residual"`` form; ``OUTPUT`` picks another, common.py).

This costs chain latency but saves ``fwd_out``'s second pass over the inputs and, for a
forward without backward (``SAVE`` off), the ``xhat``/``r``/slot stores: the launcher
picks it when there are enough chains to hide the latency (``tuning.FUSED``), and for a
generation step (no backward, every sequence within one chunk: ``ttt.schedule.generation_step``),
where the call is then this one launch.
"""

import triton
import triton.language as tl

from .common import (
    chain_start,
    inner_grad,
    last_row_eta,
    load_norm_params,
    load_state,
    mm,
    output_form,
    qk_plus_one,
    row_bases,
    row_offsets,
    store_state,
)


@triton.jit(do_not_specialize=["T"])
def ttt_linear_fwd_chain_kernel(
    # the tensors (common.py's table), offsets, scalars and T; then the constexprs
    q, k, v, eta, w, b, eta_key, o, h0, hb0, ht, hbt, ck, ckb, xbuf, rbuf,
    cu_seqlens, grp_offsets, scale, eps, T,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, G: tl.constexpr,
    USE_INITIAL: tl.constexpr, USE_INITIAL_BIAS: tl.constexpr, STORE_FINAL: tl.constexpr,
    IS_VARLEN: tl.constexpr, FUSE_OUT: tl.constexpr, SAVE: tl.constexpr, HALF: tl.constexpr,
    PREC: tl.constexpr, HAS_ETA_KEY: tl.constexpr, OUTPUT: tl.constexpr,
):
    (i_nh, i_h, bos, seq_len, NC, slot_base, o_t, o_d, m_d, o_dd,
     m_dd) = chain_start(cu_seqlens, grp_offsets, T, H, D, BT, BD, G, IS_VARLEN)
    m_tril = o_t[:, None] >= o_t[None, :]                                  # [BT, BT] j <= i

    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    # (an initial state not given starts from zeros here, not from a zero-filled buffer)
    b_W, b_hb = load_state(h0, hb0, i_nh.to(tl.int64), D, BD, o_d, m_d, o_dd, m_dd,
                           USE_INITIAL, USE_INITIAL_BIAS)                  # [BD, BD], [BD]

    p_base, p_ebase = row_bases(bos, i_h, H, D)
    # the first chunk's tiles; each step then loads the next chunk's before its math
    o_x0, m_2d0, o_e0, m_t0 = row_offsets(p_base, 0, o_t, o_d, seq_len, m_d, H, D)
    r_k = tl.load(k + o_x0, mask=m_2d0, other=0.)                          # [BT, BD]
    r_v = tl.load(v + o_x0, mask=m_2d0, other=0.)                          # [BT, BD]
    r_el = last_row_eta(eta, p_ebase, 0, seq_len, BT, H)
    if HAS_ETA_KEY:
        r_l = tl.load(eta_key + p_ebase + o_e0, mask=m_t0, other=0.)      # [BT]
    if FUSE_OUT:
        r_q = tl.load(q + o_x0, mask=m_2d0, other=0.)                      # [BT, BD]
        r_e = tl.load(eta + p_ebase + o_e0, mask=m_t0, other=0.)          # [BT]
    for i_c in range(0, NC):
        if SAVE and i_c % G == 0:
            store_state(ck, ckb, (slot_base + i_c // G) * H + i_h, b_W, b_hb, D, o_d, m_d,
                        o_dd, m_dd)
        b_k = r_k.to(tl.float32)                                           # [BT, BD]
        b_v = r_v.to(tl.float32)                                           # [BT, BD]
        b_el = r_el
        o_x, m_2d, o_e, m_t = row_offsets(p_base, i_c * BT, o_t, o_d, seq_len, m_d, H, D)
        # next chunk (masked to nothing past the end; eta clamps to the last row)
        o_xn, m_2dn, o_en, m_tn = row_offsets(p_base, (i_c + 1) * BT, o_t, o_d, seq_len, m_d,
                                              H, D)
        r_k = tl.load(k + o_xn, mask=m_2dn, other=0.)
        r_v = tl.load(v + o_xn, mask=m_2dn, other=0.)
        r_el = last_row_eta(eta, p_ebase, tl.minimum(i_c + 1, NC - 1), seq_len, BT, H)
        if HAS_ETA_KEY:
            b_l = r_l.to(tl.float32)                                       # [BT]
            r_l = tl.load(eta_key + p_ebase + o_en, mask=m_tn, other=0.)

        b_kh = mm(b_k, b_W, PREC) + b_hb[None, :]                          # [BT, BD]
        b_g, b_xh, b_rstd, b_y = inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps)
        if HAS_ETA_KEY:
            b_g = b_g * b_l[:, None]                                       # [BT, BD] l g
        if SAVE:
            tl.store(xbuf + o_x, b_xh, mask=m_2d)
            tl.store(rbuf + p_ebase + o_e, b_rstd, mask=m_t)
        if FUSE_OUT:
            c_q, b_e = r_q, r_e                                            # this chunk's
            r_q = tl.load(q + o_xn, mask=m_2dn, other=0.)
            r_e = tl.load(eta + p_ebase + o_en, mask=m_tn, other=0.)
            b_A = qk_plus_one(c_q, b_k.to(c_q.dtype), scale, HALF, PREC)   # [BT, BT]
            b_A = tl.where(m_tril, b_e.to(tl.float32)[:, None], 0.) * b_A
            b_o = mm(c_q.to(tl.float32) * scale, b_W, PREC) \
                + b_hb[None, :] - mm(b_A, b_g, PREC)                       # [BT, BD]
            b_o = output_form(b_o, c_q, b_w, b_b, m_2d, D, eps, OUTPUT)
            tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m_2d)
        b_W = b_W - b_el * mm(tl.trans(b_k), b_g, PREC)
        b_hb = b_hb - b_el * tl.sum(b_g, 0)

    if SAVE:
        store_state(ck, ckb, (slot_base + tl.cdiv(NC, G)) * H + i_h, b_W, b_hb, D, o_d, m_d,
                    o_dd, m_dd)
    if STORE_FINAL:
        store_state(ht, hbt, i_nh.to(tl.int64), b_W, b_hb, D, o_d, m_d, o_dd, m_dd)
