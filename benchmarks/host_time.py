"""How long one call keeps the host busy, next to the GPU time of the same calls.

    python benchmarks/host_time.py [--backends cupy triton] [--shapes 8,2048,12,64 ...]

Per backend (default: every installed GPU backend) and anchor shape: the Python side of one
forward and of one backward (the time until the call returns, without synchronising), and
the wall time per fwd+bwd of the same calls between two CUDA events. Where the host time is
near the wall time, the host's launch work, not the GPU, sets the pace (e.g. the cupy
backend's forward at 8,2048,12,64).
Environment variables of the backends (``TTT_CUPY_MMA``, ...) apply.
With ``--api``, also the CUDA runtime and driver calls one forward makes (torch.profiler's
host-side events named ``cuda*`` / ``cu*``: launches, allocations, events, stream waits), the
count behind its host time. With ``--cprofile N``, also cProfile's N functions of most own
time in one forward (the profiler's own cost included: compare lines, not totals).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import engine_versions  # noqa: E402
from _timing import own_time_table  # noqa: E402
from decode import gpu_backends  # noqa: E402
from run import SHAPES, make_inputs, parse_shape  # noqa: E402

import ttt  # noqa: E402


def host_times(backend: str, shape, iters: int, warmup: int, dtype=torch.bfloat16,
               chunk_size: int = 16, device=None) -> tuple[float, float, float]:
    """(host ms per forward, host ms per backward, wall ms per fwd+bwd), on CUDA unless
    ``device`` says otherwise (on a CPU the wall time is a plain clock's)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    xs = [x.detach().requires_grad_() for x in make_inputs(shape, dtype, device, 0)]
    do = torch.randn_like(xs[0])
    fwd = bwd = 0.0
    on_cuda = device.type == "cuda"
    with ttt.set_backend(backend):
        for _ in range(warmup):
            o, _, _ = ttt.chunk_ttt_linear(*xs, chunk_size=chunk_size)
            torch.autograd.grad(o, xs, do)
        if on_cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        wall = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            o, _, _ = ttt.chunk_ttt_linear(*xs, chunk_size=chunk_size)
            t1 = time.perf_counter()
            torch.autograd.grad(o, xs, do)
            fwd += t1 - t0
            bwd += time.perf_counter() - t1
        if on_cuda:
            end.record()
            torch.cuda.synchronize()
            wall_ms = start.elapsed_time(end) / iters
        else:
            wall_ms = 1e3 * (time.perf_counter() - wall) / iters
    return 1e3 * fwd / iters, 1e3 * bwd / iters, wall_ms


API_CALL = re.compile(r"(cuda|cu)[A-Z]\w*$")
"""Names of CUDA runtime (cudaLaunchKernel, cudaEventRecord, ...) and driver (cuLaunchKernel,
cuStreamWaitValue32, ...) calls among torch.profiler's events."""


def api_calls(fn, iters: int) -> Counter:
    """{CUDA runtime / driver call: times per call of ``fn``} over ``iters`` calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    counts = Counter()
    for event in prof.key_averages():
        if API_CALL.match(event.key):
            counts[event.key] += event.count / iters
    return counts


def forward_api_calls(backend: str, shape, iters: int) -> Counter:
    """:func:`api_calls` of one forward (inputs that need grad, as in :func:`host_times`)."""
    device = torch.device("cuda")
    xs = [x.detach().requires_grad_() for x in make_inputs(shape, torch.bfloat16, device, 0)]
    with ttt.set_backend(backend):
        ttt.chunk_ttt_linear(*xs)   # (compiled and warm)
        return api_calls(lambda: ttt.chunk_ttt_linear(*xs), iters)


def forward_cprofile(backend: str, shape, iters: int, top: int) -> str:
    """cProfile's ``top`` functions by own time over ``iters`` forwards, per forward (ms)."""
    import cProfile

    device = torch.device("cuda")
    xs = [x.detach().requires_grad_() for x in make_inputs(shape, torch.bfloat16, device, 0)]
    with ttt.set_backend(backend):
        ttt.chunk_ttt_linear(*xs)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            ttt.chunk_ttt_linear(*xs)
        prof.disable()
        torch.cuda.synchronize()
    return own_time_table(prof, iters, top, 1e3, "ms")


def header(backends: list[str]) -> str:
    from run import _driver_version, _git_commit

    driver = _driver_version()
    statuses = ttt.available_backends()
    engines = engine_versions({name: statuses[name] for name in backends})
    commit, dirty = _git_commit()
    return "\n".join([
        f"# ttt host time: {torch.cuda.get_device_name()}"
        f"{f', driver {driver}' if driver else ''}",
        "",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), ttt {ttt.__version__}, "
        f"python {platform.python_version()}; {engines}; commit {commit}"
        f"{' (uncommitted changes)' if dirty else ''}",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; bf16, chunk 16; host: the "
        "Python side of one call until it returns (no synchronisation), wall: one fwd+bwd "
        "between CUDA events; ms per call (mean)",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", nargs="+", default=None,
                        help="default: every available backend but the reference")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        metavar="B,T,H,D")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--api", action="store_true",
                        help="also count the CUDA runtime / driver calls of one forward")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print cProfile's N functions of most own time per forward")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    args.backends = args.backends or gpu_backends(None, torch.device("cuda"))[0]
    print(header(args.backends))
    print()
    print("| backend | B, T, H, D | host fwd ms | host bwd ms | wall fwd+bwd ms |")
    print("|---|---|---|---|---|")
    for backend in args.backends:
        for shape in args.shapes or SHAPES:
            fwd, bwd, wall = host_times(backend, shape, args.iters, args.warmup)
            print(f"| {backend} | {', '.join(map(str, shape))} | {fwd:.3f} | {bwd:.3f} "
                  f"| {wall:.3f} |")
    if args.api:
        print("\nCUDA runtime / driver calls per forward:")
        for backend in args.backends:
            for shape in args.shapes or SHAPES:
                calls = forward_api_calls(backend, shape, args.iters)
                listed = ", ".join(f"{name} {n:g}" for name, n in calls.most_common())
                print(f"- {backend} {','.join(map(str, shape))}: {sum(calls.values()):g} "
                      f"({listed})")
    if args.cprofile:
        for backend in args.backends:
            for shape in args.shapes or SHAPES:
                print(f"\ncProfile, {backend} {','.join(map(str, shape))}, per forward "
                      f"(under the profiler):")
                print(forward_cprofile(backend, shape, args.iters, args.cprofile), end="")


if __name__ == "__main__":
    main()
