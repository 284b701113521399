"""Registers, spills and shared memory of the Triton kernels for sm_90, without a GPU.

    TRITON_DEFAULT_FP_FUSION=1 python -m tools.resources [--arch 90]

Compiles each kernel configuration the launcher would pick (chunk 16/32/64, padded head
dim 16..128, bf16 and fp32) ahead of time with Triton's bundled ptxas and prints
``cuobjdump -res-usage``, without a GPU: registers, stack (local memory) bytes per thread,
shared memory, and ``reserve``, the device memory CUDA keeps for that stack in a process
that launched the kernel (stack x 2048 resident threads x 132 SMs of an H100; kept for the
process's life, so it adds up over the processes sharing a GPU). ``(not picked)`` marks a
configuration the launcher's rules never choose (a fused chain where they split it, which
only a forced ``Tuning`` compiles; a TTT-MLP backward past ``BACKWARD_MAX_TILE``, which the
backend refuses). The TTT-MLP rows (``mlp_*``) take hidden width 4 D. Pointers carry the 16-byte
alignment hint that a launch with torch tensors gets (``--unaligned`` drops it). The numbers
come from the Triton installed here, which may differ from the GPU runner's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ttt_triton.ops.ttt_linear import tuning
from ttt_triton.ops.ttt_linear.bwd_chain import ttt_linear_bwd_chain_kernel
from ttt_triton.ops.ttt_linear.bwd_grads import ttt_linear_bwd_grads_kernel
from ttt_triton.ops.ttt_linear.bwd_local import ttt_linear_bwd_local_kernel
from ttt_triton.ops.ttt_linear.fwd_chain import ttt_linear_fwd_chain_kernel
from ttt_triton.ops.ttt_linear.fwd_out import ttt_linear_fwd_out_kernel
from ttt_triton.ops.ttt_mlp import launcher as mlp_launcher
from ttt_triton.ops.ttt_mlp.bwd_chain import ttt_mlp_bwd_chain_kernel
from ttt_triton.ops.ttt_mlp.fwd_chain import ttt_mlp_fwd_chain_kernel
from ttt_triton.ops.ttt_mlp.fwd_decode import (
    ttt_mlp_fwd_decode_kernel,
    ttt_mlp_step_out_kernel,
    ttt_mlp_step_update_kernel,
    ttt_mlp_step_z2_kernel,
)

INPUTS = {"q", "k", "v", "eta", "w", "b", "o", "do", "dq", "dk", "dv"}
INTS = {"cu_seqlens": "*i64", "grp_offsets": "*i64", "grp_seq": "*i32", "T": "i32",
        "scale": "fp32", "eps": "fp32", "F": "i32", "NG": "i32", "FS": "i32", "S": "i32"}
# (name, kernel, launch kind, tunable of its rows per block or None, extra constexprs)
KERNELS = (
    ("fwd_chain", ttt_linear_fwd_chain_kernel, "chain", None,
     dict(USE_INITIAL=True, USE_INITIAL_BIAS=True, STORE_FINAL=True, FUSE_OUT=False, SAVE=True)),
    ("fwd_fused", ttt_linear_fwd_chain_kernel, "chain", None,   # inference: writes o
     dict(USE_INITIAL=True, USE_INITIAL_BIAS=True, STORE_FINAL=True, FUSE_OUT=True, SAVE=False)),
    ("fwd_out", ttt_linear_fwd_out_kernel, "group", "S_out", {}),
    ("bwd_local", ttt_linear_bwd_local_kernel, "group", "S_local", {}),
    ("bwd_chain", ttt_linear_bwd_chain_kernel, "chain", None,
     dict(USE_DHT=True, STORE_DH0=True, FUSE_GRADS=False)),
    ("bwd_fused", ttt_linear_bwd_chain_kernel, "chain", None,   # does bwd_grads' work too
     dict(USE_DHT=True, STORE_DH0=True, FUSE_GRADS=True)),
    ("bwd_grads", ttt_linear_bwd_grads_kernel, "group", "S_grads", {}),
)

MLP_KERNELS = (
    ("mlp_fwd", ttt_mlp_fwd_chain_kernel, dict(USE_INITIAL=True, SAVE=True)),   # training
    ("mlp_infer", ttt_mlp_fwd_chain_kernel, dict(USE_INITIAL=True, SAVE=False)),
    ("mlp_bwd", ttt_mlp_bwd_chain_kernel, {}),
    ("mlp_step", ttt_mlp_fwd_decode_kernel, dict(USE_INITIAL=True)),
    ("mlp_step_z2", ttt_mlp_step_z2_kernel, dict(USE_INITIAL=True)),
    ("mlp_step_update", ttt_mlp_step_update_kernel, dict(USE_INITIAL=True)),
    ("mlp_step_out", ttt_mlp_step_out_kernel, dict(USE_INITIAL=True)),
)
"""TTT-MLP's launches (hidden width 4 D): the forward saving checkpoints for a backward, the
forward alone, the backward, and the generation step (no chunk: one row per line), whole
or split over programs in a CUDA graph (``mlp_step_*``)."""
STEP_KERNELS = (ttt_mlp_fwd_decode_kernel, ttt_mlp_step_z2_kernel,
                ttt_mlp_step_update_kernel, ttt_mlp_step_out_kernel)
MLP_INPUTS = {"q", "k", "v", "eta", "w", "b", "o", "do"}   # its dq, dk, dv are fp32

DEFAULT_FORM = dict(eta_key=None, deta_key=None, HAS_ETA_KEY=False, OUTPUT="norm_residual",
                    NEED_DETA_KEY=False, NEED_DQ=True, NEED_DK=True, NEED_DV=True,
                    NEED_DETA=True, NEED_DW=True, NEED_DB=True, STORE_DHB0=True,
                    STORE_BUFS=True, FEED_GRADS=True)
"""The constexprs of a default call (no eta_key, norm_residual, every gradient), where a
kernel has them."""

LAYER_FORM = {**{k: v for k, v in DEFAULT_FORM.items() if k not in ("eta_key", "deta_key")},
              "HAS_ETA_KEY": True, "OUTPUT": "query_residual", "NEED_DETA_KEY": True}
"""``--layer``: the form ``ttt.nn.TTTLinear`` calls (eta_key, query_residual; eta_key and
deta_key then pointers, not constexprs)."""


def compile_inputs(name: str, fn, kind: str, rows: str | None, extra: dict, dtype: str,
                   BD: int, BT: int, *, varlen: bool = False, form: dict = DEFAULT_FORM,
                   aligned: bool = True, H: int = 16):
    """``(ASTSource, options, constexprs)`` of one row of :data:`KERNELS` as the launcher
    compiles it for ``dtype`` ("bf16" or "fp32"), padded head dim ``BD`` and chunk ``BT``
    (default tuning, the narrow checkpoint interval), in the call form ``form``."""
    tune, G = tuning.DEFAULT_TUNING, tuning.CKPT_INTERVAL["narrow"]
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    consts = dict(H=H, D=BD, BT=BT, BD=BD, G=G, IS_VARLEN=varlen,
                  PREC=tuning.dot_precision(torch_dtype, BD), **extra)
    consts.update({k: v for k, v in form.items() if k in fn.arg_names and k not in consts})
    if "HALF" in fn.arg_names:
        consts["HALF"] = dtype != "fp32"
    if rows is not None:
        consts["BS"] = tuning.rows_per_block(rows, BT, G, tune, BD=BD, ieee=dtype == "fp32")
    if "SPLIT" in fn.arg_names:
        consts["SPLIT"] = tuning.grads_split(torch_dtype, BD, BT, tune)
    src = _source(fn, dtype, consts, aligned)
    options = tuning.launch_options("local" if name in ("fwd_out", "bwd_local") else kind, BD,
                                    dtype == "fp32", tune, fused_bwd=name == "bwd_fused", BT=BT)
    if name in ("bwd_local", "bwd_grads") and tuning.wide_backward(torch_dtype, BD, BT):
        options["num_stages"] = tuning.WIDE_BACKWARD["stages"]
    return src, options, consts


def mlp_compile_inputs(fn, extra: dict, dtype: str, BD: int, BT: int, *,
                       form: dict = DEFAULT_FORM, aligned: bool = True, H: int = 16):
    """``(ASTSource, options, constexprs)`` of one row of :data:`MLP_KERNELS`, with the
    TTT-MLP launcher's constexprs and options (``mlp_launcher._constants``) for a dense
    batch of head dim ``BD``."""
    q = torch.empty(1, 1, H, BD, device="meta",
                    dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    eta_key = q if form["HAS_ETA_KEY"] else None
    if fn in STEP_KERNELS:
        setup = mlp_launcher.step_setup(H, BD, 4 * BD, False, eta_key is not None,
                                        form["OUTPUT"], True, False)
        consts = dict(setup[STEP_KERNELS.index(fn)])
        options = {"num_warps": consts.pop("num_warps"),
                   "num_stages": consts.pop("num_stages")}
    else:
        consts = mlp_launcher._constants(q, BT, 4 * BD, None, eta_key, form["OUTPUT"],
                                         backward=fn is ttt_mlp_bwd_chain_kernel)
        options = {"num_warps": consts.pop("num_warps")}
    consts.update(extra)
    consts.update({k: v for k, v in form.items() if k in ("eta_key", "deta_key")
                   and k in fn.arg_names})
    return _source(fn, dtype, consts, aligned, MLP_INPUTS), options, consts


def row_kernel(name: str, dtype: str, BD: int, BT: int, arch: int = 90):
    """``(compiled kernel, options)`` of the row ``name`` of :data:`KERNELS` or
    :data:`MLP_KERNELS` (an ``mlp_`` name) for ``arch``, in the default form."""
    if name.startswith("mlp_"):
        _, fn, extra = next(k for k in MLP_KERNELS if k[0] == name)
        src, options, _ = mlp_compile_inputs(fn, extra, dtype, BD, BT)
    else:
        _, fn, kind, rows, extra = next(k for k in KERNELS if k[0] == name)
        src, options, _ = compile_inputs(name, fn, kind, rows, extra, dtype, BD, BT)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options), options


def _source(fn, dtype: str, consts: dict, aligned: bool, inputs: set[str] = INPUTS):
    """The ``ASTSource`` of ``fn`` with these constexprs (pointers 16-byte aligned when
    ``aligned``)."""
    sig = _signature(fn, dtype, consts, inputs)
    return ASTSource(fn=fn, signature=sig,
                     constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                     attrs=_aligned(fn, sig) if aligned else None)


def _signature(fn, dtype: str, consts: dict, inputs: set[str] = INPUTS) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in INTS:
            sig[name] = INTS[name]
        else:
            sig[name] = f"*{dtype}" if name in inputs else "*fp32"
    return sig


def _aligned(fn, signature: dict) -> dict:
    """``tt.divisibility = 16`` on every pointer argument: what a launch with 16-byte
    aligned torch tensors specializes on (vectorized loads, fewer 64-bit pointer
    registers). Without it the counts are far from a real launch's: at bf16, head dim 64,
    chunk 16 bwd_local spilled 552 B unhinted against 304 B hinted."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, ty in signature.items() if ty.startswith("*")}


def _usage(kernel) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if not m:
        return out.strip()[:200]
    reserve = int(m.group(2)) * RESIDENT_THREADS / 2**30
    return (f"regs {m.group(1):>3} stack {m.group(2):>5} local {m.group(4):>4} "
            f"smem {kernel.metadata.shared:>6} reserve {reserve:4.1f} GiB")


RESIDENT_THREADS = 2048 * 132
"""Threads an H100 SXM holds at once (2048 per SM, 132 SMs): CUDA sizes a process's local
memory for a kernel's stack per thread times this."""


def picked(name: str, dtype: str, BD: int, BT: int) -> bool:
    """Whether the launcher's rules can choose this row of :data:`KERNELS` (a fused chain
    only where :func:`tuning.fused_forward` / :func:`tuning.fused_backward` may fuse)."""
    if name == "fwd_fused":
        return not tuning.ieee_wide(dtype == "fp32", BD, BT)
    if name == "bwd_fused":
        return BT == 16 and BD <= 64
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--only", default="", help="comma-separated kernel names")
    parser.add_argument("--bd", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--bt", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--layer", action="store_true",
                        help="the layer's form (eta_key, query_residual) instead of the "
                             "default one")
    parser.add_argument("--unaligned", dest="aligned", action="store_false",
                        help="no 16-byte alignment hint on the pointers (default: hinted, as "
                             "a launch with torch tensors compiles)")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    form = LAYER_FORM if args.layer else DEFAULT_FORM
    print(f"triton {triton.__version__}, sm_{args.arch}, G={tuning.CKPT_INTERVAL['narrow']}")
    for dtype in args.dtypes:
        for BD in args.bd:
            for BT in args.bt:
                for name, fn, kind, rows, extra in KERNELS:
                    if only and name not in only:
                        continue
                    src, options, consts = compile_inputs(
                        name, fn, kind, rows, extra, dtype, BD, BT, form=form,
                        aligned=args.aligned)
                    label = (f"{name:9} {dtype} BD={BD:>3} BT={BT:>2} "
                             f"warps={options['num_warps']}")
                    if "BS" in consts:
                        label += f" BS={consts['BS']}"
                    _report(label, src, options, args.arch,
                             "" if picked(name, dtype, BD, BT) else " (not picked)")
                for name, fn, extra in MLP_KERNELS:
                    step = name.startswith("mlp_step")      # (no chunk: once per BD)
                    if only and name not in only or step and BT != args.bt[0]:
                        continue
                    src, options, consts = mlp_compile_inputs(
                        fn, extra, dtype, BD, BT, form=form, aligned=args.aligned)
                    label = (f"{name:9} {dtype} BD={BD:>3} BT={'-' if step else BT:>2} "
                             f"warps={options['num_warps']}")
                    if "BF" in consts:
                        label += f" BF={consts['BF']}"
                    refused = name == "mlp_bwd" and not mlp_launcher.backward_fits(BD, BT)
                    _report(label, src, options, args.arch, " (not picked)" * refused)


def _report(label: str, src, options: dict, arch: int, note: str) -> None:
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        print(f"{label}: {_usage(kernel)}{note}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a report line
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
              flush=True)


if __name__ == "__main__":
    main()
