"""The core's own host time per call of ``ttt.chunk_ttt_linear``, on the CPU.

    python benchmarks/core_host_time.py                       # this checkout's ttt
    python benchmarks/core_host_time.py --compare-with main   # and another revision's
    python benchmarks/core_host_time.py --cprofile 15         # where the time goes
    python benchmarks/core_host_time.py --device cuda         # with CUDA tensors (GPU)

The calls run on a null backend, registered in this process only: its forward returns
views of tensors allocated once (``saved`` empty), its backward views of gradients
allocated once, so what is timed is the core alone: validation, the backend's choice,
autocast, the custom op's dispatch and autograd, up to the backend's ``forward`` /
``backward`` and back. Per shape, dense and packed (``cu_seqlens``: the B sequences of
length T in one row; a single sequence is cut in two), six timings, in microseconds per
call (the median over ``--repeats`` runs of ``--iters`` calls, ``time.perf_counter_ns``):

- ``fwd``: one forward, inputs without ``requires_grad``;
- ``fwd grad``: one forward, inputs with ``requires_grad`` (the autograd graph recorded);
- ``fwd+bwd``: one forward and ``torch.autograd.grad`` of ``o`` for the six inputs;
- ``fwd auto``: ``fwd`` with no backend named (no ``set_backend``; with ``TTT_BACKEND``
  unset, the automatic choice, where the null backend comes after the GPU backends and
  before ``reference``);
- ``fwd eta float``: ``fwd`` with a float ``eta``;
- ``fwd step``: ``fwd`` as a generation step makes it: initial states given,
  ``output_final_state=True``, a tensor ``eta_key``, ``output="query_residual"``.

And the automatic choice alone: ``ttt.choice.select_backend`` over the backends installed
here and the null backend, for the first shape.

``--device cuda`` makes the inputs CUDA tensors (the null backend still launches nothing): the
core's host time as a GPU call pays it, where reading tensors' devices, the autocast state
and the aliasing check may cost more than on CPU tensors. The null backend then comes first
in the automatic choice (before the GPU backends, which would take the call).

``--compare-with REV`` extracts ``packages/ttt/src/ttt`` of git revision ``REV`` into a
temporary folder and runs the same measurement (same inputs, same null backend) in two
child processes, one with that revision's ttt and one with this checkout's, which take
turns case by case for ``--rounds`` rounds (a change in the machine's load hits both
sides); it prints per cell the median of all runs of each side and their ratio.
``--cprofile N`` prints cProfile's N functions of most own time per call of the
``fwd+bwd`` case on the first shape (under the profiler, whose own cost is included:
compare lines, not totals).
"""

from __future__ import annotations

import argparse
import contextvars
import cProfile
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

import ttt
from ttt import registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import own_time_table  # noqa: E402

SHAPES = ((1, 16, 2, 16), (4, 1, 16, 64), (64, 1, 16, 64))
"""A tiny call and two decode calls (one token for each of four, of 64 sequences)."""
MODES = ("fwd", "fwd grad", "fwd+bwd", "fwd auto", "fwd eta float", "fwd step")
NULL = "null"
NULL_PRIORITY = {"cpu": 999, "cuda": -1}
"""The null backend's place in the automatic choice (lower first): on CPU inputs after the GPU
backends (which decline them), before ``reference``; on CUDA inputs first."""
DEVICE = torch.device("cpu")
"""The inputs' device (``--device``)."""


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


class NullBackend(ttt.Backend):
    """Returns views of preallocated outputs and gradients: no work of its own. Written
    against the fields a revision's ``Capabilities`` / ``Gradients`` have, so that an older
    core runs it too."""

    name = NULL

    def __init__(self):
        wide = {"eta_key": True, "outputs": frozenset({"norm_residual", "query_residual", "raw"})}
        self.capabilities = ttt.Capabilities(
            devices=frozenset({"cpu", "cuda"}), dtypes=frozenset({torch.float32, torch.bfloat16}),
            **{k: v for k, v in wide.items() if k in _fields(ttt.Capabilities)})
        self._buffers: dict[tuple, dict[str, torch.Tensor]] = {}

    def _buffers_for(self, problem) -> dict[str, torch.Tensor]:
        key = (tuple(problem.q.shape), problem.N, problem.dtype)
        if key not in self._buffers:
            q, N, H, D = problem.q, problem.N, problem.H, problem.D
            self._buffers[key] = dict(
                o=torch.empty_like(q), ht=q.new_empty(N, H, D, D, dtype=torch.float32),
                hbt=q.new_empty(N, H, 1, D, dtype=torch.float32),
                dq=torch.empty_like(q), dk=torch.empty_like(q), dv=torch.empty_like(q),
                dw=torch.empty_like(problem.w), db=torch.empty_like(problem.b),
                deta=torch.empty_like(problem.eta))
        return self._buffers[key]

    def forward(self, problem, needs_backward):
        buf = self._buffers_for(problem)
        if not problem.output_final_state:
            return buf["o"].detach(), None, None, []
        return buf["o"].detach(), buf["ht"].detach(), buf["hbt"].detach(), []

    def backward(self, problem, saved, do, dht, dhbt, needs):
        buf = self._buffers_for(problem)
        names = ("dq", "dk", "dv", "dw", "db", "deta")
        return ttt.Gradients(**{n: buf[n].detach() for n in names})


def use_device(device: torch.device) -> None:
    """Make the inputs on ``device`` (``--device``; CUDA needs a GPU)."""
    global DEVICE
    if device.type not in NULL_PRIORITY:
        raise SystemExit(f"--device: expected cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    DEVICE = device


def register_null_backend() -> None:
    """Makes ``backend="null"`` / ``ttt.set_backend("null")`` resolve to a NullBackend, and
    the automatic choice take it (see NULL_PRIORITY): with ``ttt.register_backend``, or
    for a revision without it (``--compare-with``), in its registry's tables."""
    if hasattr(ttt, "register_backend"):
        ttt.register_backend(NULL, NullBackend(), priority=NULL_PRIORITY[DEVICE.type])
        return
    registry._LOADED[NULL] = NullBackend()
    registry.KNOWN_BACKENDS[NULL] = registry.KnownBackend(
        f"{__name__}:NullBackend", "registered by benchmarks/core_host_time.py",
        NULL_PRIORITY[DEVICE.type])


def _select_backend():
    """The automatic choice's function: ``ttt.choice.select_backend``, or for a revision
    without that module, ``ttt.registry``'s."""
    try:
        from ttt.choice import select_backend
    except ImportError:
        return registry.select_backend
    return select_backend


def make_case(shape, packed: bool, requires_grad: bool, step: bool = False, seed: int = 0):
    """(args, kwargs) of one call: fresh random float32 inputs (k L2-normalised); with
    ``step``, those of a generation step too (initial states, final states, ``eta_key``,
    ``output="query_residual"``)."""
    B, T, H, D = shape
    gen = torch.Generator().manual_seed(seed)
    cu_seqlens = None
    N = B
    if packed:
        lengths = [T] * B if B > 1 else [T - T // 2, T // 2]
        B, T, N = 1, B * T, len(lengths)
        cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    w, b = 1 + 0.1 * torch.randn(H, D, generator=gen), 0.1 * torch.randn(H, D, generator=gen)
    eta = 0.1 * torch.rand(B, T, H, 1, generator=gen)
    xs = [x.to(DEVICE).requires_grad_(requires_grad) for x in (q, k, v, w, b, eta)]
    kwargs = dict(cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(DEVICE))
    if step:
        kwargs.update(
            initial_state=0.1 * torch.randn(N, H, D, D, generator=gen).to(DEVICE),
            initial_state_bias=0.1 * torch.randn(N, H, 1, D, generator=gen).to(DEVICE),
            output_final_state=True, eta_key=torch.rand(B, T, H, 1, generator=gen).to(DEVICE),
            output="query_residual")
    return xs, kwargs


def one_call(mode: str, shape, packed: bool):
    """A zero-argument function making one call of ``mode``."""
    xs, kwargs = make_case(shape, packed, requires_grad=mode in ("fwd grad", "fwd+bwd"),
                           step=mode == "fwd step")
    op = ttt.chunk_ttt_linear
    if mode == "fwd eta float":
        xs[5] = 0.1
    if mode == "fwd auto":
        unset = contextvars.Context()       # no set_backend in it: TTT_BACKEND, else automatic
        return lambda: unset.run(op, *xs, **kwargs)
    if mode != "fwd+bwd":
        return lambda: op(*xs, **kwargs)
    do = torch.randn_like(xs[0])
    grad = torch.autograd.grad
    return lambda: grad(op(*xs, **kwargs)[0], xs, do)


CASES = [(shape, packed, mode) for shape in SHAPES for packed in (False, True)
         for mode in MODES]
CHOICE = len(CASES)
"""The index of one more case: the automatic choice alone (``select_backend``)."""


def _call(case: int):
    """A zero-argument function making one call of case ``case``."""
    if case == CHOICE:
        xs, kwargs = make_case(SHAPES[0], packed=False, requires_grad=False)
        problem = ttt.make_problem(*xs, **kwargs)
        select_backend = _select_backend()
        return lambda: select_backend(problem, "auto")
    shape, packed, mode = CASES[case]
    return one_call(mode, shape, packed)


def timed_runs(fn, iters: int, repeats: int) -> list[float]:
    """``repeats`` times the mean time of ``iters`` calls of ``fn`` (after a warm-up), us
    (on CUDA inputs, what a call queued is finished between runs, outside the timing)."""
    for _ in range(max(iters // 10, 10)):
        fn()
    runs = []
    for _ in range(repeats):
        _synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter_ns() - t0) / iters / 1e3)
    _synchronize()
    return runs


def _synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _rows(samples: list[list[float]]) -> list[dict]:
    """One row per shape and layout: {"shape", "layout", mode: median us per call}, from
    the runs of each of CASES."""
    rows: dict[tuple, dict] = {}
    for (shape, packed, mode), runs in zip(CASES, samples):
        row = rows.setdefault((shape, packed), {"shape": ",".join(map(str, shape)),
                                                "layout": "packed" if packed else "dense"})
        row[mode] = statistics.median(runs)
    return list(rows.values())


def measure(iters: int, repeats: int) -> tuple[list[dict], float]:
    """(rows, us of the automatic choice): every case in this process, ``repeats`` runs of
    ``iters`` calls each."""
    torch.set_num_threads(1)
    register_null_backend()
    with ttt.set_backend(NULL):
        samples = [timed_runs(_call(case), iters, repeats) for case in range(CHOICE + 1)]
    return _rows(samples[:CHOICE]), statistics.median(samples[CHOICE])


def serve(iters: int, repeats: int) -> None:
    """Child process: for each case index read from stdin, print its runs as JSON."""
    torch.set_num_threads(1)
    register_null_backend()
    calls = {}
    with ttt.set_backend(NULL):
        for line in sys.stdin:
            case = int(line)
            if case not in calls:
                calls[case] = _call(case)
            print(json.dumps(timed_runs(calls[case], iters, repeats)), flush=True)


def profile(top: int, iters: int) -> str:
    """cProfile's ``top`` functions by own time, per fwd+bwd call on the first shape."""
    register_null_backend()
    with ttt.set_backend(NULL):
        fn = one_call("fwd+bwd", SHAPES[0], packed=False)
        fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            fn()
        prof.disable()
    return own_time_table(prof, iters, top, 1e6, "us")


def extract_sources(rev: str, into: str, sources) -> list[str]:
    """The source folders ``sources`` (e.g. ``packages/ttt/src``) of git revision ``rev``,
    extracted under ``into``; their paths there."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, *sources], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return [str(Path(into) / src) for src in sources]


FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "2000000000", "MALLOC_TRIM_THRESHOLD_": "2000000000"}
"""The measuring children's glibc malloc settings: large CPU buffers (a backward's, some MB)
stay on the heap, as freed blocks to reuse. With glibc's dynamic thresholds, whether they are
mapped and unmapped (page faults) on every call depends on what the process freed before, so
two sides running the same launcher code measured up to 1.4x apart."""


def child_process(script: str, paths: list[str], iters: int, repeats: int,
                  extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """``script --serve`` (and the options ``extra``): a measuring child process, with the
    source folders ``paths`` first on its path (none: what is installed), and glibc's malloc
    thresholds fixed (:data:`FIXED_MALLOC`)."""
    env = {**os.environ, **FIXED_MALLOC}
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, script, "--serve", "--iters", str(iters),
                             "--repeats", str(repeats), *extra], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def ask(child: subprocess.Popen, case: int) -> list[float]:
    child.stdin.write(f"{case}\n")
    child.stdin.flush()
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the measuring child process ended (exit {child.wait()})")
    return json.loads(line)


def compare(rev: str, iters: int, repeats: int, rounds: int) -> list[tuple[list[dict], float]]:
    """[(rows, automatic choice us) of revision ``rev``, of this checkout], measured by two
    child processes
    that take turns case by case, ``rounds`` times (a change in the machine's load hits
    both sides); per cell the median of all runs of a side."""
    with tempfile.TemporaryDirectory() as tmp:
        extra = ("--device", str(DEVICE))
        children = [child_process(__file__, extract_sources(rev, tmp, ["packages/ttt/src"]),
                                  iters, repeats, extra),
                    child_process(__file__, [], iters, repeats, extra)]
        samples = [[[] for _ in range(CHOICE + 1)] for _ in children]
        try:
            for r in range(rounds):
                for case in range(CHOICE + 1):
                    for side in (0, 1) if r % 2 == 0 else (1, 0):
                        samples[side][case] += ask(children[side], case)
        finally:
            for child in children:
                child.stdin.close()
                child.wait()
    return [(_rows(side[:CHOICE]), statistics.median(side[CHOICE])) for side in samples]


def us_cell(after: float, before: float | None = None) -> str:
    """A table cell: ``after`` us, or ``before -> after (ratio)``."""
    if before is None:
        return f"{after:.1f}"
    return f"{before:.1f} -> {after:.1f} ({after / before:.2f}x)"


def add_measure_arguments(parser: argparse.ArgumentParser, iters: int, repeats: int,
                          measured: str) -> None:
    """The timing and comparison options shared by the CPU host-time scripts (``measured``:
    what ``--compare-with`` measures of the other revision)."""
    parser.add_argument("--iters", type=int, default=iters, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="timed runs; the median counts")
    parser.add_argument("--compare-with", metavar="REV",
                        help=f"also measure {measured} of git revision REV")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --compare-with: turns of the two sides per case")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)


def table(rows: list[dict], before: list[dict] | None = None) -> str:
    head = "| B,T,H,D | layout | " + " | ".join(f"{m} us" for m in MODES) + " |"
    lines = [head, "|---|---|" + "---|" * len(MODES)]
    for i, row in enumerate(rows):
        cells = []
        for mode in MODES:
            cells.append(us_cell(row[mode], None if before is None else before[i][mode]))
        lines.append(f"| {row['shape']} | {row['layout']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_measure_arguments(parser, 2000, 7, "the ttt package")
    parser.add_argument("--device", type=torch.device, default=torch.device("cpu"),
                        help="the inputs' device: cpu (default) or cuda")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="print cProfile's N functions of most own time per fwd+bwd")
    args = parser.parse_args()
    use_device(args.device)
    if args.serve:
        serve(args.iters, args.repeats)
        return
    print(f"torch {torch.__version__}, ttt from {Path(ttt.__file__).parent}, one CPU thread, "
          f"{DEVICE} inputs")
    if args.compare_with:
        (before, choice_before), (rows, choice) = compare(
            args.compare_with, args.iters, args.repeats, args.rounds)
    else:
        before, (rows, choice) = None, measure(args.iters, args.repeats)
    if before is not None:
        print(f"\n{args.compare_with} -> this checkout, us per call (ratio):")
    print(table(rows, before))
    choice_text = f"{choice:.1f}" if before is None else \
        f"{choice_before:.1f} -> {choice:.1f} ({choice / choice_before:.2f}x)"
    print(f"\nautomatic choice alone (select_backend over the backends installed here, "
          f"{','.join(map(str, SHAPES[0]))} dense): {choice_text} us")
    if args.cprofile:
        print(f"\ncProfile, fwd+bwd {','.join(map(str, SHAPES[0]))} dense, per call:")
        print(profile(args.cprofile, max(args.iters // 4, 1)), end="")


if __name__ == "__main__":
    main()
