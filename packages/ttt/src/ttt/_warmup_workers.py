"""A warm-up's calls, and the child processes (``python -m ttt._warmup_workers``, reading
their calls as JSON on stdin) that run them first to compile in parallel into the on-disk
caches; the parent then runs every call itself (docs/warmup.md, "workers").
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .backend import WarmupShape
from .mlp import HIDDEN_FACTOR, chunk_ttt_mlp
from .ops import chunk_ttt_linear
from .problem import MlpProblem, Problem, state_dtype, state_shapes
from .validation import dtype_name

OPS = {Problem.op: chunk_ttt_linear, MlpProblem.op: chunk_ttt_mlp}
"""The ops a warm-up calls, by the name backends declare in ``Capabilities.ops``."""


@dataclass(frozen=True)
class CallForm:
    """How a warm-up call passes the optional arguments (``ttt.warmup``'s doc): ``initial``
    states, ``final`` states out, the ``layer``'s eta_key and output form."""

    name: str
    initial: bool
    final: bool
    layer: bool = False


FORMS = (CallForm("plain", False, False), CallForm("initial", True, False),
         CallForm("final", False, True), CallForm("states", True, True),
         CallForm("layer", True, False, layer=True),
         CallForm("layer_cache", True, True, layer=True))

FORMS_BY_NAME = {form.name: form for form in FORMS}


@dataclass(frozen=True)
class Config:
    """One configuration a warm-up compiles for."""

    dtype: torch.dtype
    head_dim: int
    chunk_size: int
    heads: int
    op: str = Problem.op

    def describe(self) -> str:
        op = "" if self.op == Problem.op else f"{self.op} "
        return (f"{op}{dtype_name(self.dtype)} D={self.head_dim} chunk={self.chunk_size} "
                f"H={self.heads}")


def call_inputs(config: Config, layout: WarmupShape, form: CallForm,
                params: tuple[torch.dtype, torch.dtype], device: torch.device,
                grad: bool) -> dict:
    """Random finite inputs of one call; ``params``: the dtypes of (w, b), (eta, eta_key)."""
    N, T, H, D = layout.sequences, layout.seq_len, config.heads, config.head_dim
    B, L = (1, N * T) if layout.packed else (N, T)
    gen = torch.Generator(device).manual_seed(0)
    dt, (affine, rates) = config.dtype, params

    def rand(*shape, dtype=dt):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype)

    k = rand(B, L, H, D)
    inputs = dict(q=rand(B, L, H, D), k=k / k.norm(dim=-1, keepdim=True), v=rand(B, L, H, D),
                  w=1 + 0.1 * rand(H, D, dtype=affine), b=0.1 * rand(H, D, dtype=affine),
                  eta=0.05 * torch.rand((B, L, H, 1), generator=gen, device=device,
                                        dtype=rates))
    if form.initial:
        mlp = config.op == MlpProblem.op
        states = tuple(0.1 * rand(*shape, dtype=state_dtype(dt))
                       for shape in state_shapes(N, H, D, HIDDEN_FACTOR * D if mlp else None))
        if mlp:
            inputs["initial_state"] = states
        else:
            inputs["initial_state"], inputs["initial_state_bias"] = states
    if form.layer:
        inputs["eta_key"] = 0.5 + torch.rand((B, L, H, 1), generator=gen, device=device,
                                             dtype=rates)
    if grad:
        for t in _tensors(inputs.values()):
            t.requires_grad_(True)
    if layout.packed:
        inputs["cu_seqlens"] = torch.arange(0, N * T + 1, T, device=device, dtype=torch.int64)
    return inputs


def run_call(backend: str, config: Config, layout: WarmupShape, form: CallForm,
             params: tuple[torch.dtype, torch.dtype], grad: bool, device: torch.device) -> None:
    """One call: forward without gradients, or forward and backward."""
    inputs = call_inputs(config, layout, form, params, device, grad)
    kwargs = dict(chunk_size=config.chunk_size, output_final_state=form.final,
                  backend=backend)
    if form.layer:
        kwargs.update(scale=1.0, output="query_residual")
    with torch.set_grad_enabled(grad):
        outputs = _tensors(OPS[config.op](**inputs, **kwargs))
        if grad:
            leaves = [t for t in _tensors(inputs.values()) if t.requires_grad]
            cotangents = [torch.randn_like(t) for t in outputs]
            torch.autograd.grad(outputs, leaves, cotangents)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensors(values) -> list[torch.Tensor]:
    """The tensors of ``values``, those of tuples (TTT-MLP's states) in order."""
    flat = []
    for value in values:
        if isinstance(value, tuple):
            flat += _tensors(value)
        elif value is not None:
            flat.append(value)
    return flat


DEFAULT_MAX_WORKERS = 12      # the parts of one half-dtype configuration (docs/warmup.md)


def default_workers(device: torch.device, calls: int) -> int:
    """Processes for ``calls`` calls when not told: one per CPU core up to
    DEFAULT_MAX_WORKERS on a GPU, 1 on the CPU (no kernel backend compiles there)."""
    if device.type == "cpu":
        return 1
    return max(1, min(DEFAULT_MAX_WORKERS, os.cpu_count() or 1, calls))


def run(groups: Sequence[list[dict]], device: torch.device, workers: int,
        on_call: Callable[[], None]) -> list[str]:
    """Run ``groups`` (lists of :func:`call_of` calls) in ``workers`` child processes,
    ``on_call()`` after each call. Returns one line per failed child (its exit status and
    last line of stderr)."""
    shares = deal(groups, workers)
    done: queue.Queue = queue.Queue()
    children = [_start(share, device, done) for share in shares if share]
    running = len(children)
    while running:
        if done.get() is None:
            running -= 1
        else:
            on_call()
    failures = []
    for process, errors in children:
        if process.wait() != 0:
            last = errors[-1].strip() if errors else "no message"
            failures.append(f"exit status {process.returncode}: {last}")
    return failures


def deal(groups: Sequence[list[dict]], workers: int) -> list[list[dict]]:
    """The calls of ``groups`` in ``workers`` shares, each group whole in the share with
    the fewest calls so far (largest first); while groups are fewer than workers, the
    largest is :func:`split`."""
    groups = sorted((list(g) for g in groups if g), key=len, reverse=True)
    while 0 < len(groups) < workers and len(groups[0]) > 1:
        groups += split(groups.pop(0))
        groups.sort(key=len, reverse=True)
    shares: list[list[dict]] = [[] for _ in range(workers)]
    for group in groups:
        min(shares, key=len).extend(group)
    return shares


def split(calls: list[dict]) -> list[list[dict]]:
    """A group's calls in two halves that need few kernels in common: by initial states,
    else final states, else gradients, else in turn."""
    for differs in (lambda c: FORMS_BY_NAME[c["form"]].initial,
                    lambda c: FORMS_BY_NAME[c["form"]].final, lambda c: c["grad"]):
        first = [c for c in calls if differs(c)]
        if 0 < len(first) < len(calls):
            return [first, [c for c in calls if not differs(c)]]
    return [calls[0::2], calls[1::2]]


def _start(calls: list[dict], device: torch.device, done: queue.Queue):
    process = subprocess.Popen(
        [sys.executable, "-m", "ttt._warmup_workers"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []

    def feed():
        try:
            process.stdin.write(json.dumps({"device": str(device), "calls": calls}))
            process.stdin.close()
        except BrokenPipeError:       # the child died first; its stderr says why
            pass

    def read_stdout():
        for line in process.stdout:
            if line.strip() == "done":
                done.put(True)
        done.put(None)

    def read_stderr():
        errors.extend(process.stderr)

    for target in (feed, read_stdout, read_stderr):
        threading.Thread(target=target, daemon=True).start()
    return process, errors


def call_of(backend: str, config, layout, form, params, grad: bool) -> dict:
    """One warm-up call (:func:`run_call`'s arguments) as JSON-able values."""
    return {"backend": backend,
            "config": [dtype_name(config.dtype), config.head_dim, config.chunk_size,
                       config.heads, config.op],
            "layout": [layout.sequences, layout.seq_len, layout.packed],
            "form": form.name, "params": [dtype_name(d) for d in params], "grad": grad}


def _main() -> int:
    job = json.load(sys.stdin)
    device = torch.device(job["device"])
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    for call in job["calls"]:
        dtype, head_dim, chunk_size, heads, op = call["config"]
        config = Config(getattr(torch, dtype), head_dim, chunk_size, heads, op)
        layout = WarmupShape(*call["layout"])
        params = tuple(getattr(torch, name) for name in call["params"])
        run_call(call["backend"], config, layout, FORMS_BY_NAME[call["form"]], params,
                 call["grad"], device)
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
