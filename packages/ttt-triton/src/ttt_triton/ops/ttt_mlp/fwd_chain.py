r"""TTT-MLP forward: one program per (sequence, head) carries the inner MLP through the chunks
and writes every output (the math and the state's layout: ``common.py``).

The state lives in global memory (fp32), in the final-state tensors (the launcher makes them
whether or not the caller keeps them). Each chunk walks it twice in hidden blocks
(``common.first_walk``, ``common.second_walk``); the chain's first chunk reads the initial state (zeros without
``USE_INITIAL``), so a call is one launch. With ``SAVE`` (a forward for the backward) the
program also copies the state before every ``G``-th chunk into checkpoint slot
``i_nh * NG + c / G``, from which the backward recomputes the states between.
"""

import triton
import triton.language as tl

from ..ttt_linear.common import mm, output_form
from .common import (
    attention_like,
    chain_start,
    chunk_inputs,
    copy_blocks,
    first_walk,
    second_walk,
)


@triton.jit(do_not_specialize=["T", "F", "NG"])
def ttt_mlp_fwd_chain_kernel(
    q, k, v, eta, w, b,
    eta_key,            # [B, T, H, 1] per-key factor (when HAS_ETA_KEY)
    o,                  # [B, T, H, D] input dtype
    W1_0, b1_0, W2_0, b2_0,   # initial state [N, H, D, F], [N, H, 1, F], [N, H, F, D],
                              # [N, H, 1, D] fp32 (when USE_INITIAL)
    W1, b1, W2, b2,     # the working and final state, same shapes, fp32
    cW1, cb1, cW2, cb2,       # checkpoint slots [N * H * NG, ...] (when SAVE)
    cu_seqlens,         # [N + 1] int64 (when IS_VARLEN)
    scale, eps,
    T, F, NG,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BF: tl.constexpr,
    G: tl.constexpr, USE_INITIAL: tl.constexpr, IS_VARLEN: tl.constexpr, SAVE: tl.constexpr,
    HALF: tl.constexpr, PREC: tl.constexpr, HAS_ETA_KEY: tl.constexpr, OUTPUT: tl.constexpr,
):
    (i_nh, i_h, seq_len, NC, o_t, o_d, m_d, m_tril, b_w, b_b, p_base,
     p_ebase) = chain_start(w, b, cu_seqlens, T, H, D, BT, BD, IS_VARLEN)
    if USE_INITIAL:
        b_b2 = tl.load(b2_0 + i_nh * D + o_d, mask=m_d, other=0.).to(tl.float32)  # [BD]
    else:
        b_b2 = tl.zeros([BD], dtype=tl.float32)
    for i_c in range(0, NC):
        first = i_c == 0
        if SAVE and i_c % G == 0:
            i_ck = i_nh * NG + i_c // G
            copy_blocks(W1_0, b1_0, W2_0, W1, b1, W2, first, i_nh, cW1, cb1, cW2, i_ck, F, D,
                        o_d, m_d, BF, USE_INITIAL)
            tl.store(cb2 + i_ck * D + o_d, b_b2, mask=m_d)
        (o_x, m_2d, o_e, m_t, r_q, r_k, b_qs, b_k, b_v, b_e, b_el,
         b_l) = chunk_inputs(q, k, v, eta, eta_key, p_base, p_ebase, i_c, o_t, o_d, m_d,
                             seq_len, scale, H, D, BT, HAS_ETA_KEY)
        b_g2, b_g2u, b_xh, b_r, b_y = first_walk(
            W1_0, b1_0, W2_0, W1, b1, W2, first, i_nh, F, b_b2, b_k, b_v, b_l, b_w, b_b,
            m_2d, eps, D, o_d, m_d, BT, BD, BF, USE_INITIAL, PREC)
        b_A1 = attention_like(r_q, r_k, b_e, m_tril, scale, HALF, PREC)    # [BT, BT]
        b_z, b_M2 = second_walk(
            W1_0, b1_0, W2_0, W1, b1, W2, W1, b1, W2, first, i_nh, i_nh, F, b_k, b_qs,
            b_g2, b_A1, b_el, D, o_d, m_d, BT, BD, BF, USE_INITIAL, True, True, PREC)
        b_A2 = tl.where(m_tril, b_e[:, None], 0.) * (b_M2 + 1.)            # [BT, BT]
        b_z = b_z + b_b2[None, :] - mm(b_A2, b_g2, PREC)                   # [BT, BD]
        b_b2 = b_b2 - b_el * tl.sum(b_g2, 0)
        b_o = output_form(b_z, r_q, b_w, b_b, m_2d, D, eps, OUTPUT)
        tl.store(o + o_x, b_o.to(o.dtype.element_ty), mask=m_2d)
        tl.debug_barrier()          # the next chunk reads what other threads wrote
    tl.store(b2 + i_nh * D + o_d, b_b2, mask=m_d)
