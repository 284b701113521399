"""``python -m ttt info`` (backends, versions, device), ``python -m ttt capabilities`` (the
backends' declared capabilities as a markdown table), ``python -m ttt demo`` and
``python -m ttt warmup`` (compile ahead of time, see ``ttt.warmup``).

An expected failure (an unknown or uninstalled backend, one that cannot run here or cannot
take the inputs, a device that is not present) prints one line to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from . import __version__
from .backend import Capabilities
from .choice import select_backend
from .errors import BackendError, BackendNotInstalledError
from .ops import chunk_ttt_linear
from .oracle import oracle_chunk_ttt_linear
from .problem import state_dtype
from .registry import KNOWN_BACKENDS, declared_capabilities
from .status import available_backends, backend_status
from .tolerances import TOLERANCES
from .validation import dtype_name, make_problem
from .warmup import OPS, ProgressBar, warmup

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
CAPABILITIES_COMMAND = "python -m ttt capabilities > docs/capabilities.md"


class CommandError(Exception):
    """An expected failure of a command: reported in one line, exit status 2."""


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
        state = "available" if status.available else status.reason
        print(f"  {name:<10} {state}" + (f"  [{versions}]" if versions else ""))
    return 0


def _dtype_names(dtypes) -> str:
    order = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
    known = [d for d in order if d in dtypes]
    others = sorted(str(d) for d in dtypes if d not in order)
    return ", ".join([dtype_name(d) for d in known] + others)


CAPABILITY_COLUMNS = {
    "ops": lambda c: ", ".join(sorted(c.ops)),
    "devices": lambda c: ", ".join(sorted(c.devices)),
    "dtypes": lambda c: _dtype_names(c.dtypes),
    "chunk sizes": lambda c: "any" if c.chunk_sizes is None else
    ", ".join(map(str, sorted(c.chunk_sizes))),
    "max head dim": lambda c: "any" if c.max_head_dim is None else str(c.max_head_dim),
    "varlen": lambda c: "yes" if c.varlen else "no",
    "varlen backward": lambda c: "yes" if c.varlen_backward else "no",
    "backward": lambda c: "yes" if c.backward else "no",
    "deterministic": lambda c: "yes" if c.deterministic else "no",
    "eta_key": lambda c: "yes" if c.eta_key else "no",
    "output forms": lambda c: ", ".join(sorted(c.outputs)),
}
"""Column title -> its cell for a backend's :class:`Capabilities`."""


def capabilities_table() -> str:
    """The markdown page ``python -m ttt capabilities`` prints: one row per built-in backend."""
    lines = [
        "# Backend capabilities",
        "",
        "Generated from each built-in backend's declared `Capabilities` (the GPU backends'",
        f"as declared on a CUDA machine) by `{CAPABILITIES_COMMAND}`;",
        "do not edit by hand.",
        "",
        "| backend | " + " | ".join(CAPABILITY_COLUMNS) + " |",
        "|---" * (len(CAPABILITY_COLUMNS) + 1) + "|",
    ]
    for name in KNOWN_BACKENDS:
        try:
            caps: Capabilities = declared_capabilities(name)
        except BackendNotInstalledError as exc:
            cells = [f"not installed here ({exc.reason})"] + [""] * (len(CAPABILITY_COLUMNS) - 1)
        else:
            cells = [cell(caps) for cell in CAPABILITY_COLUMNS.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cmd_capabilities(_args) -> int:
    sys.stdout.write(capabilities_table())
    return 0


def _demo_device(requested: str | None) -> torch.device:
    """The demo's device: ``requested``, checked to be present, else cuda if present."""
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise CommandError(f"--device: expected cpu or cuda[:N], got {requested!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {requested}: no CUDA GPU on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise CommandError(f"--device {requested}: this machine has "
                           f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def _require_runnable(name: str | None) -> None:
    """CommandError unless backend ``name`` (None: any) is installed and can run here."""
    if name is not None and not (status := backend_status(name)).available:
        raise CommandError(f"backend {name!r} cannot run here: {status.reason}")


def cmd_demo(args) -> int:
    device = _demo_device(args.device)
    _require_runnable(args.backend)
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
    inputs = {n: t.to(device=device, dtype=state_dtype(dtype) if n.startswith("initial")
                      else dtype).requires_grad_(True) for n, t in base.items()}
    problem = make_problem(**inputs, chunk_size=C, output_final_state=True)
    backend = select_backend(problem, args.backend)
    print(f"ttt demo: TTT-linear forward + backward on backend {backend.name!r}")
    print(f"  device {device} ({_device_line()})")
    print(f"  B={B} T={T} H={H} D={D} chunk={C} dtype={dtype_name(dtype)}")

    gc = torch.Generator()

    def cotangents(*outs):          # the same ones for every call
        gc.manual_seed(1)
        return [torch.randn(x.shape, generator=gc, dtype=torch.float64).to(x) for x in outs]

    def step():
        o, ht, hbt = chunk_ttt_linear(**inputs, chunk_size=C, output_final_state=True,
                                      backend=backend.name)
        grads = torch.autograd.grad([o, ht, hbt], list(inputs.values()), cotangents(o, ht, hbt))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (o, ht, hbt), grads

    for _ in range(args.warmup):         # compilation, autotuning, caches
        step()
    times_ms = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        (o, ht, hbt), grads = step()
        times_ms.append((time.perf_counter() - start) * 1e3)
    times_ms.sort()
    print(f"  forward + backward: {statistics.median(times_ms):.2f} ms median of "
          f"{args.repeat} calls (min {times_ms[0]:.2f}, max {times_ms[-1]:.2f}) after "
          f"{args.warmup} warm-up call(s)")

    ref_inputs = {n: t.detach().double().requires_grad_(True) for n, t in inputs.items()}
    ref = oracle_chunk_ttt_linear(**ref_inputs, chunk_size=C)
    ref_grads = torch.autograd.grad(list(ref), list(ref_inputs.values()), cotangents(*ref))
    out_tol, grad_tol = TOLERANCES[dtype]
    ok = True
    print("  relative error against the float64 oracle:")
    for label, x, r, tol in [("o", o, ref[0], out_tol), ("final_state", ht, ref[1], out_tol),
                             ("final_state_bias", hbt, ref[2], out_tol)] + [
            (f"d{n}", gx, gr, grad_tol) for n, gx, gr in zip(inputs, grads, ref_grads)]:
        x, r = x.detach().double().cpu(), r.detach().double().cpu()
        err = ((x - r).norm() / r.norm()).item()
        good = err <= tol
        ok &= good
        print(f"    {label:<22} {err:.2e}  (bound {tol:.0e}) {'ok' if good else 'FAIL'}")
    print("demo passed" if ok else "demo FAILED: errors above the bounds")
    return 0 if ok else 1


def cmd_warmup(args) -> int:
    device = _demo_device(args.device)
    _require_runnable(args.backend)
    repeated = {"head_dims": args.head_dim, "chunk_sizes": args.chunk_size,
                "heads": args.heads, "ops": args.op}     # None where not given: the defaults
    report = warmup(args.backend,
                    dtypes=None if args.dtype is None else [DTYPES[d] for d in args.dtype],
                    backward=not args.no_backward, device=device,
                    progress=ProgressBar(quiet=args.quiet), workers=args.workers,
                    **{name: values for name, values in repeated.items() if values})
    passes = "forward" if args.no_backward else "forward + backward"
    for entry in report.entries:
        print(f"warmed up {entry.config.describe()} on {entry.backend} ({passes}, "
              f"{entry.calls} calls): {entry.seconds:.1f} s")
    for config, reason in report.skipped:
        print(f"skipped {config.describe()}: {reason}")
    processes = f", {report.workers} compiling processes" if report.workers > 1 else ""
    print(f"warmup: {len(report.entries)} configuration(s) on {report.device} in "
          f"{report.seconds:.1f} s{processes}")
    return 0


def _int_at_least(low: int, words: str):
    """An argparse type: an int >= ``low``, else "expected a ``words`` integer"."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a {words} integer, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1, "positive")
_non_negative_int = _int_at_least(0, "non-negative")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, "(default: X)", except where there is none to show
    (None, a flag's False) or the help says it in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ttt", description=__doc__,
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, func, help, description):
        command = sub.add_parser(name, help=help, description=description,
                                 formatter_class=HelpFormatter)
        command.set_defaults(func=func)
        return command

    command("info", cmd_info, "backends, versions, device",
            "ttt, torch and Python versions, the device, every backend and whether it runs here")
    command("capabilities", cmd_capabilities,
            "the backends' declared capabilities, a markdown table (docs/capabilities.md)",
            "the backends' declared capabilities as a markdown table")
    demo = command("demo", cmd_demo,
                   "forward + backward on the best backend, checked against the float64 oracle",
                   "A TTT-linear forward + backward, timed (the median of several calls after "
                   "warm-up), checked against the float64 oracle; exit status 1 if an error is "
                   "above its bound.")
    demo.add_argument("--backend", default=None, help="backend name (default: the best here)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="input dtype (default: bf16 on cuda, fp32 on cpu)")
    for flag, default, help in (
            ("--batch", 2, "batch size B"), ("--seq-len", 256, "sequence length T"),
            ("--heads", 4, "heads H"), ("--head-dim", 64, "head dim D"),
            ("--chunk-size", 16, "tokens per inner mini-batch"),
            ("--warmup", 2, "untimed calls first (compilation, autotuning, caches)"),
            ("--repeat", 10, "timed calls; their median is reported")):
        kind = _non_negative_int if flag == "--warmup" else _positive_int
        demo.add_argument(flag, type=kind, default=default, help=help)
    warm = command("warmup", cmd_warmup,
                   "compile ahead of time the kernels of some configurations (forward and "
                   "backward)",
                   "Compile ahead of time the kernels of some configurations, forward and "
                   "backward.")
    warm.add_argument("--backend", default=None,
                      help="backend name (default: the one each configuration's calls get)")
    warm.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if present)")
    warm.add_argument("--dtype", choices=sorted(DTYPES), action="append",
                      help="input dtype, repeatable (default: bf16 and fp32, those the "
                           "backend takes)")
    for flag, help in (("--head-dim", "repeatable (default: 64 and 128)"),
                       ("--chunk-size", "repeatable (default: 16)"),
                       ("--heads", "number of heads, repeatable (default: 32; Triton compiles "
                                   "per number of heads)")):
        warm.add_argument(flag, type=_positive_int, action="append", help=help)
    warm.add_argument("--op", choices=sorted(OPS), action="append",
                      help="the op whose kernels to compile, repeatable (default: ttt_linear)")
    warm.add_argument("--no-backward", action="store_true", help="forward only")
    warm.add_argument("--workers", type=_positive_int, default=None,
                      help="processes compiling in parallel before this one loads their "
                           "kernels (default: one per CPU core, at most 12, on a GPU; 1 on "
                           "the CPU)")
    warm.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        try:
            status = args.func(args)
        except (CommandError, BackendError) as exc:
            message = " ".join(str(exc).split())
            print(f"{parser.prog} {args.command}: error: {message}", file=sys.stderr)
            status = 2
        sys.stdout.flush()           # a closed pipe shows here, not at the interpreter's exit
    except BrokenPipeError:
        # the reader went away (``python -m ttt info | head -2``): nothing more to say. Point
        # stdout at devnull so that the interpreter's own flush at exit stays quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status
