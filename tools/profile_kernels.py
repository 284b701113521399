"""Where one forward+backward spends its GPU time, kernel by kernel (torch.profiler).

    python -m tools.profile_kernels [--backend triton] [--shapes 8,2048,12,64 ...]

Prints, per anchor shape, the mean device time of each kernel per fwd+bwd call, and the
sum. Complements ``benchmarks/run.py`` (end-to-end medians) when deciding what to optimise next.

With ``--ncu`` it runs one warmed-up fwd+bwd per shape between cudaProfilerStart and Stop
instead, for Nsight Compute's hardware counters:

    ncu --clock-control none --profile-from-start off --set full -o report \
        python -m tools.profile_kernels --backend cupy --shapes 1,32768,16,64 --ncu
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import ttt
from benchmarks.run import SHAPES, make_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--shapes", nargs="+", default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--ncu", action="store_true",
                        help="one fwd+bwd per shape inside cudaProfilerStart/Stop, no table")
    args = parser.parse_args()
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes
              else SHAPES)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, backend "
          f"{args.backend}")
    for shape in shapes:
        q, k, v, w, b, eta = make_inputs(shape, torch.bfloat16, dev, seed=0)
        leaves = [x.requires_grad_() for x in (q, k, v, w, b, eta)]
        do = torch.randn_like(q)

        def step(leaves=leaves, do=do):
            o = ttt.chunk_ttt_linear(*leaves, chunk_size=16, backend=args.backend)[0]
            torch.autograd.grad(o, leaves, do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        if args.ncu:
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                step()
            torch.cuda.synchronize()
        per_kernel: dict[str, float] = defaultdict(float)
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[evt.name[:60]] += evt.device_time / args.iters
        total = sum(per_kernel.values())
        print(f"\n{','.join(map(str, shape))}: {total / 1000:.3f} ms per fwd+bwd")
        for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {us / 1000:8.3f} ms  {name}")


if __name__ == "__main__":
    main()
