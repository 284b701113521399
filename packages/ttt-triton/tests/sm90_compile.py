"""Compiles, for sm_90 and without a GPU, every kernel launch the launcher makes for a set of
calls (test_sm90_compile.py runs this file in a child process without ``TRITON_INTERPRET``).

The interpreter runs a kernel's Python on CPU tensors; the compiler checks more (a loop's
carried variables keep one type, constexpr branches, layouts, register and shared-memory
limits through ptxas). Here the launcher runs on CPU tensors with its launch step replaced
by a recorder (nothing runs), then each distinct launch is compiled as Triton would compile
it on a GPU: the argument types of the recorded tensors and scalars, ``None`` and the
constexprs as constants, the 16-byte alignment of the pointers, the launch's compiler
options. Each must compile within :data:`STACK_LIMIT` bytes of stack per thread and
:data:`SHARED_LIMIT` bytes of shared memory (Triton refuses a launch above it). Prints one
line per compiled launch; exits 1 naming each launch that fails.

    python packages/ttt-triton/tests/sm90_compile.py               # every case below
    python packages/ttt-triton/tests/sm90_compile.py --case step   # one (repeatable)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

if __name__ == "__main__":           # (imported, by the test for CASES, it changes nothing)
    os.environ.pop("TRITON_INTERPRET", None)   # compile, never interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import ttt  # noqa: E402
from ttt_triton.ops.ttt_linear import launcher  # noqa: E402
from ttt_triton.ops.ttt_mlp import launcher as mlp_launcher  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
         torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

class Case(NamedTuple):
    """One set of calls: ``calls`` "train" (forward saving for the backward, then the
    backward), "train states" (the same with initial and final states, the backward getting
    the final states' cotangents) or "infer" (forward without backward, with states);
    generation steps are "infer" with T within one chunk. H sets the chain count, and with it
    the fused chains (tuning.FUSED). ``packed``: the packed lengths (None: dense); ``layer``:
    the layer's form (eta_key, query_residual). ``calls`` "mlp" (with ``hidden``, 0: 4 D):
    TTT-MLP without autograd, with states (``packed``, ``layer`` as above); "mlp split" the
    same with a generation step split over 4 programs per chain (``step_splits``)."""
    label: str
    dtype: str = "bf16"
    B: int = 2
    T: int = 40
    H: int = 2
    D: int = 64
    chunk: int = 16
    packed: tuple | None = None
    layer: bool = False
    calls: str = "train"
    hidden: int = 0


CASES = (
    Case("train"),
    Case("train layer", layer=True),
    Case("train fused", B=1, H=256, layer=True),
    Case("train fp32", "fp32", layer=True),
    Case("train fp32 fused", "fp32", B=1, H=256),
    Case("train packed", B=1, packed=(7, 0, 33), layer=True),
    Case("train states", layer=True, calls="train states"),
    Case("train states packed", "fp32", B=1, D=32, packed=(9, 31), calls="train states"),
    Case("train d128 c64", B=1, T=130, D=128, chunk=64, layer=True),
    Case("train d24", "fp16", B=1, D=24, packed=(17, 23)),
    Case("infer", layer=True, calls="infer"),
    Case("infer fused", B=1, H=96, layer=True, calls="infer"),
    Case("infer fp32 d128 fused", "fp32", B=1, H=96, D=128, calls="infer"),
    Case("step", B=4, T=1, layer=True, calls="infer"),
    Case("step default", B=4, T=1, calls="infer"),
    Case("step fp32 rows", "fp32", B=4, T=4, layer=True, calls="infer"),
    Case("step packed", "fp32", B=1, T=3, D=128, packed=(1, 0, 2), layer=True, calls="infer"),
    Case("step chain", B=4, T=16, layer=True, calls="infer"),
    Case("mlp", calls="mlp"),
    Case("mlp train", layer=True, calls="mlp train"),
    Case("mlp train d128", B=1, T=40, D=128, calls="mlp train"),
    Case("mlp train packed fp32", "fp32", B=1, D=32, packed=(9, 31), calls="mlp train"),
    Case("mlp step", "fp16", B=1, T=2, D=24, packed=(1, 0, 1), calls="mlp", hidden=40),
    Case("mlp step d64", B=4, T=1, layer=True, calls="mlp"),
    Case("mlp step fp32 d128", "fp32", B=4, T=1, D=128, calls="mlp"),
    Case("mlp step split d64", B=4, T=1, layer=True, calls="mlp split"),
    Case("mlp step split fp32 d128", "fp32", B=4, T=1, D=128, calls="mlp split"),
    Case("mlp step split packed", "fp16", B=1, T=2, D=24, packed=(1, 0, 1), calls="mlp split",
         hidden=300),
    # the largest tile the TTT-MLP backward takes (launcher.BACKWARD_MAX_TILE), the most
    # shared memory of its launches
    Case("mlp train d64 c64", B=1, T=70, chunk=64, layer=True, calls="mlp train"),
)

SLOW_CASES = (
    Case("train fp32 d128 c64", "fp32", B=1, T=130, D=128, chunk=64, layer=True),
    Case("train fp32 d64 c64", "fp32", B=1, T=130, chunk=64),
    Case("mlp fp32 d128 c32", "fp32", B=1, T=70, D=128, chunk=32, layer=True,
         calls="mlp train"),
)
"""Float32 at chunk 64 (tuning.IEEE_WIDE), whose kernels take minutes to compile on a CPU:
test_sm90_compile.py marks them ``big``."""


def problem(dtype, B, T, H, D, chunk, packed, layer, states):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0, offset=0.0, uniform=False):
        x = (torch.rand if uniform else torch.randn)(*shape, generator=gen)
        return (offset + scale * x).to(dtype)

    N = len(packed) if packed else B
    extra = {}
    if packed:
        lengths = torch.tensor([0, *packed])
        extra["cu_seqlens"] = lengths.cumsum(0)
    if layer:
        extra.update(eta_key=rand(B, T, H, 1, offset=0.5, uniform=True),
                     output="query_residual")
    if states:
        extra.update(initial_state=0.1 * torch.randn(N, H, D, D, generator=gen),
                     initial_state_bias=0.1 * torch.randn(N, H, 1, D, generator=gen),
                     output_final_state=True)
    x = [rand(B, T, H, D) for _ in range(3)]
    return ttt.make_problem(*x, rand(H, D, scale=0.1, offset=1.0), rand(H, D, scale=0.1),
                            rand(B, T, H, 1, scale=0.1, uniform=True), chunk_size=chunk,
                            **extra)


def recorded_launches(case) -> list:
    """The launches (``launches.Launch``) of ``case``'s calls, run (and compiled ahead)
    nowhere."""
    _, dtype, B, T, H, D, chunk, packed, layer, calls, hidden = case
    recorded = []
    if calls.startswith("mlp"):
        mlp_launcher.run_launch = recorded.append
        if calls == "mlp split":         # a step of fewer chains than SMs, in a graph
            mlp_launcher.step_splits = lambda *args: 4
            mlp_launcher.capturing = lambda: True
            mlp_launcher.split_loaded = lambda key: True
        p = problem(DTYPES[dtype], B, T, H, D, chunk, packed, layer, False)
        F = hidden or 4 * D
        N = len(packed) if packed else B
        state = tuple(torch.randn(shape) for shape in (
            (N, H, D, F), (N, H, 1, F), (N, H, F, D), (N, H, 1, D)))
        train = calls == "mlp train"
        leaves = [t.requires_grad_(train) for t in (p.q, p.k, p.v)]
        o, final = mlp_launcher.ttt_mlp_fwd(ttt.mlp.make_mlp_problem(
            *leaves, p.w, p.b, p.eta, chunk_size=chunk, initial_state=state,
            output_final_state=True, cu_seqlens=p.cu_seqlens, eta_key=p.eta_key,
            output=p.output))
        if train:
            torch.autograd.grad([o, *final], leaves, [torch.randn_like(o),
                                                      *map(torch.randn_like, final)])
        return recorded
    launcher.launches_run = lambda launches, *args, **kwargs: recorded.extend(launches)
    launcher.launches_prefetch = lambda launches, *args, **kwargs: None
    launcher.launches_wants_prefetch = lambda *args, **kwargs: False
    train = calls.startswith("train")
    p = problem(DTYPES[dtype], B, T, H, D, chunk, packed, layer, calls != "train")
    o, ht, hbt, saved = launcher.ttt_linear_fwd(p, train)
    if train:
        cotangents = (None, None) if ht is None else (torch.randn_like(ht),
                                                      torch.randn_like(hbt))
        launcher.ttt_linear_bwd(p, saved, torch.randn_like(o), *cotangents)
    return recorded


def compile_inputs(launch):
    """``(signature, constexprs, attrs, options)`` of one launch, as a launch with these
    arguments compiles (the inputs of ``ASTSource`` and ``triton.compile``)."""
    fn = launch.kernel
    values = dict(zip(fn.arg_names, launch.args))
    options = {}
    for name, value in launch.kwargs.items():
        if name in fn.arg_names:
            values[name] = value
        else:
            options[name] = value
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = values[param.name]
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {param.name} of type "
                            f"{type(value).__name__}")
    return signature, constexprs, attrs, options


def launch_key(launch, inputs: tuple) -> tuple:
    """What tells one compile from another: the kernel and its :func:`compile_inputs`."""
    signature, constexprs, attrs, options = inputs
    return (launch.kernel.__name__, tuple(signature.items()),
            tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
            tuple(sorted(attrs)), tuple(sorted(options.items())))


STACK_LIMIT = 8 * 1024
"""The most stack (local memory) per thread a launch may compile to: CUDA reserves it for
every thread the GPU can hold, in every process that launched the kernel (8 KB: 2 GiB on an
H100), so spilling kernels exhaust a GPU that several processes share. The rules' largest
is 6.0 KB (``tuning.IEEE_WIDE``)."""


SHARED_LIMIT = 227 * 1024
"""The most shared memory a block may opt in to on sm_90 (227 KiB); the GPU's own limit is
checked by Triton at launch, this one on CPU."""


def stack_bytes(kernel) -> int:
    """The stack frame per thread of a compiled kernel (``cuobjdump -res-usage``)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", action="append",
                        choices=[case.label for case in CASES + SLOW_CASES],
                        help="only this case (default: every case)")
    args = parser.parse_args()
    seen, failed = set(), []
    for case in CASES + SLOW_CASES:
        if (args.case and case.label not in args.case) or (not args.case and case in SLOW_CASES):
            continue
        for launch in recorded_launches(case):
            inputs = compile_inputs(launch)
            key = launch_key(launch, inputs)
            if key in seen:
                continue
            seen.add(key)
            name = f"{case.label}: {launch.kernel.__name__}"
            start = time.perf_counter()
            try:
                signature, constexprs, attrs, options = inputs
                src = ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs,
                                attrs=attrs)
                kernel = triton.compile(src, target=TARGET, options=options)
            except Exception:  # noqa: BLE001 - every failing launch is named, then exit 1
                failed.append(name)
                print(f"FAILED {name}\n{traceback.format_exc()}", flush=True)
                continue
            stack = stack_bytes(kernel)
            if stack > STACK_LIMIT:
                failed.append(name)
                print(f"FAILED {name}: {stack} bytes of stack per thread, more than "
                      f"{STACK_LIMIT} (tuning.IEEE_WIDE)", flush=True)
                continue
            shared = kernel.metadata.shared
            if shared > SHARED_LIMIT:
                failed.append(name)
                print(f"FAILED {name}: {shared} bytes of shared memory, more than "
                      f"{SHARED_LIMIT}", flush=True)
                continue
            print(f"ok {name} ({time.perf_counter() - start:.1f} s, stack {stack} B, "
                  f"shared {shared} B)", flush=True)
    print(f"{len(seen)} launches compiled for sm_90, {len(failed)} failed")
    for name in failed:
        print(f"FAILED {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
