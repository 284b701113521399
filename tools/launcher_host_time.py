"""The host time of each GPU backend's launcher, on the CPU, with nothing launched.

    python -m tools.launcher_host_time                       # this checkout's
    python -m tools.launcher_host_time --compare-with main   # and another revision's

What a launcher does on the host between the core's call and its kernels: the schedule,
the buffers, the casts and each launch's arguments. Here the launches do nothing: the cupy
launcher runs through its device seam with a stand-in whose kernels are their names and
whose ``launch`` returns at once (no cupy needed), the Triton launcher with its launch step
(``launches.run``) replaced by a no-op. CPU tensors, bfloat16 inputs (q, k, v, w, b, eta,
as ``benchmarks/decode.py`` passes them). Per backend and shape, microseconds per call
(the median over ``--repeats`` runs of ``--iters`` calls):

- ``decode``: a forward without backward, with initial and final states (a generation step
  at 4,1,16,64);
- ``fwd``: a forward that saves for the backward;
- ``bwd``: the backward of that forward, every gradient.

On a GPU the same code also pays for CUDA allocations, casts and launches (see
``tools/host_time.py``); this measures the part a change to a launcher's Python moves,
on any machine. ``--compare-with REV`` runs the same cases with the three packages of git
revision ``REV`` in one child process and this checkout's in another, taking turns case by
case for ``--rounds`` rounds; it prints per cell both medians and their ratio. The
measuring children run with glibc's malloc thresholds fixed (``core_host_time.FIXED_MALLOC``),
so that the backward's MB buffers do not measure the heap's history.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile

import torch

import ttt
from benchmarks._ab_child import PACKAGES
from tools.core_host_time import (
    REPO,
    add_measure_arguments,
    ask,
    child_process,
    extract_sources,
    timed_runs,
    us_cell,
)

SHAPES = ((4, 1, 16, 64), (2, 1024, 8, 64))
CALLS = ("decode", "fwd", "bwd")
BACKENDS = ("cupy", "triton")
CASES = [(backend, shape, call) for backend in BACKENDS for shape in SHAPES for call in CALLS
         if call != "decode" or shape[1] == 1]
SOURCES = tuple(PACKAGES.values())


class _Stream:
    cuda_stream = 0

    def record_event(self):
        return None

    def wait_event(self, event) -> None:
        pass


class NoLaunchDevice:
    """The cupy launcher's device seam (``ttt_cupy.device.CudaDevice``) for CPU tensors: an
    sm_90 whose kernels are their names; prefetches, stream waits and launches do nothing."""

    smem_limit = 227 * 1024

    def __init__(self):
        from ttt_cupy import compile as cc
        from ttt_cupy.device import CudaDevice

        self._cc = cc
        # the device's own launch arguments of tensors (``pointers``: one call for many,
        # where the revision has it)
        self.pointer = CudaDevice.pointer
        if hasattr(CudaDevice, "pointers"):
            self.pointers = CudaDevice.pointers
        self.chain_stream = _Stream()
        self.group_streams = tuple(_Stream() for _ in range(8))

    def uses_mma(self, dtype_name: str, requested: bool) -> bool:
        return self._cc.use_mma(self._cc.CTYPES[dtype_name], "90", requested)

    def kernels(self, pass_, dtype_name, dp, bt, mma, key=False, out="norm_residual",
                **native):      # (native_params: the decode kernel's, where the launcher has it)
        return self._cc.pass_names(pass_, self._cc.CTYPES[dtype_name], dp, bt, mma, key, out,
                                   **native)

    def prefetch(self, *args, **kwargs) -> None:
        pass

    def active(self):
        return contextlib.nullcontext()


    def current_stream(self):
        return _Stream()

    def wait_value(self, stream, address: int, value: int) -> bool:
        return False

    def launch(self, kernel, grid, block, smem, args, stream) -> None:
        pass


def _problem(shape, decode: bool):
    B, T, H, D = shape
    gen = torch.Generator().manual_seed(0)

    def randn(*size, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(*size, generator=gen)).to(torch.bfloat16)

    states = dict(initial_state=torch.zeros(B, H, D, D), initial_state_bias=torch.zeros(
        B, H, 1, D), output_final_state=True) if decode else {}
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    return ttt.make_problem(randn(B, T, H, D), k.to(torch.bfloat16), randn(B, T, H, D),
                            randn(H, D, scale=0.1, offset=1.0), randn(H, D, scale=0.1),
                            (0.1 * torch.rand(B, T, H, 1, generator=gen)).to(torch.bfloat16),
                            **states)


def _launchers(backend: str):
    """(forward, backward) of ``backend``'s launcher, launching nothing."""
    if backend == "cupy":
        from ttt_cupy import launcher

        device = NoLaunchDevice()
        return (lambda p, save: launcher.ttt_linear_fwd(p, save, device=device),
                lambda p, saved, do: launcher.ttt_linear_bwd(p, saved, do, None, None,
                                                             device=device))
    from ttt_triton.ops.ttt_linear import launcher

    launcher.launches_run = lambda *args, **kwargs: None
    return (lambda p, save: launcher.ttt_linear_fwd(p, save),
            lambda p, saved, do: launcher.ttt_linear_bwd(p, saved, do, None, None))


def _call(case: int):
    """A zero-argument function making one call of case ``case``."""
    backend, shape, call = CASES[case]
    forward, backward = _launchers(backend)
    p = _problem(shape, decode=call == "decode")
    if call == "decode":
        return lambda: forward(p, False)
    if call == "fwd":
        return lambda: forward(p, True)
    saved = forward(p, True)[3]
    do = torch.randn(p.q.shape).to(p.q.dtype)
    return lambda: backward(p, saved, do)


def serve(iters: int, repeats: int) -> None:
    """Child process: for each case index read from stdin, print its runs as JSON."""
    torch.set_num_threads(1)
    calls = {}
    for line in sys.stdin:
        case = int(line)
        if case not in calls:
            calls[case] = _call(case)
        print(json.dumps(timed_runs(calls[case], iters, repeats)), flush=True)


def measure(sides: list[list[str]], iters: int, repeats: int, rounds: int
            ) -> list[list[float]]:
    """Per side (its source paths), the median us of every case: one child process a side,
    taking turns case by case, ``rounds`` times."""
    children = [child_process("tools.launcher_host_time", paths, iters, repeats)
                for paths in sides]
    samples = [[[] for _ in CASES] for _ in children]
    try:
        for r in range(rounds):
            for case in range(len(CASES)):
                order = range(len(children)) if r % 2 == 0 else reversed(range(len(children)))
                for side in order:
                    samples[side][case] += ask(children[side], case)
    finally:
        for child in children:
            child.stdin.close()
            child.wait()
    return [[statistics.median(runs) for runs in side] for side in samples]


def table(after: list[float], before: list[float] | None = None) -> str:
    lines = ["| backend | B,T,H,D | " + " | ".join(f"{c} us" for c in CALLS) + " |",
             "|---|---|" + "---|" * len(CALLS)]
    for backend in BACKENDS:
        for shape in SHAPES:
            cells = []
            for call in CALLS:
                key = (backend, shape, call)
                if key not in CASES:
                    cells.append("-")
                    continue
                i = CASES.index(key)
                cells.append(us_cell(after[i], None if before is None else before[i]))
            lines.append(f"| {backend} | {','.join(map(str, shape))} | " + " | ".join(cells)
                         + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_arguments(parser, 1000, 5, "the three packages")
    args = parser.parse_args()
    if args.serve:
        serve(args.iters, args.repeats)
        return
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, one CPU thread, "
          f"launches stubbed out")
    here = [str(REPO / src) for src in SOURCES]
    if not args.compare_with:
        (after,) = measure([here], args.iters, args.repeats, args.rounds)
        print(table(after))
        return
    with tempfile.TemporaryDirectory() as tmp:
        before, after = measure([extract_sources(args.compare_with, tmp, SOURCES), here],
                                args.iters,
                                args.repeats, args.rounds)
    print(f"\n{args.compare_with} -> this checkout, us per call (ratio):")
    print(table(after, before))


if __name__ == "__main__":
    main()
