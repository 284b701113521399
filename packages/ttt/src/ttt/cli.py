"""``python -m ttt info`` (backends, versions, device) and ``python -m ttt demo``."""

from __future__ import annotations

import argparse
import platform
import time

import torch

from . import __version__
from .registry import available_backends

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}


def _device_line() -> str:
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"cuda: {', '.join(names)} (CUDA {torch.version.cuda})"
    return "cpu only (no CUDA device)"


def cmd_info(_args) -> int:
    print(f"ttt {__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"device: {_device_line()}")
    print("backends:")
    for name, status in available_backends().items():
        versions = ", ".join(f"{k} {v}" for k, v in status.versions.items())
        state = "available" if status.available else f"unavailable: {status.reason}"
        print(f"  {name:<10} {state}" + (f"  [{versions}]" if versions else ""))
    return 0


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).norm() / ref.norm()).item()


def cmd_demo(args) -> int:
    from .ops import chunk_ttt_linear
    from .registry import select_backend
    from .testing.oracle import oracle_chunk_ttt_linear
    from .testing.tolerances import TOLERANCES
    from .validation import make_problem

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    B, T, H, D, C = args.batch, args.seq_len, args.heads, args.head_dim, args.chunk_size
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*shape, generator=g, dtype=torch.float64))

    k = rand(B, T, H, D)
    base = dict(q=rand(B, T, H, D), k=k / k.norm(dim=-1, keepdim=True), v=rand(B, T, H, D),
                w=rand(H, D, scale=0.1, offset=1.0), b=rand(H, D, scale=0.1),
                eta=0.1 * torch.rand(B, T, H, 1, generator=g, dtype=torch.float64),
                initial_state=rand(B, H, D, D, scale=0.1),
                initial_state_bias=rand(B, H, 1, D, scale=0.1))
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inputs = {n: t.to(device=device, dtype=state_dtype if n.startswith("initial") else dtype)
              .requires_grad_(True) for n, t in base.items()}
    problem = make_problem(**inputs, chunk_size=C, output_final_state=True)
    backend = select_backend(problem, args.backend)
    print(f"ttt demo: TTT-linear forward + backward on backend {backend.name!r}")
    print(f"  device {device} ({_device_line()})")
    print(f"  B={B} T={T} H={H} D={D} chunk={C} dtype={str(dtype).replace('torch.', '')}")

    def step():
        o, ht, hbt = chunk_ttt_linear(**inputs, chunk_size=C, output_final_state=True,
                                      backend=backend.name)
        grads = torch.autograd.grad([o, ht, hbt], list(inputs.values()), cotangents(o, ht, hbt))
        return (o, ht, hbt), grads

    gc = torch.Generator().manual_seed(1)

    def cotangents(*outs):
        return [torch.randn(x.shape, generator=gc, dtype=torch.float64).to(x) for x in outs]

    gc.manual_seed(1)
    step()  # warm-up: compilation and caches
    if device.type == "cuda":
        torch.cuda.synchronize()
    gc.manual_seed(1)
    start = time.perf_counter()
    (o, ht, hbt), grads = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    print(f"  forward + backward: {elapsed * 1e3:.2f} ms (one call after a warm-up)")

    ref_inputs = {n: t.detach().double().requires_grad_(True) for n, t in inputs.items()}
    ref = oracle_chunk_ttt_linear(**ref_inputs, chunk_size=C)
    gc.manual_seed(1)
    ref_grads = torch.autograd.grad(list(ref), list(ref_inputs.values()), cotangents(*ref))
    out_tol, grad_tol = TOLERANCES[dtype]
    ok = True
    print("  relative error against the float64 oracle:")
    for label, x, r, tol in [("o", o, ref[0], out_tol), ("final_state", ht, ref[1], out_tol),
                             ("final_state_bias", hbt, ref[2], out_tol)] + [
            (f"d{n}", gx, gr, grad_tol) for n, gx, gr in zip(inputs, grads, ref_grads)]:
        err = _rel(x, r)
        good = err <= tol
        ok &= good
        print(f"    {label:<22} {err:.2e}  (bound {tol:.0e}) {'ok' if good else 'FAIL'}")
    print("demo passed" if ok else "demo FAILED: errors above the bounds")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ttt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends, versions, device").set_defaults(func=cmd_info)
    demo = sub.add_parser("demo", help="forward + backward on the best backend, "
                                       "checked against the float64 oracle")
    demo.add_argument("--backend", default=None, help="backend name (default: the best here)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="default: bf16 on cuda, fp32 on cpu")
    demo.add_argument("--batch", type=int, default=2)
    demo.add_argument("--seq-len", type=int, default=256)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--head-dim", type=int, default=64)
    demo.add_argument("--chunk-size", type=int, default=16)
    demo.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    return args.func(args)
