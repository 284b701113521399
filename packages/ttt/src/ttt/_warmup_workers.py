"""A warm-up's calls run in child processes, which compile in parallel.

Compiling is single-threaded work on the host (Triton's passes and ptxas, NVRTC); a warm-up
compiles one kernel specialisation after another. Here the calls are dealt out to
``workers`` child processes (``python -m ttt._warmup_workers``, each reading its calls as
JSON on stdin), which run them on the same device and leave what they compiled in the
on-disk caches (Triton's, the cupy backend's). The parent then runs every call itself and
finds the kernels there, so it loads instead of compiling (``ttt.warmup``).

A child that fails (a backend that exists only in this process is unknown in a new one, say)
costs nothing but time: the parent's own pass compiles what is missing.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

import torch

from ._warmup_calls import FORMS_BY_NAME, Config, run_call
from .backend import WarmupShape

DEFAULT_MAX_WORKERS = 12
"""A Triton warm-up of one half-dtype configuration has 8 call groups, 4 of them twice the
calls of the others: split by initial states (:func:`split`), those make 12 parts of about
equal compiling that share few kernels. Splitting these further, their halves would share
most of their kernels."""


def default_workers(device: torch.device, calls: int) -> int:
    """Processes a warm-up of ``calls`` calls uses when not told: one per CPU core up
    to DEFAULT_MAX_WORKERS on a GPU, none on the CPU (no kernel backend compiles there)."""
    if device.type == "cpu":
        return 1
    return max(1, min(DEFAULT_MAX_WORKERS, os.cpu_count() or 1, calls))


def run(groups: Sequence[list[dict]], device: torch.device, workers: int,
        on_call: Callable[[], None]) -> list[str]:
    """Run the call groups ``groups`` (each a list of JSON-able calls, see ``call_of``) in
    ``workers`` child processes (:func:`deal`); ``on_call()`` after each finished call.
    Returns one line per child that failed (its exit status and the last line it wrote to
    stderr)."""
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
    """The calls of ``groups`` in ``workers`` shares: each group whole in one share (the
    share with the fewest calls so far, largest group first), so that calls that may need
    the same kernels compile them in one process. While there are fewer groups than
    workers, the largest is split in two (:func:`split`)."""
    groups = sorted((list(g) for g in groups if g), key=len, reverse=True)
    while 0 < len(groups) < workers and len(groups[0]) > 1:
        groups += split(groups.pop(0))
        groups.sort(key=len, reverse=True)
    shares: list[list[dict]] = [[] for _ in range(workers)]
    for group in groups:
        min(shares, key=len).extend(group)
    return shares


def split(calls: list[dict]) -> list[list[dict]]:
    """A group's calls (``call_of``) in two halves that need few kernels in common: by
    whether they pass initial states, else by whether they return final states, else by
    whether they take gradients, else taken in turn. Initial and final states are part of
    the specialisation of most kernels a call launches (forward and backward), so either
    half compiles little of the other's; split by gradients, the half with them would hold
    most of the compiling (the backward's kernels), and calls that differ only in their
    layout need mostly the same kernels."""
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
    """One warm-up call (``ttt._warmup_calls.run_call``'s arguments) as JSON-able values."""
    return {"backend": backend,
            "config": [_dtype_name(config.dtype), config.head_dim, config.chunk_size,
                       config.heads],
            "layout": [layout.sequences, layout.seq_len, layout.packed],
            "form": form.name, "params": [_dtype_name(d) for d in params], "grad": grad}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _main() -> int:
    job = json.load(sys.stdin)
    device = torch.device(job["device"])
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    for call in job["calls"]:
        dtype, head_dim, chunk_size, heads = call["config"]
        config = Config(getattr(torch, dtype), head_dim, chunk_size, heads)
        layout = WarmupShape(*call["layout"])
        params = tuple(getattr(torch, name) for name in call["params"])
        run_call(call["backend"], config, layout, FORMS_BY_NAME[call["form"]], params,
                 call["grad"], device)
        print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
