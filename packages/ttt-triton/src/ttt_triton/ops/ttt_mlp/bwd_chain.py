r"""TTT-MLP backward: one program per (sequence, head) walks the chunks last to first, carrying
the state's cotangent ``dS = (dW1, db1, dW2, db2)`` (the math of a chunk: ``common.py``).

The states a chunk starts from come back group by group: checkpoint slot ``c0 / G`` (the
forward's) is copied into the chain's scratch slot 0 and the forward step
(``common.first_walk``, ``common.second_walk`` without outputs) recomputes slots
``1 .. G - 1``; then each chunk of the group, last first, takes its VJP at its slot's state.
With ``dS'`` the cotangent of the state after the chunk and ``dz`` that of its ``z``
(through the output form), ``D_2 = P e (-dz g_2^\top)`` and ``\bar s_1 = gelu'(\bar Z_1)``:

.. math::

    d\bar X_2 &= dz\, W_2^\top + D_2 X_2,\quad d\bar Z_1 = d\bar X_2 \odot \bar s_1,\quad
    dA_1 = -\textstyle\sum_j d\bar Z_{1,j}\, g_{1,j}^\top\\
    dg_1 &= -A_1^\top d\bar Z_1 - e_{last}(k\, dW_1' + db_1'),\quad
    dg_2 = -A_2^\top dz + \textstyle\sum_j (dg_{1,j} \odot s_{1,j}) W_{2,j}
           - e_{last}(X_2\, dW_2' + db_2')\\
    dX_2 &= -e_{last}\, g_2\, dW_2'^\top + D_2^\top \bar X_2 + dZ_2 W_2^\top,\quad
    dZ_1 = dX_2 \odot s_1 + (dg_1 \odot g_2 W_2^\top) \odot gelu''(Z_1)

with ``dZ_2`` the inner loss's backward of ``l dg_2`` (``inner_grad_bwd``), and

.. math::

    dW_1 &= dW_1' + q^\top d\bar Z_1 + k^\top dZ_1,\quad
    db_1 = db_1' + \textstyle\sum (d\bar Z_1 + dZ_1)\\
    dW_2 &= dW_2' + (dg_1 \odot s_1)^\top g_2 + \bar X_2^\top dz + X_2^\top dZ_2,\quad
    db_2 = db_2' + \textstyle\sum (dz + dZ_2)

Every product over the hidden width runs in hidden blocks ``j``, in four walks over the
blocks per chunk after ``common.first_walk``'s ``g_2``:

1. ``z`` and ``\bar X_2 X_2^\top`` (for ``dz`` and ``A_2``; ``common.second_walk``);
2. :func:`terms_walk`: each block's terms above but ``dZ_2``'s, reading ``dS'``; it writes
   ``dZ_1`` without its ``dZ_2`` term and the block's ``d\bar Z_1``,
   ``dg_1 \odot s_1`` and ``\bar X_2`` to the chain's ``tmp``;
3. :func:`dstate_walk`: from those, ``dS``'s ``q^\top d\bar Z_1``, ``\sum d\bar Z_1``
   and ``(dg_1 \odot s_1)^\top g_2 + \bar X_2^\top dz``, and ``q``'s
   ``d\bar Z_1 W_1^\top``;
4. ``dZ_2`` known, ``dZ_1`` and the rest of ``dS``.

The inputs' gradients follow the same products (q scaled); ``eta`` gets ``A_1``'s and
``A_2``'s row terms and, at the chunk's last valid row,
``-(<dW_1', k^\top g_1> + <db_1', \sum g_1> + <dW_2', X_2^\top g_2> + <db_2', \sum g_2>)``.
"""

import triton
import triton.language as tl

from ..ttt_linear.common import (
    inner_grad_bwd,
    inner_norm_grads,
    mm,
    post_norm,
    post_norm_bwd,
    qk_plus_one,
)
from .common import (
    chain_start,
    chunk_inputs,
    copy_blocks,
    first_walk,
    gelu_and_slope,
    gelu_slope_and_curve,
    hidden_block,
    second_walk,
)


@triton.jit
def recompute_group(q, k, v, eta, w, b, eta_key, cW1, cb1, cW2, cb2, sW1, sb1, sW2, sb2,
                    i_ck, i_s0, c0, nc, p_base, p_ebase, o_t, o_d, m_d, seq_len, b_w, b_b,
                    scale, eps, F, H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                    BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr,
                    HAS_ETA_KEY: tl.constexpr):
    """Scratch slots ``i_s0 ..``: the states before chunks ``c0 .. c0 + nc - 1``, from
    checkpoint ``i_ck``."""
    copy_blocks(cW1, cb1, cW2, cW1, cb1, cW2, False, i_ck, sW1, sb1, sW2, i_s0, F, D, o_d, m_d,
                BF, True)
    tl.store(sb2 + i_s0 * D + o_d, tl.load(cb2 + i_ck * D + o_d, mask=m_d), mask=m_d)
    tl.debug_barrier()
    for i in range(0, nc - 1):
        i_s = i_s0 + i
        (o_x, m_2d, o_e, m_t, r_q, r_k, b_qs, b_k, b_v, b_e, b_el,
         b_l) = chunk_inputs(q, k, v, eta, eta_key, p_base, p_ebase, c0 + i, o_t, o_d, m_d,
                             seq_len, scale, H, D, BT, HAS_ETA_KEY)
        b_b2 = tl.load(sb2 + i_s * D + o_d, mask=m_d, other=0.)           # [BD]
        b_g2, b_g2u, b_xh, b_r, b_y = first_walk(
            sW1, sb1, sW2, sW1, sb1, sW2, False, i_s, F, b_b2, b_k, b_v, b_l, b_w, b_b,
            m_2d, eps, D, o_d, m_d, BT, BD, BF, True, PREC)
        b_z, b_M2 = second_walk(
            sW1, sb1, sW2, sW1, sb1, sW2, sW1, sb1, sW2, False, i_s, i_s + 1, F, b_k, b_qs,
            b_g2, b_g2, b_el, D, o_d, m_d, BT, BD, BF, True, False, True, PREC)
        tl.store(sb2 + (i_s + 1) * D + o_d, b_b2 - b_el * tl.sum(b_g2, 0), mask=m_d)
        tl.debug_barrier()


@triton.jit(do_not_specialize=["T", "F", "NG"])
def ttt_mlp_bwd_chain_kernel(
    q, k, v, eta, w, b, eta_key, do,
    cW1, cb1, cW2, cb2,       # the forward's checkpoint slots [N * H * NG, ...]
    sW1, sb1, sW2, sb2,       # scratch: a group's states [N * H * G, ...]
    dW1, db1, dW2, db2,       # the state's cotangent [N, H, ...], from the final state's;
                              # the initial state's gradient at the end
    tmp,                      # [N * H, 4, BT, F] fp32 scratch: dZ1 but its dZ2 term, and
                              # terms_walk's dZ1b, dG, x2b for dstate_walk
    dq, dk, dv, deta, deta_key,   # [B, T, H, D] fp32; [B, T, H] fp32 (deta_key: HAS_ETA_KEY)
    dwp, dbp,                 # [N * H, D] fp32 partial sums of dw, db
    cu_seqlens,               # [N + 1] int64 (when IS_VARLEN)
    scale, eps,
    T, F, NG,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    G: tl.constexpr, IS_VARLEN: tl.constexpr,
    HALF: tl.constexpr, PREC: tl.constexpr, HAS_ETA_KEY: tl.constexpr, OUTPUT: tl.constexpr,
):
    (i_nh, i_h, seq_len, NC, o_t, o_d, m_d, m_tril, b_w, b_b, p_base,
     p_ebase) = chain_start(w, b, cu_seqlens, T, H, D, BT, BD, IS_VARLEN)
    b_db2 = tl.load(db2 + i_nh * D + o_d, mask=m_d, other=0.)             # [BD] carry
    b_dw = tl.zeros([BD], dtype=tl.float32)
    b_db = tl.zeros([BD], dtype=tl.float32)
    i_s0 = i_nh * G
    NGc = tl.cdiv(NC, G)
    for i_g in range(0, NGc):
        grp = NGc - 1 - i_g
        c0 = grp * G
        nc = tl.minimum(G, NC - c0)
        recompute_group(q, k, v, eta, w, b, eta_key, cW1, cb1, cW2, cb2, sW1, sb1, sW2, sb2,
                        i_nh * NG + grp, i_s0, c0, nc, p_base, p_ebase, o_t, o_d, m_d,
                        seq_len, b_w, b_b, scale, eps, F, H, D, BT, BD, BF, PREC,
                        HAS_ETA_KEY)
        for i in range(0, nc):
            b_db2, b_dw, b_db = chunk_vjp(
                q, k, v, eta, eta_key, do, sW1, sb1, sW2, sb2, dW1, db1, dW2, tmp, dq, dk,
                dv, deta, deta_key, i_nh, i_s0 + nc - 1 - i, c0 + nc - 1 - i, b_db2, b_dw,
                b_db, p_base, p_ebase, o_t, o_d, m_d, m_tril, seq_len, b_w, b_b, scale, eps,
                F, H, D, BT, BD, BF, HALF, PREC, HAS_ETA_KEY, OUTPUT)
    tl.store(db2 + i_nh * D + o_d, b_db2, mask=m_d)
    tl.store(dwp + i_nh * D + o_d, b_dw, mask=m_d)
    tl.store(dbp + i_nh * D + o_d, b_db, mask=m_d)


@triton.jit
def chunk_vjp(q, k, v, eta, eta_key, do, sW1, sb1, sW2, sb2, dW1, db1, dW2, tmp, dq, dk, dv,
              deta, deta_key, i_nh, i_s, i_c, b_db2, b_dw, b_db, p_base, p_ebase, o_t, o_d,
              m_d, m_tril, seq_len, b_w, b_b, scale, eps, F, H: tl.constexpr,
              D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
              HALF: tl.constexpr, PREC: tl.constexpr, HAS_ETA_KEY: tl.constexpr,
              OUTPUT: tl.constexpr):
    """Chunk ``i_c``'s VJP at the state in scratch slot ``i_s``: stores its rows' dq, dk, dv,
    deta (and deta_key), updates the carried ``dW1, db1, dW2`` (state ``i_nh``) and returns
    the carried ``db2`` and the partial sums of dw, db."""
    (o_x, m_2d, o_e, m_t, r_q, r_k, b_qs, b_k, b_v, b_e, b_el,
     b_l) = chunk_inputs(q, k, v, eta, eta_key, p_base, p_ebase, i_c, o_t, o_d, m_d,
                         seq_len, scale, H, D, BT, HAS_ETA_KEY)
    b_b2 = tl.load(sb2 + i_s * D + o_d, mask=m_d, other=0.)               # [BD]
    b_g2, b_g2u, b_xh, b_r, b_y = first_walk(
        sW1, sb1, sW2, sW1, sb1, sW2, False, i_s, F, b_b2, b_k, b_v, b_l, b_w, b_b, m_2d,
        eps, D, o_d, m_d, BT, BD, BF, True, PREC)
    b_P = tl.where(m_tril, b_e[:, None], 0.)                               # [BT, BT] P e
    b_Q1 = qk_plus_one(r_q, r_k.to(r_q.dtype), scale, HALF, PREC)          # [BT, BT]
    b_A1 = b_P * b_Q1
    b_zs, b_M2 = second_walk(
        sW1, sb1, sW2, sW1, sb1, sW2, sW1, sb1, sW2, False, i_s, i_s, F, b_k, b_qs, b_g2,
        b_A1, b_el, D, o_d, m_d, BT, BD, BF, True, True, False, PREC)
    b_A2 = b_P * (b_M2 + 1.)                                               # [BT, BT]
    b_z = b_zs + b_b2[None, :] - mm(b_A2, b_g2, PREC)                      # [BT, BD]

    # the output form's backward: dz, and dw, db of the post norm
    b_do = tl.load(do + o_x, mask=m_2d, other=0.).to(tl.float32)           # [BT, BD]
    if OUTPUT == "raw":
        b_dz = b_do
    else:
        b_out, b_oh, b_ro = post_norm(b_z, b_z, b_w, b_b, m_2d, D, eps)
        b_dz = post_norm_bwd(b_do, b_oh, b_ro, b_w, m_2d, D, OUTPUT)
        b_dw += tl.sum(b_do * b_oh, 0)
        b_db += tl.sum(b_do, 0)
    b_dA2 = -mm(b_dz, tl.trans(b_g2), PREC)                                # [BT, BT]
    b_de = tl.sum(tl.where(m_tril, b_dA2 * (b_M2 + 1.), 0.), 1)           # [BT]
    b_D2 = b_P * b_dA2                                                     # [BT, BT]
    b_dg2 = -mm(tl.trans(b_A2), b_dz, PREC)                                # [BT, BD]

    # every block's terms but dZ2's, then the dS terms of q's side from them
    o_tmp = (i_nh * 4 * BT + o_t[:, None]) * F                             # [BT, 1] tmp's rows
    b_dA1, b_dk, b_dg2, b_del = terms_walk(
        sW1, sb1, sW2, dW1, db1, dW2, tmp, i_s, i_nh, o_tmp, F, b_k, b_qs, b_g2, b_dz, b_A1,
        b_D2, b_dg2, b_el, m_t, D, o_d, m_d, BT, BD, BF, PREC)
    tl.debug_barrier()               # tmp as the other threads wrote it; dS' read by all
    b_dqs = dstate_walk(sW1, sb1, sW2, dW1, db1, dW2, tmp, i_s, i_nh, o_tmp, F, b_qs, b_g2,
                        b_dz, D, o_d, m_d, BT, BD, BF, PREC)
    b_del -= tl.sum(b_db2 * tl.sum(b_g2, 0), 0)
    b_dg2 = tl.where(m_2d, b_dg2 - b_el * b_db2[None, :], 0.)
    b_db2 += tl.sum(b_dz, 0)

    # the inner loss's backward: dZ2, dv, and dk, dw, db terms
    b_dl = tl.sum(b_dg2 * b_g2u, 1)                                        # [BT]
    b_dZ2, b_dy = inner_grad_bwd(b_dg2 * b_l[:, None], b_xh, b_r, b_y, b_g2u, b_w, m_2d, D)
    b_dyw, b_dw, b_db = inner_norm_grads(b_dy, b_xh, b_k, b_v, b_w, b_b, b_dw, b_db, True,
                                         True)
    b_dk += b_dyw
    b_db2 += tl.sum(b_dZ2, 0)
    b_dN = b_P * b_dA1                                                     # [BT, BT]
    b_de += tl.sum(tl.where(m_tril, b_dA1 * b_Q1, 0.), 1)
    b_dqs += mm(b_dN, b_k, PREC)
    b_dk += mm(tl.trans(b_dN), b_qs, PREC)
    tl.debug_barrier()               # tmp, dW1, db1, dW2 as the other threads wrote them

    # last walk: dZ1 and the rest of dS
    for f0 in range(0, F, BF):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            sW1, sb1, sW2, i_s, f0, F, D, o_d, m_d, BF, True)
        b_x2, b_s1 = gelu_and_slope(mm(b_k, b_W1, PREC) + b_b1[None, :])   # [BT, BF]
        b_dZ1 = tl.load(tmp + o_tmp + (f0 + tl.arange(0, BF))[None, :], mask=m_f[None, :],
                        other=0.) + mm(b_dZ2, tl.trans(b_W2), PREC) * b_s1
        b_dZ1 = tl.where(m_t[:, None], b_dZ1, 0.)                          # [BT, BF]
        b_dk += mm(b_dZ1, tl.trans(b_W1), PREC)
        d_w = (i_nh - i_s) * D * F
        tl.store(dW1 + d_w + o_w1, tl.load(dW1 + d_w + o_w1, mask=m_w1, other=0.)
                 + mm(tl.trans(b_k), b_dZ1, PREC), mask=m_w1)
        tl.store(db1 + (i_nh - i_s) * F + o_b1, tl.load(db1 + (i_nh - i_s) * F + o_b1,
                 mask=m_f, other=0.) + tl.sum(b_dZ1, 0), mask=m_f)
        tl.store(dW2 + d_w + o_w2, tl.load(dW2 + d_w + o_w2, mask=m_w2, other=0.)
                 + mm(tl.trans(b_x2), b_dZ2, PREC), mask=m_w2)
    tl.debug_barrier()

    # the rows' gradients (eta's last valid row also gets e_last's)
    b_dq = b_dqs * scale
    if OUTPUT == "query_residual":
        b_dq += b_do
    tl.store(dq + o_x, b_dq, mask=m_2d)
    tl.store(dk + o_x, b_dk, mask=m_2d)
    tl.store(dv + o_x, -b_dyw, mask=m_2d)
    r_last = tl.minimum((i_c + 1) * BT, seq_len) - 1 - i_c * BT
    b_de += tl.where(o_t == r_last, b_del, 0.)
    tl.store(deta + p_ebase + o_e, b_de, mask=m_t)
    if HAS_ETA_KEY:
        tl.store(deta_key + p_ebase + o_e, b_dl, mask=m_t)
    return b_db2, b_dw, b_db


@triton.jit
def terms_walk(sW1, sb1, sW2, dW1, db1, dW2, tmp, i_s, i_nh, o_tmp, F, b_k, b_qs, b_g2, b_dz,
               b_A1, b_D2, b_dg2, b_el, m_t, D: tl.constexpr, o_d, m_d, BT: tl.constexpr,
               BD: tl.constexpr, BF: tl.constexpr, PREC: tl.constexpr):
    """Each hidden block's terms but ``dZ2``'s, at the state in scratch slot ``i_s`` and
    the carried ``dS'`` (state ``i_nh``, read only): returns ``dA1`` [BT, BT], ``dk``'s
    ``-e_last g1 dW1'^T`` [BT, BD], ``dg2`` (``b_dg2`` plus the blocks') and ``e_last``'s
    sum; writes ``dZ1`` but its ``dZ2`` term to ``tmp``'s slot 0 (rows ``o_tmp``) and the
    block's ``dZ1b``, ``dG = dg1 s1``, ``x2b`` to slots 1-3 (each [BT, F])."""
    b_dA1 = tl.zeros([BT, BT], dtype=tl.float32)
    b_dk = tl.zeros([BT, BD], dtype=tl.float32)
    b_del = b_el * 0.                                                      # e_last's
    for f0 in range(0, F, BF):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            sW1, sb1, sW2, i_s, f0, F, D, o_d, m_d, BF, True)
        b_dW1, b_db1, b_dW2, o_v1, m_v1, o_c1, m_c1, o_v2, m_v2 = hidden_block(
            dW1, db1, dW2, i_nh, f0, F, D, o_d, m_d, BF, True)             # dS' of the block
        b_z1 = mm(b_k, b_W1, PREC) + b_b1[None, :]                         # [BT, BF]
        b_x2, b_s1 = gelu_and_slope(b_z1)
        b_gW = mm(b_g2, tl.trans(b_W2), PREC)                              # [BT, BF]
        b_g1 = b_gW * b_s1
        b_x2b, b_s1b = gelu_and_slope(mm(b_qs, b_W1, PREC) + b_b1[None, :]
                                      - mm(b_A1, b_g1, PREC))              # [BT, BF]
        b_dZ1b = (mm(b_dz, tl.trans(b_W2), PREC) + mm(b_D2, b_x2, PREC)) * b_s1b
        b_dA1 -= mm(b_dZ1b, tl.trans(b_g1), PREC)
        b_kdW1 = mm(b_k, b_dW1, PREC)                                      # [BT, BF]
        b_dg1 = -mm(tl.trans(b_A1), b_dZ1b, PREC) - b_el * (b_kdW1 + b_db1[None, :])
        b_dg1 = tl.where(m_t[:, None], b_dg1, 0.)
        b_del -= tl.sum(tl.sum(b_kdW1 * b_g1, 1), 0) + tl.sum(b_db1 * tl.sum(b_g1, 0), 0)
        b_dk -= b_el * mm(b_g1, tl.trans(b_dW1), PREC)
        b_dG = b_dg1 * b_s1                                                # [BT, BF]
        b_dX2 = -b_el * mm(b_g2, tl.trans(b_dW2), PREC) + mm(tl.trans(b_D2), b_x2b, PREC)
        b_sl, b_cu = gelu_slope_and_curve(b_z1)
        o_s = o_tmp + (f0 + tl.arange(0, BF))[None, :]                     # [BT, BF]
        tl.store(tmp + o_s, b_dX2 * b_sl + b_dg1 * b_gW * b_cu, mask=m_f[None, :])
        tl.store(tmp + BT * F + o_s, b_dZ1b, mask=m_f[None, :])
        tl.store(tmp + 2 * BT * F + o_s, b_dG, mask=m_f[None, :])
        tl.store(tmp + 3 * BT * F + o_s, b_x2b, mask=m_f[None, :])
        # the [BT, BD] products last: Triton gives a loop's chained tile products the warps
        # of the last one (second_walk), along its columns where it is wider than tall
        b_x2dW2 = mm(b_x2, b_dW2, PREC)                                    # [BT, BD]
        b_del -= tl.sum(tl.sum(b_x2dW2 * b_g2, 1), 0)
        b_dg2 += mm(b_dG, b_W2, PREC) - b_el * b_x2dW2
    return b_dA1, b_dk, b_dg2, b_del


@triton.jit
def dstate_walk(sW1, sb1, sW2, dW1, db1, dW2, tmp, i_s, i_nh, o_tmp, F, b_qs, b_g2, b_dz,
                D: tl.constexpr, o_d, m_d, BT: tl.constexpr, BD: tl.constexpr,
                BF: tl.constexpr, PREC: tl.constexpr):
    """With :func:`terms_walk`'s ``dZ1b, dG, x2b`` from ``tmp``, each block's ``dS'``
    (state ``i_nh``) plus ``(q^T dZ1b, sum dZ1b, dG^T g2 + x2b^T dz)``; returns ``dqs``'s
    ``sum_j dZ1b_j W1_j^T`` [BT, BD] (``W1`` at scratch slot ``i_s``)."""
    b_dqs = tl.zeros([BT, BD], dtype=tl.float32)
    for f0 in range(0, F, BF):
        b_W1, b_b1, b_W2, o_w1, m_w1, o_b1, m_f, o_w2, m_w2 = hidden_block(
            sW1, sb1, sW2, i_s, f0, F, D, o_d, m_d, BF, True)              # W1 only read
        b_dW1, b_db1, b_dW2, o_v1, m_v1, o_c1, m_c1, o_v2, m_v2 = hidden_block(
            dW1, db1, dW2, i_nh, f0, F, D, o_d, m_d, BF, True)             # dS' of the block
        o_s = o_tmp + (f0 + tl.arange(0, BF))[None, :]                     # [BT, BF]
        b_dZ1b = tl.load(tmp + BT * F + o_s, mask=m_f[None, :], other=0.)  # [BT, BF]
        b_dG = tl.load(tmp + 2 * BT * F + o_s, mask=m_f[None, :], other=0.)
        b_x2b = tl.load(tmp + 3 * BT * F + o_s, mask=m_f[None, :], other=0.)
        tl.store(dW1 + o_v1, b_dW1 + mm(tl.trans(b_qs), b_dZ1b, PREC), mask=m_v1)
        tl.store(db1 + o_c1, b_db1 + tl.sum(b_dZ1b, 0), mask=m_c1)
        tl.store(dW2 + o_v2, b_dW2 + mm(tl.trans(b_dG), b_g2, PREC)
                 + mm(tl.trans(b_x2b), b_dz, PREC), mask=m_v2)
        b_dqs += mm(b_dZ1b, tl.trans(b_W1), PREC)                          # last (terms_walk)
    return b_dqs
