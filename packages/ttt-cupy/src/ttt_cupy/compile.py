"""Lazy compilation of the CUDA C++ kernels in ``csrc/`` (CuPy RawModule, NVRTC).

Nothing happens at import. The first call for a (dtype, D_PAD, BT, device arch) builds one
:class:`cupy.RawModule` holding that forward and backward template instance (through
``name_expressions``), cached for the process. The same sources, names and options are
compile-checked without a GPU by :mod:`ttt_cupy.nvrtc_check`.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = "ttt_linear.cu"

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
    raise ValueError(f"head dim {D} above the largest supported {D_PADS[-1]}")


def kernel_name(kind: str, ctype: str, dp: int, bt: int) -> str:
    """The name expression of one instance, e.g. ``ttt_linear_fwd<__half, 64, 16>``."""
    if kind not in ("fwd", "bwd"):
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    return f"ttt_linear_{kind}<{ctype}, {dp}, {bt}>"


def threads(dp: int) -> int:
    """Threads per block (TttTraits::kThreads)."""
    return 256 if dp >= 64 else 128


def smem_bytes(kind: str, dp: int, bt: int) -> int:
    """Dynamic shared memory of one block (TttTraits::kFwdBytes / kBwdBytes, in bytes).

    Tiles are fp32 with rows padded by one float: [BT, D_PAD + 1] tiles, a
    [D_PAD, D_PAD + 1] state, [BT, BT + 1] attention-like tiles. The forward holds the state,
    4 tiles and A; the backward the state and its cotangent, 7 tiles, A and dP. The C++
    traits give the same numbers (checked by ``python -m ttt_cupy.nvrtc_check``)."""
    tile = bt * (dp + 1)
    state = dp * (dp + 1)
    square = bt * (bt + 1)
    if kind == "fwd":
        floats = state + 3 * dp + 4 * tile + square + bt
    elif kind == "bwd":
        floats = 2 * state + 4 * dp + 7 * tile + 2 * square + 3 * bt + 4
    else:
        raise ValueError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    return 4 * floats


HEADER = "ttt_linear.cuh"


def source() -> str:
    """The .cu with the .cuh pasted in place of its #include: one self-contained string, so
    CuPy's on-disk kernel cache (keyed by source and options) sees header changes too."""
    texts = {}
    for name in (SOURCE, HEADER):
        path = CSRC / name
        if not path.is_file():
            raise RuntimeError(f"the CUDA source {path} is missing from the ttt-cupy installation")
        texts[name] = path.read_text()
    include = f'#include "{HEADER}"'
    if include not in texts[SOURCE]:
        raise RuntimeError(f"{SOURCE} does not include {HEADER}")
    return texts[SOURCE].replace(include, f"// ---- {HEADER} ----\n{texts[HEADER]}", 1)


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
def _module(ctype: str, dp: int, bt: int, arch: str) -> Any:
    """One RawModule per (C++ type, D_PAD, BT, arch), compiled now. ``arch`` (the device's
    compute capability, e.g. "90") is part of the key: CuPy compiles for the current device."""
    import cupy

    names = [kernel_name("fwd", ctype, dp, bt), kernel_name("bwd", ctype, dp, bt)]
    module = cupy.RawModule(code=source(), options=NVRTC_OPTIONS + include_options(),
                            name_expressions=names)
    try:
        module.compile()
    except cupy.cuda.compiler.CompileException as err:
        raise RuntimeError(
            f"NVRTC could not compile {names} for sm_{arch}:\n{err.get_message()}") from err
    return module


def get_kernels(dtype_name: str, dp: int, bt: int, device_index: int) -> tuple[Any, Any]:
    """(forward, backward) :class:`cupy.RawKernel` for the inputs' dtype, D_PAD and BT, on
    device ``device_index``; compiled on first use, cached after."""
    import cupy

    if dtype_name not in CTYPES:
        raise TypeError(f"the cupy kernels take {sorted(CTYPES)}, got {dtype_name}")
    if dp not in D_PADS or bt not in BLOCK_TS:
        raise ValueError(f"no kernel instance for D_PAD={dp}, BT={bt} "
                         f"(D_PAD in {D_PADS}, BT in {BLOCK_TS})")
    ctype = CTYPES[dtype_name]
    with cupy.cuda.Device(device_index) as device:
        module = _module(ctype, dp, bt, device.compute_capability)
        fwd = module.get_function(kernel_name("fwd", ctype, dp, bt))
        bwd = module.get_function(kernel_name("bwd", ctype, dp, bt))
    return fwd, bwd
