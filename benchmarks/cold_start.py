"""First-call cost: the first forward + backward of a fresh process, per backend and
configuration, with empty compile caches, with the caches a first process left, and after
``python -m ttt warmup``.

    python -m benchmarks.cold_start                          # GPU: every kernel backend
    python -m benchmarks.cold_start --backends triton --dtype bf16 --head-dim 64
    python -m benchmarks.cold_start --quick --device cpu     # no GPU: the reference backend

For each backend and configuration (dtype, head dim, chunk size, heads) it makes a new
cache directory (``TRITON_CACHE_DIR``, ``TTT_CUPY_CACHE_DIR`` and CuPy's own
``CUPY_CACHE_DIR`` point into it) and runs, each in a new Python process:

1. ``cold``: one forward + backward (``--shape B,T``), with the caches empty;
2. ``second``: the same again, a second process finding what the first compiled;
3. in a second, empty cache directory: ``python -m ttt warmup`` for that configuration,
   then ``after warmup``: the same call in a third process.

Each child times its first call (CUDA and torch's autograd initialised before, so the time
is ttt's: loading or compiling its kernels, and running) and a second call in the same
process (``warm``). The table, with the GPU and the
versions, goes to stdout; ``--json PATH`` also writes the rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CACHE_VARIABLES = {"TRITON_CACHE_DIR": "triton", "TTT_CUPY_CACHE_DIR": "ttt-cupy",
                   "CUPY_CACHE_DIR": "cupy"}
"""The compile caches a child may find: Triton's, the cupy backend's (its cubins) and CuPy's
own (kernels CuPy compiles without name expressions)."""


@dataclass
class Row:
    backend: str
    dtype: str
    head_dim: int
    chunk_size: int
    heads: int
    shape: str                       # "B,T"
    cold_s: float | None = None      # first fwd+bwd, empty caches
    second_s: float | None = None    # first fwd+bwd of a second process, same caches
    warmup_s: float | None = None    # python -m ttt warmup (its whole process)
    after_warmup_s: float | None = None
    warm_ms: float | None = None     # a second fwd+bwd in the cold process
    status: str = "ok"


# ----------------------------------------------------------------------------- child


def child(args: argparse.Namespace) -> int:
    """One process: CUDA and torch's autograd up, then the first and a second forward +
    backward; prints JSON."""
    import torch

    import ttt
    from benchmarks.run import make_inputs

    device = torch.device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    B, T = args.shape
    if device.type == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    # torch's own first use, paid by any process whatever it runs: the first autograd.grad
    # with a gradient tensor imports torch's symbolic shapes and sympy (seconds where
    # site-packages has no bytecode)
    one = torch.ones(1, device=device, requires_grad=True)
    torch.autograd.grad(one * 2, one, torch.ones_like(one))
    xs = [x.requires_grad_() for x in make_inputs((B, T, args.heads, args.head_dim), dtype,
                                                  device, seed=0)]
    do = torch.randn_like(xs[0])

    def step() -> float:
        start = time.perf_counter()
        o, _, _ = ttt.chunk_ttt_linear(*xs, chunk_size=args.chunk_size, backend=args.backend)
        torch.autograd.grad(o, xs, do)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    first = step()
    print(json.dumps({"first_s": first, "warm_ms": 1e3 * step()}))
    return 0


# ----------------------------------------------------------------------------- parent


def _environment(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_IN_MEMORY"}
    for var, sub in CACHE_VARIABLES.items():
        env[var] = str(cache / sub)
    return env


def _child_first_call(args, backend: str, config: dict, cache: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.cold_start", "--child", "--backend", backend,
           "--device", args.device, "--shape", f"{args.shape[0]},{args.shape[1]}",
           *[f"--{k.replace('_', '-')}={v}" for k, v in config.items()]]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_environment(cache),
                         timeout=args.timeout, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(_last_line(out.stderr))
    return json.loads(out.stdout.splitlines()[-1])


def _warmup(args, backend: str, config: dict, cache: Path) -> float:
    cmd = [sys.executable, "-m", "ttt", "warmup", "--quiet", "--backend", backend,
           "--device", args.device, "--dtype", config["dtype"],
           "--head-dim", str(config["head_dim"]), "--chunk-size", str(config["chunk_size"]),
           "--heads", str(config["heads"])]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=_environment(cache),
                         timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError("warmup: " + _last_line(out.stderr))
    return time.perf_counter() - start


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def measure(args, backend: str, config: dict) -> Row:
    row = Row(backend, shape=f"{args.shape[0]},{args.shape[1]}", **config)
    try:
        with tempfile.TemporaryDirectory(prefix="ttt-cold-") as tmp:
            cold = _child_first_call(args, backend, config, Path(tmp))
            row.cold_s, row.warm_ms = cold["first_s"], cold["warm_ms"]
            row.second_s = _child_first_call(args, backend, config, Path(tmp))["first_s"]
        with tempfile.TemporaryDirectory(prefix="ttt-warm-") as tmp:
            row.warmup_s = _warmup(args, backend, config, Path(tmp))
            after = _child_first_call(args, backend, config, Path(tmp))
            row.after_warmup_s = after["first_s"]
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        row.status = f"error: {exc}"
    return row


def _fmt(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} {unit}" if unit == "s" else f"{x:.1f} {unit}"


def table(rows: list[Row]) -> str:
    lines = ["| backend | dtype | D | chunk | H | B,T | cold first call | second process | "
             "warmup | after warmup | warm call | status |",
             "|---" * 12 + "|"]
    for r in rows:
        lines.append(f"| {r.backend} | {r.dtype} | {r.head_dim} | {r.chunk_size} | {r.heads} "
                     f"| {r.shape} | {_fmt(r.cold_s, 's')} | {_fmt(r.second_s, 's')} | "
                     f"{_fmt(r.warmup_s, 's')} | {_fmt(r.after_warmup_s, 's')} | "
                     f"{_fmt(r.warm_ms, 'ms')} | {r.status} |")
    return "\n".join(lines)


def header(device: str, backends: dict) -> str:
    import torch

    import ttt
    from benchmarks._report import engine_versions
    from benchmarks.run import _driver_version, _git_commit

    if device.startswith("cuda"):
        gpu = torch.cuda.get_device_name(torch.device(device))
        driver = _driver_version()
        gpu += f", driver {driver}" if driver else ""
    else:
        gpu = f"CPU ({platform.processor() or platform.machine()}): a smoke run, not a result"
    engines = engine_versions(backends)
    commit, dirty = _git_commit()
    return "\n".join([
        f"# ttt first-call cost: {gpu}",
        "",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), ttt "
        f"{ttt.__version__}, python {platform.python_version()}; {engines}; commit "
        f"{commit}{' (uncommitted changes)' if dirty else ''}",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; times are the first "
        "forward + backward of a new process (CUDA and autograd initialised before), in seconds",
    ])


def _backends(requested: list[str] | None, device: str) -> dict:
    import ttt
    from ttt.status import backend_status

    if requested:
        statuses = {name: backend_status(name) for name in requested}
    else:
        statuses = {n: s for n, s in ttt.available_backends().items() if s.available
                    and (n != "reference" or not device.startswith("cuda"))}
    missing = {n: s.reason for n, s in statuses.items() if not s.available}
    if missing:
        raise SystemExit(f"cold_start.py: cannot run {missing}")
    if not statuses:
        raise SystemExit("cold_start.py: no backend to measure here (python -m ttt info)")
    return statuses


def _shape(text: str) -> tuple[int, int]:
    try:
        B, T = (int(x) for x in text.split(","))
    except ValueError:
        B = T = 0
    if B < 1 or T < 1:
        raise argparse.ArgumentTypeError(f"expected B,T (two positive ints), got {text!r}")
    return B, T


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=None,
                        help="backend names (default: every available kernel backend; on "
                             "cpu the available ones)")
    parser.add_argument("--backend", help=argparse.SUPPRESS)            # the child's
    parser.add_argument("--dtype", action="append", choices=sorted(DTYPES),
                        help="repeatable (default: bf16 and fp32)")
    parser.add_argument("--head-dim", type=_positive, action="append",
                        help="repeatable (default: 64 and 128)")
    parser.add_argument("--chunk-size", type=_positive, action="append",
                        help="repeatable (default: 16)")
    parser.add_argument("--heads", type=_positive, action="append",
                        help="repeatable (default: 32)")
    parser.add_argument("--shape", type=_shape, default=None,
                        help="B,T of the measured call (default 8,2048; --quick 2,64)")
    parser.add_argument("--device", default=None, help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true",
                        help="fp32, head dim 16, 2 heads, B,T 2,64: checks the script runs")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per child process (default 900)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        args.dtype, args.head_dim, args.chunk_size, args.heads = (
            args.dtype[0], args.head_dim[0], args.chunk_size[0], args.heads[0])
        return child(args)
    import torch

    if args.device is None:
        if not torch.cuda.is_available():
            print("cold_start.py: no CUDA device here; --device cpu (with --quick) runs a "
                  "smoke test", file=sys.stderr)
            return 2
        args.device = "cuda"
    quick = dict(dtype=["fp32"], head_dim=[16], heads=[2], shape=(2, 64))
    defaults = dict(dtype=["bf16", "fp32"], head_dim=[64, 128], heads=[32], shape=(8, 2048))
    for key, value in (quick if args.quick else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.chunk_size = args.chunk_size or [16]
    backends = _backends(args.backends, args.device)
    print(header(args.device, backends), flush=True)
    rows = []
    for backend in backends:
        for dtype in args.dtype:
            for D in args.head_dim:
                for C in args.chunk_size:
                    for H in args.heads:
                        config = dict(dtype=dtype, head_dim=D, chunk_size=C, heads=H)
                        rows.append(measure(args, backend, config))
                        print(f"  measured {backend} {config}: {rows[-1].status}",
                              file=sys.stderr, flush=True)
    print()
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0 if any(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
