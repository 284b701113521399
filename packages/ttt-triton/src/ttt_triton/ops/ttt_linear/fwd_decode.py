r"""Forward of a generation step: every sequence holds a few tokens (at most one chunk), no
backward.

One program per (sequence, head), walking its rows one by one against the state ``W``,
``hb`` before the chunk (``e_i`` row i's eta, ``l_i`` its per-key factor, 1 without
``HAS_ETA_KEY``, ``g`` the inner-loss gradient of common.py, ``\tilde q = s\, q``). The
chunk's products ``P \odot (q k^\top + 1)`` (fwd_chain.py) become running sums, the
update so far ``A_i = \sum_{j \le i} k_j^\top g_j`` and ``a_i = \sum_{j \le i} g_j``:

.. math::

    kh_i = k_i W + hb, \quad g_i \leftarrow l_i\, g(kh_i), \quad
    A_i = A_{i-1} + k_i^\top g_i, \quad a_i = a_{i-1} + g_i\\
    o_{pre,i} = \tilde q_i (W - e_i A_i) + hb - e_i\, a_i
    \qquad (= \tilde q_i W + hb - e_i \textstyle\sum_{j \le i} (\tilde q_i \cdot k_j + 1)\, g_j)\\
    W \leftarrow W - e_{last} A, \qquad hb \leftarrow hb - e_{last}\, a

and ``o`` from ``o_pre`` in the form ``OUTPUT`` (common.output_form). Each row is two
products of a row with a [D, D] tile and an outer product, in fp32 without dot
instructions; the state is read once and written once. A packed sequence of no token
passes its state through.
"""

import triton
import triton.language as tl

from .common import (
    chain_coords,
    dim_offsets,
    inner_grad,
    load_norm_params,
    load_state,
    output_form,
    store_state,
)


@triton.jit(do_not_specialize=["T"])
def ttt_linear_fwd_decode_kernel(
    # the tensors (common.py's table), offsets, scalars and T; then the constexprs
    q, k, v, eta, w, b, eta_key, o, h0, hb0, ht, hbt, cu_seqlens,
    scale, eps, T,
    H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, USE_INITIAL: tl.constexpr,
    USE_INITIAL_BIAS: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_ETA_KEY: tl.constexpr, OUTPUT: tl.constexpr,
):
    # (no slots: cu_seqlens stands in for the group offsets, whose slot index goes unused)
    # (names of their own for the unused values: a name assigned here and in the loop would
    # be a loop-carried variable, whose type must not change)
    i_nh, i_h, bos, seq_len, _nc, _slot = chain_coords(cu_seqlens, cu_seqlens, T, H, 1, 1,
                                                       IS_VARLEN)

    o_d, m_d, o_dd, m_dd = dim_offsets(D, BD)
    m_row = m_d[None, :]                                                   # [1, BD]

    b_W, b_hb = load_state(h0, hb0, i_nh.to(tl.int64), D, BD, o_d, m_d, o_dd, m_dd,
                           USE_INITIAL, USE_INITIAL_BIAS)                  # [BD, BD], [BD]
    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    b_A = tl.zeros([BD, BD], dtype=tl.float32)                             # [BD, BD] sum k^T g
    b_a = tl.zeros([1, BD], dtype=tl.float32)                              # [1, BD] sum g
    for i_t in range(0, seq_len):
        p_e = (bos + i_t) * H + i_h
        p_x = p_e * D + o_d[None, :]                                       # [1, BD]
        r_q = tl.load(q + p_x, mask=m_row, other=0.)                       # [1, BD]
        b_k = tl.load(k + p_x, mask=m_row, other=0.).to(tl.float32)        # [1, BD]
        b_v = tl.load(v + p_x, mask=m_row, other=0.).to(tl.float32)        # [1, BD]
        b_e = tl.load(eta + p_e).to(tl.float32)

        b_kh = tl.sum(tl.trans(b_k) * b_W, 0)[None, :] + b_hb[None, :]     # [1, BD]
        b_g, _, _, _ = inner_grad(b_kh, b_k, b_v, b_w, b_b, m_row, D, eps)  # [1, BD]
        if HAS_ETA_KEY:
            b_g = b_g * tl.load(eta_key + p_e).to(tl.float32)
        b_A += tl.trans(b_k) * b_g
        b_a += b_g

        b_q = r_q.to(tl.float32) * scale                                   # [1, BD]
        b_o = tl.sum(tl.trans(b_q) * (b_W - b_e * b_A), 0)[None, :] \
            + b_hb[None, :] - b_e * b_a                                    # [1, BD]
        b_o = output_form(b_o, r_q, b_w, b_b, m_row, D, eps, OUTPUT)
        tl.store(o + p_x, b_o.to(o.dtype.element_ty), mask=m_row)

    if STORE_FINAL:
        # the last row's eta (no row: A and a are zero, any row's will do)
        r_last = tl.where(seq_len > 0, bos + seq_len - 1, 0)
        b_el = tl.load(eta + r_last * H + i_h).to(tl.float32)
        b_W = b_W - b_el * b_A                                             # [BD, BD]
        b_hb = b_hb - b_el * tl.sum(b_a, 0)                                # [BD]
        store_state(ht, hbt, i_nh.to(tl.int64), b_W, b_hb, D, o_d, m_d, o_dd, m_dd)
