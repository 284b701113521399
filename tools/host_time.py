"""How long one call keeps the host busy, next to the GPU time of the same calls.

    python -m tools.host_time [--backends cupy triton] [--shapes 8,2048,12,64 ...]

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
from collections import Counter

import torch

import ttt
from benchmarks._report import engine_versions
from benchmarks._timing import own_time_table
from benchmarks.decode import gpu_backends
from benchmarks.run import SHAPES, host_times, make_inputs, parse_shape

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
    from benchmarks.run import _driver_version, _git_commit

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
