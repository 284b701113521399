"""Where the host time of a ``ttt.chunk_ttt_linear`` call goes: the whole call on a GPU, the
core alone and each GPU backend's launcher alone (both on the CPU).

    python -m tools.host_time gpu [--backends cupy triton] [--shapes 8,2048,12,64 ...]
    python -m tools.host_time core                        # this checkout's core, CPU
    python -m tools.host_time core --compare-with main    # and another revision's
    python -m tools.host_time core --cprofile 15          # where the time goes
    python -m tools.host_time core --device cuda          # with CUDA tensors (GPU)
    python -m tools.host_time launchers --compare-with main

``gpu``: how long one call keeps the host busy, next to the GPU time of the same calls. Per
backend (default: every installed GPU backend) and shape (default: the anchor shapes): the
Python side of one forward and of one backward (the time until the call returns, without
synchronising; ``benchmarks.run.host_times``), and the wall time per fwd+bwd of the same
calls between two CUDA events. Where the host time is near the wall time, the host's launch
work, not the GPU, sets the pace (e.g. the cupy backend's forward at 8,2048,12,64).
Environment variables of the backends (``TTT_CUPY_MMA``, ...) apply. With ``--api``, also
the CUDA runtime and driver calls one forward makes (torch.profiler's host-side events named
``cuda*`` / ``cu*``: launches, allocations, events, stream waits), the count behind its host
time. With ``--cprofile N``, also cProfile's N functions of most own time in one forward
(the profiler's own cost included: compare lines, not totals). The bench session's
``host_time.md`` is this table.

``core``: the core's own host time per call, on the CPU. The calls run on a null backend,
registered in the measuring process only: its forward returns views of tensors allocated
once (``saved`` empty), its backward views of gradients allocated once, so what is timed is
the core alone: validation, the backend's choice, autocast, the custom op's dispatch and
autograd, up to the backend's ``forward`` / ``backward`` and back. Per shape, dense and
packed (``cu_seqlens``: the B sequences of length T in one row; a single sequence is cut in
two), six timings:

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
here and the null backend, for the first shape. ``--device cuda`` makes the inputs CUDA
tensors (the null backend still launches nothing): the core's host time as a GPU call pays
it, where reading tensors' devices, the autocast state and the aliasing check may cost more
than on CPU tensors. The null backend then comes first in the automatic choice (before the
GPU backends, which would take the call). ``--cprofile N`` prints cProfile's N functions of
most own time per call of the ``fwd+bwd`` case on the first shape (in this process, with the
``ttt`` installed here).

``launchers``: what a launcher does on the host between the core's call and its kernels (the
schedule, the buffers, the casts and each launch's arguments), on the CPU, with nothing
launched: the cupy launcher runs through its device seam with a stand-in whose kernels are
their names and whose ``launch`` returns at once (no cupy needed), the Triton launcher with
its launch step (``launches.run``) and compiling ahead replaced by no-ops. CPU tensors,
bfloat16 inputs (q, k, v, w, b, eta, as ``benchmarks/decode.py`` passes them). Per backend
and shape:

- ``decode``: a forward without backward, with initial and final states (a generation step
  at 4,1,16,64; ``triton mlp``: TTT-MLP's, hidden width 4 D);
- ``fwd``: a forward that saves for the backward;
- ``bwd``: the backward of that forward, every gradient.

On a GPU the same code also pays for CUDA allocations, casts and launches (``gpu``); this
measures the part a change to a launcher's Python moves, on any machine.

``core`` and ``launchers`` measure in a child process with this checkout's sources first on
its path (``core``: ``packages/ttt/src``; ``launchers``: the three packages'), in
microseconds per call (the median over ``--repeats`` runs of ``--iters`` calls,
``time.perf_counter_ns``, and over ``--rounds`` rounds). ``--compare-with REV`` extracts the
same sources of git revision ``REV`` into a temporary folder and measures them in a second
child; the two take turns case by case for ``--rounds`` rounds (a change in the machine's
load hits both sides), and each cell shows both medians and their ratio. The children run
with glibc's malloc thresholds fixed (:data:`FIXED_MALLOC`), so that the backward's MB
buffers do not measure the heap's history.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import cProfile
import dataclasses
import datetime as dt
import io
import json
import os
import platform
import pstats
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

import ttt
from benchmarks._ab_child import PACKAGES
from benchmarks._report import engine_versions
from benchmarks.decode import gpu_backends
from benchmarks.run import SHAPES, host_times, make_inputs, parse_shape
from ttt import registry

REPO = Path(__file__).resolve().parents[1]
MODULE = "tools.host_time"


def own_time_table(prof: cProfile.Profile, iters: int, top: int, scale: float,
                   unit: str) -> str:
    """The ``top`` functions of most own time in ``prof`` (``iters`` calls profiled), one line
    each, per call, in seconds times ``scale`` (1e6: ``unit`` "us", 1e3: "ms")."""
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # (own time)
    out = io.StringIO()
    for (path, line, name), (_, calls, own, cum, _) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        out.write(f"  {scale * own / iters:7.4g} {unit} own, {scale * cum / iters:7.4g} "
                  f"cumulative, {calls / iters:5.1f} calls  {name} ({where})\n")
    return out.getvalue()


# ----------------------------------------------------------------------------- gpu


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
    """:func:`api_calls` of one forward (inputs that need grad, as in ``host_times``)."""
    device = torch.device("cuda")
    xs = [x.detach().requires_grad_() for x in make_inputs(shape, torch.bfloat16, device, 0)]
    with ttt.set_backend(backend):
        ttt.chunk_ttt_linear(*xs)   # (compiled and warm)
        return api_calls(lambda: ttt.chunk_ttt_linear(*xs), iters)


def forward_cprofile(backend: str, shape, iters: int, top: int) -> str:
    """cProfile's ``top`` functions by own time over ``iters`` forwards, per forward (ms)."""
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


def gpu_header(backends: list[str]) -> str:
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


def gpu_main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    backends = args.backends or gpu_backends(None, torch.device("cuda"))[0]
    shapes = args.shapes or SHAPES
    print(gpu_header(backends))
    print()
    print("| backend | B, T, H, D | host fwd ms | host bwd ms | wall fwd+bwd ms |")
    print("|---|---|---|---|---|")
    for backend in backends:
        for shape in shapes:
            fwd, bwd, wall = host_times(backend, shape, args.iters, args.warmup)
            print(f"| {backend} | {', '.join(map(str, shape))} | {fwd:.3f} | {bwd:.3f} "
                  f"| {wall:.3f} |")
    if args.api:
        print("\nCUDA runtime / driver calls per forward:")
        for backend in backends:
            for shape in shapes:
                calls = forward_api_calls(backend, shape, args.iters)
                listed = ", ".join(f"{name} {n:g}" for name, n in calls.most_common())
                print(f"- {backend} {','.join(map(str, shape))}: {sum(calls.values()):g} "
                      f"({listed})")
    if args.cprofile:
        for backend in backends:
            for shape in shapes:
                print(f"\ncProfile, {backend} {','.join(map(str, shape))}, per forward "
                      f"(under the profiler):")
                print(forward_cprofile(backend, shape, args.iters, args.cprofile), end="")


# ----------------------------------------------------------------------------- core


CORE_SHAPES = ((1, 16, 2, 16), (4, 1, 16, 64), (64, 1, 16, 64))
"""A tiny call and two decode calls (one token for each of four, of 64 sequences)."""
MODES = ("fwd", "fwd grad", "fwd+bwd", "fwd auto", "fwd eta float", "fwd step")
NULL = "null"
NULL_PRIORITY = {"cpu": 999, "cuda": -1}
"""The null backend's place in the automatic choice (lower first): on CPU inputs after the GPU
backends (which decline them), before ``reference``; on CUDA inputs first."""
DEVICE = torch.device("cpu")
"""The core's inputs' device (``core --device``)."""


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
    """Make the core's inputs on ``device`` (``--device``; CUDA needs a GPU)."""
    global DEVICE
    if device.type not in NULL_PRIORITY:
        raise SystemExit(f"--device: expected cpu or cuda, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    DEVICE = device


@contextlib.contextmanager
def null_backend():
    """Within: ``backend="null"`` / ``ttt.set_backend("null")`` resolve to a NullBackend, the
    automatic choice takes it (see NULL_PRIORITY), and it is the backend set: with
    ``ttt.register_backend``, or for a revision without it (``--compare-with``), in its
    registry's tables."""
    if hasattr(ttt, "register_backend"):
        with ttt.register_backend(NULL, NullBackend(), priority=NULL_PRIORITY[DEVICE.type]):
            with ttt.set_backend(NULL):
                yield
        return
    registry._LOADED[NULL] = NullBackend()
    registry.KNOWN_BACKENDS[NULL] = registry.KnownBackend(
        f"{__name__}:NullBackend", "registered by tools/host_time.py core",
        NULL_PRIORITY[DEVICE.type])
    with ttt.set_backend(NULL):
        yield


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


CORE_CASES = [(shape, packed, mode) for shape in CORE_SHAPES for packed in (False, True)
              for mode in MODES]
CHOICE = len(CORE_CASES)
"""The index of one more case: the automatic choice alone (``select_backend``)."""


def _select_backend():
    """The automatic choice's function: ``ttt.choice.select_backend``, or for a revision
    without that module, ``ttt.registry``'s."""
    try:
        from ttt.choice import select_backend
    except ImportError:
        return registry.select_backend
    return select_backend


def core_call(case: int):
    """A zero-argument function making one call of core case ``case``."""
    if case == CHOICE:
        xs, kwargs = make_case(CORE_SHAPES[0], packed=False, requires_grad=False)
        problem = ttt.make_problem(*xs, **kwargs)
        select_backend = _select_backend()
        return lambda: select_backend(problem, "auto")
    shape, packed, mode = CORE_CASES[case]
    return one_call(mode, shape, packed)


def core_profile(top: int, iters: int) -> str:
    """cProfile's ``top`` functions by own time, per fwd+bwd call on the first shape."""
    with null_backend():
        fn = one_call("fwd+bwd", CORE_SHAPES[0], packed=False)
        fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(iters):
            fn()
        prof.disable()
    return own_time_table(prof, iters, top, 1e6, "us")


def core_table(after: list[float], before: list[float] | None = None) -> str:
    head = "| B,T,H,D | layout | " + " | ".join(f"{m} us" for m in MODES) + " |"
    lines = [head, "|---|---|" + "---|" * len(MODES)]
    for shape in CORE_SHAPES:
        for packed in (False, True):
            cells = []
            for mode in MODES:
                i = CORE_CASES.index((shape, packed, mode))
                cells.append(us_cell(after[i], None if before is None else before[i]))
            lines.append(f"| {','.join(map(str, shape))} | {'packed' if packed else 'dense'} "
                         "| " + " | ".join(cells) + " |")
    shape = ",".join(map(str, CORE_SHAPES[0]))
    choice = us_cell(after[CHOICE], None if before is None else before[CHOICE])
    lines.append(f"\nautomatic choice alone (select_backend over the backends installed here, "
                 f"{shape} dense): {choice} us")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- launchers


LAUNCHER_SHAPES = ((4, 1, 16, 64), (2, 1024, 8, 64))
CALLS = ("decode", "fwd", "bwd")
BACKENDS = ("cupy", "triton", "triton mlp")
LAUNCHER_CASES = [(backend, shape, call) for backend in BACKENDS for shape in LAUNCHER_SHAPES
                  for call in CALLS if (call != "decode" or shape[1] == 1)
                  and (backend != "triton mlp" or call != "bwd")]


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
        # the device's own launch arguments of tensors, where the revision's launcher asks
        # the device for them (``pointer``; ``pointers``: one call for many)
        for name in ("pointer", "pointers"):
            if hasattr(CudaDevice, name):
                setattr(self, name, getattr(CudaDevice, name))
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


def _mlp_problem(shape, decode: bool):
    """A TTT-MLP call's problem (hidden width 4 D): a generation step with a state, or a
    forward for a backward (q requires grad)."""
    p = _problem(shape, decode=False)
    B, _, H, D = shape
    state = tuple(torch.zeros(size)
                  for size in ttt.problem.state_shapes(B, H, D, ttt.mlp.HIDDEN_FACTOR * D))
    q = p.q if decode else p.q.detach().requires_grad_()
    return ttt.mlp.make_mlp_problem(q, p.k, p.v, p.w, p.b, p.eta, initial_state=state,
                                    output_final_state=True)


def _launchers(backend: str):
    """(forward, backward) of ``backend``'s launcher, launching nothing (``triton mlp``:
    the TTT-MLP forward; no backward)."""
    if backend == "triton mlp":
        from ttt_triton.ops.ttt_mlp import launcher as mlp_launcher

        mlp_launcher.run_launch = lambda launch: None
        return (lambda p, save: mlp_launcher.ttt_mlp_fwd(p)), None
    if backend == "cupy":
        from ttt_cupy import launcher

        device = NoLaunchDevice()
        return (lambda p, save: launcher.ttt_linear_fwd(p, save, device=device),
                lambda p, saved, do: launcher.ttt_linear_bwd(p, saved, do, None, None,
                                                             device=device))
    from ttt_triton.ops.ttt_linear import launcher

    launcher.launches_run = lambda *args, **kwargs: None
    launcher.launches_prefetch = lambda *args, **kwargs: None   # (compiles, once per key)
    return (lambda p, save: launcher.ttt_linear_fwd(p, save),
            lambda p, saved, do: launcher.ttt_linear_bwd(p, saved, do, None, None))


def launcher_call(case: int):
    """A zero-argument function making one call of launcher case ``case``."""
    backend, shape, call = LAUNCHER_CASES[case]
    forward, backward = _launchers(backend)
    make = _mlp_problem if backend == "triton mlp" else _problem
    p = make(shape, decode=call == "decode")
    if call == "decode":
        return lambda: forward(p, False)
    if call == "fwd":
        return lambda: forward(p, True)
    saved = forward(p, True)[3]
    do = torch.randn(p.q.shape).to(p.q.dtype)
    return lambda: backward(p, saved, do)


def launchers_table(after: list[float], before: list[float] | None = None) -> str:
    lines = ["| backend | B,T,H,D | " + " | ".join(f"{c} us" for c in CALLS) + " |",
             "|---|---|" + "---|" * len(CALLS)]
    for backend in BACKENDS:
        for shape in LAUNCHER_SHAPES:
            cells = []
            for call in CALLS:
                key = (backend, shape, call)
                if key not in LAUNCHER_CASES:
                    cells.append("-")
                    continue
                i = LAUNCHER_CASES.index(key)
                cells.append(us_cell(after[i], None if before is None else before[i]))
            lines.append(f"| {backend} | {','.join(map(str, shape))} | " + " | ".join(cells)
                         + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CPU parts' children


@dataclasses.dataclass(frozen=True)
class Part:
    """A CPU measurement: its cases, how a child makes one, in what setting, its table, and
    the source folders a revision lends it."""

    cases: int
    call: Callable[[int], Callable[[], object]]     # a case's index -> one call of it
    setting: Callable[[], AbstractContextManager]   # the context the calls run in
    table: Callable[[list[float], list[float] | None], str]   # (after, before) -> markdown
    sources: tuple[str, ...]


PARTS = {
    "core": Part(CHOICE + 1, core_call, null_backend, core_table, (PACKAGES["ttt"],)),
    "launchers": Part(len(LAUNCHER_CASES), launcher_call, contextlib.nullcontext,
                      launchers_table, tuple(PACKAGES.values())),
}


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


def serve(part: Part, iters: int, repeats: int) -> None:
    """Child process: for each case index read from stdin, print its runs as JSON."""
    torch.set_num_threads(1)
    calls = {}
    with part.setting():
        for line in sys.stdin:
            case = int(line)
            if case not in calls:
                calls[case] = part.call(case)
            print(json.dumps(timed_runs(calls[case], iters, repeats)), flush=True)


def extract_sources(rev: str, into: str, sources) -> list[str]:
    """The source folders ``sources`` (e.g. ``packages/ttt/src``) of git revision ``rev``,
    extracted under ``into``; their paths there."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *sources], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return [str(Path(into) / src) for src in sources]


FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "2000000000", "MALLOC_TRIM_THRESHOLD_": "2000000000"}
"""The measuring children's glibc malloc settings: large CPU buffers (a backward's, some MB)
stay on the heap, as freed blocks to reuse. With glibc's dynamic thresholds, whether they are
mapped and unmapped (page faults) on every call depends on what the process freed before, so
two sides running the same launcher code measured up to 1.4x apart."""


def child_process(argv: list[str], paths: list[str]) -> subprocess.Popen:
    """``python -m tools.host_time ARGV --serve`` in the repository root: a measuring child
    process, with the source folders ``paths`` first on its path, and glibc's malloc
    thresholds fixed (:data:`FIXED_MALLOC`)."""
    env = {**os.environ, **FIXED_MALLOC}
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen([sys.executable, "-m", MODULE, *argv, "--serve"], env=env,
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=REPO)


def ask(child: subprocess.Popen, case: int) -> list[float]:
    child.stdin.write(f"{case}\n")
    child.stdin.flush()
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the measuring child process ended (exit {child.wait()})")
    return json.loads(line)


def measure(part: Part, argv: list[str], rev: str | None, rounds: int) -> list[list[float]]:
    """Per side (git revision ``rev``'s sources when given, then this checkout's), the
    median us of every case of ``part``: one child process a side (``argv``: its
    subcommand and options), taking turns case by case, ``rounds`` times."""
    with tempfile.TemporaryDirectory() as tmp:
        sides = [[str(REPO / src) for src in part.sources]]
        if rev:
            sides.insert(0, extract_sources(rev, tmp, part.sources))
        children = [child_process(argv, paths) for paths in sides]
        samples = [[[] for _ in range(part.cases)] for _ in children]
        try:
            for r in range(rounds):
                order = list(range(len(children)))[::1 if r % 2 == 0 else -1]
                for case in range(part.cases):
                    for side in order:
                        samples[side][case] += ask(children[side], case)
        finally:
            for child in children:
                child.stdin.close()
                child.wait()
    return [[statistics.median(runs) for runs in side] for side in samples]


def us_cell(after: float, before: float | None = None) -> str:
    """A table cell: ``after`` us, or ``before -> after (ratio)``."""
    if before is None:
        return f"{after:.1f}"
    return f"{before:.1f} -> {after:.1f} ({after / before:.2f}x)"


def cpu_main(name: str, args: argparse.Namespace) -> None:
    part = PARTS[name]
    if name == "core":
        use_device(args.device)
    if args.serve:
        serve(part, args.iters, args.repeats)
        return
    argv = [name, "--iters", str(args.iters), "--repeats", str(args.repeats)]
    if name == "core":
        argv += ["--device", str(DEVICE)]
        inputs = f"{DEVICE} inputs"
    else:
        inputs = "launches stubbed out"
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, this checkout's "
          f"{', '.join(part.sources)}, one CPU thread, {inputs}")
    rounds = args.rounds or (3 if args.compare_with else 1)
    if not args.compare_with:
        (after,) = measure(part, argv, None, rounds)
        print(part.table(after))
    else:
        before, after = measure(part, argv, args.compare_with, rounds)
        print(f"\n{args.compare_with} -> this checkout, us per call (ratio):")
        print(part.table(after, before))
    if name == "core" and args.cprofile:
        shape = ",".join(map(str, CORE_SHAPES[0]))
        print(f"\ncProfile, fwd+bwd {shape} dense, per call (ttt from "
              f"{Path(ttt.__file__).parent}):")
        print(core_profile(args.cprofile, max(args.iters // 4, 1)), end="")


# ----------------------------------------------------------------------------- main


def _measure_arguments(parser: argparse.ArgumentParser, iters: int, repeats: int,
                       measured: str) -> None:
    """The timing and comparison options of the CPU parts (``measured``: what
    ``--compare-with`` measures of the other revision)."""
    parser.add_argument("--iters", type=int, default=iters, help="calls per timed run")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="timed runs; the median counts")
    parser.add_argument("--compare-with", metavar="REV",
                        help=f"also measure {measured} of git revision REV")
    parser.add_argument("--rounds", type=int, default=None,
                        help="turns of the sides per case (default 3 with --compare-with, "
                             "else 1)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    gpu = parts.add_parser("gpu", help="host and wall time of real calls on a GPU")
    gpu.add_argument("--backends", nargs="+", default=None,
                     help="default: every available backend but the reference")
    gpu.add_argument("--shapes", nargs="+", type=parse_shape, default=None, metavar="B,T,H,D")
    gpu.add_argument("--iters", type=int, default=20)
    gpu.add_argument("--warmup", type=int, default=3)
    gpu.add_argument("--api", action="store_true",
                     help="also count the CUDA runtime / driver calls of one forward")
    gpu.add_argument("--cprofile", type=int, default=0, metavar="N",
                     help="also print cProfile's N functions of most own time per forward")
    core = parts.add_parser("core", help="the core alone on a null backend (CPU)")
    _measure_arguments(core, 2000, 7, "the ttt package")
    core.add_argument("--device", type=torch.device, default=torch.device("cpu"),
                      help="the inputs' device: cpu (default) or cuda")
    core.add_argument("--cprofile", type=int, default=0, metavar="N",
                      help="print cProfile's N functions of most own time per fwd+bwd")
    launchers = parts.add_parser("launchers", help="each GPU backend's launcher, nothing "
                                 "launched (CPU)")
    _measure_arguments(launchers, 1000, 5, "the three packages")
    args = parser.parse_args()
    if args.part == "gpu":
        gpu_main(args, gpu)
    else:
        cpu_main(args.part, args)


if __name__ == "__main__":
    main()
