"""Run the CUDA kernels' C++ on the CPU (one fiber per CUDA thread) against a float64
NumPy oracle: outputs, final states and every gradient (by central differences).

This is not a GPU test: it checks the kernels' math, indexing, masking, padding rule,
checkpointing and varlen handling, with T = float only (no half types, no real warps or
memory model). Needs g++ with C++20, glibc's ucontext and NumPy; skips without them.
"""

from __future__ import annotations

import ctypes

import pytest

from ttt_cupy.compile import d_pad
from ttt_cupy.params import BwdParams, DecodeParams, FwdParams
from ttt_cupy.smem import decode_rows, grads_split, traits

np = pytest.importorskip("numpy")

EPS = 1e-6


# the emulated kernels: conftest.emu (csrc/ and cpu_emulation/harness.cpp built with g++)


# ---------------------------------------------------------------- float64 oracle
def _ln(x):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    r = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + EPS)
    return xc * r, r


OUT_FORMS = {"norm_residual": 0, "query_residual": 1, "raw": 2}   # (compile.OUT_FORMS)


def oracle(q, k, v, eta, w, b, h0, hb0, seqs, scale, BT, eta_key=None, out="norm_residual"):
    """q, k, v [B, T, H, D]; eta and eta_key (None: no factor) [B, T, H]; seqs: (batch, start,
    length) per sequence; out: the output form."""
    B, T, H, D = q.shape
    N = len(seqs)
    o_all = np.zeros_like(q)
    ht = np.zeros((N, H, D, D))
    hbt = np.zeros((N, H, D))
    for n, (bi, s0, length) in enumerate(seqs):
        for h in range(H):
            W, hb = h0[n, h].copy(), hb0[n, h].copy()
            for c0 in range(0, length, BT):
                sl = slice(s0 + c0, s0 + min(c0 + BT, length))
                bq = q[bi, sl, h] * scale
                bk, bv, be = k[bi, sl, h], v[bi, sl, h], eta[bi, sl, h]
                xh, r = _ln(bk @ W + hb)
                y = (xh * w[h] + b[h] - bv + bk) * w[h]
                g = r * (y - y.mean(-1, keepdims=True)
                         - xh * (y * xh).mean(-1, keepdims=True))
                if eta_key is not None:
                    g = g * eta_key[bi, sl, h][:, None]
                L = bq.shape[0]
                M = np.tril(np.ones((L, L)))
                A = np.tril(bq @ bk.T) + M
                o = bq @ W + hb - be[:, None] * (A @ g)
                oh, _ = _ln(o)
                residual = q[bi, sl, h] if out == "query_residual" else o
                o_all[bi, sl, h] = o if out == "raw" else residual + oh * w[h] + b[h]
                W = W - be[-1] * (bk.T @ g)
                hb = hb - be[-1] * g.sum(0)
            ht[n, h], hbt[n, h] = W, hb
    return o_all, ht, hbt


# ---------------------------------------------------------------- the emulated launcher
def _cdiv(a, b):
    return -(-a // b)


def _empty(*shape):
    """torch.empty stand-in: NaN-poisoned, so a value never written shows up."""
    return np.full(shape, np.nan, np.float32)


CHAIN_KERNELS = ("fwd_chain", "bwd_chain")
GROUP_KERNELS = ("fwd_out", "bwd_local", "bwd_grads")


def run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads, init=True, mma=(), fused=False,
                seg=0, fuse_grads=False, overlap=None, out="norm_residual"):
    """:func:`_run_kernels` in the variant of ``x`` (an ``eta_key`` entry: the KEY instances,
    and deta_key among the gradients) and ``out`` (the output form: the OUT instances)."""
    emu.emu_set_variant(int("eta_key" in x), OUT_FORMS[out])
    try:
        return _run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads, init, mma, fused, seg,
                            fuse_grads, overlap)
    finally:
        emu.emu_set_variant(0, 0)


def _run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads, init=True, mma=(), fused=False,
                 seg=0, fuse_grads=False, overlap=None):
    """The launcher's sequence (ttt_cupy.launcher) on the emulated kernels, float32
    everywhere: fwd_chain, fwd_out, then bwd_local, bwd_chain, bwd_grads. ``mma``: the kernels
    that run their tensor-core instances (emulated mma.sync) instead of their SIMT ones.
    ``fused``: fwd_chain's fused instance writes o and fwd_out is skipped; ``grads`` None then
    means a forward without backward (no slots, xhat or r: null pointers) and returns
    (o, ht, hbt), None. ``seg`` > 0: the segmented launch order (placement.segment_plan), seg
    groups per segment: each segment's chain, then its group kernels; the backward's segments
    in reverse. ``fuse_grads``: bwd_chain's fused instance (ttt_linear_bwd_chain_fused, MMA)
    writes dk, dv and per-group dw, db partials (where bwd_grads puts its), and bwd_grads
    is skipped. ``overlap``: the overlapped passes (launcher._run_pass, one sync buffer per
    pass; the backward's bwd_local first): "chain first" runs the chain kernel, then the group
    kernel's tickets (kOverlap: every group is finished, none put back), then the cleanup
    launch (kCleanup: nothing to do); "out first" runs the group kernel's blocks before any
    chain block has started, with no wait (every ticket put back), then the chain kernel,
    then the cleanup launch (every ticket)."""
    f = {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in x.items()}
    B, T, H, D = f["q"].shape
    N = len(seqs)
    offs = [0]
    for _, _, length in seqs:
        offs.append(offs[-1] + _cdiv(_cdiv(length, BT), G))
    count, slots = offs[-1], offs[-1] + N
    cu_arr = go = gs = None
    if cu is not None:
        cu_arr = np.asarray(cu, dtype=np.int64)
        go = np.asarray(offs, dtype=np.int64)
        gs = np.repeat(np.arange(N, dtype=np.int32), np.diff(offs)).astype(np.int32)
    h0, hb0 = (f["h0"], f["hb0"]) if init else (None, None)
    i64 = ctypes.c_longlong
    shape = dict(T_len=T, scale=scale, eps=EPS, H=H, D=D, G=G, n_chains=N * H)
    ng_max = max(b - a for a, b in zip(offs[:-1], offs[1:]))
    # (g_lo, g_hi) per launch; (0, 0): one launch over every group
    segs = ([(g, min(g + seg, ng_max)) for g in range(0, ng_max, seg)] if seg > 0 and ng_max > 0
            else [(0, 0)])

    def span(lo, hi):  # the group kernels' blocks per head of a launch
        return count if hi <= lo else N * (hi - lo)

    prefetches: dict[str, int] = {}  # prefetch hints per kernel (all checked in bounds)
    copies: dict[str, int] = {}  # cp.async copies per kernel (checked likewise)

    def pack(cls, **fields):
        """The pass's struct of ``fields`` (arrays as their addresses) and its arrays: each
        launch's prefetch hints and copies must stay inside them."""
        arrays = [a for a in fields.values() if isinstance(a, np.ndarray)]
        return cls(**{n: a.ctypes.data if isinstance(a, np.ndarray) else a
                      for n, a in fields.items()}), arrays

    def call(name, grid, packed, seg_=(0, 0), sync=None, mode=0, spins=0,
             fused_instance=False):
        params, arrays = packed
        entry = f"emu_{name}{'_fused' if fused_instance else ''}{'_mma' if name in mma else ''}"
        emu.emu_clear_buffers()
        for a in arrays + ([] if sync is None else [sync]):  # the arrays of this launch
            emu.emu_add_buffer(a.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(a.nbytes))
        params = params.at(g_lo=seg_[0], g_hi=seg_[1], mode=mode, wait_spins=spins,
                           sync=0 if sync is None else sync.ctypes.data)
        rc = getattr(emu, entry)(DP, BT, i64(grid), ctypes.byref(params))
        assert rc == 0, f"no emulated {entry} instance for D_PAD={DP}, BT={BT}"
        strays = emu.emu_prefetch_strays()
        assert strays == 0, (f"{entry}: {strays} of {emu.emu_prefetches()} prefetch hints "
                             f"outside the arrays it was given")
        prefetches[name] = prefetches.get(name, 0) + emu.emu_prefetches()
        strays, left = emu.emu_async_strays(), emu.emu_async_leftovers()
        assert strays == 0, (f"{entry}: {strays} of {emu.emu_async_copies()} asynchronous "
                             f"copies read outside the arrays it was given")
        assert left == 0, f"{entry}: {left} asynchronous copies never waited for"
        copies[name] = copies.get(name, 0) + emu.emu_async_copies()

    # ---- forward
    ht, hbt = _empty(N, H, D, D), _empty(N, H, D)
    ck, ckb = _empty(slots, H, D, D), _empty(slots, H, D)
    xbuf, rbuf = _empty(B, T, H, D), _empty(B, T, H)  # the saved activations xhat, r
    key = f.get("eta_key")
    rlbuf = None if key is None else _empty(B, T, H)  # (eta_key: the LayerNorm's r)
    if fused and grads is None:
        ck = ckb = xbuf = rbuf = rlbuf = None
    o = _empty(B, T, H, D)
    fwd = pack(FwdParams, q=f["q"], k=f["k"], v=f["v"], eta=f["eta"], lnw=f["w"], lnb=f["b"],
               h0=h0, hb0=hb0, ht=ht, hbt=hbt, ck=ck, ckb=ckb, xbuf=xbuf, rbuf=rbuf, o=o,
               ekey=key, rlbuf=rlbuf, cu_seqlens=cu_arr, grp_offsets=go, grp_seq=gs, **shape)

    def chain(sg, sync=None):
        call("fwd_chain", N * H, fwd, sg, sync, fused_instance=fused)

    def overlapped_pass(run_chain, run_group, tickets, group_name):
        """One overlapped pass on a fresh sync buffer, in the order ``overlap`` asks (above)."""
        whole = (0, 0)
        sync = np.zeros(3 + N * H + tickets, np.int32)
        if overlap == "chain first":
            run_chain(whole, sync)
            run_group(tickets, whole, sync, mode=1, spins=1)
            assert sync[2] == 0, f"a {group_name} ticket was put back though every chain had " \
                                 f"finished"
        elif overlap == "out first":
            run_group(tickets, whole, sync, mode=1, spins=0)
            assert sync[2] == tickets, f"a {group_name} block ran before its chain had started"
            run_chain(whole, sync)
        else:
            raise ValueError(overlap)
        assert sync[0] == N * H and sync[1] == tickets, "not every block counted itself"
        run_group(tickets, whole, sync, mode=2)

    def out(grid, sg, sync=None, mode=0, spins=0):
        call("fwd_out", grid, fwd, sg, sync, mode, spins)

    if overlap is not None:
        assert not fused and seg == 0, "the overlapped forward is neither fused nor segmented"
        overlapped_pass(chain, out, N * H * ng_max, "fwd_out")
    for lo, hi in ([] if overlap is not None else segs):
        chain((lo, hi))
        if not fused:
            out(span(lo, hi) * H, (lo, hi))
    if grads is None:
        return (o, ht, hbt), None

    # ---- backward
    do, dht, dhbt = (None if a is None else np.ascontiguousarray(a, dtype=np.float32)
                     for a in grads)
    dopbuf, dgbuf = _empty(B, T, H, D), _empty(B, T, H, D)
    g = {n: _empty(*f[n].shape) for n in ("q", "k", "v", "eta")}
    dwp, dbp = _empty(2, count, H, D), _empty(2, count, H, D)
    dh0 = dhb0 = None
    if init:
        dh0, dhb0 = _empty(N, H, D, D), _empty(N, H, D)
    dck, dckb = _empty(slots, H, D, D), _empty(slots, H, D)
    dkey = None if key is None else _empty(B, T, H)
    split = grads_split(DP, BT)
    bwd = pack(BwdParams, q=f["q"], k=f["k"], v=f["v"], dout=do, eta=f["eta"], lnw=f["w"],
               lnb=f["b"], ck=ck, ckb=ckb, xbuf=xbuf, rbuf=rbuf, rlbuf=rlbuf, dopbuf=dopbuf,
               dgbuf=dgbuf, dq=g["q"], dk=g["k"], dv=g["v"], deta=g["eta"], dwp_local=dwp[0],
               dbp_local=dbp[0], dwp=dwp[1], dbp=dbp[1], dht=dht, dhbt=dhbt, dck=dck,
               dckb=dckb, dh0=dh0, dhb0=dhb0, dkey=dkey, cu_seqlens=cu_arr, grp_offsets=go,
               grp_seq=gs, **shape)

    def bchain(sg, sync=None):
        call("bwd_chain", N * H, bwd, sg, sync)

    def bgrads(grid, sg, sync=None, mode=0, spins=0):
        call("bwd_grads", grid, bwd, sg, sync, mode, spins)

    if overlap is not None:  # bwd_local, then bwd_chain and bwd_grads overlapped (as above)
        assert not fuse_grads
        call("bwd_local", count * H, bwd)
        overlapped_pass(bchain, bgrads, N * H * ng_max * split, "bwd_grads")
        segs = []
    for lo, hi in reversed(segs):
        call("bwd_local", span(lo, hi) * H, bwd, (lo, hi))
        if fuse_grads:  # the chain does bwd_grads' work: dk, dv, dw / db per group
            call("bwd_chain", N * H, bwd, (lo, hi), fused_instance=True)
            continue
        bchain((lo, hi))
        bgrads(span(lo, hi) * H * split, (lo, hi))  # grads_split blocks per (group, head)
    # bwd_grads asks for every group's last chunk before its state loads
    assert fuse_grads or prefetches.get("bwd_grads", 0) > 0, \
        "no bwd_grads prefetch hint reached the check"
    per_launch = seg * G if seg > 0 else None  # chunks of a sequence per chain launch
    if any(min(_cdiv(length, BT), per_launch or length) > 1 for _, _, length in seqs):
        # the backward chain asked for the previous chunk's rows: the bounds check saw hints
        assert prefetches.get("bwd_chain", 0) > 0, "no prefetch hint reached the bounds check"
    if "bwd_chain" in mma and traits(DP, BT)["kBwdChainStage"]:
        # its rows came through cp.async: the copies' bounds and waits were checked
        assert copies.get("bwd_chain", 0) > 0, "no asynchronous copy reached the checks"
    g["w"], g["b"] = dwp.sum((0, 1)), dbp.sum((0, 1))
    g["h0"], g["hb0"] = dh0, dhb0
    if key is not None:
        g["eta_key"] = dkey
    return (o, ht, hbt), g


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


CASES = [
    # B, T, H, D, DP, BT, G, varlen lengths (None: dense), initial states, dht given
    (2, 37, 2, 20, 32, 16, 2, None, True, True),       # partial last chunk and group
    (1, 50, 2, 16, 16, 16, 8, [21, 29], True, True),   # nc < G in every group
    (1, 70, 1, 24, 32, 32, 1, [5, 65], True, False),   # G = 1: every chunk its own group
    (1, 40, 2, 40, 64, 16, 2, [33, 7], True, True),
    (1, 19, 1, 100, 128, 16, 8, None, True, True),
    (2, 70, 1, 16, 16, 16, 2, None, False, True),      # zero initial state at group 0
    (1, 150, 2, 12, 16, 64, 2, [70, 80], False, False),  # BT = 64, varlen, no states
    (1, 120, 1, 30, 32, 32, 3, [45, 75], False, True),   # groups of 3, last one partial
    (1, 70, 1, 96, 128, 32, 2, None, False, True),     # D = 96 backward at chunk 32
    (1, 40, 1, 60, 64, 32, 4, [17, 23], True, True),   # D = 60, one group per sequence
    (1, 130, 1, 96, 128, 64, 2, None, True, True),     # D = 96 at chunk 64: split bwd_grads
    (1, 80, 2, 64, 64, 16, 4, None, True, True),       # D_PAD 64: two staged row blocks a group
]


def _id(c):
    return (f"T{c[1]}-D{c[3]}-BT{c[5]}-G{c[6]}" + ("-varlen" if c[7] else "")
            + ("" if c[8] else "-noinit") + ("" if c[9] else "-nodht"))


def _inputs(case, key=False):
    """(x, seqs, cu, scale, cot) of a case: inputs in float64 holding float32 values; ``key``:
    with an ``eta_key`` (drawn after the others, which stay those of the case)."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    rng = np.random.default_rng(0)
    if lens is None:
        seqs = [(bi, 0, T) for bi in range(B)]
        cu = None
    else:
        starts = np.concatenate([[0], np.cumsum(lens)])
        assert starts[-1] == T
        seqs = [(0, int(starts[n]), int(lens[n])) for n in range(len(lens))]
        cu = starts
    N = len(seqs)
    x = dict(
        q=rng.standard_normal((B, T, H, D)), k=rng.standard_normal((B, T, H, D)),
        v=rng.standard_normal((B, T, H, D)), eta=rng.uniform(0.02, 0.2, (B, T, H)),
        w=1 + 0.3 * rng.standard_normal((H, D)), b=0.3 * rng.standard_normal((H, D)),
        h0=0.3 * rng.standard_normal((N, H, D, D)), hb0=0.3 * rng.standard_normal((N, H, D)))
    if not init:
        x["h0"], x["hb0"] = np.zeros((N, H, D, D)), np.zeros((N, H, D))
    x = {n: a.astype(np.float32).astype(np.float64) for n, a in x.items()}
    scale = D ** -0.5
    cot = (rng.standard_normal((B, T, H, D)), rng.standard_normal((N, H, D, D)),
           rng.standard_normal((N, H, D)))
    if not with_dht:
        cot = (cot[0], 0 * cot[1], 0 * cot[2])
    if key:
        x["eta_key"] = rng.uniform(0.3, 1.7, (B, T, H)).astype(np.float32).astype(np.float64)
    return x, seqs, cu, scale, cot, rng


def _assert_bitwise(got, ref, got_g, ref_g, what):
    """_assert_close, then every output and gradient bitwise equal (``what``: the message)."""
    _assert_close(got, ref, got_g, ref_g, 1e-30)
    for name, a, r in list(zip(("o", "ht", "hbt"), got, ref)) + [
            (n, got_g[n], ref_g[n]) for n in got_g if got_g[n] is not None]:
        assert np.array_equal(a, r), f"{name}: {what}"


def _assert_close(got, ref, got_g, ref_g, tol):
    """Outputs, final states and every gradient (``got_g`` None: a forward only) written
    everywhere (no NaN poison left) and within relative error ``tol`` of the reference."""
    for name, a, r in zip(("o", "ht", "hbt"), got, ref):
        assert np.isfinite(a).all(), f"{name}: not every entry written (NaN poison)"
        assert _rel(a, r) < tol, f"{name}: relative error {_rel(a, r):.2e}"
    for name, a in (got_g or {}).items():
        if a is None:
            assert ref_g[name] is None
            continue
        assert np.isfinite(a).all(), f"d{name}: not every entry written (NaN poison)"
        assert _rel(a, ref_g[name]) < tol, f"d{name}: relative error {_rel(a, ref_g[name]):.2e}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernels_match_oracle(emu, case):
    _check_against_oracle(emu, case)


def _check_against_oracle(emu, case, key=False, out="norm_residual"):
    """Outputs and final states of the plain launches against the float64 oracle, every
    gradient (deta_key too, with ``key``) against its central differences."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, cot, rng = _inputs(case, key)

    def loss(xx):
        o, ht, hbt = oracle(xx["q"], xx["k"], xx["v"], xx["eta"], xx["w"], xx["b"], xx["h0"],
                            xx["hb0"], seqs, scale, BT, xx.get("eta_key"), out)
        return (o * cot[0]).sum() + (ht * cot[1]).sum() + (hbt * cot[2]).sum(), (o, ht, hbt)

    _, ref = loss(x)
    grads_in = cot if with_dht else (cot[0], None, None)
    got, grads = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, out=out)
    for name, a, r in zip(("o", "ht", "hbt"), got, ref):
        assert _rel(a, r) < 2e-5, f"{name}: relative error {_rel(a, r):.2e}"
    for name, a in grads.items():
        if a is not None:
            assert np.isfinite(a).all(), f"d{name}: not every entry written (NaN poison)"

    h = 1e-6
    names = ("q", "k", "v", "eta", "w", "b") + (("h0", "hb0") if init else ()) + (
        ("eta_key",) if key else ())
    for name in names:
        flat = x[name].reshape(-1)
        idx = rng.choice(flat.size, size=min(8, flat.size), replace=False)
        if name == "eta":  # half of them on chunks' last rows (deta's state-chain term)
            last = [((bi * T + s0 + min(c0 + BT, n) - 1) * H + hh)
                    for bi, s0, n in seqs for c0 in range(0, n, BT) for hh in range(H)]
            n_last = min(4, len(last))
            idx[:n_last] = rng.choice(last, size=n_last, replace=False)
            idx = np.unique(idx)
        fd, an = [], []
        for i in idx:
            xp = {n: a.copy() for n, a in x.items()}
            xm = {n: a.copy() for n, a in x.items()}
            xp[name].reshape(-1)[i] += h
            xm[name].reshape(-1)[i] -= h
            fd.append((loss(xp)[0] - loss(xm)[0]) / (2 * h))
            an.append(float(grads[name].reshape(-1)[i]))
        fd, an = np.array(fd), np.array(an)
        err = np.abs(fd - an).max() / max(np.abs(fd).max(), 1e-12)
        assert err < 2e-3, f"d{name}: max error {err:.2e} (fd {fd}, kernel {an})"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_forward(emu, case):
    """fwd_chain's fused instance (SIMT) writes o itself: against the oracle without a backward
    (no slots, xhat or r stored), and with one (what it stores feeds the backward) against the
    unfused sequence, every output and gradient."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, cot, _ = _inputs(case)
    ref = oracle(x["q"], x["k"], x["v"], x["eta"], x["w"], x["b"], x["h0"], x["hb0"], seqs,
                 scale, BT)
    got, none = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, None, init, fused=True)
    assert none is None
    _assert_close(got, ref, None, None, 2e-5)

    grads_in = cot if with_dht else (cot[0], None, None)
    unfused, unfused_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init)
    got, got_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, fused=True)
    _assert_close(got, unfused, got_g, unfused_g, 1e-6)


@pytest.mark.parametrize("kernels", [CHAIN_KERNELS, GROUP_KERNELS], ids=["chain", "group"])
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32-operands", "tf32-operands"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_mma_instances_match_simt(emu, case, tf32, kernels):
    """The tensor-core instances (MMA = true, an emulated mma.sync with the PTX ISA's fragment
    layout) of the chain kernels, or of the three group kernels, against the SIMT instances,
    every output and gradient. With fp32 operands only the summation order differs (checks
    the fragment index math, the triangles and the pads); with tf32 rounding (cvt.rna) the
    error is the GPU's tf32 error."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, cot, _ = _inputs(case)
    grads_in = cot if with_dht else (cot[0], None, None)
    ref, ref_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init)
    emu.emu_set_tf32_round(int(tf32))
    try:
        got, got_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init,
                                 mma=kernels)
    finally:
        emu.emu_set_tf32_round(0)
    _assert_close(got, ref, got_g, ref_g, 2e-2 if tf32 else 2e-5)


@pytest.mark.parametrize("backward", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32-operands", "tf32-operands"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_mma_instance_matches_simt(emu, case, tf32, backward):
    """fwd_chain's fused tensor-core instance (emulated mma.sync; o finished a step late from
    per-warp statistics) against the unfused SIMT sequence: o, the final states and, with a
    backward (SIMT kernels on what the fused chain stored), every gradient."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, cot, _ = _inputs(case)
    grads_in = (cot if with_dht else (cot[0], None, None)) if backward else None
    ref, ref_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G,
                             cot if with_dht else (cot[0], None, None), init)
    emu.emu_set_tf32_round(int(tf32))
    try:
        got, got_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init,
                                 mma=("fwd_chain",), fused=True)
    finally:
        emu.emu_set_tf32_round(0)
    _assert_close(got, ref, got_g, ref_g, 2e-2 if tf32 else 2e-5)


def _assert_variant_bitwise(emu, case, mma, what: str, **variant):
    """run_kernels with ``variant`` (a launch order: seg=..., overlap=...) against one plain
    launch per kernel: bitwise the same outputs, final states and gradients (_assert_bitwise)."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, cot, _ = _inputs(case)
    grads_in = cot if with_dht else (cot[0], None, None)
    ref, ref_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, mma=mma)
    got, got_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, mma=mma,
                             **variant)
    _assert_bitwise(got, ref, got_g, ref_g, what)


@pytest.mark.parametrize("seg", [1, 2], ids=["seg1", "seg2"])
@pytest.mark.parametrize("mma", [(), CHAIN_KERNELS + GROUP_KERNELS], ids=["simt", "mma"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_segments_match_one_launch(emu, case, mma, seg):
    """The segmented launch order (placement.segment_plan: every pass split into launches over
    ``seg`` groups of each sequence; a segment's chain starts from the slot its predecessor
    stored, the backward chain's from the slot cotangents dck, dckb) against one launch per
    kernel: the same arithmetic in the same order, so every output and gradient is bitwise
    the same, and every entry is written (no NaN poison left)."""
    _assert_variant_bitwise(emu, case, mma, "segmented launches differ from one launch",
                            seg=seg)


@pytest.mark.parametrize("order", ["chain first", "out first"], ids=["chain-first", "out-first"])
@pytest.mark.parametrize("mma", [(), CHAIN_KERNELS + GROUP_KERNELS], ids=["simt", "mma"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_overlapped_passes_match_plain(emu, case, mma, order):
    """The overlapped passes (ttt_common.cuh: fwd_chain / bwd_chain publish each finished
    group, fwd_out / bwd_grads blocks take group-major tickets and wait for them, or put them
    back for the cleanup launch when the chain has not started) against the plain launches:
    bitwise the same outputs, final states and every gradient, in both orders the GPU may place
    the blocks in (every group block claims and counts itself; "out first": every ticket put
    back, then run by the cleanup launch)."""
    _assert_variant_bitwise(emu, case, mma, f"the overlapped passes differ ({order})",
                            overlap=order)


FUSE_GRADS_CASES = [c for c in CASES if c[4] <= 64]


@pytest.mark.parametrize("seg", [0, 1], ids=["one-launch", "seg1"])
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32-operands", "tf32-operands"])
@pytest.mark.parametrize("case", FUSE_GRADS_CASES, ids=_id)
def test_fused_backward_chain_matches_unfused(emu, case, tf32, seg):
    """bwd_chain's fused instance (bwd_grads' work done per chunk in the chain: the state
    before each chunk stepped back in shared memory, dk, dv and the dw, db partials written by
    the chain) against the unfused sequence on the same tensor-core instances: every output
    and gradient, and every entry written (no NaN poison). Segmented too (a segment's W from
    the slot at its end); the fused segmented run is bitwise the fused one-launch run (the
    dw, db partials are per group, not per launch)."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, cot, _ = _inputs(case)
    grads_in = cot if with_dht else (cot[0], None, None)
    mma = CHAIN_KERNELS + GROUP_KERNELS
    emu.emu_set_tf32_round(int(tf32))
    try:
        ref, ref_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, mma=mma,
                                 seg=seg)
        got, got_g = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, mma=mma,
                                 seg=seg, fuse_grads=True)
        one = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, mma=mma,
                          fuse_grads=True)[1] if seg else got_g
    finally:
        emu.emu_set_tf32_round(0)
    _assert_close(got, ref, got_g, ref_g, 2e-2 if tf32 else 2e-5)
    for name in got_g:
        if got_g[name] is not None:
            assert np.array_equal(got_g[name], one[name]), \
                f"d{name}: the fused chain's segmented launches differ from one launch"



# ---------------------------------------------------------------- eta_key and the output forms
VARIANTS = [(key, out) for key in (False, True) for out in OUT_FORMS][1:]   # (not the default)
VARIANT_CASES = [CASES[i] for i in (0, 1, 3, 5, 10)]   # dense, varlen, no states, D_PAD 16 .. 128
"""At the shapes where the emulation builds the instances of every variant (harness.cpp,
``kAllVariants``)."""


def _vid(v):
    return ("key-" if v[0] else "") + v[1]


@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", VARIANT_CASES, ids=_id)
def test_variants_match_oracle(emu, case, variant):
    """eta_key (g's rows scaled; deta_key) and each output form on the SIMT instances, plain
    launches: against the float64 oracle and every gradient's central differences, as
    test_kernels_match_oracle."""
    _check_against_oracle(emu, case, *variant)


def _variant_run(emu, case, variant, **kw):
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, cot, _ = _inputs(case, variant[0])
    grads_in = cot if with_dht else (cot[0], None, None)
    if kw.pop("forward_only", False):
        grads_in = None
    return run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads_in, init, out=variant[1], **kw)


@pytest.mark.parametrize("kernels", [CHAIN_KERNELS, GROUP_KERNELS], ids=["chain", "group"])
@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", [VARIANT_CASES[i] for i in (0, 2, 4)], ids=_id)
def test_variant_mma_instances_match_simt(emu, case, variant, kernels):
    """The tensor-core instances of each variant against its SIMT instances (fp32 operands:
    only the summation order differs), every output and gradient."""
    ref, ref_g = _variant_run(emu, case, variant)
    got, got_g = _variant_run(emu, case, variant, mma=kernels)
    _assert_close(got, ref, got_g, ref_g, 2e-5)


@pytest.mark.parametrize("mma", [(), ("fwd_chain",)], ids=["simt", "mma"])
@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("case", [VARIANT_CASES[i] for i in (1, 3)], ids=_id)
def test_variant_fused_forward(emu, case, variant, mma):
    """fwd_chain's fused instances (SIMT, MMA) of each variant: without a backward against the
    oracle, with one (what it stores feeds the backward) against the unfused sequence."""
    B, T, H, D, DP, BT, G, lens, init, with_dht = case
    x, seqs, cu, scale, _, _ = _inputs(case, variant[0])
    ref = oracle(x["q"], x["k"], x["v"], x["eta"], x["w"], x["b"], x["h0"], x["hb0"], seqs,
                 scale, BT, x.get("eta_key"), variant[1])
    got, none = _variant_run(emu, case, variant, fused=True, mma=mma, forward_only=True)
    assert none is None
    _assert_close(got, ref, None, None, 2e-5)
    unfused, unfused_g = _variant_run(emu, case, variant)
    got, got_g = _variant_run(emu, case, variant, fused=True, mma=mma)
    _assert_close(got, unfused, got_g, unfused_g, 2e-5 if mma else 1e-6)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[0]], ids=_vid)
@pytest.mark.parametrize("case", [c for c in VARIANT_CASES if c[4] <= 64], ids=_id)
def test_variant_fused_backward_chain(emu, case, variant):
    """The fused backward chain with eta_key (its KEY instance: deta_key from the chain)
    against the unfused tensor-core sequence, one launch and segmented (bitwise alike)."""
    mma = CHAIN_KERNELS + GROUP_KERNELS
    ref, ref_g = _variant_run(emu, case, variant, mma=mma)
    got, got_g = _variant_run(emu, case, variant, mma=mma, fuse_grads=True)
    _assert_close(got, ref, got_g, ref_g, 2e-5)
    _, seg_g = _variant_run(emu, case, variant, mma=mma, fuse_grads=True, seg=1)
    for name in got_g:
        if got_g[name] is not None:
            assert np.array_equal(got_g[name], seg_g[name]), f"d{name}: segmented differs"


@pytest.mark.parametrize("launch", ["seg1", "chain first", "out first"])
@pytest.mark.parametrize("mma", [(), CHAIN_KERNELS + GROUP_KERNELS], ids=["simt", "mma"])
@pytest.mark.parametrize("variant", [(True, "query_residual"), (True, "raw")], ids=_vid)
@pytest.mark.parametrize("case", [VARIANT_CASES[i] for i in (0, 1)], ids=_id)
def test_variant_schedules_match_one_launch(emu, case, variant, mma, launch):
    """Segmented and overlapped passes of a variant: bitwise those of one launch per kernel."""
    order = dict(seg=1) if launch == "seg1" else dict(overlap=launch)
    ref, ref_g = _variant_run(emu, case, variant, mma=mma)
    got, got_g = _variant_run(emu, case, variant, mma=mma, **order)
    _assert_bitwise(got, ref, got_g, ref_g, f"{launch} differs from one launch")


# ---------------------------------------------------------------- fwd_decode
DECODE_CASES = [
    # D, dense (B, T) or packed lengths, H, initial states ("both", "state", "bias", "none"),
    # final states, eta_key, output form, eta a constant (a float through the op)
    (24, (3, 1), 2, "both", True, False, "norm_residual", False),
    (24, (2, 3), 2, "both", True, True, "query_residual", False),
    (64, (2, 4), 1, "none", True, False, "raw", True),
    (64, (2, 1), 2, "state", True, True, "norm_residual", False),
    (24, [1, 0, 3, 1, 4], 2, "bias", True, True, "raw", False),     # an empty sequence
    (64, [4, 1, 0, 1], 1, "both", False, False, "query_residual", True),
    (64, [1, 1, 1], 2, "none", False, True, "norm_residual", False),
    (24, (1, 1), 2, "both", False, True, "raw", False),
    (100, (1, 16), 1, "both", True, True, "query_residual", False),  # D_PAD 128, 16 rows
    (16, (2, 2), 2, "both", True, False, "raw", False),              # D_PAD 16
    (64, [16, 3, 0], 2, "both", True, False, "norm_residual", False),
]


def _decode_id(c):
    D, shape, H, states, final, key, out, const = c
    what = f"B{shape[0]}-T{shape[1]}" if isinstance(shape, tuple) else \
        "packed" + "+".join(map(str, shape))
    return (f"D{D}-{what}-H{H}-{states}{'-final' if final else ''}{'-key' if key else ''}-"
            f"{out}{'-eta-float' if const else ''}")


def _decode_inputs(case, seed=7):
    """Fresh random inputs of a DECODE_CASES case (float32 values in float64 arrays; none
    zero), its sequences (batch, start, length) and cu_seqlens (None: dense)."""
    D, shape, H, states, final, key, out, const = case
    rng = np.random.default_rng(seed)
    if isinstance(shape, tuple):
        B, T = shape
        seqs, cu = [(bi, 0, T) for bi in range(B)], None
    else:
        B, T = 1, sum(shape)
        cu = np.concatenate([[0], np.cumsum(shape)]).astype(np.int64)
        seqs = [(0, int(cu[n]), int(shape[n])) for n in range(len(shape))]
    N = len(seqs)
    k = rng.standard_normal((B, T, H, D))
    x = dict(q=rng.standard_normal((B, T, H, D)), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
             v=rng.standard_normal((B, T, H, D)),
             eta=np.full((B, T, H), 0.07) if const else rng.uniform(0.02, 0.2, (B, T, H)),
             w=1 + 0.3 * rng.standard_normal((H, D)), b=0.3 * rng.standard_normal((H, D)),
             h0=0.3 * rng.standard_normal((N, H, D, D)), hb0=0.3 * rng.standard_normal((N, H, D)))
    if key:
        x["eta_key"] = rng.uniform(0.3, 1.7, (B, T, H))
    x = {n: a.astype(np.float32).astype(np.float64) for n, a in x.items()}
    return x, seqs, cu


def run_decode(emu, x, seqs, cu, scale, states, final, out, rows, entry="emu_fwd_decode"):
    """fwd_decode on the emulation as the launcher launches it (one block per (sequence,
    head), shared memory for ``rows`` rows): (o, ht, hbt), ht and hbt None without final
    states. ``states``: which initial states are given (the others null). ``entry``: the
    instance (emu_fwd_decode: T = P = float; emu_fwd_decode_half, _bf16: T = P = the stand-in
    half types, which hold floats)."""
    f = {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in x.items()}
    B, T, H, D = f["q"].shape
    N = len(seqs)
    o = _empty(B, T, H, D)
    ht, hbt = (_empty(N, H, D, D), _empty(N, H, D)) if final else (None, None)
    h0 = f["h0"] if states in ("both", "state") else None
    hb0 = f["hb0"] if states in ("both", "bias") else None
    cu_arr = None if cu is None else np.asarray(cu, dtype=np.int64)
    fields = dict(q=f["q"], k=f["k"], v=f["v"], eta=f["eta"], lnw=f["w"], lnb=f["b"],
                  ekey=f.get("eta_key"), h0=h0, hb0=hb0, ht=ht, hbt=hbt, o=o, cu_seqlens=cu_arr)
    emu.emu_clear_buffers()
    for a in fields.values():
        if a is not None:
            emu.emu_add_buffer(a.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(a.nbytes))
    params = DecodeParams(**{n: None if a is None else a.ctypes.data for n, a in fields.items()},
                          scale=scale, eps=EPS, T_len=T, H=H, D=D, rows=rows)
    emu.emu_set_variant(int("eta_key" in f), OUT_FORMS[out])
    try:
        rc = getattr(emu, entry)(d_pad(D), 0, ctypes.c_longlong(N * H), ctypes.byref(params))
    finally:
        emu.emu_set_variant(0, 0)
    assert rc == 0, "no emulated fwd_decode instance"
    return o, ht, hbt


@pytest.mark.parametrize("case", DECODE_CASES, ids=_decode_id)
def test_decode_kernel_matches_oracle(emu, case):
    """fwd_decode (a short generation step's kernel: every row of a sequence at once against
    the state in registers) against the float64 oracle: outputs and final states, dense and
    packed (an empty sequence passes its states through bitwise), each initial state alone,
    both or none (zeros), with and without final states, eta_key, every output form, a
    constant eta, head dims 16, 24, 64 and 100; shared memory for the longest sequence's rows
    rounded up to a power of two (as the launcher sizes it) and for more rows."""
    D, shape, H, states, final, key, out, const = case
    x, seqs, cu = _decode_inputs(case)
    scale = D ** -0.5
    zero_h0 = x["h0"] if states in ("both", "state") else 0 * x["h0"]
    zero_hb0 = x["hb0"] if states in ("both", "bias") else 0 * x["hb0"]
    ref = oracle(x["q"], x["k"], x["v"], x["eta"], x["w"], x["b"], zero_h0, zero_hb0, seqs,
                 scale, 64, x.get("eta_key"), out)
    rows = decode_rows(max(length for _, _, length in seqs))
    got = run_decode(emu, x, seqs, cu, scale, states, final, out, rows)
    assert np.isfinite(got[0]).all(), "o: not every entry written (NaN poison)"
    assert _rel(got[0], ref[0]) < 2e-5, f"o: relative error {_rel(got[0], ref[0]):.2e}"
    if final:
        _assert_close(got, ref, None, None, 2e-5)
        for n, (_, _, length) in enumerate(seqs):
            if length == 0:   # passed through as given (zeros without an initial state)
                assert np.array_equal(got[1][n], zero_h0[n].astype(np.float32))
                assert np.array_equal(got[2][n], zero_hb0[n].astype(np.float32))
    else:
        assert got[1] is None and got[2] is None
    roomier = run_decode(emu, x, seqs, cu, scale, states, final, out, 2 * rows + 3)
    for a, b in zip(got, roomier):
        assert a is None or np.array_equal(a, b), "the result depends on the rows held"


@pytest.mark.parametrize("entry", ["emu_fwd_decode_half", "emu_fwd_decode_bf16"])
@pytest.mark.parametrize("case", DECODE_CASES[:6] + DECODE_CASES[8:9], ids=_decode_id)
def test_decode_native_params_instance(emu, case, entry):
    """fwd_decode's instance that reads eta, w, b and eta_key in the input type (P = T, the
    launcher's native_params) widens them on load exactly as the launcher's fp32 casts do: with
    the stand-in half types (floats inside) it gives bitwise the float instance's outputs and
    final states, every variant among the cases."""
    D, shape, H, states, final, key, out, const = case
    x, seqs, cu = _decode_inputs(case)
    rows = decode_rows(max(length for _, _, length in seqs))
    args = (x, seqs, cu, D ** -0.5, states, final, out, rows)
    want = run_decode(emu, *args)
    got = run_decode(emu, *args, entry=entry)
    assert np.isfinite(got[0]).all(), "o: not every entry written (NaN poison)"
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (a is None or np.array_equal(a, b))
