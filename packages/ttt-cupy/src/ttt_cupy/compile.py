"""Lazy compilation of the CUDA C++ kernels in ``csrc/`` (CuPy RawModule, NVRTC).

Nothing happens at import. The first call for a (pass, dtype, D_PAD, BT, device arch) builds
one :class:`cupy.RawModule` holding that pass's template instances (forward: fwd_chain,
fwd_out; backward: bwd_local, bwd_chain, bwd_grads; through ``name_expressions``), cached
for the process. For half inputs every kernel is its tensor-core (tf32 mma.sync) instance
unless ``TTT_CUPY_MMA=0`` (:func:`use_mma`); float inputs always run SIMT fp32.
The same sources, names and options are compile-checked without a GPU by
:mod:`ttt_cupy.nvrtc_check`.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

CSRC = Path(__file__).resolve().parent / "csrc"
HEADER = "ttt_common.cuh"

PASSES = {
    "fwd": ("fwd_chain", "fwd_out"),
    "bwd": ("bwd_local", "bwd_chain", "bwd_grads"),
}
"""The kernels of each pass, in launch order; kernel ``x`` lives in ``csrc/x.cu`` as the
template ``ttt_linear_x<T, D_PAD, BT>``. One program (RawModule) per pass and instance."""

KERNELS = tuple(k for ks in PASSES.values() for k in ks)

MMA_KERNELS = KERNELS
"""The kernels with a fourth template parameter ``bool MMA`` (all five): their [BT, D] x
[D, D], [D, BT] x [BT, D] and [BT, BT] x [BT, D] products on tensor cores (mma.sync m16n8k8,
tf32 operands, fp32 accumulation) when true. Only half types (``__half``,
``__nv_bfloat16``) have MMA instances; float inputs always run the SIMT fp32 instance
(float32-exact arithmetic)."""

REGISTER_STATE_KERNELS = ("fwd_chain", "bwd_chain")
"""The kernels whose MMA instance keeps the state in registers (one warp per 16 state
columns): it runs with :func:`threads` ``(dp, kernel, mma=True)`` threads and its own shared
memory (:func:`smem_bytes` with ``mma=True``)."""

FUSED_KERNEL = "fwd_chain"
"""The kernel with a fifth template parameter ``bool FUSE``: its FUSE instances also write the
forward's outputs (fwd_out's work, for :func:`ttt_cupy.launcher.fused_forward`), e.g.
``ttt_linear_fwd_chain<__half, 64, 16, true, true>``. :func:`pass_names` lists them as
:data:`FUSED_NAME`."""

FUSED_NAME = "fwd_chain_fused"
"""The key of :data:`FUSED_KERNEL`'s FUSE instance in :func:`pass_names` and
:func:`get_kernels` (forward pass)."""

FUSED_BWD_NAME = "bwd_chain_fused"
"""The key of the fused backward chain (``ttt_linear_bwd_chain_fused<T, D_PAD, BT, true>``,
bwd_chain.cu: bwd_grads' work done in the chain) in :func:`pass_names` and
:func:`get_kernels` (backward pass): tensor-core instances of the half types at D_PAD <=
:data:`FUSED_BWD_MAX_D_PAD` only."""

FUSED_BWD_MAX_D_PAD = 64
"""The widest padded head dim with a fused backward chain (two [D_PAD, D_PAD] tiles in its
shared memory besides the MMA chain's)."""

MMA_ENV = "TTT_CUPY_MMA"
"""``TTT_CUPY_MMA=0`` makes half inputs run the SIMT fp32 instances of :data:`MMA_KERNELS`
too (default: tensor cores for half inputs on sm_80+). Read at every launch."""

MMA_MIN_ARCH = 80
"""mma.sync with tf32 operands needs sm_80 or newer."""

D_PADS = (16, 32, 64, 128)
BLOCK_TS = (16, 32, 64)
CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
"""torch dtype name -> the C++ type of the kernels' template parameter T."""

NVRTC_OPTIONS = ("-std=c++17",)
"""Options for every compile (besides the include path and the arch, which the caller adds).
No --use_fast_math: the fp32 arithmetic must stay IEEE (divisions, sqrt)."""


def d_pad(D: int) -> int:
    """The padded head dim: the smallest of :data:`D_PADS` that holds ``D``."""
    for p in D_PADS:
        if D <= p:
            return p
    raise ValueError(f"head dim: expected at most {D_PADS[-1]}, got {D}")


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"pass: expected one of {tuple(PASSES)}, got {pass_!r}")


def mma_requested() -> bool:
    """False when the environment sets ``TTT_CUPY_MMA=0`` (see :data:`MMA_ENV`)."""
    return os.environ.get(MMA_ENV, "1").strip() != "0"


def use_mma(ctype: str, arch: str | int | None = None) -> bool:
    """Whether the kernels run their tensor-core instances for C++ type ``ctype``: a half
    type, :func:`mma_requested`, and (when given) a compute capability of at least 8.0."""
    if ctype == "float" or not mma_requested():
        return False
    return arch is None or int(arch) >= MMA_MIN_ARCH


def _check_fused(kernel: str, fused: bool) -> None:
    if fused and kernel != FUSED_KERNEL:
        raise ValueError(f"fused: only {FUSED_KERNEL} has fused instances, not {kernel!r}")


def kernel_name(kernel: str, ctype: str, dp: int, bt: int, mma: bool | None = None,
                fused: bool = False) -> str:
    """The name expression of one instance, e.g. ``ttt_linear_fwd_out<float, 64, 16, false>``
    or ``ttt_linear_fwd_chain<__half, 64, 16, true>``. ``mma`` matters for :data:`MMA_KERNELS`
    only (None: the type's default, true for half types); float has no MMA instance.
    ``fused``: :data:`FUSED_KERNEL`'s instance that writes the outputs (``..., true>``)."""
    _check_kernel(kernel)
    _check_fused(kernel, fused)
    if kernel not in MMA_KERNELS:
        return f"ttt_linear_{kernel}<{ctype}, {dp}, {bt}>"
    if mma is None:
        mma = ctype != "float"
    if mma and ctype == "float":
        raise ValueError("float inputs have no MMA instance (float32-exact arithmetic)")
    return (f"ttt_linear_{kernel}<{ctype}, {dp}, {bt}, {'true' if mma else 'false'}"
            + (", true>" if fused else ">"))


def pass_names(pass_: str, ctype: str, dp: int, bt: int, mma: bool) -> dict[str, str]:
    """{kernel: name expression} of one pass as launched (``mma``: see :func:`use_mma`); the
    forward also holds :data:`FUSED_NAME`, the chain that writes the outputs."""
    _check_pass(pass_)
    mma = mma and ctype != "float"
    names = {k: kernel_name(k, ctype, dp, bt, mma) for k in PASSES[pass_]}
    if FUSED_KERNEL in PASSES[pass_]:
        names[FUSED_NAME] = kernel_name(FUSED_KERNEL, ctype, dp, bt, mma, fused=True)
    if pass_ == "bwd" and mma and dp <= FUSED_BWD_MAX_D_PAD:
        names[FUSED_BWD_NAME] = f"ttt_linear_bwd_chain_fused<{ctype}, {dp}, {bt}, true>"
    return names


def program_names(pass_: str, ctype: str, dp: int, bt: int) -> list[str]:
    """Every name expression the backend may launch from one (pass, type, D_PAD, BT) program:
    the pass's kernels (and the fused forward chain), plus their SIMT instances for half
    types."""
    names = list(pass_names(pass_, ctype, dp, bt, ctype != "float").values())
    if ctype != "float":
        names += list(pass_names(pass_, ctype, dp, bt, False).values())
    return names


def threads(dp: int, kernel: str | None = None, mma: bool = False) -> int:
    """Threads per block: Traits::kThreads for every kernel, except the MMA instances of
    :data:`REGISTER_STATE_KERNELS` (Traits::kTcThreads, a warp per 16 state columns)."""
    if mma and kernel in REGISTER_STATE_KERNELS:
        return 32 * (dp // 16)
    return 256 if dp >= 64 else 128


def grads_split(dp: int, bt: int) -> int:
    """Blocks per (group, head) of bwd_grads (Traits::kGradsSplit): 2 at D_PAD 128 with BT 64,
    each holding half of the state's rows (and of q's and k's columns) so that the block fits
    an H100/H200's 227 KiB; 1 elsewhere. The launcher multiplies bwd_grads' grid by it."""
    return 2 if (dp, bt) == (128, 64) else 1


BLOCK_ROWS_KERNELS = ("fwd_out", "bwd_local")
"""Group kernels whose MMA instances walk their group in blocks of :func:`out_rows` rows."""


def out_rows(dp: int, bt: int) -> int:
    """Rows per block of the MMA instances of :data:`BLOCK_ROWS_KERNELS` (Traits::kOutRows): 64
    at D_PAD <= 32, 32 at D_PAD 64 with chunk 16, else one chunk."""
    if dp <= 32:
        return 64
    return 32 if dp == 64 and bt < 32 else bt


STAGE_SMEM_LIMIT = 163 * 1024  # the A100's opt-in shared memory per block (Traits::kStageLimit)


def _chain_tc_floats(kernel: str, dp: int, bt: int, fused: bool) -> int:
    """Shared memory (floats) of a chain's MMA instance without its stage."""
    tile, square, warps = bt * (dp + 1), bt * (bt + 1), dp // 16
    if kernel == "bwd_chain":
        return 4 * tile + 12 * warps * bt      # Q, K double-buffered; 3 rounds of row sums
    base = 4 * tile + 4 * warps * bt           # K, V double-buffered; 2 rounds of statistics
    # fused: Q double-buffered, A, eta double-buffered, one more round (o_pre's rows)
    return base + (2 * tile + square + 2 * bt + 2 * warps * bt if fused else 0)


def bwd_chain_stage_floats(dp: int, bt: int) -> int:
    """Shared memory (floats) of bwd_chain's MMA instance for the previous chunk's rows staged
    by cp.async (Traits::kBwdChainStageFloats): xh, do_pre, dg, v, q, k as [BT, D_PAD + 4]
    floats each, then r's [BT]; 0 where the whole block would pass :data:`STAGE_SMEM_LIMIT`
    (Traits::kBwdChainStage false: (64, 64), (128, 32), (128, 64) load those rows through
    registers and L1). The forward chain keeps its register-staged loads: on an H200 the same
    staging makes it slower."""
    stage = 6 * bt * (dp + 4) + bt
    base = _chain_tc_floats("bwd_chain", dp, bt, False)
    return stage if 4 * (base + stage) <= STAGE_SMEM_LIMIT else 0


def _bwd_grads_base_floats(dp: int, bt: int) -> int:
    """Shared memory (floats) of a bwd_grads block without its stage: W, dW (its rows), Q, K
    (their columns), DOP, G, DKH, S, eta."""
    rows = dp // grads_split(dp, bt)     # the block's state rows (and q, k columns)
    return 2 * rows * (dp + 1) + 2 * bt * (rows + 1) + 3 * bt * (dp + 1) + bt * (bt + 1) + bt


def _block_rows_floats(kernel: str, dp: int, bt: int) -> int:
    """Shared memory (floats) of the MMA instance of a :data:`BLOCK_ROWS_KERNELS` kernel
    without its stage, in blocks of R = :func:`out_rows` rows: fwd_out W, hb, Q, K, G
    ([R, D_PAD + 1]), M ([R, R + 1]), eta; bwd_local W, hb, Q, K, DO, G, A, M / dS / dP', eta."""
    r = out_rows(dp, bt)
    tiles, squares = {"fwd_out": (3, 1), "bwd_local": (4, 2)}[kernel]
    return dp * (dp + 1) + dp + tiles * r * (dp + 1) + squares * r * (r + 1) + r


def fwd_out_stage_floats(dp: int, bt: int) -> int:
    """Shared memory (floats) of fwd_out's MMA instance for the next block's rows staged by
    cp.async (Traits::kFwdOutTcFloatsT<2> past the block): from a 16-byte aligned offset, q, k,
    v as [R, D_PAD + 8] halves each (R = :func:`out_rows`), xh as [R, D_PAD + 4] floats, then
    r's and eta's [R]; 0 at D_PAD 128 and where R * D_PAD > 2048 (Traits::kOutStage false:
    those load their rows from device memory, with prefetch hints). Sized for 2-byte inputs,
    the only ones fwd_out's MMA instance takes on a GPU."""
    r = out_rows(dp, bt)
    if dp > 64 or dp * r > 2048:
        return 0
    base = _block_rows_floats("fwd_out", dp, bt)
    return (-base) % 4 + 3 * r * (dp + 8) // 2 + r * (dp + 4) + 2 * r


def bwd_grads_stage_floats(dp: int, bt: int) -> int:
    """Shared memory (floats) of bwd_grads' stage (Traits::kGradsStageFloats): the next chunk's
    do_pre as [BT, D_PAD + 4] floats from a 16-byte aligned offset, then eta's [BT]; 0 where
    bwd_grads splits the state's rows or the whole block would pass :data:`STAGE_SMEM_LIMIT`
    (Traits::kGradsStage false: those load their tiles from device memory)."""
    base = _bwd_grads_base_floats(dp, bt)
    stage = (-base) % 4 + bt * (dp + 4) + bt
    fits = grads_split(dp, bt) == 1 and 4 * (base + stage) <= STAGE_SMEM_LIMIT
    return stage if fits else 0


def bwd_local_stage_floats(dp: int, bt: int) -> int:
    """Shared memory (floats) of bwd_local's MMA instance for the next block's q, k, do staged
    by cp.async (Traits::kLocalStageFloats): [R, D_PAD + 4] floats each (R = :func:`out_rows`)
    from a 16-byte aligned offset, then eta's [R], and at D_PAD 64 the stored xh, v, r
    (kLocalStageSavedFloats); 0 at D_PAD 128 (where the stage would leave 1 block per SM
    instead of 2: slower on an H200) and where the whole block would pass
    :data:`STAGE_SMEM_LIMIT` (Traits::kLocalStage false: those load their tiles from device
    memory)."""
    r = out_rows(dp, bt)
    base = _block_rows_floats("bwd_local", dp, bt)
    stage = (-base) % 4 + 3 * r * (dp + 4) + r
    if not (dp <= 64 and 4 * (base + stage) <= STAGE_SMEM_LIMIT):
        return 0
    # at D_PAD 64 (Traits::kLocalStageSaved) also the g row pass's xh, v ([R, D_PAD + 4]
    # floats each) and r ([R]): the block stays at 2 per H200 SM
    return stage + (2 * r * (dp + 4) + r if dp == 64 else 0)


@functools.cache
def smem_bytes(kernel: str, dp: int, bt: int, mma: bool = False, fused: bool = False) -> int:
    """Dynamic shared memory of one block of ``kernel`` in bytes (Traits::k*Bytes).

    fp32 tiles with rows padded by one float: [BT, D_PAD + 1] tiles, [D_PAD, D_PAD + 1]
    states, [BT, BT + 1] square tiles, [D_PAD] / [BT] vectors. The MMA instances of
    :data:`REGISTER_STATE_KERNELS` hold no state in shared memory (Traits::k*TcBytes);
    those of :data:`BLOCK_ROWS_KERNELS` hold blocks of :func:`out_rows` rows and their stage
    (Traits::kFwdOutTcBytes, kBwdLocalTcBytes);
    bwd_grads holds 1 / :func:`grads_split` of the state's rows; ``fused``: the instance of
    :data:`FUSED_KERNEL` that writes the outputs (Traits::kFwdChainFused*Bytes). The C++
    traits give the same numbers (checked by ``python -m ttt_cupy.nvrtc_check``)."""
    _check_kernel(kernel)
    _check_fused(kernel, fused)
    tile, state, square = bt * (dp + 1), dp * (dp + 1), bt * (bt + 1)
    if mma and kernel in REGISTER_STATE_KERNELS:
        # fwd: K, V double-buffered, 2 rounds of per-warp statistics; fused: then Q
        # double-buffered, A, eta double-buffered, one more round (o_pre's rows). bwd: Q, K
        # double-buffered, 3 rounds of (up to) 4 per-warp row sums, then its stage (if any)
        stage = bwd_chain_stage_floats(dp, bt) if kernel == "bwd_chain" else 0
        return 4 * (_chain_tc_floats(kernel, dp, bt, fused) + stage)
    if fused:
        return smem_bytes("fwd_out", dp, bt)     # fwd_out's tiles: W, hb, K, G, Q, A, eta
    if mma and kernel in BLOCK_ROWS_KERNELS:  # blocks of out_rows rows, then their stage
        stage = (bwd_local_stage_floats if kernel == "bwd_local" else fwd_out_stage_floats)(dp, bt)
        return 4 * (_block_rows_floats(kernel, dp, bt) + stage)
    floats = {
        "fwd_chain": state + dp + 2 * tile,                       # W, hb, K, G
        "fwd_out": state + dp + 3 * tile + square + bt,           # W, hb, Q, K, G, A, eta
        "bwd_local": state + dp + 4 * tile + 2 * square + bt,     # W, hb, Q, K, DO, G, A, dS
        "bwd_chain": state + dp + 4 * tile + bt,                  # dW, dhb, Q, K, DOP, DKH
        # its rows of W, dW, ..., then its stage (if any)
        "bwd_grads": _bwd_grads_base_floats(dp, bt) + bwd_grads_stage_floats(dp, bt),
    }[kernel]
    return 4 * floats


@functools.cache
def bwd_chain_fused_smem_bytes(dp: int, bt: int) -> int:
    """Dynamic shared memory of the fused backward chain (Traits::kBwdChainFusedTcBytes): the
    MMA chain's, then g, dkh, do_pre tiles ([BT, D_PAD + 1]), dW and W ([D_PAD, D_PAD + 1]),
    S ([BT, BT + 1]) and eta ([BT])."""
    if dp > FUSED_BWD_MAX_D_PAD:
        raise ValueError(f"D_PAD: the fused backward chain needs at most {FUSED_BWD_MAX_D_PAD}, "
                         f"got {dp}")
    tile, state, square = bt * (dp + 1), dp * (dp + 1), bt * (bt + 1)
    return smem_bytes("bwd_chain", dp, bt, True) + 4 * (3 * tile + 2 * state + square + bt)


def pass_smem(pass_: str, dp: int, bt: int) -> tuple[str, int]:
    """(kernel, bytes) of the pass's kernel that needs the most shared memory (any instance,
    the fused forward chain's included)."""
    _check_pass(pass_)
    return max(((k, max(smem_bytes(k, dp, bt, mma, fused)
                        for mma in (False, True)
                        for fused in ((False, True) if k == FUSED_KERNEL else (False,))))
                for k in PASSES[pass_]), key=lambda kv: kv[1])


def source(pass_: str) -> str:
    """The pass's .cu files with the .cuh pasted once in place of their #include: one
    self-contained string, so CuPy's on-disk kernel cache (keyed by source and options)
    sees header changes too."""
    _check_pass(pass_)
    include = f'#include "{HEADER}"'
    parts = [f"// ---- {HEADER} ----\n{_read(HEADER)}"]
    for kernel in PASSES[pass_]:
        name = f"{kernel}.cu"
        text = _read(name)
        if include not in text:
            raise RuntimeError(f"{name} does not include {HEADER}")
        parts.append(f"// ---- {name} ----\n" + text.replace(include, "", 1))
    return "\n".join(parts)


def _read(name: str) -> str:
    path = CSRC / name
    if not path.is_file():
        raise RuntimeError(f"the CUDA source {path} is missing from the ttt-cupy installation")
    return path.read_text()


def cuda_include_dir() -> str | None:
    """The directory holding cuda_fp16.h / cuda_bf16.h: from the CUDA-runtime (or NVRTC) wheel
    via cuda.pathfinder, else site-packages' nvidia/*/include, else CUDA_HOME / CUDA_PATH.
    None when NVRTC's built-in headers have to do."""
    try:
        from cuda import pathfinder

        for lib in ("cudart", "nvrtc"):
            try:
                found = pathfinder.find_nvidia_header_directory(lib)
            except Exception:  # noqa: BLE001 - pathfinder raises its own types per version
                found = None
            if found and (Path(found) / "cuda_fp16.h").is_file():
                return str(found)
    except ImportError:
        pass
    for entry in sys.path:
        base = Path(entry) / "nvidia"
        if not base.is_dir():
            continue
        for sub in ("cu13", "cuda_runtime", "cuda_nvrtc", "cu12"):
            inc = base / sub / "include"
            if (inc / "cuda_fp16.h").is_file():
                return str(inc)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "include" / "cuda_fp16.h").is_file():
            return str(Path(root) / "include")
    return None


def include_options() -> tuple[str, ...]:
    """-I for the CUDA headers (cuda_fp16.h, cuda_bf16.h), when found."""
    inc = cuda_include_dir()
    return () if inc is None else (f"-I{inc}",)


@functools.cache
def _module(pass_: str, ctype: str, dp: int, bt: int, arch: str, mma: bool) -> Any:
    """One RawModule per (pass, C++ type, D_PAD, BT, arch, mma), compiled now. ``arch`` (the
    device's compute capability, e.g. "90") is part of the key: CuPy compiles for the current
    device."""
    import cupy

    names = list(pass_names(pass_, ctype, dp, bt, mma).values())
    module = cupy.RawModule(code=source(pass_), options=NVRTC_OPTIONS + include_options(),
                            name_expressions=names)
    try:
        module.compile()
    except cupy.cuda.compiler.CompileException as err:
        raise RuntimeError(
            f"NVRTC could not compile {names} for sm_{arch}:\n{err.get_message()}") from err
    return module


@functools.cache
def device_arch(device_index: int) -> str:
    """The compute capability of device ``device_index`` without a dot (e.g. "90"), asked
    once per process."""
    import cupy

    return cupy.cuda.Device(device_index).compute_capability


def kernels_use_mma(dtype_name: str, device_index: int) -> bool:
    """Whether :func:`get_kernels` gives the tensor-core instances for this dtype on this
    device (:func:`use_mma` with the device's compute capability)."""
    return use_mma(CTYPES[dtype_name], device_arch(device_index))


def get_kernels(pass_: str, dtype_name: str, dp: int, bt: int,
                device_index: int) -> Mapping[str, Any]:
    """{kernel: :class:`cupy.RawKernel`} of one pass (``"fwd"`` or ``"bwd"``) for the inputs'
    dtype, D_PAD and BT, on device ``device_index``; compiled on first use, cached after (the
    same read-only table, and the same kernel objects, at every call: CuPy's
    ``RawModule.get_function`` builds a new RawKernel each time it is asked).
    The kernels are the tensor-core instances when :func:`use_mma` says so (half
    inputs, ``TTT_CUPY_MMA`` not ``0``, sm_80+), else the SIMT fp32 ones."""
    _check_pass(pass_)
    if dtype_name not in CTYPES:
        raise TypeError(f"dtype: expected one of {sorted(CTYPES)}, got {dtype_name}")
    if dp not in D_PADS:
        raise ValueError(f"D_PAD: expected one of {D_PADS}, got {dp}")
    if bt not in BLOCK_TS:
        raise ValueError(f"chunk_size: expected one of {BLOCK_TS}, got {bt}")
    ctype = CTYPES[dtype_name]
    arch = device_arch(device_index)
    return _kernel_table(pass_, ctype, dp, bt, device_index, arch, use_mma(ctype, arch))


@functools.cache
def _kernel_table(pass_: str, ctype: str, dp: int, bt: int, device_index: int, arch: str,
                  mma: bool) -> Mapping[str, Any]:
    import cupy

    with cupy.cuda.Device(device_index):
        module = _module(pass_, ctype, dp, bt, arch, mma)
        return MappingProxyType({k: module.get_function(name)
                                 for k, name in pass_names(pass_, ctype, dp, bt, mma).items()})
