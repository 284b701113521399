r"""Forward kernel of chunked TTT-linear, with the post norm-residual fused in.

One program per (sequence, head) walks the sequence's chunks in order, carrying the fp32
state ``W [D, D]`` and bias state ``hb [D]`` in registers. For a chunk of ``L <= BT``
valid rows (``q`` pre-scaled by ``scale``; rows past the sequence end are zero and take no
part in anything):

.. math::

    kh &= k W + hb, \qquad \hat x = (kh - \mu)\,r, \quad r = 1/\sqrt{\sigma^2 + \epsilon}\\
    y &= (\hat x \odot w + b - v + k) \odot w\\
    g &= r\,(y - \overline{y} - \hat x\,\overline{y \hat x})\\
    o &= q W + hb - \eta \odot \big((\mathrm{tril}(q k^\top) + \mathrm{tril}(1))\, g\big)\\
    W &\leftarrow W - \eta_{last}\, k^\top g, \qquad hb \leftarrow hb - \eta_{last} \textstyle\sum_i g_i

with ``eta_last`` the eta of the chunk's last valid row; the epilogue writes
``o + LN(o) * w + b`` (LayerNorm over D, no affine, same eps). Padded columns (D not a
power of two) are masked to exactly zero. When ``SAVE_CKPT``, the state *before* every
``G``-th chunk (chunks 0, G, 2G, ...) is written in fp32 to a checkpoint buffer for the
backward kernel.
"""

import triton
import triton.language as tl


@triton.jit
def _inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps):
    """The inner-loss gradient g of kh (rows and columns outside ``m_2d`` are zero).

    Returns (g, xhat, rstd, y), each [BT, BD] except rstd [BT]."""
    b_mean = tl.sum(tl.where(m_2d, b_kh, 0.), 1) / D                       # [BT]
    b_xc = tl.where(m_2d, b_kh - b_mean[:, None], 0.)                      # [BT, BD]
    b_var = tl.sum(b_xc * b_xc, 1) / D                                     # [BT]
    b_rstd = 1. / tl.sqrt(b_var + eps)                                     # [BT]
    b_xh = b_xc * b_rstd[:, None]                                          # [BT, BD]
    b_y = (b_xh * b_w[None, :] + b_b[None, :] - b_v + b_k) * b_w[None, :]  # [BT, BD]
    b_ym = tl.sum(b_y, 1) / D                                              # [BT]
    b_yx = tl.sum(b_y * b_xh, 1) / D                                       # [BT]
    b_g = b_rstd[:, None] * (b_y - b_ym[:, None] - b_xh * b_yx[:, None])   # [BT, BD]
    b_g = tl.where(m_2d, b_g, 0.)
    return b_g, b_xh, b_rstd, b_y


@triton.jit
def _row_layer_norm(b_x, m_2d, D, eps):
    """(x - mean) * rstd over the last dim, zero outside ``m_2d``; returns (xhat, rstd)."""
    b_mean = tl.sum(tl.where(m_2d, b_x, 0.), 1) / D                        # [BT]
    b_xc = tl.where(m_2d, b_x - b_mean[:, None], 0.)                       # [BT, BD]
    b_rstd = 1. / tl.sqrt(tl.sum(b_xc * b_xc, 1) / D + eps)                # [BT]
    return b_xc * b_rstd[:, None], b_rstd


@triton.jit
def _load_chunk(q, k, v, eta, p_base, p_ebase, r0, seq_len, o_t, o_d, m_d, H, D):
    """Raw (input dtype) q, k, v [BT, BD] and eta [BT] of the chunk starting at row r0;
    rows at or past ``seq_len`` read as zero."""
    o_r = r0 + o_t                                                         # [BT]
    m_t = o_r < seq_len
    m_2d = m_t[:, None] & m_d[None, :]
    o_x = p_base + o_r.to(tl.int64)[:, None] * (H * D) + o_d[None, :]      # [BT, BD]
    r_q = tl.load(q + o_x, mask=m_2d, other=0.)
    r_k = tl.load(k + o_x, mask=m_2d, other=0.)
    r_v = tl.load(v + o_x, mask=m_2d, other=0.)
    r_e = tl.load(eta + p_ebase + o_r.to(tl.int64) * H, mask=m_t, other=0.)
    return r_q, r_k, r_v, r_e


@triton.jit(do_not_specialize=["T"])
def ttt_linear_fwd_kernel(
    q, k, v, eta, w, b,
    h0, hb0,            # [N, H, D, D], [N, H, 1, D] fp32 (when USE_INITIAL)
    o,                  # [B, T, H, D] input dtype
    ht, hbt,            # [N, H, D, D], [N, H, 1, D] fp32 (when STORE_FINAL)
    ck, ckb,            # [NCK_total, H, D, D], [NCK_total, H, D] fp32 (when SAVE_CKPT)
    cu_seqlens,         # [N + 1] int64 (when IS_VARLEN)
    ck_offsets,         # [N + 1] int64 checkpoint offsets per sequence (when IS_VARLEN)
    scale, eps,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    G: tl.constexpr,
    USE_INITIAL: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    SAVE_CKPT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    PREC: tl.constexpr,
    PREFETCH: tl.constexpr = False,
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

    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_dd = m_d[:, None] & m_d[None, :]
    o_dd = o_d[:, None] * D + o_d[None, :]                                 # [BD, BD]
    m_tril = o_t[:, None] >= o_t[None, :]                                  # [BT, BT]

    b_w = tl.load(w + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    b_b = tl.load(b + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]

    if USE_INITIAL:
        b_W = tl.load(h0 + i_nh.to(tl.int64) * D * D + o_dd, mask=m_dd, other=0.).to(tl.float32)
        b_hb = tl.load(hb0 + i_nh.to(tl.int64) * D + o_d, mask=m_d, other=0.).to(tl.float32)
    else:
        b_W = tl.zeros([BD, BD], dtype=tl.float32)                         # [BD, BD]
        b_hb = tl.zeros([BD], dtype=tl.float32)                            # [BD]

    # row 0 of this (sequence, head); rows are H * D apart (H apart for eta)
    p_base = (bos * H + i_h) * D
    p_ebase = bos * H + i_h
    if PREFETCH:  # the first chunk's tiles; each step then loads the next chunk's early
        r_q, r_k, r_v, r_e = _load_chunk(q, k, v, eta, p_base, p_ebase, 0, seq_len, o_t, o_d,
                                         m_d, H, D)
    for i_c in range(0, NC):
        if SAVE_CKPT:
            if i_c % G == 0:
                i_ck = (ck0 + i_c // G) * H + i_h
                tl.store(ck + i_ck * D * D + o_dd, b_W, mask=m_dd)
                tl.store(ckb + i_ck * D + o_d, b_hb, mask=m_d)
        o_r = i_c * BT + o_t                                               # [BT]
        m_t = o_r < seq_len
        m_2d = m_t[:, None] & m_d[None, :]
        o_x = p_base + o_r.to(tl.int64)[:, None] * (H * D) + o_d[None, :]  # [BT, BD]
        if PREFETCH:
            b_q = r_q.to(tl.float32) * scale                               # [BT, BD]
            b_k = r_k.to(tl.float32)                                       # [BT, BD]
            b_v = r_v.to(tl.float32)                                       # [BT, BD]
            b_e = r_e.to(tl.float32)                                       # [BT]
            # issued now, waited for at the next step: the loads leave the chain
            r_q, r_k, r_v, r_e = _load_chunk(q, k, v, eta, p_base, p_ebase, (i_c + 1) * BT,
                                             seq_len, o_t, o_d, m_d, H, D)
        else:
            b_q = tl.load(q + o_x, mask=m_2d, other=0.).to(tl.float32) * scale  # [BT, BD]
            b_k = tl.load(k + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)     # [BT, BD]
            b_e = tl.load(eta + p_ebase + o_r.to(tl.int64) * H, mask=m_t, other=0.).to(tl.float32)  # [BT]
        L = tl.minimum(seq_len - i_c * BT, BT)
        b_el = tl.sum(tl.where(o_t == L - 1, b_e, 0.), 0)                  # scalar

        b_kh = tl.dot(b_k, b_W, input_precision=PREC) + b_hb[None, :]     # [BT, BD]
        b_g, b_xh, b_rstd, b_y = _inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps)

        b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)            # [BT, BT]
        b_A = tl.where(m_tril, b_A + 1., 0.)
        b_o = tl.dot(b_q, b_W, input_precision=PREC) + b_hb[None, :]      # [BT, BD]
        b_o = b_o - b_e[:, None] * tl.dot(b_A, b_g, input_precision=PREC)
        # fused post norm-residual: o + LN(o) * w + b
        b_oh, b_ro = _row_layer_norm(b_o, m_2d, D, eps)
        b_o = b_o + b_oh * b_w[None, :] + b_b[None, :]
        tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m_2d)

        b_W = b_W - b_el * tl.dot(tl.trans(b_k), b_g, input_precision=PREC)
        b_hb = b_hb - b_el * tl.sum(b_g, 0)

    if STORE_FINAL:
        tl.store(ht + i_nh.to(tl.int64) * D * D + o_dd, b_W, mask=m_dd)
        tl.store(hbt + i_nh.to(tl.int64) * D + o_d, b_hb, mask=m_d)
