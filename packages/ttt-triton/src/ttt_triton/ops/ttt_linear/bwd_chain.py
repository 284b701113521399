r"""Backward, sequential part: carry the state's cotangent back through the chunks.

One program per (sequence, head), chunks in reverse, with ``dW = dL/dW'`` and
``dhb = dL/dhb'`` the cotangents of the state *after* the chunk. ``g`` comes back from the
stored ``xhat`` and ``r`` (row-local); ``dg_loc`` and ``do_pre`` were stored by
``bwd_local.py``. The chain:

.. math::

    dg &= dg_{loc} - \eta_{last}\,(k\, dW + dhb) \;\to\; dkh \text{ (inner-grad backward,
        common.py)}\\
    dW &\leftarrow dW + q^\top do_{pre} + k^\top dkh, \qquad
        dhb \leftarrow dhb + \textstyle\sum_i do_{pre,i} + \textstyle\sum_i dkh_i

With ``HAS_ETA_KEY`` the state takes ``l \odot g`` (``l`` the per-key factor, ``g`` as
stored, unscaled): ``dg`` above is the cotangent of ``l \odot g``, the per-key factor's
gradient is final here, ``dl_i = dg_i \cdot g_i``, and the inner-grad backward takes
``l \odot dg``. The full ``dg`` (times ``l`` with ``HAS_ETA_KEY``: the cotangent of the
unscaled ``g``) replaces ``dg_loc`` in its buffer. The last-row term of ``deta``,

.. math::

    d\eta_{last} = -\textstyle\sum_i g_i \cdot (k_i\, dW + dhb),

leaves the chain as per-row sums (one row reduction per step; ``bwd_grads.py`` sums them
per chunk and adds them to ``deta``). The cotangent of checkpoint slot ``s`` (the state
before chunk ``s * G``; the last slot is the final state) is written to ``dck`` for
``bwd_grads.py``, and slot 0's to ``dh0``/``dhb0`` when asked. Inputs of the next chunk
are loaded one step early (not with ``FUSE_GRADS``, which has no registers to spare).

With ``FUSE_GRADS`` the program does ``bwd_grads.py``'s work itself, one chunk at a time
(its formulas with blocks of one chunk, where ``C_k`` vanishes), instead of storing ``dg``,
the per-row sums and the slot cotangents: with ``W`` the state before the chunk (stepped
back from the state after it, ``W \leftarrow W + \eta_{last} k^\top g``, or read from
the chunk's own slot at a group start) and ``dW`` the cotangent of the state after it,

.. math::

    dk = dy\, w + dkh\, W^\top - \eta_{last}\, g\, dW^\top + C_q\, q, \quad
    (C_q)_{ij} = -[j \ge i]\, e_j\, (g_i \cdot do_{pre,j}), \quad dv = -dy\, w

and the chunk's last-row ``deta`` term is added in place. ``NEED_*`` leave out what
autograd does not ask for; without ``FEED_GRADS`` (no ``bwd_grads`` after the chain) ``dg``
and the slot cotangents are not stored. This puts more work on the
chain, which pays when there are enough chains to hide it (``tuning.FUSED``).
"""

import triton
import triton.language as tl

from .common import (
    chain_start,
    inner_grad_bwd,
    inner_grad_from_xhat,
    inner_norm_grads,
    last_row_eta,
    load_norm_params,
    load_state,
    mm,
    mm_acc,
    row_bases,
    row_offsets,
    store_norm_partials,
)


@triton.jit
def _load_step(q, k, v, xbuf, rbuf, dopbuf, dgbuf, p_base, p_ebase, r0, o_t, o_d, seq_len,
               m_d, H: tl.constexpr, D: tl.constexpr):
    o_x, m_2d, o_e, m_t = row_offsets(p_base, r0, o_t, o_d, seq_len, m_d, H, D)
    r_q = tl.load(q + o_x, mask=m_2d, other=0.)                            # [BT, BD]
    r_k = tl.load(k + o_x, mask=m_2d, other=0.)                            # [BT, BD]
    r_v = tl.load(v + o_x, mask=m_2d, other=0.)                            # [BT, BD]
    b_xh = tl.load(xbuf + o_x, mask=m_2d, other=0.)                        # [BT, BD]
    b_r = tl.load(rbuf + p_ebase + o_e, mask=m_t, other=0.)                # [BT]
    b_dop = tl.load(dopbuf + o_x, mask=m_2d, other=0.)                     # [BT, BD]
    b_dgl = tl.load(dgbuf + o_x, mask=m_2d, other=0.)                      # [BT, BD]
    return r_q, r_k, r_v, b_xh, b_r, b_dop, b_dgl


@triton.jit(do_not_specialize=["T"])
def ttt_linear_bwd_chain_kernel(
    # the tensors (common.py's table), offsets, scalars and T; then the constexprs
    q, k, v, eta, w, b, eta_key, deta_key, xbuf, rbuf, dopbuf, dgbuf, desum, dht, dhbt, dck, dh0,
    dhb0, ck, dk, dv, deta, dwc, dbc,
    cu_seqlens, grp_offsets, scale, T,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, G: tl.constexpr,
    USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
    FUSE_GRADS: tl.constexpr, PREC: tl.constexpr, HAS_ETA_KEY: tl.constexpr,
    NEED_DETA_KEY: tl.constexpr, STORE_DHB0: tl.constexpr, NEED_DK: tl.constexpr,
    NEED_DV: tl.constexpr, NEED_DETA: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    FEED_GRADS: tl.constexpr,
):
    (i_nh, i_h, bos, seq_len, NC, slot_base, o_t, o_d, m_d, o_dd,
     m_dd) = chain_start(cu_seqlens, grp_offsets, T, H, D, BT, BD, G, IS_VARLEN)

    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    b_dW, b_dhb = load_state(dht, dhbt, i_nh.to(tl.int64), D, BD, o_d, m_d, o_dd, m_dd,
                             USE_DHT, USE_DHT)                             # [BD, BD], [BD]
    i_ck = (slot_base + tl.cdiv(NC, G)) * H + i_h
    if FUSE_GRADS:
        m_jgei = o_t[:, None] <= o_t[None, :]                              # [BT, BT] j >= i
        # W^T, so that dkh W^T needs no transpose of a computed tile (fewer registers)
        o_ddt = o_d[:, None] + o_d[None, :] * D                            # [BD, BD]
        if NEED_DK:
            b_Wt = tl.load(ck + i_ck * D * D + o_ddt, mask=m_dd, other=0.)  # [BD, BD] after
        b_dw = tl.zeros([BD], dtype=tl.float32)                            # [BD]
        b_db = tl.zeros([BD], dtype=tl.float32)                            # [BD]
    elif FEED_GRADS:
        tl.store(dck + i_ck * D * D + o_dd, b_dW, mask=m_dd)

    p_base, p_ebase = row_bases(bos, i_h, H, D)
    if not FUSE_GRADS:
        r_q, r_k, r_v, r_xh, r_r, r_dop, r_dgl = _load_step(
            q, k, v, xbuf, rbuf, dopbuf, dgbuf, p_base, p_ebase, (NC - 1) * BT, o_t, o_d,
            seq_len, m_d, H, D)
        r_el = last_row_eta(eta, p_ebase, NC - 1, seq_len, BT, H)
    for i_r in range(0, NC):
        i_c = NC - 1 - i_r
        if FUSE_GRADS:
            # no prefetch: the fused step has no registers to spare for the next inputs
            r_q, r_k, r_v, b_xh, b_r, b_dop, b_dgl = _load_step(
                q, k, v, xbuf, rbuf, dopbuf, dgbuf, p_base, p_ebase, i_c * BT, o_t, o_d,
                seq_len, m_d, H, D)
            b_el = last_row_eta(eta, p_ebase, i_c, seq_len, BT, H)
        else:
            b_xh, b_r, b_dop, b_dgl, b_el = r_xh, r_r, r_dop, r_dgl, r_el
        b_q = r_q.to(tl.float32) * scale                                   # [BT, BD]
        b_k = r_k.to(tl.float32)                                           # [BT, BD]
        b_v = r_v.to(tl.float32)                                           # [BT, BD]
        o_x, m_2d, o_e, m_t = row_offsets(p_base, i_c * BT, o_t, o_d, seq_len, m_d, H, D)
        if not FUSE_GRADS:
            # the previous chunk's inputs (a chunk before the first reads as nothing)
            i_p = tl.maximum(i_c - 1, 0)
            r_q, r_k, r_v, r_xh, r_r, r_dop, r_dgl = _load_step(
                q, k, v, xbuf, rbuf, dopbuf, dgbuf, p_base, p_ebase, i_p * BT, o_t, o_d,
                seq_len, m_d, H, D)
            r_el = last_row_eta(eta, p_ebase, i_p, seq_len, BT, H)

        b_g, b_y = inner_grad_from_xhat(b_xh, b_r, b_k, b_v, b_w, b_b, m_2d, D)
        b_g0 = b_g                                                         # [BT, BD] unscaled
        if HAS_ETA_KEY:
            b_l = tl.load(eta_key + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)
            b_g = b_g0 * b_l[:, None]                                      # [BT, BD] l g
        b_kdW = mm(b_k, b_dW, PREC)                                        # [BT, BD]
        b_dg = tl.where(m_2d, b_dgl - b_el * (b_kdW + b_dhb[None, :]), 0.)
        if HAS_ETA_KEY:
            if NEED_DETA_KEY:
                tl.store(deta_key + p_ebase + o_e, tl.sum(b_dg * b_g0, 1), mask=m_t)
            b_dg = b_dg * b_l[:, None]                                     # [BT, BD] of g0
        b_dkh, b_dy = inner_grad_bwd(b_dg, b_xh, b_r, b_y, b_g0, b_w, m_2d, D)
        b_rs = tl.sum(b_g * (b_kdW + b_dhb[None, :]), 1)                    # [BT]
        if FUSE_GRADS:
            b_dyw, b_dw, b_db = inner_norm_grads(b_dy, b_xh, b_k, b_v, b_w, b_b, b_dw, b_db,
                                                 NEED_DW, NEED_DB)        # [BT, BD], [BD]
            if NEED_DV:
                tl.store(dv + o_x, (-b_dyw).to(dv.dtype.element_ty), mask=m_2d)
            if NEED_DETA:
                o_last = p_ebase + (tl.minimum((i_c + 1) * BT, seq_len) - 1).to(tl.int64) * H
                tl.store(deta + o_last, tl.load(deta + o_last) - tl.sum(b_rs, 0))
            if NEED_DK:
                b_e = tl.load(eta + p_ebase + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
                b_S1 = mm(b_g, tl.trans(b_dop), PREC)                      # [BT, BT]
                b_Cq = -tl.where(m_jgei, b_e[None, :], 0.) * b_S1          # [BT, BT]
                # dk in accumulated parts, the state's term last (the state is stepped
                # back right before it); v, the dw/db/dv inputs, die before the products
                b_dk = mm_acc(b_g * -b_el, tl.trans(b_dW), b_dyw, PREC)
                b_dk = mm_acc(b_Cq, b_q, b_dk, PREC)                       # [BT, BD]
                # the state before the chunk: its own slot at a group start, else stepped
                # back
                if i_c % G == 0:
                    i_cs = (slot_base + i_c // G) * H + i_h
                    b_Wt = tl.load(ck + i_cs * D * D + o_ddt, mask=m_dd, other=0.)
                else:
                    b_Wt = mm_acc(tl.trans(b_g * b_el), b_k, b_Wt, PREC)
                b_dk = mm_acc(b_dkh, b_Wt, b_dk, PREC)                     # [BT, BD]
                tl.store(dk + o_x, b_dk.to(dk.dtype.element_ty), mask=m_2d)
        else:
            if FEED_GRADS:
                tl.store(dgbuf + o_x, b_dg, mask=m_2d)
            if NEED_DETA:
                tl.store(desum + p_ebase + o_e, b_rs, mask=m_t)
        b_dW = mm_acc(tl.trans(b_q), b_dop, b_dW, PREC)
        b_dW = mm_acc(tl.trans(b_k), b_dkh, b_dW, PREC)
        b_dhb += tl.sum(b_dop, 0) + tl.sum(b_dkh, 0)
        if not FUSE_GRADS and FEED_GRADS and i_c % G == 0:
            i_ck = (slot_base + i_c // G) * H + i_h
            tl.store(dck + i_ck * D * D + o_dd, b_dW, mask=m_dd)

    if FUSE_GRADS:
        store_norm_partials(dwc, dbc, i_nh.to(tl.int64), b_dw, b_db, o_d, m_d, 0, D, NEED_DW,
                            NEED_DB)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * D * D + o_dd, b_dW, mask=m_dd)
    if STORE_DHB0:
        tl.store(dhb0 + i_nh.to(tl.int64) * D + o_d, b_dhb, mask=m_d)
