"""Ahead-of-time compilation: ``ttt.warmup(...)`` and ``python -m ttt warmup``: each
configuration's calls (batch layouts, call forms, parameter dtypes), forward and backward, run
on small inputs so that the kernels land in the backends' caches (docs/warmup.md).
"""

from __future__ import annotations

import itertools
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from . import _warmup_workers as _workers
from ._warmup_workers import FORMS, OPS, CallForm, Config, call_inputs, run_call
from .backend import Backend, WarmupShape
from .choice import select_backend
from .errors import BackendNotSupportedError
from .mlp import make_mlp_problem
from .problem import MlpProblem, Problem
from .registry import load_backend
from .validation import make_problem

DEFAULT_DTYPES = (torch.bfloat16, torch.float32)
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_CHUNK_SIZES = (16,)     # the official TTT-Linear layer's mini-batch
DEFAULT_HEADS = (32,)           # the official TTT-Linear 1B's (Triton compiles per head count)
DEFAULT_OPS = (Problem.op,)


@dataclass(frozen=True)
class WarmupEntry:
    config: Config
    backend: str
    calls: int
    seconds: float


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warmup` compiled, what it ``skipped`` and why (default-dtype configurations
    the backend cannot take), the total time and the compiling processes (the entries' times
    are this process's own calls, after the workers')."""

    device: torch.device
    entries: list[WarmupEntry]
    skipped: list[tuple[Config, str]]
    seconds: float
    workers: int = 1


Progress = Callable[[int, int, str], None]     # (done, total, label): before each call, at the end


def warmup(backend: str | None = None, *, dtypes: Iterable[torch.dtype] | None = None,
           head_dims: Iterable[int] = DEFAULT_HEAD_DIMS,
           chunk_sizes: Iterable[int] = DEFAULT_CHUNK_SIZES,
           heads: Iterable[int] = DEFAULT_HEADS, backward: bool = True,
           device: str | torch.device | None = None,
           shapes: Sequence[WarmupShape] | None = None,
           progress: Progress | None = None, workers: int | None = None,
           ops: Iterable[str] = DEFAULT_OPS) -> WarmupReport:
    """Compile ahead of time the kernels calls of these configurations will use, on
    ``backend`` (None: the one each configuration's calls would get); the arguments and their
    defaults: docs/warmup.md. Raises ``BackendNotSupportedError`` for a configuration asked
    for explicitly that the backend cannot take."""
    device = _device(device)
    if not isinstance(backward, bool):
        raise TypeError(f"backward: expected a bool, got {type(backward).__name__}")
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)):
        raise TypeError(f"workers: expected a positive int or None, got {type(workers).__name__}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers: expected a positive int or None, got {workers}")
    configs = _configs(DEFAULT_DTYPES if dtypes is None else dtypes, head_dims, chunk_sizes,
                       heads, ops)
    progress = ProgressBar(quiet=True) if progress is None else progress
    start = time.perf_counter()
    plans, skipped = _plans(configs, backend, device, shapes, backward,
                            strict=dtypes is not None)
    calls = sum(len(plan.calls) for plan in plans)
    workers = _workers.default_workers(device, calls) if workers is None else workers
    workers = min(workers, calls)
    total, done, entries = calls * (2 if workers > 1 else 1), 0, []
    if workers > 1:
        def count(step=1):
            nonlocal done
            done += step
            progress(done, total, f"compiling in {workers} processes")

        count(0)
        for failure in _workers.run(_call_groups(plans), device, workers, count):
            warnings.warn(f"ttt.warmup: a worker process failed ({failure}); this process "
                          f"compiles what it left", RuntimeWarning, stacklevel=2)
        done = calls
    for plan in plans:
        plan_start = time.perf_counter()
        for layout, form, params, grad in plan.calls:
            progress(done, total, f"{plan.backend} {plan.config.describe()}")
            run_call(plan.backend, plan.config, layout, form, params, grad, device)
            done += 1
        entries.append(WarmupEntry(plan.config, plan.backend, len(plan.calls),
                                   time.perf_counter() - plan_start))
    progress(done, total, "done")
    return WarmupReport(device, entries, skipped, time.perf_counter() - start, workers)


def _call_groups(plans: list[_Plan]) -> list[list[dict]]:
    """The calls as JSON for the workers, in groups that need no kernel in common
    (docs/warmup.md)."""
    groups: dict[tuple, list[dict]] = {}
    for plan in plans:
        for layout, form, params, grad in plan.calls:
            key = (plan.backend, plan.config, params, layout.packed, form.layer)
            groups.setdefault(key, []).append(
                _workers.call_of(plan.backend, plan.config, layout, form, params, grad))
    return list(groups.values())


@dataclass(frozen=True)
class _Plan:
    """One configuration's calls: (layout, form, parameter dtypes, with gradients)."""

    config: Config
    backend: str
    calls: list[tuple[WarmupShape, CallForm, tuple[torch.dtype, torch.dtype], bool]]


def _plans(configs: list[Config], backend: str | None, device: torch.device,
           shapes: Sequence[WarmupShape] | None, backward: bool,
           strict: bool) -> tuple[list[_Plan], list[tuple[Config, str]]]:
    """Each configuration's calls on its backend, and those it cannot take (an error when
    ``strict``, or when none is left)."""
    plans, skipped = [], []
    for config in configs:
        try:
            chosen = _backend_for(config, backend, device)
        except BackendNotSupportedError as exc:
            if strict:
                raise
            skipped.append((config, str(exc)))
            continue
        if shapes is not None:
            layouts = list(shapes)
        elif config.op == MlpProblem.op:
            layouts = mlp_warmup_shapes(config.chunk_size)
        else:
            layouts = chosen.warmup_shapes(config.heads, config.head_dim, config.chunk_size,
                                           config.dtype)
        if not layouts or not all(isinstance(s, WarmupShape) for s in layouts):
            raise TypeError(f"shapes: expected a non-empty list of ttt.backend.WarmupShape, "
                            f"got {layouts!r}")
        caps = chosen.capabilities
        layer = caps.eta_key and "query_residual" in caps.outputs
        forms = [f for f in FORMS if layer or not f.layer]
        grads = (False, True) if backward else (False,)
        calls = list(itertools.product(layouts, forms, param_dtypes(config.dtype), grads))
        plans.append(_Plan(config, chosen.name, calls))
    if not plans:
        reasons = "; ".join(f"{c.describe()}: {why}" for c, why in skipped)
        raise BackendNotSupportedError(f"nothing to warm up: {reasons}")
    return plans, skipped


def mlp_warmup_shapes(chunk_size: int) -> list[WarmupShape]:
    """TTT-MLP's layouts: one sequence of 2.5 chunks and a generation step of two sequences,
    each dense and packed (its kernels depend on no other trait of the batch)."""
    shapes = [WarmupShape(1, 2 * chunk_size + chunk_size // 2), WarmupShape(2, 1)]
    return shapes + [WarmupShape(s.sequences, s.seq_len, packed=True) for s in shapes]


def param_dtypes(dtype: torch.dtype) -> list[tuple[torch.dtype, torch.dtype]]:
    """(dtype of w and b, of eta and eta_key) of the calls of ``dtype`` inputs: the input
    dtype and, for half inputs, float32 (``ttt.nn.TTTLinear``'s two setups)."""
    pairs = [(dtype, dtype)]
    if dtype not in (torch.float32, torch.float64):
        pairs.append((torch.float32, torch.float32))
    return pairs


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got "
                         f"{device!r}") from None


def _positive_ints(name: str, values) -> list[int]:
    values = list(values)
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name}: expected positive ints, got {type(v).__name__} {v!r}")
        if v < 1:
            raise ValueError(f"{name}: expected positive ints, got {v}")
    if not values:
        raise ValueError(f"{name}: expected at least one value, got none")
    return list(dict.fromkeys(values))


def _configs(dtypes, head_dims, chunk_sizes, heads, ops) -> list[Config]:
    if isinstance(ops, str):
        raise TypeError(f"ops: expected an iterable of op names such as ('ttt_mlp',), got "
                        f"the string {ops!r}")
    ops = list(dict.fromkeys(ops))
    for op in ops:
        if op not in OPS:
            raise ValueError(f"ops: expected names among {tuple(OPS)}, got {op!r}")
    if not ops:
        raise ValueError("ops: expected at least one op, got none")
    dtypes = list(dict.fromkeys(dtypes))
    for d in dtypes:
        if not isinstance(d, torch.dtype) or not d.is_floating_point:
            raise TypeError(f"dtypes: expected floating torch dtypes, got {d!r}")
    if not dtypes:
        raise ValueError("dtypes: expected at least one dtype, got none")
    head_dims = _positive_ints("head_dims", head_dims)      # (each iterable read once)
    chunk_sizes = _positive_ints("chunk_sizes", chunk_sizes)
    heads = _positive_ints("heads", heads)
    return [Config(dt, d, c, h, op) for op in ops for dt in dtypes for d in head_dims
            for c in chunk_sizes for h in heads]


def _backend_for(config: Config, name: str | None, device: torch.device) -> Backend:
    """The backend a call of ``config`` gets (raises BackendNotSupportedError)."""
    inputs = call_inputs(config, WarmupShape(1, config.chunk_size), FORMS[0],
                         (config.dtype, config.dtype), device, grad=True)
    make = make_mlp_problem if config.op == MlpProblem.op else make_problem
    problem = make(**inputs, chunk_size=config.chunk_size)
    if name is not None:
        load_backend(name)
    return select_backend(problem, name)


class ProgressBar:
    """A one-line progress bar on ``stream`` (stderr), redrawn in place; silent unless the
    stream is a terminal and not ``quiet``."""

    WIDTH = 30

    def __init__(self, stream=None, quiet: bool = False) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = not quiet and getattr(self.stream, "isatty", lambda: False)()

    def __call__(self, done: int, total: int, label: str) -> None:
        if not self.enabled:
            return
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        end = "\n" if done >= total else ""
        self.stream.write(f"\r[{bar}] {done}/{total} {label:<48.48}{end}")
        self.stream.flush()
