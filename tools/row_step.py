"""A/B of a generation step's two kernels per GPU backend: ``fwd_decode`` (row by row) against
the fused forward chain (a padded chunk of tile products), the data behind ``ROW_STEP_ROWS``
(triton's ``tuning.py``, cupy's ``placement.py``).

    python -m tools.row_step                              # both backends, the grid below
    python -m tools.row_step --backends cupy --rows 1 2 4 --dtypes bf16

For each backend, dtype, head dim, batch size and rows per sequence (a dense ``[B, rows, H,
D]`` step in the layer's form: ``eta_key``, ``query_residual``, carried float32 states,
final states returned, chunk 16, no gradient) it calls the backend's launcher twice:
``fwd_decode`` (the backend's ``ROW_STEP_ROWS`` raised to the chunk for the call, so that
its rule takes every row count) and the fused chain (forced: triton
``Tuning(fuse_forward=True)``, cupy ``Schedule(fuse_forward=True)``). Each is captured in a
CUDA graph and timed replayed (the kernel alone, no host work), as the median of
back-to-back replays in microseconds (``_timing.back_to_back``); the table gives both, their
ratio, the kernel the backend's rules take for that step and the largest norm-relative
difference between the two results (outputs and final states). GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import ttt
from benchmarks import _timing
from benchmarks.decode import DTYPES, gpu_backends, graph_replay, header, make_step

CHUNK = 16


def launchers(backend: str):
    """(launcher module, rules module, chain(p), row_step(p)) of ``backend``: its forward
    launcher without a backward with the fused chain forced, and its routing rule."""
    if backend == "triton":
        from ttt_triton.ops.ttt_linear import launcher, tuning

        chain = tuning.Tuning(fuse_forward=True)
        return (launcher, tuning, lambda p: launcher.ttt_linear_fwd(p, False, tuning=chain),
                lambda p: tuning.row_step(p, False, tuning.DEFAULT_TUNING))
    if backend == "cupy":
        from ttt_cupy import launcher, placement
        from ttt_cupy.config import Schedule
        from ttt_cupy.device import cuda_device

        chain = Schedule(fuse_forward=True)
        return (launcher, placement,
                lambda p: launcher.ttt_linear_fwd(p, False, schedule=chain),
                lambda p: placement.row_step(p, False, cuda_device(p.q.device).smem_limit))
    raise ValueError(f"backend: expected triton or cupy, got {backend!r}")


@contextlib.contextmanager
def every_row_count(launcher, rules):
    """Within: the backend's rule sends every generation step of up to a chunk of rows to
    fwd_decode (``rules.ROW_STEP_ROWS`` raised to the chunk, the launcher's kept forward
    setups forgotten on the way in and out)."""
    saved = rules.ROW_STEP_ROWS
    raised = dict.fromkeys(saved, CHUNK) if isinstance(saved, dict) else CHUNK
    rules.ROW_STEP_ROWS = raised
    launcher._FORWARD_SETUPS.clear()
    try:
        yield
    finally:
        rules.ROW_STEP_ROWS = saved
        launcher._FORWARD_SETUPS.clear()


def make_problem(B: int, T: int, H: int, D: int, dtype: torch.dtype, device: torch.device):
    """The layer-form problem of decode.py's step inputs with ``T`` rows per sequence."""
    s = make_step(B, H, D, dtype, device, rows=T)
    return ttt.make_problem(s.q, s.k, s.v, s.w, s.b, s.eta, chunk_size=CHUNK,
                            initial_state=s.h0, initial_state_bias=s.hb0,
                            output_final_state=True, eta_key=s.eta_key,
                            output="query_residual")


def difference(a, b) -> float:
    """The largest norm-relative difference of two (o, ht, hbt, saved) results."""
    return max(((x.float() - y.float()).norm() / y.float().norm()).item()
               for x, y in zip(a[:3], b[:3]))


def compare(launcher, rules, chain, p, budget: _timing.Budget) -> tuple[list[float], float]:
    """([fwd_decode us, fused chain us], their largest difference) of the step ``p``."""
    device = p.q.device

    def decode():
        return launcher.ttt_linear_fwd(p, False)

    def fused():
        return chain(p)

    with torch.no_grad():
        with every_row_count(launcher, rules):
            diff = difference(decode(), fused())
            replays = [graph_replay(decode, device)]
        replays.append(graph_replay(fused, device))
        return [1e3 * _timing.back_to_back(replay, device, budget)[1]
                for replay in replays], diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=None,
                        help="triton, cupy (default: those installed)")
    parser.add_argument("--batches", nargs="+", type=int, default=[4, 64])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 16])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("row_step.py: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    backends, skipped = gpu_backends(args.backends or ["triton", "cupy"], device)
    backends = [b for b in backends if b in ("triton", "cupy")]
    print(header(device, backends, "not timed"))
    for name, why in skipped.items():
        print(f"- ttt.{name} not timed: {why}")
    print("\nlayer form, chunk 16, CUDA graph replay, us per call\n")
    print("| backend | dtype | B, T, H, D | rules take | fwd_decode us | fused chain us | ratio "
          "| max rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    budget, measured = _timing.Budget(), 0
    for backend in backends:
        launcher, rules, chain, row_step = launchers(backend)
        for dtype_name in args.dtypes:
            for D in args.head_dims:
                for B in args.batches:
                    for T in (t for t in args.rows if t <= CHUNK):
                        p = make_problem(B, T, args.heads, D, DTYPES[dtype_name], device)
                        kernel = "fwd_decode" if row_step(p) else "fused chain"
                        us, diff = compare(launcher, rules, chain, p, budget)
                        measured += 1
                        print(f"| {backend} | {dtype_name} | {B}, {T}, {args.heads}, {D} | "
                              f"{kernel} | {us[0]:.1f} | {us[1]:.1f} | {us[0] / us[1]:.2f} | "
                              f"{diff:.1e} |", flush=True)
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
