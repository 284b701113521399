import itertools
import time

DEV = "cuda"
import torch

import ttt

torch.manual_seed(0)

def rel(x, r):
    if x is None and r is None: return 0.0
    x = x.double(); r = r.double()
    n = r.norm()
    return float((x - r).norm() / (n if n > 0 else 1))

def make(B, T, H, D, dtype, eta_tensor, init, lens=None):
    torch.set_default_device(DEV)
    if lens is not None:
        B, T = 1, sum(lens)
    N = len(lens) if lens else B
    q = torch.randn(B, T, H, D)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1)
    v = torch.randn(B, T, H, D)
    w = 1 + 0.1 * torch.randn(H, D); b = 0.1 * torch.randn(H, D)
    eta = 0.1 * torch.rand(B, T, H, 1) if eta_tensor else 0.05
    h0 = 0.1 * torch.randn(N, H, D, D) if init else None
    hb0 = 0.1 * torch.randn(N, H, 1, D) if init else None
    cu = torch.tensor([0] + list(itertools.accumulate(lens))) if lens else None
    torch.set_default_device('cpu')
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), w=w, b=b,
                eta=eta.to(dtype) if eta_tensor else eta, h0=h0, hb0=hb0, cu=cu)

def run(inp, backend, dtype_up=None, cots=None, chunk=16):
    names = ["q", "k", "v", "w", "b", "eta", "h0", "hb0"]
    leaves = {}
    for n in names:
        t = inp[n]
        if isinstance(t, torch.Tensor):
            t = t.detach().clone()
            if dtype_up is not None: t = t.to(dtype_up)
            t.requires_grad_(True)
        leaves[n] = t
    o, ht, hbt = ttt.chunk_ttt_linear(leaves["q"], leaves["k"], leaves["v"], leaves["w"], leaves["b"],
        leaves["eta"], chunk_size=chunk, initial_state=leaves["h0"], initial_state_bias=leaves["hb0"],
        output_final_state=True, cu_seqlens=inp["cu"], backend=backend)
    outs = [o, ht, hbt]
    if cots is None:
        cots = [torch.randn_like(x, dtype=torch.float32) for x in outs]
    wanted = [n for n in names if isinstance(leaves[n], torch.Tensor)]
    grads = torch.autograd.grad(outs, [leaves[n] for n in wanted], [c.to(x.dtype) for c, x in zip(cots, outs)])
    return outs, dict(zip(wanted, grads)), cots

def check(B, T, H, D, chunk, dtype=torch.float32, eta_tensor=True, init=True, lens=None, verbose=False):
    inp = make(B, T, H, D, dtype, eta_tensor, init, lens)
    t0 = time.time()
    outs, grads, cots = run(inp, "triton", chunk=chunk)
    t1 = time.time()
    routs, rgrads, _ = run(inp, "reference", torch.float64, cots, chunk=chunk)
    # bitwise repeat
    outs2, grads2, _ = run(inp, "triton", cots=cots, chunk=chunk)
    same = all(torch.equal(a, b) for a, b in zip(outs, outs2)) and all(torch.equal(grads[n], grads2[n]) for n in grads)
    eo = max(rel(a, r) for a, r in zip(outs, routs))
    eg = {n: rel(grads[n], rgrads[n]) for n in grads}
    tol_o, tol_g = (1e-5, 1e-4) if dtype == torch.float32 else (1e-2, 5e-2)
    verbose = verbose or dtype != torch.float32
    ok = eo <= tol_o and max(eg.values()) <= tol_g and same
    print(f"{'OK ' if ok else 'BAD'} B={B} T={T} H={H} D={D} c={chunk} {str(dtype)[6:]} etaT={eta_tensor} init={init} lens={lens} "
          f"out={eo:.2e} grads_max={max(eg.values()):.2e} same={same} ({t1-t0:.1f}s)")
    if not ok or verbose:
        print("   outs", [f"{rel(a, r):.2e}" for a, r in zip(outs, routs)], {n: f"{e:.2e}" for n, e in eg.items()})
    return ok

if __name__ == "__main__":
    import triton
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
    allok = True
    for D in (16, 32, 60, 64, 96, 100, 128):
        for c in (16, 32, 64):
            allok &= check(2, 150, 2, D, c)
    allok &= check(1, 0, 2, 32, 16, lens=[1, 7, 16, 33])
    allok &= check(1, 0, 3, 64, 16, lens=[1, 7, 16, 33, 300, 129])
    allok &= check(1, 0, 3, 128, 32, lens=[1, 7, 16, 33, 300, 129], init=False)
    allok &= check(2, 50, 2, 32, 16, eta_tensor=False)
    allok &= check(2, 1, 2, 32, 16)
    for dt in (torch.float16, torch.bfloat16):
        for D in (32, 64, 128):
            allok &= check(2, 300, 2, D, 16, dtype=dt)
        allok &= check(1, 0, 2, 64, 64, dtype=dt, lens=[5, 70, 400])
    print("ALL OK" if allok else "FAILURES")
    # timing
    from triton.testing import do_bench
    for (B, T, H, D, c, dt) in [(1, 32768, 16, 64, 16, torch.bfloat16), (32, 2048, 16, 64, 16, torch.bfloat16),
                                (8, 2048, 16, 128, 16, torch.bfloat16), (1, 8192, 16, 128, 16, torch.bfloat16),
                                (32, 2048, 16, 64, 16, torch.float32)]:
        inp = make(B, T, H, D, dt, True, True)
        args = [inp[n].detach().clone().requires_grad_(True) for n in ["q", "k", "v", "w", "b", "eta", "h0", "hb0"]]
        def fwd():
            return ttt.chunk_ttt_linear(*args[:6], chunk_size=c, initial_state=args[6], initial_state_bias=args[7],
                                        output_final_state=True, backend="triton")
        out = fwd()
        cots = [torch.randn_like(x) for x in out]
        def fb():
            out = fwd()
            torch.autograd.grad(out, args, cots)
        with torch.no_grad():
            tf = do_bench(fwd, warmup=3, rep=20)
        torch.cuda.reset_peak_memory_stats()
        tfb = do_bench(fb, warmup=3, rep=20)
        mem = torch.cuda.max_memory_allocated() / 2**20
        nt = T // c
        print(f"B={B} T={T} H={H} D={D} c={c} {dt}: fwd {tf:.2f} ms ({tf/nt*1e3:.2f} us/step) fwd+bwd {tfb:.2f} ms  peak {mem:.0f} MiB")
