r"""Device helpers shared by the chunked TTT-linear kernels: coordinates, loads, and the
per-row math of the inner loss and its backward.

Notation (per chunk of ``L <= BT`` valid rows; rows past the sequence end are zero):

.. math::

    kh &= k W + hb, \qquad \hat x = (kh - \mu)\,r, \quad r = 1/\sqrt{\sigma^2 + \epsilon}\\
    y &= (\hat x \odot w + b - v + k) \odot w\\
    g &= r\,(y - \overline{y} - \hat x\,\overline{y \hat x})

``g`` is the gradient of the inner loss ``1/2 ||LN(kh) w + b - (v - k)||^2`` w.r.t. ``kh``.
With a per-key factor ``l`` (``eta_key``, ``HAS_ETA_KEY``) the kernels use ``l \odot g``
(:func:`key_scaled`) wherever the state takes ``g``; the helpers here compute the unscaled
``g``, and :func:`inner_grad_bwd` takes the cotangent of the unscaled ``g`` (``l \odot dg``).

Output forms (``OUTPUT``, :func:`output_form`), with ``o_pre`` the inner model's prediction:
``"norm_residual"`` ``o_pre + LN(o_pre) w + b``, ``"query_residual"`` ``q + LN(o_pre) w + b``
(``q`` unscaled) and ``"raw"`` ``o_pre``.

Checkpoint *slots*: every sequence owns ``NG + 1`` slots (``NG = cdiv(chunks, G)``); slot
``s < NG`` holds the state before chunk ``s * G`` and slot ``NG`` the final state. A
*group* is the run of ``G`` chunks between two slots.

The kernels' tensor arguments besides ``q, k, v`` (``[B, T, H, D]`` in the input dtype),
``eta`` ``[B, T, H]`` and ``w, b`` ``[H, D]``; each kernel takes those it uses, a flag in
parentheses tells when one is given::

    o, do, dq, dk, dv       [B, T, H, D] in the input dtype (fwd_chain's o: FUSE_OUT;
                            bwd_chain's dk, dv, ck, dwc, dbc: FUSE_GRADS)
    eta_key, deta_key       [B, T, H, 1] per-key factor (HAS_ETA_KEY), its fp32 gradient
                            (NEED_DETA_KEY)
    h0, hb0 / ht, hbt       [N, H, D, D], [N, H, 1, D] fp32 initial (USE_INITIAL,
                            USE_INITIAL_BIAS) and final (STORE_FINAL) states
    dht, dhbt / dh0, dhb0   their cotangents (USE_DHT / STORE_DH0)
    ck, ckb / dck           [slots, H, D, D], [slots, H, D] fp32 state slots (fwd_chain; SAVE)
                            and the state's cotangent at each slot (bwd_chain)
    xbuf, rbuf              [B * T, H, D], [B * T, H] fp32 xhat and r of every valid row
                            (fwd_chain; SAVE)
    dopbuf, dgbuf           [B * T, H, D] fp32 do_pre and dg_loc (bwd_local); bwd_chain makes
                            dgbuf the full dg
    desum                   [B * T, H] fp32 per-row parts of the last-row deta (bwd_chain)
    deta                    [B, T, H] fp32 (bwd_local); the last-row terms are added by
                            bwd_grads or by the fused bwd_chain
    dwp, dbp / dwc, dbc     [groups, H, D] / [N, H, D] fp32 per-program partials of dw, db
    cu_seqlens, grp_offsets [N + 1] int64 sequence starts and each sequence's first group
                            (IS_VARLEN)
    grp_seq                 [groups] int32 sequence of each group (IS_VARLEN)
"""

import triton
import triton.language as tl

# No JIT function here reads a global ``tl.constexpr`` (constants are literals or
# parameters): Triton 3.6 adds a called function's global constexprs to the caller's cache
# key only when the callee's key was computed first, so a kernel's key, and its entry in
# Triton's disk cache, then depended on the order in which a process first launched the
# kernels. tests/test_cache_keys.py checks this.


@triton.jit
def dim_offsets(D: tl.constexpr, BD: tl.constexpr):
    """The head dim's offsets ``o_d`` and mask ``m_d`` ([BD]), and the state's ``o_dd``
    (row-major ``D x D``) and mask ``m_dd`` ([BD, BD])."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_dd = m_d[:, None] & m_d[None, :]
    o_dd = o_d[:, None] * D + o_d[None, :]                                 # [BD, BD]
    return o_d, m_d, o_dd, m_dd


@triton.jit
def load_norm_params(w, b, i_h, D: tl.constexpr, o_d, m_d):
    """The inner LayerNorm's weight and bias of head ``i_h``, fp32 ([BD] each)."""
    b_w = tl.load(w + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    b_b = tl.load(b + i_h * D + o_d, mask=m_d, other=0.).to(tl.float32)   # [BD]
    return b_w, b_b


@triton.jit
def load_slot(ck, ckb, slot, i_h, H: tl.constexpr, D: tl.constexpr, o_d, m_d, o_dd, m_dd):
    """The state ``W`` [BD, BD] and bias ``hb`` [BD] of checkpoint slot ``slot``, head
    ``i_h``."""
    i_ck = slot * H + i_h
    b_W = tl.load(ck + i_ck * D * D + o_dd, mask=m_dd, other=0.)           # [BD, BD]
    b_hb = tl.load(ckb + i_ck * D + o_d, mask=m_d, other=0.)               # [BD]
    return b_W, b_hb


@triton.jit
def block_masks(o_s, BT: tl.constexpr):
    """For a block of rows ``o_s`` [BS] (``BS / BT`` chunks): ``m_same`` [BS, BS], row j in
    row i's chunk and ``j <= i``; ``m_prev`` [BS, BS], row j in an earlier chunk."""
    o_c = o_s // BT                                                        # [BS] chunk in block
    m_same = (o_c[:, None] == o_c[None, :]) & (o_s[:, None] >= o_s[None, :])  # [BS, BS]
    m_prev = o_c[:, None] > o_c[None, :]                                   # [BS, BS]
    return m_same, m_prev


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """``a @ b`` ([M, K] x [K, N], fp32 accumulation) at ``PREC``: "tf32" or "ieee" as Triton
    has them, or "ieee_kblocks" (float32 inputs at padded head dim 128, see
    ``tuning.dot_precision``): IEEE fp32, accumulated over K blocks of 16 one after another
    (:func:`_kblocks_acc`). Triton lowers an IEEE dot to FMA loops that hold each thread's
    whole K slices of both operands; at K = 128 that puts the kernels into local memory.
    The products stay exact fp32, only the summation order changes."""
    if PREC == "ieee_kblocks":
        M: tl.constexpr = a.shape[0]
        N: tl.constexpr = b.shape[1]
        return _kblocks_acc(a, b, tl.zeros((M, N), dtype=tl.float32))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def mm_acc(a, b, acc, PREC: tl.constexpr):
    """``acc + a @ b`` (:func:`mm`), accumulated in place."""
    if PREC == "ieee_kblocks":
        return _kblocks_acc(a, b, acc)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _kblocks_acc(a, b, acc):
    """``acc + a @ b`` in IEEE fp32 dots of K <= 16: for K > 16, the first halves of K
    (columns of ``a``, rows of ``b``), then the second halves, each the same way. Only one
    block's operands and the accumulator are live at a time (a batched dot over all the K
    blocks, summed after, held an [K / 16, M, N] product: local memory at M 64, N 128)."""
    K: tl.constexpr = a.shape[1]
    if K > 16:
        a_lo, a_hi = _halves(a, 1)                  # [M, K / 2] each
        b_lo, b_hi = _halves(b, 0)                  # [K / 2, N] each
        acc = _kblocks_acc(a_lo, b_lo, acc)
        acc = _kblocks_acc(a_hi, b_hi, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _halves(x, AXIS: tl.constexpr):
    """The first and second halves of ``x`` [R, C] along ``AXIS`` (0: rows, 1: columns),
    exactly: a reshape and a split, no product."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    if AXIS == 0:
        return tl.split(tl.permute(tl.reshape(x, (2, R // 2, C)), (1, 2, 0)))
    else:
        return tl.split(tl.permute(tl.reshape(x, (R, 2, C // 2)), (0, 2, 1)))


@triton.jit
def split_cols(x, i_p, SPLIT: tl.constexpr):
    """Columns ``i_p * N / SPLIT ..`` of ``x`` [M, N] (SPLIT = 2), exactly: a reshape and a
    split, no product."""
    M: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    x_lo, x_hi = tl.split(tl.permute(tl.reshape(x, (M, SPLIT, N // SPLIT)), (0, 2, 1)))
    return tl.where(i_p == 0, x_lo, x_hi)                                  # [M, N / SPLIT]


@triton.jit
def seq_coords(i_n, cu_seqlens, grp_offsets, T, BT: tl.constexpr, G: tl.constexpr,
               IS_VARLEN: tl.constexpr):
    """(bos, seq_len, NC, slot_base) of sequence ``i_n``: first row (int64), length, chunk
    count and index of its first checkpoint slot."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        slot_base = tl.load(grp_offsets + i_n).to(tl.int64) + i_n
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        slot_base = i_n.to(tl.int64) * (tl.cdiv(tl.cdiv(T, BT), G) + 1)
    seq_len = (eos - bos).to(tl.int32)
    NC = tl.cdiv(seq_len, BT)
    return bos, seq_len, NC, slot_base


@triton.jit
def group_coords(gid, cu_seqlens, grp_offsets, grp_seq, T, BT: tl.constexpr,
                 G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(i_n, bos, seq_len, c0, nc, slot) of group ``gid`` (counted over the batch): its
    sequence, that sequence's first row and length, the group's first chunk, its chunk
    count (<= G) and the slot holding the state before chunk ``c0``."""
    if IS_VARLEN:
        i_n = tl.load(grp_seq + gid)
        j = gid - tl.load(grp_offsets + i_n).to(tl.int32)
    else:
        NGs = tl.cdiv(tl.cdiv(T, BT), G)
        i_n = gid // NGs
        j = gid % NGs
    bos, seq_len, NC, slot_base = seq_coords(i_n, cu_seqlens, grp_offsets, T, BT, G,
                                             IS_VARLEN)
    c0 = j * G
    nc = tl.minimum(NC - c0, G)
    return i_n, bos, seq_len, c0, nc, slot_base + j


@triton.jit
def chain_coords(cu_seqlens, grp_offsets, T, H: tl.constexpr, BT: tl.constexpr,
                 G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(i_nh, i_h, bos, seq_len, NC, slot_base) of the chain of program ``i_nh = i_n * H +
    i_h``, one per (sequence, head): :func:`seq_coords` of sequence ``i_n``."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, seq_len, NC, slot_base = seq_coords(i_n, cu_seqlens, grp_offsets, T, BT, G,
                                             IS_VARLEN)
    return i_nh, i_h, bos, seq_len, NC, slot_base


@triton.jit
def chain_start(cu_seqlens, grp_offsets, T, H: tl.constexpr, D: tl.constexpr,
                BT: tl.constexpr, BD: tl.constexpr, G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What a program of the chain kernels (one per sequence and head, walking chunks of
    ``BT`` rows) starts from: ``(i_nh, i_h, bos, seq_len, NC, slot_base, o_t, o_d, m_d, o_dd,
    m_dd)``, that is :func:`chain_coords`, a chunk's row offsets ``o_t`` and the head dim's
    offsets (:func:`dim_offsets`)."""
    i_nh, i_h, bos, seq_len, NC, slot_base = chain_coords(cu_seqlens, grp_offsets, T, H, BT,
                                                          G, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_d, m_d, o_dd, m_dd = dim_offsets(D, BD)
    return i_nh, i_h, bos, seq_len, NC, slot_base, o_t, o_d, m_d, o_dd, m_dd


@triton.jit
def row_bases(bos, i_h, H: tl.constexpr, D: tl.constexpr):
    """Offsets of row 0 of one (sequence, head) in [rows, H, D] (rows ``H * D`` apart) and in
    [rows, H] tensors (rows ``H`` apart)."""
    return (bos * H + i_h) * D, bos * H + i_h


@triton.jit
def load_state(h, hb, i, D: tl.constexpr, BD: tl.constexpr, o_d, m_d, o_dd, m_dd,
               HAS_W: tl.constexpr, HAS_HB: tl.constexpr):
    """The state ``W`` [BD, BD] and bias ``hb`` [BD] (fp32) at index ``i`` of [N, H, D, D]
    and [N, H, 1, D] tensors; zeros for a tensor not given (``HAS_W``, ``HAS_HB``)."""
    if HAS_W:
        b_W = tl.load(h + i * D * D + o_dd, mask=m_dd, other=0.).to(tl.float32)  # [BD, BD]
    else:
        b_W = tl.zeros([BD, BD], dtype=tl.float32)                         # [BD, BD]
    if HAS_HB:
        b_hb = tl.load(hb + i * D + o_d, mask=m_d, other=0.).to(tl.float32)  # [BD]
    else:
        b_hb = tl.zeros([BD], dtype=tl.float32)                            # [BD]
    return b_W, b_hb


@triton.jit
def store_state(h, hb, i, b_W, b_hb, D: tl.constexpr, o_d, m_d, o_dd, m_dd):
    """Stores ``W`` [BD, BD] and ``hb`` [BD] at index ``i`` of [slots or N, H, D, D] and
    [slots or N, H, (1,) D] tensors."""
    tl.store(h + i * D * D + o_dd, b_W, mask=m_dd)
    tl.store(hb + i * D + o_d, b_hb, mask=m_d)


@triton.jit
def group_rows(bos, c0, nc, seq_len, i_h, H: tl.constexpr, D: tl.constexpr,
               BT: tl.constexpr):
    """(p_base, p_ebase, r_beg, r_end) of the group of chunks ``c0 .. c0 + nc - 1`` (of
    :func:`group_coords`), head ``i_h``: the offsets of its sequence's row 0
    (:func:`row_bases`) and its rows ``r_beg .. r_end - 1`` (from row 0)."""
    p_base, p_ebase = row_bases(bos, i_h, H, D)
    r_end = tl.minimum((c0 + nc) * BT, seq_len)
    return p_base, p_ebase, c0 * BT, r_end


@triton.jit
def group_start(w, b, ck, ckb, cu_seqlens, grp_offsets, grp_seq, T, H: tl.constexpr,
                D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
                G: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What a program of the parallel kernels (one per group of G chunks and head ``i_h``,
    walking blocks of ``BS`` rows) starts from: ``(gid, i_h, seq_len, o_s, o_d, m_d, m_same,
    m_prev, b_w, b_b, b_W, b_hb, p_base, p_ebase, r_beg, r_end)``, that is the program's
    coordinates (:func:`group_coords`), the block's row offsets ``o_s`` and masks
    (:func:`block_masks`), the head dim's offsets, the norm parameters, the state of the
    group's slot (:func:`load_slot`) and its rows (:func:`group_rows`)."""
    gid, i_h = tl.program_id(0), tl.program_id(1)
    i_n, bos, seq_len, c0, nc, slot = group_coords(gid, cu_seqlens, grp_offsets, grp_seq,
                                                   T, BT, G, IS_VARLEN)
    o_s = tl.arange(0, BS)
    o_d, m_d, o_dd, m_dd = dim_offsets(D, BD)
    m_same, m_prev = block_masks(o_s, BT)

    b_w, b_b = load_norm_params(w, b, i_h, D, o_d, m_d)
    b_W, b_hb = load_slot(ck, ckb, slot, i_h, H, D, o_d, m_d, o_dd, m_dd)
    p_base, p_ebase, r_beg, r_end = group_rows(bos, c0, nc, seq_len, i_h, H, D, BT)
    return (gid, i_h, seq_len, o_s, o_d, m_d, m_same, m_prev, b_w, b_b, b_W, b_hb, p_base,
            p_ebase, r_beg, r_end)


@triton.jit
def row_offsets(p_base, r0, o_t, o_d, seq_len, m_d, H: tl.constexpr, D: tl.constexpr):
    """Offsets [BT, BD] of the rows r0 .. r0 + BT - 1 of one (sequence, head) in a
    [rows, H, D] tensor whose row 0 is at ``p_base``, with the mask of valid rows/cols, and
    the per-row offsets [BT] (relative to the sequence's first row) for [rows, H] tensors."""
    o_r = r0 + o_t                                                         # [BT]
    m_t = o_r < seq_len
    m_2d = m_t[:, None] & m_d[None, :]                                     # [BT, BD]
    o_x = p_base + o_r.to(tl.int64)[:, None] * (H * D) + o_d[None, :]      # [BT, BD]
    return o_x, m_2d, o_r.to(tl.int64) * H, m_t


@triton.jit
def block_rows(eta, p_base, p_ebase, r0, o_s, o_d, m_d, seq_len, H: tl.constexpr,
               D: tl.constexpr, BT: tl.constexpr):
    """A block of rows r0 .. r0 + BS - 1 (``r0`` a multiple of BT, relative to the
    sequence's first row): offsets [BS, BD] into a [rows, H, D] tensor and [BS] into a
    [rows, H] one, the masks of valid entries, of valid rows and of each chunk's last valid
    row, each row's eta ``e`` and the eta ``el`` of the last valid row of each row's chunk
    (fp32, [BS]; rows past the end read the sequence's last row)."""
    o_r = r0 + o_s                                                         # [BS]
    m_t = o_r < seq_len
    m_2d = m_t[:, None] & m_d[None, :]                                     # [BS, BD]
    o_x = p_base + o_r.to(tl.int64)[:, None] * (H * D) + o_d[None, :]      # [BS, BD]
    o_e = p_ebase + o_r.to(tl.int64) * H                                   # [BS]
    b_e = tl.load(eta + o_e, mask=m_t, other=0.).to(tl.float32)
    r_last = tl.minimum((o_r // BT + 1) * BT, seq_len) - 1                 # [BS]
    m_last = m_t & (o_r == r_last)
    b_el = tl.load(eta + p_ebase + r_last.to(tl.int64) * H).to(tl.float32)
    return o_x, o_e, m_2d, m_t, m_last, b_e, b_el


@triton.jit
def last_row_eta(eta, p_ebase, c, seq_len, BT: tl.constexpr, H: tl.constexpr):
    """eta of the last valid row of chunk ``c`` (always an in-bounds row)."""
    r_last = tl.minimum((c + 1) * BT, seq_len) - 1
    return tl.load(eta + p_ebase + r_last.to(tl.int64) * H).to(tl.float32)


@triton.jit
def inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D: tl.constexpr, eps):
    """g, xhat, r, y of kh (see the module docstring); zero outside ``m_2d``."""
    b_mean = tl.sum(tl.where(m_2d, b_kh, 0.), 1) / D                       # [BT]
    b_xc = tl.where(m_2d, b_kh - b_mean[:, None], 0.)                      # [BT, BD]
    b_rstd = 1. / tl.sqrt(tl.sum(b_xc * b_xc, 1) / D + eps)                # [BT]
    b_xh = b_xc * b_rstd[:, None]                                          # [BT, BD]
    b_g, b_y = inner_grad_from_xhat(b_xh, b_rstd, b_k, b_v, b_w, b_b, m_2d, D)
    return b_g, b_xh, b_rstd, b_y


@triton.jit
def inner_grad_from_xhat(b_xh, b_rstd, b_k, b_v, b_w, b_b, m_2d, D: tl.constexpr):
    """g and y from a stored xhat and r (rows with r = 0 give g = 0)."""
    b_y = (b_xh * b_w[None, :] + b_b[None, :] - b_v + b_k) * b_w[None, :]  # [BT, BD]
    b_y = tl.where(m_2d, b_y, 0.)
    b_ym = tl.sum(b_y, 1) / D                                              # [BT]
    b_yx = tl.sum(b_y * b_xh, 1) / D                                       # [BT]
    b_g = b_rstd[:, None] * (b_y - b_ym[:, None] - b_xh * b_yx[:, None])   # [BT, BD]
    return tl.where(m_2d, b_g, 0.), b_y


@triton.jit
def block_qkg(q, k, v, xbuf, rbuf, eta_key, o_x, o_e, m_2d, m_t, b_w, b_b, D: tl.constexpr,
              HAS_ETA_KEY: tl.constexpr):
    """The raw q and k tiles of a block and g of its rows from the stored xhat and r
    (row-local: :func:`inner_grad_from_xhat`), scaled by the per-key factor under
    ``HAS_ETA_KEY`` (:func:`key_scaled`); zero outside ``m_2d``."""
    r_q = tl.load(q + o_x, mask=m_2d, other=0.)                            # [BS, BD]
    r_k = tl.load(k + o_x, mask=m_2d, other=0.)                            # [BS, BD]
    b_v = tl.load(v + o_x, mask=m_2d, other=0.).to(tl.float32)             # [BS, BD]
    b_xh = tl.load(xbuf + o_x, mask=m_2d, other=0.)                        # [BS, BD]
    b_r = tl.load(rbuf + o_e, mask=m_t, other=0.)                          # [BS]
    b_g, _ = inner_grad_from_xhat(b_xh, b_r, r_k.to(tl.float32), b_v, b_w, b_b, m_2d, D)
    return r_q, r_k, key_scaled(b_g, eta_key, o_e, m_t, HAS_ETA_KEY)


@triton.jit
def qk_plus_one(r_q, r_k, scale, HALF: tl.constexpr, PREC: tl.constexpr):
    """``scale q k^T + 1`` [rows, rows] from the raw input tiles: for half inputs a
    half-precision dot with fp32 accumulation (exact products), else at ``PREC``."""
    if HALF:
        b_A = tl.dot(r_q, tl.trans(r_k))
    else:
        b_A = mm(r_q, tl.trans(r_k), PREC)
    return b_A * scale + 1.


@triton.jit
def inner_grad_bwd(b_dg, b_xh, b_rstd, b_y, b_g, b_w, m_2d, D: tl.constexpr):
    r"""Backward of g(kh, v, k) for a cotangent dg [BT, BD]: returns (dkh, dy) with dy the
    cotangent of y (so dv = -dy w, and dk, dw, db get dy-terms from the caller).

    .. math::
        dy &= r (dg - \overline{dg} - \hat x\, \overline{dg\, \hat x}),\quad
        d\hat x = -r (dg\, \overline{\hat x y} + y\, \overline{dg\, \hat x}) + dy\, w^2,
        \quad dr = \textstyle\sum dg\, g / r\\
        dkh &= r (d\hat x - \overline{d\hat x} - \hat x\, \overline{d\hat x\, \hat x})
            - dr\, r^2 \hat x / D
    """
    b_a1 = tl.sum(b_dg, 1) / D                                             # [BT]
    b_a2 = tl.sum(b_dg * b_xh, 1) / D                                      # [BT]
    b_a3 = tl.sum(b_xh * b_y, 1) / D                                       # [BT]
    b_dy = b_rstd[:, None] * (b_dg - b_a1[:, None] - b_xh * b_a2[:, None])
    b_dy = tl.where(m_2d, b_dy, 0.)                                        # [BT, BD]
    b_dxh = -b_rstd[:, None] * (b_dg * b_a3[:, None] + b_y * b_a2[:, None]) \
        + b_dy * (b_w * b_w)[None, :]
    b_dxh = tl.where(m_2d, b_dxh, 0.)                                      # [BT, BD]
    # dr * r^2 / D with dr = sum(dg * g) / r
    b_dr = tl.sum(b_dg * b_g, 1) * b_rstd / D                              # [BT]
    b_c1 = tl.sum(b_dxh, 1) / D
    b_c2 = tl.sum(b_dxh * b_xh, 1) / D
    b_dkh = b_rstd[:, None] * (b_dxh - b_c1[:, None] - b_xh * b_c2[:, None]) \
        - b_dr[:, None] * b_xh
    return tl.where(m_2d, b_dkh, 0.), b_dy


@triton.jit
def inner_norm_grads(b_dy, b_xh, b_k, b_v, b_w, b_b, b_dw, b_db, NEED_DW: tl.constexpr,
                     NEED_DB: tl.constexpr):
    """From ``dy``, the cotangent of y (:func:`inner_grad_bwd`): ``dy w`` (``-dv``) and the
    sums ``b_dw``, ``b_db`` [BD] with the inner loss's terms of a tile added."""
    b_dyw = b_dy * b_w[None, :]                                            # [BT, BD]
    if NEED_DW:
        b_dw += tl.sum(b_dy * (2. * b_xh * b_w[None, :] + b_b[None, :] - b_v + b_k), 0)
    if NEED_DB:
        b_db += tl.sum(b_dyw, 0)
    return b_dyw, b_dw, b_db


@triton.jit
def store_norm_partials(dwp, dbp, i_p, b_dw, b_db, o_d, m_d, i_split, D: tl.constexpr,
                        NEED_DW: tl.constexpr, NEED_DB: tl.constexpr):
    """Stores a program's partial sums of dw, db [BD] at index ``i_p`` (int64) of
    [programs, D] tensors; of the programs that split a tile's columns, only the one of
    ``i_split`` 0 (0 where there is no split)."""
    o_p = i_p * D + o_d
    m_p = m_d & ((o_d * 0 + i_split) == 0)
    if NEED_DW:
        tl.store(dwp + o_p, b_dw, mask=m_p)
    if NEED_DB:
        tl.store(dbp + o_p, b_db, mask=m_p)


@triton.jit
def key_scaled(b_g, eta_key, o_e, m_t, HAS_ETA_KEY: tl.constexpr):
    """``l * g`` [BT, BD] (row by row) with ``l`` the per-key factors of the rows at ``eta_key + o_e``
    ([BT] offsets; rows outside ``m_t`` read 0); ``g`` itself without ``HAS_ETA_KEY``."""
    if HAS_ETA_KEY:
        b_l = tl.load(eta_key + o_e, mask=m_t, other=0.).to(tl.float32)  # [BT]
        b_g = b_g * b_l[:, None]
    return b_g


@triton.jit
def post_norm(b_o, b_res, b_w, b_b, m_2d, D: tl.constexpr, eps):
    """The fused post norm with residual ``b_res``: res + LN(o) w + b (LayerNorm over D, no
    affine); returns it with LN(o) and its r."""
    b_mean = tl.sum(tl.where(m_2d, b_o, 0.), 1) / D                        # [BT]
    b_xc = tl.where(m_2d, b_o - b_mean[:, None], 0.)                       # [BT, BD]
    b_ro = 1. / tl.sqrt(tl.sum(b_xc * b_xc, 1) / D + eps)                  # [BT]
    b_oh = b_xc * b_ro[:, None]                                            # [BT, BD]
    return b_res + b_oh * b_w[None, :] + b_b[None, :], b_oh, b_ro


@triton.jit
def output_form(b_o, r_q, b_w, b_b, m_2d, D: tl.constexpr, eps, OUTPUT: tl.constexpr):
    """The output of the pre-norm output ``b_o`` [BT, BD] in form ``OUTPUT`` (module
    docstring); ``r_q`` the raw (unscaled) q tile."""
    if OUTPUT == "raw":
        b_out = b_o
    elif OUTPUT == "query_residual":
        b_out, _, _ = post_norm(b_o, r_q.to(tl.float32), b_w, b_b, m_2d, D, eps)
    else:
        b_out, _, _ = post_norm(b_o, b_o, b_w, b_b, m_2d, D, eps)
    return b_out


@triton.jit
def post_norm_bwd(b_do, b_oh, b_ro, b_w, m_2d, D: tl.constexpr, OUTPUT: tl.constexpr):
    """Cotangent of the pre-norm output: r (do w - mean(do w) - oh mean(do w oh)), plus do for
    ``"norm_residual"`` (whose residual is the pre-norm output itself)."""
    b_doh = b_do * b_w[None, :]                                            # [BT, BD]
    b_m1 = tl.sum(b_doh, 1) / D
    b_m2 = tl.sum(b_doh * b_oh, 1) / D
    b_dn = b_ro[:, None] * (b_doh - b_m1[:, None] - b_oh * b_m2[:, None])  # [BT, BD]
    if OUTPUT == "norm_residual":
        b_dop = b_do + b_dn
    else:
        b_dop = b_dn
    return tl.where(m_2d, b_dop, 0.)
