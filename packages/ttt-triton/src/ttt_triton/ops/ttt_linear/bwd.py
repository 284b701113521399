r"""Backward kernel of chunked TTT-linear (post norm-residual included).

One program per (sequence, head). The forward stored the fp32 state before every ``G``-th
chunk; this kernel walks the groups of ``G`` chunks in reverse: it recomputes the states
before each chunk of the group from the group's checkpoint into a small per-program
scratch buffer (global memory, L2 resident), then walks the group's chunks in reverse,
carrying ``dW = dL/dW'`` and ``dhb = dL/dhb'`` (cotangents of the state *after* the chunk)
in fp32 registers. Per chunk (``q`` pre-scaled, ``A = tril(q k^T) + tril(1)``,
``E = eta * do_pre``, ``e_l`` the eta of the last valid row; the forward quantities
``kh, xhat, r, y, g, o_pre`` are recomputed):

.. math::

    do_{pre} &= do + r_o (d\hat o - \overline{d\hat o} - \hat o\, \overline{d\hat o\, \hat o}),
        \quad d\hat o = do \odot w \quad (\text{post norm-residual})\\
    dg &= -A^\top E - e_l\, k\, dW - e_l\, dhb\\
    dP &= -\mathrm{tril}(E g^\top), \quad dq = \mathrm{scale}\,(do_{pre} W^\top + dP\, k),
        \quad dk = dP^\top q - e_l\, g\, dW^\top\\
    d\eta_i &= -\textstyle\sum_j A_{ij}\, (do_{pre,i} \cdot g_j)
        \;\; [-\,\langle k\,dW, g\rangle - dhb\cdot\textstyle\sum_i g_i \text{ on the last valid row}]\\
    dy &= r (dg - \overline{dg} - \hat x\, \overline{dg\, \hat x}),\quad
        d\hat x = -r (dg\, \overline{\hat x y} + y\, \overline{dg\, \hat x}) + dy\, w^2,\quad
        dr = \textstyle\sum dg\, g / r\\
    dkh &= r (d\hat x - \overline{d\hat x} - \hat x\, \overline{d\hat x\, \hat x})
        - dr\, r^2 \hat x / D\\
    dk &\mathrel{+}= dy\, w + dkh\, W^\top, \quad dv = -dy\, w, \quad
        dw \mathrel{+}= \textstyle\sum_i dy (2 \hat x w + b - v + k), \quad
        db \mathrel{+}= \textstyle\sum_i dy\, w\\
    dW &\leftarrow dW + q^\top do_{pre} + k^\top dkh, \qquad
        dhb \leftarrow dhb + \textstyle\sum_i do_{pre,i} + \textstyle\sum_i dkh_i

plus ``dw += sum(do * LN(o_pre))``, ``db += sum(do)`` from the post norm-residual. ``dw``
and ``db`` are written per program (summed over sequences by the launcher: deterministic,
no atomics). Rows past a sequence's end and padded columns are exactly zero everywhere.
"""

import triton
import triton.language as tl

from .fwd import _inner_grad, _row_layer_norm


@triton.jit(do_not_specialize=["T", "SG"])
def ttt_linear_bwd_kernel(
    q, k, v, eta, w, b,
    do,                 # [B, T, H, D] cotangent of o
    dht, dhbt,          # [N, H, D, D], [N, H, 1, D] cotangents of the final states
    ck, ckb,            # checkpoints written by the forward
    scr, scrb,          # [N * H, SG, D, D], [N * H, SG, D] fp32 scratch
    dq, dk, dv,         # [B, T, H, D]
    deta,               # [B, T, H] fp32
    dh0, dhb0,          # [N, H, D, D], [N, H, 1, D] fp32 (when STORE_DH0)
    dwp, dbp,           # [N, H, D] fp32 partials of dw, db
    cu_seqlens, ck_offsets,
    scale, eps,
    T,
    SG,                 # states per program in the scratch (min(G, max chunks))
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    G: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        ck0 = tl.load(ck_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        ck0 = i_n.to(tl.int64) * tl.cdiv(tl.cdiv(T, BT), G)
    seq_len = (eos - bos).to(tl.int32)
    NC = tl.cdiv(seq_len, BT)
    NG = tl.cdiv(NC, G)

    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_dd = m_d[:, None] & m_d[None, :]
    o_dd = o_d[:, None] * D + o_d[None, :]                                 # [BD, BD]
    m_tril = o_t[:, None] >= o_t[None, :]                                  # [BT, BT]

    b_w = tl.load(w + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    b_b = tl.load(b + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]

    if USE_DHT:
        b_dW = tl.load(dht + i_nh.to(tl.int64) * D * D + o_dd, mask=m_dd, other=0.).to(tl.float32)
        b_dhb = tl.load(dhbt + i_nh.to(tl.int64) * D + o_d, mask=m_d, other=0.).to(tl.float32)
    else:
        b_dW = tl.zeros([BD, BD], dtype=tl.float32)                        # [BD, BD]
        b_dhb = tl.zeros([BD], dtype=tl.float32)                           # [BD]
    b_dw = tl.zeros([BD], dtype=tl.float32)                                # [BD]
    b_db = tl.zeros([BD], dtype=tl.float32)                                # [BD]

    p_base = (bos * H + i_h) * D
    p_ebase = bos * H + i_h
    p_scr = scr + i_nh.to(tl.int64) * SG * D * D
    p_scrb = scrb + i_nh.to(tl.int64) * SG * D

    for i_gr in range(0, NG):
        i_g = NG - 1 - i_gr
        c0 = i_g * G
        nc = tl.minimum(NC - c0, G)
        # ---- recompute the states before chunks c0 .. c0 + nc - 1 into the scratch ----
        i_ck = (ck0 + i_g) * H + i_h
        b_W = tl.load(ck + i_ck * D * D + o_dd, mask=m_dd, other=0.)       # [BD, BD]
        b_hb = tl.load(ckb + i_ck * D + o_d, mask=m_d, other=0.)           # [BD]
        tl.debug_barrier()  # the previous group's reads of the scratch are done
        tl.store(p_scr + o_dd, b_W, mask=m_dd)
        tl.store(p_scrb + o_d, b_hb, mask=m_d)
        for j in range(1, nc):
            o_r = (c0 + j - 1) * BT + o_t                                  # [BT]
            # chunks before the last one of the sequence are full
            m_2d = (o_r < seq_len)[:, None] & m_d[None, :]
            o_x = p_base + o_r.to(tl.int64)[:, None] * (H * D) + o_d[None, :]
            b_k = tl.load(k + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_el = tl.load(eta + p_ebase + ((c0 + j) * BT - 1).to(tl.int64) * H).to(tl.float32)
            b_kh = tl.dot(b_k, b_W, input_precision=PREC) + b_hb[None, :]
            b_g, b_xh, b_rstd, b_y = _inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps)
            b_W = b_W - b_el * tl.dot(tl.trans(b_k), b_g, input_precision=PREC)
            b_hb = b_hb - b_el * tl.sum(b_g, 0)
            tl.store(p_scr + j * D * D + o_dd, b_W, mask=m_dd)
            tl.store(p_scrb + j * D + o_d, b_hb, mask=m_d)
        tl.debug_barrier()  # the scratch is written
        # ---- walk the group's chunks in reverse ----
        for jr in range(0, nc):
            j = nc - 1 - jr
            i_c = c0 + j
            b_W = tl.load(p_scr + j * D * D + o_dd, mask=m_dd, other=0.)   # [BD, BD]
            b_hb = tl.load(p_scrb + j * D + o_d, mask=m_d, other=0.)       # [BD]

            o_r = i_c * BT + o_t                                           # [BT]
            m_t = o_r < seq_len
            m_2d = m_t[:, None] & m_d[None, :]
            o_x = p_base + o_r.to(tl.int64)[:, None] * (H * D) + o_d[None, :]
            b_q = tl.load(q + o_x, mask=m_2d, other=0.).to(tl.float32) * scale  # [BT, BD]
            b_k = tl.load(k + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_do = tl.load(do + o_x, mask=m_2d, other=0.).to(tl.float32)   # [BT, BD]
            p_e = eta + p_ebase + o_r.to(tl.int64) * H
            b_e = tl.load(p_e, mask=m_t, other=0.).to(tl.float32)          # [BT]
            L = tl.minimum(seq_len - i_c * BT, BT)
            m_last = o_t == L - 1                                          # [BT]
            b_el = tl.sum(tl.where(m_last, b_e, 0.), 0)

            # recompute the forward of the chunk
            b_kh = tl.dot(b_k, b_W, input_precision=PREC) + b_hb[None, :]
            b_g, b_xh, b_rstd, b_y = _inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps)
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)        # [BT, BT]
            b_A = tl.where(m_tril, b_A + 1., 0.)
            b_o = tl.dot(b_q, b_W, input_precision=PREC) + b_hb[None, :]  # [BT, BD]
            b_o = b_o - b_e[:, None] * tl.dot(b_A, b_g, input_precision=PREC)

            # post norm-residual backward: o = o_pre + LN(o_pre) * w + b
            b_oh, b_ro = _row_layer_norm(b_o, m_2d, D, eps)
            b_dw += tl.sum(b_do * b_oh, 0)
            b_db += tl.sum(b_do, 0)
            b_doh = b_do * b_w[None, :]                                    # [BT, BD]
            b_m1 = tl.sum(b_doh, 1) / D
            b_m2 = tl.sum(b_doh * b_oh, 1) / D
            b_dop = b_do + b_ro[:, None] * (b_doh - b_m1[:, None] - b_oh * b_m2[:, None])
            b_dop = tl.where(m_2d, b_dop, 0.)                              # [BT, BD]

            # inner recurrence
            b_E = b_e[:, None] * b_dop                                     # [BT, BD]
            b_kdW = tl.dot(b_k, b_dW, input_precision=PREC)               # [BT, BD]
            b_dg = -tl.dot(tl.trans(b_A), b_E, input_precision=PREC) - b_el * b_kdW \
                - b_el * b_dhb[None, :]
            b_dg = tl.where(m_2d, b_dg, 0.)                                # [BT, BD]
            b_dA = tl.dot(b_dop, tl.trans(b_g), input_precision=PREC)     # [BT, BT]
            b_de = -tl.sum(b_A * b_dA, 1)                                  # [BT]
            b_de_last = -tl.sum(tl.sum(b_kdW * b_g, 1), 0) - tl.sum(b_dhb * tl.sum(b_g, 0), 0)
            b_de += tl.where(m_last, b_de_last, 0.)
            b_dP = tl.where(m_tril, -b_e[:, None] * b_dA, 0.)              # [BT, BT]
            b_dq = tl.dot(b_dop, tl.trans(b_W), input_precision=PREC) \
                + tl.dot(b_dP, b_k, input_precision=PREC)
            b_dk = tl.dot(tl.trans(b_dP), b_q, input_precision=PREC) \
                - b_el * tl.dot(b_g, tl.trans(b_dW), input_precision=PREC)

            # backward of g(kh, v, k, w, b)
            b_a1 = tl.sum(b_dg, 1) / D
            b_a2 = tl.sum(b_dg * b_xh, 1) / D
            b_a3 = tl.sum(b_xh * b_y, 1) / D
            b_dy = b_rstd[:, None] * (b_dg - b_a1[:, None] - b_xh * b_a2[:, None])
            b_dy = tl.where(m_2d, b_dy, 0.)                                # [BT, BD]
            b_dxh = -b_rstd[:, None] * (b_dg * b_a3[:, None] + b_y * b_a2[:, None]) \
                + b_dy * (b_w * b_w)[None, :]
            b_dxh = tl.where(m_2d, b_dxh, 0.)                              # [BT, BD]
            b_drstd = tl.sum(b_dg * b_g, 1) / b_rstd                       # [BT]
            b_c1 = tl.sum(b_dxh, 1) / D
            b_c2 = tl.sum(b_dxh * b_xh, 1) / D
            b_dkh = b_rstd[:, None] * (b_dxh - b_c1[:, None] - b_xh * b_c2[:, None]) \
                - (b_drstd * b_rstd * b_rstd / D)[:, None] * b_xh
            b_dkh = tl.where(m_2d, b_dkh, 0.)                              # [BT, BD]
            b_dyw = b_dy * b_w[None, :]
            b_dk += b_dyw + tl.dot(b_dkh, tl.trans(b_W), input_precision=PREC)
            b_dw += tl.sum(b_dy * (2. * b_xh * b_w[None, :] + b_b[None, :] - b_v + b_k), 0)
            b_db += tl.sum(b_dyw, 0)

            tl.store(dq + o_x, (b_dq * scale).to(dq.dtype.element_ty), mask=m_2d)
            tl.store(dk + o_x, b_dk.to(dk.dtype.element_ty), mask=m_2d)
            tl.store(dv + o_x, (-b_dyw).to(dv.dtype.element_ty), mask=m_2d)
            tl.store(deta + p_ebase + o_r.to(tl.int64) * H, b_de, mask=m_t)

            # cotangents of the state before this chunk
            b_dW += tl.dot(tl.trans(b_q), b_dop, input_precision=PREC) \
                + tl.dot(tl.trans(b_k), b_dkh, input_precision=PREC)
            b_dhb += tl.sum(b_dop, 0) + tl.sum(b_dkh, 0)

    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * D * D + o_dd, b_dW, mask=m_dd)
        tl.store(dhb0 + i_nh.to(tl.int64) * D + o_d, b_dhb, mask=m_d)
    tl.store(dwp + i_nh.to(tl.int64) * D + o_d, b_dw, mask=m_d)
    tl.store(dbp + i_nh.to(tl.int64) * D + o_d, b_db, mask=m_d)
