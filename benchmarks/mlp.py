"""TTT-MLP speed: ``ttt.chunk_ttt_mlp`` on each backend, forward without autograd (inference,
prefill), forward+backward, and a generation step (one token per sequence, state in and
out) beside TTT-Linear's step on the same backend.

    python -m benchmarks.mlp                          # B 4, T 4096, H 16, D 64, bf16, chunk 16
    python -m benchmarks.mlp --shapes 4,4096,16,64 1,16384,8,64 --backends triton reference

The ``reference`` backend is the chunked dual form of the official ``TTTMLP`` in eager
PyTorch (per chunk the same matrix products); ``reference-compiled`` is the same with its
per-chunk step under ``torch.compile``, as the official code compiles its mini-batch step.
Prints a markdown table; ``rel error`` is the forward's output error relative to the
reference backend's in float64 on the same inputs (``||o - ref|| / ||ref||``; the outputs
reach the thousands here, so a largest difference says little), ``peak MiB`` the memory a
forward+backward allocates beyond its inputs, ``x reference`` and ``x compiled`` the
forward+backward speed-up over those two providers in the same run. Needs a CUDA device
(exits 2 without).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys

import torch

import ttt
from benchmarks import _timing
from benchmarks.decode import measure

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def inputs(B: int, T: int, H: int, D: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Random inputs of ``chunk_ttt_mlp`` (k L2-normalised) with an initial state of the
    official layer's scale, float32."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(*size, generator=gen, device=device)

    F = 4 * D
    q, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    k = torch.nn.functional.normalize(k, dim=-1)
    state = (randn(B, H, D, F, scale=0.02), torch.zeros(B, H, 1, F, device=device),
             randn(B, H, F, D, scale=0.02), torch.zeros(B, H, 1, D, device=device))
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), w=1 + randn(H, D, scale=0.1),
                b=randn(H, D, scale=0.1), eta=0.1 * torch.rand(B, T, H, 1, generator=gen,
                                                               device=device),
                initial_state=state, output_final_state=True)


def timed(fn, device) -> str:
    try:
        return f"{_timing.bench(fn, device, _timing.Budget())[1]:.3f}"
    except Exception as exc:  # noqa: BLE001 - one cell failing is a cell, not the run
        torch.cuda.synchronize(device)
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"


COMPILED = "reference-compiled"
_COMPILED_CHUNK = []


@contextlib.contextmanager
def _backend(provider: str):
    """The ttt backend of a provider; for ``reference-compiled``, the reference with its chunk
    step (``ttt.reference_mlp``'s per-chunk function) under ``torch.compile`` meanwhile."""
    if provider != COMPILED:
        yield provider
        return
    import ttt.reference_mlp as reference_mlp

    original = reference_mlp._chunk
    if not _COMPILED_CHUNK:
        _COMPILED_CHUNK.append(torch.compile(original))
    reference_mlp._chunk = _COMPILED_CHUNK[0]
    try:
        yield "reference"
    finally:
        reference_mlp._chunk = original


def shape_row(provider: str, shape: tuple[int, ...], dtype, device) -> list[str]:
    x = inputs(*shape, dtype, device)
    leaves = {n: x[n].detach().requires_grad_() for n in ("q", "k", "v")}
    with torch.no_grad():
        as64 = {n: (t.double() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
        as64["initial_state"] = tuple(s.double() for s in x["initial_state"])
        ref = ttt.chunk_ttt_mlp(**as64, backend="reference")[0]
    with _backend(provider) as backend:

        def forward():
            with torch.no_grad():
                return ttt.chunk_ttt_mlp(**x, backend=backend)

        def training():
            o, final = ttt.chunk_ttt_mlp(**{**x, **leaves}, backend=backend)
            torch.autograd.grad([o, *final], list(leaves.values()),
                                [torch.ones_like(o), *(torch.zeros_like(f) for f in final)])

        error = ((forward()[0].double() - ref).norm() / ref.norm()).item()
        times = [timed(forward, device), timed(training, device)]
        peak = "-" if times[1].startswith("error") else \
            f"{_timing.peak_extra_mib(training, device):.0f}"
    return [provider, ",".join(map(str, shape)), *times, peak, f"{error:.1e}"]


def speed_ups(rows: list[list[str]]) -> list[list[str]]:
    """Each row with its forward+backward speed-up over ``reference`` and
    ``reference-compiled`` (of the same shape, when both were measured)."""
    fwd_bwd = {row[0]: row[3] for row in rows}

    def ratio(base: str, ms: str) -> str:
        try:
            return f"{float(fwd_bwd[base]) / float(ms):.1f}x"
        except (KeyError, ValueError):
            return "-"

    return [row + [ratio("reference", row[3]), ratio(COMPILED, row[3])] for row in rows]


def step_row(backend: str, B: int, H: int, D: int, dtype, device) -> list[str]:
    x = inputs(B, 1, H, D, dtype, device)
    h0 = torch.zeros(B, H, D, D, device=device)
    hb0 = torch.zeros(B, H, 1, D, device=device)

    def mlp():
        return ttt.chunk_ttt_mlp(**x, backend=backend)

    def linear():
        return ttt.chunk_ttt_linear(x["q"], x["k"], x["v"], x["w"], x["b"], x["eta"],
                                    initial_state=h0, initial_state_bias=hb0,
                                    output_final_state=True, backend=backend)

    budget = _timing.Budget()
    return [backend, f"{B},1,{H},{D}",
            *(measure(f, device, budget, g) for f in (mlp, linear) for g in (False, True))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mlp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["4,4096,16,64"])
    parser.add_argument("--steps", nargs="+", default=["4,16,64", "64,16,64"],
                        help="generation steps B,H,D")
    parser.add_argument("--backends", nargs="+", default=["triton", "reference", COMPILED],
                        help=f"ttt backends, or {COMPILED}")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.mlp: needs a CUDA device", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), DTYPES[args.dtype]
    import triton

    from benchmarks.run import _git_commit

    commit, dirty = _git_commit()
    print(f"# ttt TTT-MLP: {torch.cuda.get_device_name(device)}\n\ntorch {torch.__version__}, "
          f"triton {triton.__version__}; commit {commit}"
          f"{' (uncommitted changes)' if dirty else ''}; "
          f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; {args.dtype}, chunk 16")
    print("\n| backend | B,T,H,D | forward ms | fwd+bwd ms | peak MiB | rel error | x reference | "
          "x compiled |\n|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        rows = [shape_row(provider, tuple(int(n) for n in shape.split(",")), dtype, device)
                for provider in args.backends]
        for row in speed_ups(rows):
            print("| " + " | ".join(row) + " |", flush=True)
    print("\n| backend | B,T,H,D | MLP step us | MLP step, graph | linear step us | "
          "linear step, graph |\n|---|---|---|---|---|---|")
    for step in args.steps:
        B, H, D = (int(n) for n in step.split(","))
        for backend in args.backends:
            if backend != COMPILED:
                print("| " + " | ".join(step_row(backend, B, H, D, dtype, device)) + " |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
