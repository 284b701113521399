"""Per-kernel device time and do_bench of the forward, per shape and variant (a session
script, kept with the results that use it).

    python benchmarks/results/2026-12-04-l/kernel_diag.py "8,2048,12,64 4,4096,16,64" \
        "cupy cupy:TTT_CUPY_OVERLAP=0 triton"

A variant is ``backend[:ENV=V,ENV=V,...]``: the environment variables are set for its lines
and put back after. Per shape and variant: do_bench medians of the forward (inputs that need
grad) and of forward + backward (warm-up 5 ms, rep 30 ms), then the forward's five largest
kernels by mean device time over 5 forwards (torch.profiler). Run from the repository root.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
import triton
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path("benchmarks").resolve()))
from run import make_inputs  # noqa: E402

import ttt  # noqa: E402


def variant_line(shape, variant: str, dev: torch.device) -> str:
    backend, _, envs = variant.partition(":")
    leaves = [x.requires_grad_() for x in make_inputs(shape, torch.bfloat16, dev, seed=0)]
    do = torch.randn_like(leaves[0])
    before = {}
    for pair in filter(None, envs.split(",")):
        key, value = pair.split("=")
        before[key] = os.environ.get(key)
        os.environ[key] = value
    try:
        def fwd():
            return ttt.chunk_ttt_linear(*leaves, chunk_size=16, backend=backend)[0]

        def fwd_bwd():
            torch.autograd.grad(fwd(), leaves, do)

        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        ms_f = triton.testing.do_bench(fwd, warmup=5, rep=30)
        ms_fb = triton.testing.do_bench(fwd_bwd, warmup=5, rep=30)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fwd()
            torch.cuda.synchronize()
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    per = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per[event.name[:40]] += event.device_time / 5
    top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    kernels = "  ".join(f"{name.replace('ttt_linear_', '')[:28]}={us / 1000:.3f}"
                        for name, us in top)
    return (f"{','.join(map(str, shape))} {variant:40s} fwd {ms_f:.3f} fb {ms_fb:.3f} | "
            f"{kernels}")


def main() -> None:
    shapes = [tuple(int(x) for x in s.split(",")) for s in sys.argv[1].split()]
    variants = sys.argv[2].split()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), torch.__version__, triton.__version__)
    for shape in shapes:
        for variant in variants:
            print(variant_line(shape, variant, dev), flush=True)


if __name__ == "__main__":
    main()
