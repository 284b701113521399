"""Benchmark ``ttt.chunk_ttt_linear`` backends against FLA's TTT-linear kernels on one GPU.

    python -m benchmarks.run                       # the five anchor shapes, every provider
    python -m benchmarks.run --shapes 4,4096,16,64 --backends triton fla.chunk
    python -m benchmarks.run --quick               # tiny shapes: a smoke test on a GPU
    python -m benchmarks.run --quick --device cpu  # no GPU: exercises the reporting only

Writes results.json, results.csv, results.md, results.png and environment.txt into --out,
then prints the markdown table. See benchmarks/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

import ttt
from benchmarks import _report, _timing
from benchmarks._providers import Provider, discover, fla_version

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results"

SHAPES = [(8, 2048, 12, 64), (4, 4096, 16, 64), (1, 32768, 16, 64), (4, 4096, 8, 128),
          (32, 2048, 16, 64)]
QUICK_SHAPES_CUDA = [(2, 256, 4, 64), (1, 512, 4, 128)]
QUICK_SHAPES_CPU = [(1, 64, 2, 32)]
CHECK_SHAPE_CUDA = (2, 256, 4, 64)
CHECK_SHAPE_CPU = (1, 64, 2, 32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Shape = tuple[int, int, int, int]


# ----------------------------------------------------------------------------- inputs


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device,
                seed: int) -> list[torch.Tensor]:
    """q, k, v, w, b, eta: fresh random values (seeded), k L2-normalised over D."""
    B, T, H, D = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32)

    q = randn(B, T, H, D)
    k = torch.nn.functional.normalize(randn(B, T, H, D), p=2, dim=-1)
    v = randn(B, T, H, D)
    w = 1.0 + 0.1 * randn(H, D)
    b = 0.1 * randn(H, D)
    eta = 0.1 * torch.rand(B, T, H, 1, generator=gen, device=device, dtype=torch.float32)
    return [x.to(dtype).contiguous() for x in (q, k, v, w, b, eta)]


def make_cotangent(shape: Shape, dtype: torch.dtype, device: torch.device,
                   seed: int) -> torch.Tensor:
    """The fixed random cotangent of ``o`` for the fwd+bwd timings (seeded with ``seed + 1``)."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _grad_leaves(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.detach().clone().requires_grad_(True) for x in xs]


# ----------------------------------------------------------------------------- measuring


def _short_error(exc: BaseException) -> str:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "out of memory"
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:300]


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure(provider: Provider, shape: Shape, args: argparse.Namespace,
            device: torch.device) -> _report.Row:
    B, T, H, D = shape
    dtype = DTYPES[args.dtype]
    row = _report.Row(shape=f"{B},{T},{H},{D}", B=B, T=T, H=H, D=D, dtype=args.dtype,
                      chunk_size=args.chunk_size, provider=provider.name)
    budget = _timing.Budget(args.warmup, args.rep, args.min_iters)
    errors: list[str] = []

    try:
        xs = make_inputs(shape, dtype, device, args.seed)   # same seed: same values for all
        leaves = _grad_leaves(xs)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the inputs
        row.status = f"error: inputs: {_short_error(exc)}"
        return row
    try:
        reason = provider.support(*leaves, chunk_size=args.chunk_size)
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        reason = f"support check failed: {_short_error(exc)}"
    if reason:
        row.status = f"unsupported: {reason}"
        return row

    def forward() -> None:
        provider.fn(*xs)

    try:
        row.fwd_p20_ms, row.fwd_ms, row.fwd_p80_ms = _timing.bench(forward, device, budget)
        row.step_us = row.fwd_ms * 1e3 / math.ceil(T / args.chunk_size)
        row.hbm_fwd = hbm_fraction(min_bytes(shape, dtype, backward=False), row.fwd_ms,
                                   device)
    except Exception as exc:  # noqa: BLE001 - OOM, compile errors, unsupported: a row
        errors.append(f"fwd: {_short_error(exc)}")
    _free(device)

    if not args.fwd_only:
        do = make_cotangent(shape, dtype, device, args.seed)

        def forward_backward() -> None:
            o = provider.fn(*leaves)
            torch.autograd.grad(o, leaves, grad_outputs=do)

        try:
            timed = _timing.bench(forward_backward, device, budget)
            row.fwdbwd_p20_ms, row.fwdbwd_ms, row.fwdbwd_p80_ms = timed
            row.hbm_fwdbwd = hbm_fraction(min_bytes(shape, dtype, backward=True),
                                          row.fwdbwd_ms, device)
            _free(device)
            row.peak_mib = _timing.peak_extra_mib(forward_backward, device)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"fwd+bwd: {_short_error(exc)}")
    if errors:
        row.status = "error: " + "; ".join(errors)
    return row


def min_bytes(shape: Shape, dtype: torch.dtype, backward: bool) -> int:
    """The bytes a pass cannot avoid moving: q, k, v and eta read and o written; with the
    backward also do read and dq, dk, dv and deta written."""
    B, T, H, D = shape
    tokens, size = B * T * H, torch.empty((), dtype=dtype).element_size()
    per_token = (4 * D + 1) * size
    return tokens * per_token * (2 if backward else 1)


def peak_bandwidth(device: torch.device) -> float | None:
    """The GPU's peak memory bandwidth in bytes/s (double data rate: 2 transfers per
    memory clock over the bus), or None off CUDA."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = (getattr(props, name, 0) for name in
                           ("memory_clock_rate", "memory_bus_width"))
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def hbm_fraction(nbytes: int, ms: float, device: torch.device) -> float | None:
    """The share of the peak bandwidth that moving ``nbytes`` in ``ms`` uses."""
    peak = peak_bandwidth(device)
    return None if peak is None else nbytes / (ms / 1e3) / peak


def step_floor_us(shape: Shape, args: argparse.Namespace, device: torch.device):
    """``benchmarks.step_floor``'s floor for the shape's head dim (a power of two), the
    chunk size and dtype, on a CUDA GPU with Triton; None elsewhere."""
    D = shape[3]
    if device.type != "cuda" or D & (D - 1):
        return None
    try:
        from benchmarks import step_floor
    except ImportError:                 # no Triton backend installed
        return None
    return step_floor.floor_us(D, args.chunk_size, DTYPES[args.dtype], str(device))


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def correctness(provider: Provider, shape: Shape, args: argparse.Namespace,
                device: torch.device) -> dict:
    """Relative errors of one provider against the float64 ttt reference backend."""
    B, T, H, D = shape
    result: dict = {"provider": provider.name, "shape": f"{B},{T},{H},{D}", "status": "ok"}
    base = make_inputs(shape, torch.float32, device, args.seed + 7)
    gen = torch.Generator(device=device).manual_seed(args.seed + 8)
    do = torch.randn(B, T, H, D, generator=gen, device=device, dtype=torch.float32)
    names = ["dq", "dk", "dv", "dw", "db", "deta"]
    try:
        ref_in = _grad_leaves([x.double() for x in base])
        o_ref = ttt.chunk_ttt_linear(*ref_in, chunk_size=args.chunk_size,
                                     backend="reference")[0]
        g_ref = torch.autograd.grad(o_ref, ref_in, grad_outputs=do.double())
    except Exception as exc:  # noqa: BLE001
        result["status"] = f"reference failed: {_short_error(exc)}"
        return result
    notes = []
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        leaves = _grad_leaves([x.to(dtype) for x in base])
        try:
            reason = provider.support(*leaves, chunk_size=args.chunk_size)
            if reason:
                notes.append(f"{label} unsupported: {reason}")
                continue
            o = provider.fn(*leaves)
            result[f"o_{label}"] = _rel(o, o_ref)
            if label == "fp32":
                grads = torch.autograd.grad(o, leaves, grad_outputs=do.to(dtype))
                errs = {n: _rel(g, r) for n, g, r in zip(names, grads, g_ref)}
                result["grads_fp32"] = errs
                result["worst_grad"] = max(errs, key=errs.__getitem__)
                result["grad_fp32"] = errs[result["worst_grad"]]
        except Exception as exc:  # noqa: BLE001
            notes.append(f"{label}: {_short_error(exc)}")
    if notes:
        result["status"] = "; ".join(notes)[:200]
    _free(device)
    return result


def host_times(backend: str, shape: Shape, iters: int, warmup: int,
               dtype: torch.dtype = torch.bfloat16, chunk_size: int = 16,
               device: torch.device | str | None = None) -> tuple[float, float, float]:
    """(host ms per forward, host ms per backward, wall ms per fwd+bwd) of ``backend`` over
    ``iters`` calls after ``warmup`` untimed ones: the host's time until each call returns
    (no synchronisation), the wall time between CUDA events, on CUDA unless ``device`` says
    otherwise (on a CPU the wall time is a plain clock's)."""
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


# ----------------------------------------------------------------------------- metadata


def _git_commit() -> tuple[str, bool | None]:
    """TTT_COMMIT when set (a copied tree's .git may be stale), else git's HEAD."""
    if os.environ.get("TTT_COMMIT"):
        return os.environ["TTT_COMMIT"], None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10,
                               check=True).stdout.strip()
        if head:
            return head, bool(dirty)
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("TTT_COMMIT") or "unknown", None


def _driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi (None where it cannot say)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out else None


def metadata(args: argparse.Namespace, device: torch.device, discovery) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        device_name, sms = props.name, props.multi_processor_count
        memory_gib = round(props.total_memory / 2**30, 1)
    else:
        device_name = f"CPU ({platform.processor() or platform.machine()})"
        sms, memory_gib = None, None
    commit, dirty = _git_commit()
    if device.type == "cuda":
        timing = (f"triton.testing.do_bench median (p20/p50/p80 in json/csv), L2 flushed, "
                  f"warm-up {args.warmup:g} ms, timed >= {args.rep:g} ms and >= "
                  f"{args.min_iters} calls")
    else:
        timing = "time.perf_counter on CPU: a smoke test of the reporting, not a benchmark"
    return {
        "device_name": device_name,
        "device": str(device),
        "sm_count": sms,
        "device_memory_gib": memory_gib,
        "driver": _driver_version() if device.type == "cuda" else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "triton": triton_version,
        "fla": fla_version() if discovery.fla_absent is None else None,
        "ttt": getattr(ttt, "__version__", "unknown"),
        "backend_versions": {p.name: p.versions for p in discovery.providers},
        "commit": commit,
        "commit_dirty": dirty,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "dtype": args.dtype,
        "chunk_size": args.chunk_size,
        "seed": args.seed,
        "timing": timing,
        "providers": [p.name for p in discovery.providers],
        "skipped": discovery.skipped,
        "fla_absent": discovery.fla_absent,
    }


# ----------------------------------------------------------------------------- CLI


def parse_shape(text: str) -> Shape:
    parts = text.replace("x", ",").replace("X", ",").split(",")
    try:
        values = tuple(int(p) for p in parts if p.strip())
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B,T,H,D (four positive "
                                         f"integers, e.g. 8,2048,12,64)")
    return values  # type: ignore[return-value]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Benchmark ttt.chunk_ttt_linear backends against FLA (fla-core).")
    p.add_argument("--shapes", nargs="+", type=parse_shape, metavar="B,T,H,D",
                   help="shapes to run (default: the five anchor shapes)")
    p.add_argument("--backends", nargs="+", metavar="NAME",
                   help="providers: ttt backend names (triton, cupy, reference, ...), "
                        "'fla' (both FLA variants), 'fla.fused_chunk', 'fla.chunk', or "
                        "'all'; comma-separated works too (default: every available ttt "
                        "backend except reference, plus both FLA variants)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and short timing: a smoke test")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="default cuda; cpu only with --quick: runs the reference backend to "
                        "exercise the reporting path")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output folder (default benchmarks/results)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="default bf16")
    p.add_argument("--chunk-size", type=int, default=16, help="default 16")
    p.add_argument("--warmup", type=float, default=None,
                   help="warm-up per measurement, ms (default 50; 10 with --quick)")
    p.add_argument("--rep", type=float, default=None,
                   help="timed duration per measurement, ms (default 300; 30 with --quick)")
    p.add_argument("--min-iters", type=int, default=None,
                   help="fewest timed calls per measurement (default 10; 3 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--fwd-only", action="store_true", help="skip the fwd+bwd measurements")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--no-plot", action="store_true", help="do not write results.png")
    return p


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cpu" and not args.quick:
        _log("run.py: --device cpu is only a smoke test of the reporting; add --quick "
             "(CPU times are not benchmarks)")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        _log("run.py: no CUDA device here (torch.cuda.is_available() is False; torch "
             f"{torch.__version__}). Run on a GPU machine (nox --no-venv -s bench), or use "
             "--quick --device cpu to exercise the reporting path only.")
        return 2
    if args.chunk_size < 1:
        _log("run.py: --chunk-size must be positive")
        return 2
    device = torch.device(args.device)
    args.warmup = args.warmup if args.warmup is not None else (10.0 if args.quick else 50.0)
    args.rep = args.rep if args.rep is not None else (30.0 if args.quick else 300.0)
    args.min_iters = args.min_iters if args.min_iters is not None else (3 if args.quick else 10)

    if args.shapes:
        shapes = args.shapes
    elif args.quick:
        shapes = QUICK_SHAPES_CPU if device.type == "cpu" else QUICK_SHAPES_CUDA
    else:
        shapes = SHAPES
    requested = None
    if args.backends:
        requested = [n for item in args.backends for n in item.split(",") if n.strip()]
    elif device.type == "cpu":
        requested = ["all"]        # the reference backend is the one that runs on a CPU

    discovery = discover(requested, args.chunk_size)
    meta = metadata(args, device, discovery)
    for name, why in discovery.skipped.items():
        _log(f"skip {name}: {why}")
    if discovery.fla_absent:
        _log(f"FLA not benchmarked: {discovery.fla_absent}")
    if not discovery.providers:
        _log("run.py: nothing to benchmark (no provider available); see the lines above")
        return 1

    checks: list[dict] = []
    if not args.no_check:
        check_shape = CHECK_SHAPE_CPU if device.type == "cpu" else CHECK_SHAPE_CUDA
        for provider in discovery.providers:
            _log(f"check {provider.name} on {check_shape} ...")
            checks.append(correctness(provider, check_shape, args, device))

    rows: list[_report.Row] = []
    fla_names = {p.name for p in discovery.providers if p.is_fla}
    for shape in shapes:
        floor = step_floor_us(shape, args, device)
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else None)
        for provider in discovery.providers:
            _log(f"bench {provider.name} on B,T,H,D={shape} ...")
            row = measure(provider, shape, args, device)
            _free(device)          # the inputs of measure() are gone now
            row.floor_us = floor
            row.chains_per_sm = None if sms is None else shape[0] * shape[2] / sms
            _log(f"  fwd {_report.fmt(row.fwd_ms)} ms, fwd+bwd {_report.fmt(row.fwdbwd_ms)} ms, "
                 f"peak {_report.fmt(row.peak_mib)} MiB"
                 + ("" if row.status == "ok" else f" [{row.status}]"))
            rows.append(row)
        # after every shape: what is measured so far, so a run cut short keeps its rows
        _report.add_speedups(rows, fla_names)
        done = len(dict.fromkeys(r.shape for r in rows))
        if done < len(shapes):
            _report.write_all(args.out, rows, dict(meta, partial=f"{done} of {len(shapes)}"),
                              checks, plot=False)

    written = _report.write_all(args.out, rows, meta, checks, plot=not args.no_plot)
    for path in written:
        _log(f"wrote {path}")

    print(_report.header_text(meta))
    if checks:
        print("\nCorrectness against the float64 ttt reference backend (relative error):\n")
        print(_report.checks_table(checks))
    print()
    print(_report.markdown_table(rows))
    return 0 if any(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
