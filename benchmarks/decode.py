"""Per-call time of one generation (decode) step: T = 1 per sequence with carried state.

    python -m benchmarks.decode                     # B 4 and 64, H 16, D 64, bf16 and fp32
    python -m benchmarks.decode --backends triton --batches 4 --dtypes bf16
    python -m benchmarks.decode --device cpu --quick    # no GPU: the reference backend, tiny

Per installed ttt GPU backend, batch size and dtype: one ``ttt.chunk_ttt_linear`` call on
``[B, 1, H, D]`` inputs with ``initial_state``/``initial_state_bias`` (float32, as a
generation cache carries them) and ``output_final_state=True``, in two forms: the layer's
(``eta_key`` and ``output="query_residual"``, as ``ttt.nn.TTTLinear`` calls it) and the
op's default (``norm_residual``, no ``eta_key``); ``eta`` a tensor. Each is timed eager
(the whole call: validation, the backend's launcher, the kernels) and replayed in a CUDA
graph captured around the same call (the kernels and one graph launch, the host's work
gone). Beside them, FLA's ``fused_chunk`` and ``chunk`` TTT-linear ops on the same
default-form call (FLA has no ``eta_key`` or other output forms) when ``fla`` is installed.

Times are medians of back-to-back calls, as a generation loop makes them
(``_timing.back_to_back``: batches of calls from an idle GPU to the end of the last one's
work, the host's work and the GPU's overlapping), in microseconds per call, under a header
with the GPU, the driver and the versions. Nothing is written to files. A cell that cannot
run says why (``unsupported: ...``, ``error: ...``); the script
exits 1 when no measurement succeeded, else 0.

``--device cpu --quick``: the reference backend on a tiny shape (B 2, H 2, D 16, fp32) with
a wall clock, eager only: it checks the script without a GPU; the times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import platform
import sys
from dataclasses import dataclass

import torch

import ttt
from benchmarks import _timing
from benchmarks._providers import FLA_INSTALL_HINT, FLA_VARIANTS, SLOW_BACKENDS, fla_version
from benchmarks._report import engine_versions

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMS = {
    "layer": dict(eta_key=True, output="query_residual"),
    "default": dict(eta_key=False, output="norm_residual"),
}
"""The forms of a step: the layer's (``ttt.nn.TTTLinear``) and the op's default."""
CHUNK = 16


@dataclass
class Step:
    """One decode step's inputs: ``[B, 1, H, D]`` q, k, v, eta (and eta_key), carried
    float32 states."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor
    eta: torch.Tensor
    eta_key: torch.Tensor
    h0: torch.Tensor
    hb0: torch.Tensor


def make_step(B: int, H: int, D: int, dtype: torch.dtype, device: torch.device,
              seed: int = 0, rows: int = 1) -> Step:
    """Fresh random inputs (seeded), k L2-normalised over D, states 0.1 randn; ``rows``
    tokens per sequence."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*size, generator=gen, device=device, dtype=torch.float32)

    def rand(*size: int, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        return offset + scale * torch.rand(*size, generator=gen, device=device,
                                           dtype=torch.float32)

    q, k, v = randn(B, rows, H, D), randn(B, rows, H, D), randn(B, rows, H, D)
    k = torch.nn.functional.normalize(k, p=2, dim=-1)
    inputs = [q, k, v, 1.0 + randn(H, D, scale=0.1), randn(H, D, scale=0.1),
              rand(B, rows, H, 1, scale=0.1), rand(B, rows, H, 1, offset=0.5)]
    return Step(*(x.to(dtype).contiguous() for x in inputs),
                h0=randn(B, H, D, D, scale=0.1), hb0=randn(B, H, 1, D, scale=0.1))


def ttt_call(backend: str, s: Step, form: str):
    """``fn()``: one decode step on ttt backend ``backend`` in form ``form``."""
    options = FORMS[form]
    eta_key = s.eta_key if options["eta_key"] else None

    def fn():
        return ttt.chunk_ttt_linear(
            s.q, s.k, s.v, s.w, s.b, s.eta, chunk_size=CHUNK, initial_state=s.h0,
            initial_state_bias=s.hb0, output_final_state=True, eta_key=eta_key,
            output=options["output"], backend=backend)
    return fn


def ttt_support(backend: str, s: Step, form: str) -> str | None:
    """Why ``backend`` cannot take this step (None: it can)."""
    options = FORMS[form]
    problem = ttt.make_problem(
        s.q, s.k, s.v, s.w, s.b, s.eta, chunk_size=CHUNK, initial_state=s.h0,
        initial_state_bias=s.hb0, output_final_state=True,
        eta_key=s.eta_key if options["eta_key"] else None, output=options["output"])
    reasons = ttt.load_backend(backend).not_supported_reasons(problem)
    return "; ".join(reasons) if reasons else None


def fla_calls() -> tuple[dict, str | None]:
    """{variant name: op} of FLA's TTT-linear ops, or ({}, why FLA is absent)."""
    try:
        module = importlib.import_module("fla.ops.ttt")
    except Exception as exc:  # noqa: BLE001 - absent or broken: both are a header line
        return {}, f"{type(exc).__name__}: {exc} (install with: {FLA_INSTALL_HINT})"
    found = {name: getattr(module, attribute) for name, attribute in FLA_VARIANTS.items()
             if getattr(module, attribute, None) is not None}
    if not found:
        return {}, f"fla.ops.ttt has none of {sorted(FLA_VARIANTS.values())}"
    return found, None


def fla_call(op, s: Step):
    """``fn()``: the default-form step through FLA's ``op`` (same tensors)."""
    def fn():
        return op(s.q, s.k, s.v, s.w, s.b, s.eta, chunk_size=CHUNK, initial_state=s.h0,
                  initial_state_bias=s.hb0, output_final_state=True)
    return fn


def graph_replay(fn, device: torch.device):
    """``replay()`` of a CUDA graph captured around one call of ``fn`` (warmed up first on
    a side stream, as torch's docs do)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize(device)
    return graph.replay


def measure(fn, device: torch.device, budget: _timing.Budget, graph: bool) -> str:
    """Median us per call of ``fn`` (eager, or its CUDA graph's replay), or why not."""
    try:
        with torch.no_grad():
            run = graph_replay(fn, device) if graph else fn
            p50 = _timing.back_to_back(run, device, budget)[1]
    except Exception as exc:  # noqa: BLE001 - one cell failing is a cell, not the run
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return f"{1e3 * p50:.1f}"


def gpu_backends(requested: list[str] | None, device: torch.device) -> tuple[list, dict]:
    """(names of the ttt backends to time, {name: why not}): every available one that
    runs on ``device`` (but the slow reference, unless named)."""
    statuses = ttt.available_backends()
    names = requested or [n for n in statuses if n not in SLOW_BACKENDS]
    chosen, skipped = [], {}
    for name in names:
        status = statuses.get(name)
        if status is None:
            skipped[name] = f"unknown backend (known: {sorted(statuses)})"
        elif not status.available:
            skipped[name] = status.reason or "unavailable"
        elif device.type not in ttt.load_backend(name).capabilities.devices:
            skipped[name] = f"does not run on {device.type}"
        else:
            chosen.append(name)
    return chosen, skipped


def header(device: torch.device, backends: list[str], fla_absent: str | None) -> str:
    from benchmarks.run import _driver_version, _git_commit

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        driver = _driver_version()
        gpu += f", driver {driver}" if driver else ""
    else:
        gpu = f"CPU ({platform.processor() or platform.machine()}): a smoke run, not a result"
    statuses = ttt.available_backends()
    engines = engine_versions({name: statuses[name] for name in backends})
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    commit, dirty = _git_commit()
    fla = f"fla-core {fla_version()}" if fla_absent is None else f"fla: {fla_absent}"
    return "\n".join([
        f"# ttt decode step: {gpu}",
        "",
        f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}), triton "
        f"{triton_version}, ttt {ttt.__version__}, python {platform.python_version()}; "
        f"{engines or 'no ttt backend'}; {fla}; commit {commit}"
        f"{' (uncommitted changes)' if dirty else ''}",
        f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; T = 1 per sequence, "
        f"chunk {CHUNK}, carried float32 states, final states returned; us per call "
        "(median of back-to-back calls); graph: the same call replayed in a CUDA graph",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=None,
                        help="ttt backends (default: every installed GPU backend)")
    parser.add_argument("--batches", nargs="+", type=int, default=[4, 64])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true",
                        help="10 ms warm-up, 30 ms timing; with --device cpu: the reference "
                        "backend on a tiny shape")
    parser.add_argument("--no-fla", action="store_true", help="leave FLA out")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    budget = _timing.Budget(10.0, 30.0, 5) if args.quick else _timing.Budget()
    if device.type == "cpu":
        if not args.quick:
            parser.error("--device cpu is a smoke run: add --quick")
        backends = args.backends or ["reference"]
        batches, H, D, dtypes = [2], 2, 16, ["fp32"]
    else:
        if not torch.cuda.is_available():
            print("decode.py: no CUDA device (use --device cpu --quick for a smoke run)",
                  file=sys.stderr)
            return 2
        backends, batches, H, D, dtypes = (args.backends, args.batches, args.heads,
                                           args.head_dim, args.dtypes)
    backends, skipped = gpu_backends(backends, device)
    fla, fla_absent = ({}, "not requested (--no-fla)") if args.no_fla else fla_calls()
    if device.type != "cuda" and fla:
        fla, fla_absent = {}, "runs on CUDA only"
    print(header(device, backends, fla_absent))
    for name, why in skipped.items():
        print(f"- ttt.{name} not timed: {why}")
    print()
    graphs = device.type == "cuda"
    print("| provider | form | dtype | B, H, D | eager us | graph us |")
    print("|---|---|---|---|---|---|")
    measured = 0
    for dtype_name in dtypes:
        for B in batches:
            step = make_step(B, H, D, DTYPES[dtype_name], device)
            rows = []
            for backend in backends:
                for form in FORMS:
                    why = ttt_support(backend, step, form)
                    fn = ttt_call(backend, step, form)
                    rows.append((f"ttt.{backend}", form, why, fn))
            for name, op in fla.items():
                rows.append((name, "default", None, fla_call(op, step)))
            for provider, form, why, fn in rows:
                if why is not None:
                    eager = graph = f"unsupported: {why}"
                else:
                    eager = measure(fn, device, budget, graph=False)
                    graph = measure(fn, device, budget, graph=True) if graphs else "-"
                measured += sum(not c.startswith(("error", "unsupported", "-"))
                                for c in (eager, graph))
                print(f"| {provider} | {form} | {dtype_name} | {B}, {H}, {D} | {eager} | "
                      f"{graph} |", flush=True)
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
