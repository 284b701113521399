"""Run the CUDA kernels' C++ on the CPU (one std::thread per CUDA thread) against a float64
NumPy oracle: outputs, final states and every gradient (by central differences).

This is not a GPU test: it checks the kernels' math, indexing, masking, padding rule,
checkpointing and varlen handling, with T = float only (no half types, no real warps or
memory model). Needs g++ with C++20 (std::barrier) and NumPy; skips without them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

np = pytest.importorskip("numpy")

HERE = Path(__file__).resolve().parent / "cpu_emulation"
CSRC = HERE.parents[1] / "src" / "ttt_cupy" / "csrc"
EPS = 1e-6


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found (the CPU emulation compiles the kernels as C++20)")
    out = tmp_path_factory.mktemp("emu") / "emu.so"
    cmd = [cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", f"-I{HERE / 'fake_include'}",
           f"-I{CSRC}", str(HERE / "harness.cpp"), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"the CPU emulation does not compile:\n{res.stderr[-4000:]}")
    return ctypes.CDLL(str(out))


# ---------------------------------------------------------------- float64 oracle
def _ln(x):
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    r = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + EPS)
    return xc * r, r


def oracle(q, k, v, eta, w, b, h0, hb0, seqs, scale, BT):
    """q, k, v [B, T, H, D]; eta [B, T, H]; seqs: (batch, start, length) per sequence."""
    B, T, H, D = q.shape
    N = len(seqs)
    out = np.zeros_like(q)
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
                L = bq.shape[0]
                M = np.tril(np.ones((L, L)))
                A = np.tril(bq @ bk.T) + M
                o = bq @ W + hb - be[:, None] * (A @ g)
                oh, _ = _ln(o)
                out[bi, sl, h] = o + oh * w[h] + b[h]
                W = W - be[-1] * (bk.T @ g)
                hb = hb - be[-1] * g.sum(0)
            ht[n, h], hbt[n, h] = W, hb
    return out, ht, hbt


# ---------------------------------------------------------------- the emulated launcher
def _p(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _cdiv(a, b):
    return -(-a // b)


def run_kernels(emu, x, seqs, cu, scale, BT, DP, G, grads):
    """Forward then backward through the emulated kernels; float32 everywhere."""
    f = {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in x.items()}
    B, T, H, D = f["q"].shape
    N = len(seqs)
    lengths = [s[2] for s in seqs]
    offs = [0]
    for length in lengths:
        offs.append(offs[-1] + _cdiv(_cdiv(length, BT), G))
    cu_arr = None if cu is None else np.asarray(cu, dtype=np.int64)
    ck_off = None if cu is None else np.asarray(offs, dtype=np.int64)
    o = np.zeros_like(f["q"])
    ht = np.zeros((N, H, D, D), np.float32)
    hbt = np.zeros((N, H, D), np.float32)
    ck = np.zeros((max(offs[-1], 1), H, D, D), np.float32)
    ckb = np.zeros((max(offs[-1], 1), H, D), np.float32)
    fl, i64 = ctypes.c_float, ctypes.c_longlong
    rc = emu.emu_fwd(DP, BT, N * H, _p(f["q"]), _p(f["k"]), _p(f["v"]), _p(f["eta"]),
                     _p(f["w"]), _p(f["b"]), _p(f["h0"]), _p(f["hb0"]), _p(o), _p(ht), _p(hbt),
                     _p(ck), _p(ckb), _p(cu_arr), _p(ck_off), fl(scale), fl(EPS), i64(T), H, D, G)
    assert rc == 0, "no emulated instance for this D_PAD / BT"
    SG = min(G, max(_cdiv(n, BT) for n in lengths))
    scr = np.zeros((N * H, SG, D, D), np.float32)
    scrb = np.zeros((N * H, SG, D), np.float32)
    g = {n: np.zeros_like(f[n]) for n in ("q", "k", "v", "eta", "h0", "hb0")}
    dwp = np.zeros((N, H, D), np.float32)
    dbp = np.zeros((N, H, D), np.float32)
    do, dht, dhbt = (np.ascontiguousarray(a, dtype=np.float32) for a in grads)
    rc = emu.emu_bwd(DP, BT, N * H, _p(f["q"]), _p(f["k"]), _p(f["v"]), _p(f["eta"]),
                     _p(f["w"]), _p(f["b"]), _p(do), _p(dht), _p(dhbt), _p(ck), _p(ckb),
                     _p(scr), _p(scrb), _p(g["q"]), _p(g["k"]), _p(g["v"]), _p(g["eta"]),
                     _p(g["h0"]), _p(g["hb0"]), _p(dwp), _p(dbp), _p(cu_arr), _p(ck_off),
                     fl(scale), fl(EPS), i64(T), H, D, G, SG)
    assert rc == 0
    g["w"], g["b"] = dwp.sum(0), dbp.sum(0)
    return (o, ht, hbt), g


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


CASES = [
    # B, T, H, D, DP, BT, G, varlen lengths (None: dense)
    (2, 37, 2, 20, 32, 16, 2, None),
    (1, 50, 2, 16, 16, 16, 8, [21, 29]),
    (1, 70, 1, 24, 32, 32, 1, [5, 65]),
    (1, 40, 2, 40, 64, 16, 2, [33, 7]),
    (1, 19, 1, 100, 128, 16, 8, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[1]}-D{c[3]}-BT{c[5]}-G{c[6]}"
                         + ("-varlen" if c[7] else ""))
def test_kernels_match_oracle(emu, case):
    B, T, H, D, DP, BT, G, lens = case
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
    x = {n: a.astype(np.float32).astype(np.float64) for n, a in x.items()}
    scale = D ** -0.5
    cot = (rng.standard_normal((B, T, H, D)), rng.standard_normal((N, H, D, D)),
           rng.standard_normal((N, H, D)))

    def loss(xx):
        o, ht, hbt = oracle(xx["q"], xx["k"], xx["v"], xx["eta"], xx["w"], xx["b"], xx["h0"],
                            xx["hb0"], seqs, scale, BT)
        return (o * cot[0]).sum() + (ht * cot[1]).sum() + (hbt * cot[2]).sum(), (o, ht, hbt)

    _, ref = loss(x)
    got, grads = run_kernels(emu, x, seqs, cu, scale, BT, DP, G, cot)
    for name, a, r in zip(("o", "ht", "hbt"), got, ref):
        assert _rel(a, r) < 2e-5, f"{name}: relative error {_rel(a, r):.2e}"

    h = 1e-6
    for name in ("q", "k", "v", "eta", "w", "b", "h0", "hb0"):
        flat = x[name].reshape(-1)
        idx = rng.choice(flat.size, size=min(8, flat.size), replace=False)
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
