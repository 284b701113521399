"""The kernels' names and sources, and their lazy compilation (NVRTC through cuda-python).

The first call for a (pass, dtype, D_PAD, BT, device arch, variant) compiles that pass's
template instances, a program each, side by side (NVRTC runs outside the GIL) into the disk
cache (:mod:`ttt_cupy.diskcache`), and CuPy loads them from there. The *variant* (``eta_key``
given, the output form) picks the instances of the kernels it changes (:data:`VARIANT_KERNELS`);
the default variant spells no such parameter. Half inputs run the tensor-core (tf32 mma.sync)
instances unless turned off (:func:`use_mma`); float inputs and fwd_decode run SIMT fp32.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

CSRC = Path(__file__).resolve().parent / "csrc"

PASSES = {"fwd": ("fwd_chain", "fwd_out"), "bwd": ("bwd_local", "bwd_chain", "bwd_grads"),
          "dec": ("fwd_decode",)}
"""The kernels of each pass, in launch order; kernel ``x`` is the template ``ttt_linear_x<T,
D_PAD, BT, MMA, ...>`` of ``csrc/x.cu``; ``MMA`` instances (half types only) run tf32
mma.sync."""

DECODE_PASS, DECODE_KERNEL = "dec", "fwd_decode"
"""The pass and kernel of a short generation step (placement.row_step):
``ttt_linear_fwd_decode<T, D_PAD, KEY, OUT, P>``, no chunk size, no ``MMA``; ``P`` is the
type it reads eta, w, b and eta_key in: float, or T (``native_params``)."""

KERNELS = tuple(k for pass_, ks in PASSES.items() if pass_ != DECODE_PASS for k in ks)

REGISTER_STATE_KERNELS = ("fwd_chain", "bwd_chain")
"""Their MMA instances keep the state in registers (one warp per 16 state columns)."""

FUSED_KERNEL, FUSED_NAME = "fwd_chain", "fwd_chain_fused"
"""Its ``FUSE`` instances (a fifth template parameter) also write the outputs; the key of
that instance in the forward's kernel table."""

FUSED_BWD_NAME = "bwd_chain_fused"
"""The key of ``ttt_linear_bwd_chain_fused<T, D_PAD, BT, true, KEY>`` (bwd_grads' work in the
chain; half types at D_PAD <= :data:`FUSED_BWD_MAX_D_PAD`) in the backward's kernel table."""

FUSED_BWD_MAX_D_PAD = 64
"""Two more [D_PAD, D_PAD] tiles in shared memory do not fit beyond it."""

MMA_MIN_ARCH = 80
"""mma.sync with tf32 operands needs sm_80 or newer."""

OUT_FORMS = {"norm_residual": 0, "query_residual": 1, "raw": 2}
"""Output form -> the kernels' ``OUT`` template argument (csrc/types.cuh)."""

VARIANT_KERNELS = {"fwd_chain": ("KEY", "OUT"), "fwd_out": ("OUT",), "bwd_local": ("OUT",),
                   "bwd_chain": ("KEY",), "bwd_grads": ("KEY",)}
"""The variant's template parameters of each kernel after ``MMA`` (and fwd_chain's ``FUSE``):
``KEY`` (eta_key) where a kernel computes the LayerNorm's r, ``OUT`` where it writes o or
takes its cotangent (fwd_chain: its FUSE instance only)."""

D_PADS = (16, 32, 64, 128)
BLOCK_TS = (16, 32, 64)
CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
"""torch dtype name -> the C++ type of the kernels' template parameter T."""

NVRTC_OPTIONS = ("-std=c++17",)
"""No --use_fast_math: IEEE divisions and sqrt (:func:`compile_options` adds the headers)."""


def d_pad(D: int) -> int:
    """The padded head dim: the smallest of :data:`D_PADS` that holds ``D``."""
    if D > D_PADS[-1]:
        raise ValueError(f"head dim: expected at most {D_PADS[-1]}, got {D}")
    return next(p for p in D_PADS if D <= p)


def _check_pass(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"pass: expected one of {tuple(PASSES)}, got {pass_!r}")


def _check_variant(key: bool, out: str) -> None:
    if out not in OUT_FORMS:
        raise ValueError(f"output: expected one of {tuple(OUT_FORMS)}, got {out!r}")
    if not isinstance(key, bool):
        raise TypeError(f"key: expected a bool, got {key!r}")


def use_mma(ctype: str, arch: str | int | None = None, requested: bool = True) -> bool:
    """Whether the kernels run their tensor-core instances: a half ``ctype``, ``requested``
    (:attr:`CupyConfig.mma <ttt_cupy.config.CupyConfig>`) and (when given) sm_80 or newer."""
    if ctype == "float" or not requested:
        return False
    return arch is None or int(arch) >= MMA_MIN_ARCH


def _cpp(x: bool | int | str) -> str:
    return ("true" if x else "false") if isinstance(x, bool) else str(x)


def _spell(kernel: str, targs: list, extra: list) -> str:
    """``ttt_linear_<kernel><targs, extra>`` without ``extra``'s trailing defaults."""
    while extra and not extra[-1]:
        extra = extra[:-1]
    return f"ttt_linear_{kernel}<{', '.join(_cpp(x) for x in (*targs, *extra))}>"


def kernel_name(kernel: str, ctype: str, dp: int, bt: int, mma: bool | None = None,
                fused: bool = False, key: bool = False, out: str = "norm_residual",
                native_params: bool = False) -> str:
    """The name expression of one instance, e.g. ``ttt_linear_fwd_out<float, 64, 16, false>``
    (``mma`` None: true for half types; ``fused``: the FUSE instance; ``native_params``: see
    :data:`DECODE_KERNEL`)."""
    if kernel not in KERNELS and kernel != DECODE_KERNEL:
        raise ValueError(f"kernel: expected one of {(*KERNELS, DECODE_KERNEL)}, got {kernel!r}")
    if fused and kernel != FUSED_KERNEL:
        raise ValueError(f"fused: only {FUSED_KERNEL} has fused instances, not {kernel!r}")
    _check_variant(key, out)
    if native_params and kernel != DECODE_KERNEL:
        raise ValueError(f"native_params: only {DECODE_KERNEL} reads eta, w, b in the input "
                         f"type, not {kernel!r}")
    if kernel == DECODE_KERNEL and mma:
        raise ValueError(f"{DECODE_KERNEL} has no MMA instance (SIMT fp32 for every type)")
    if mma and ctype == "float":
        raise ValueError("float inputs have no MMA instance (float32-exact arithmetic)")
    if kernel == DECODE_KERNEL:
        p = ctype if native_params and ctype != "float" else ""    # float: the default
        return _spell(kernel, [ctype, dp], [key, OUT_FORMS[out], p])
    values = {"KEY": key, "OUT": OUT_FORMS[out] if fused or kernel != FUSED_KERNEL else 0}
    extra = [fused] * (kernel == FUSED_KERNEL) + [values[p] for p in VARIANT_KERNELS[kernel]]
    return _spell(kernel, [ctype, dp, bt, ctype != "float" if mma is None else mma], extra)


def decode_name(ctype: str, dp: int, key: bool = False, out: str = "norm_residual",
                native_params: bool = False) -> str:
    """The name expression of a :data:`DECODE_KERNEL` instance, e.g.
    ``ttt_linear_fwd_decode<__half, 64, false, 0, __half>`` (``P``: float unless
    ``native_params``)."""
    return kernel_name(DECODE_KERNEL, ctype, dp, 0, False, False, key, out, native_params)


def pass_names(pass_: str, ctype: str, dp: int, bt: int, mma: bool, key: bool = False,
               out: str = "norm_residual", native_params: bool = False) -> dict[str, str]:
    """{kernel: name expression} of one pass as launched (``dec``: whatever ``bt`` and
    ``mma``), with :data:`FUSED_NAME` (forward) or :data:`FUSED_BWD_NAME` (backward) where it
    exists."""
    _check_pass(pass_)
    mma = mma and ctype != "float" and pass_ != DECODE_PASS
    v = dict(key=key, out=out, native_params=native_params)
    names = {k: kernel_name(k, ctype, dp, bt, mma, **v) for k in PASSES[pass_]}
    if FUSED_KERNEL in PASSES[pass_]:
        names[FUSED_NAME] = kernel_name(FUSED_KERNEL, ctype, dp, bt, mma, True, **v)
    if pass_ == "bwd" and mma and dp <= FUSED_BWD_MAX_D_PAD:
        names[FUSED_BWD_NAME] = _spell("bwd_chain_fused", [ctype, dp, bt, True], [key])
    return names


_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.M)


def source(pass_: str) -> str:
    """The pass's .cu files with their csrc/ headers pasted in at their first #include: one
    string, so that the disk cache's key covers the headers."""
    _check_pass(pass_)
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        path = CSRC / name
        if not path.is_file():
            raise RuntimeError(f"the CUDA source {path} is missing from the ttt-cupy "
                               f"installation")
        return _LOCAL_INCLUDE.sub(lambda m: expand(m.group(1)), path.read_text())

    return "\n".join(f"// ---- {k}.cu ----\n{expand(f'{k}.cu')}" for k in PASSES[pass_])


def cuda_include_dir() -> str | None:
    """The directory of cuda_fp16.h / cuda_bf16.h: cuda.pathfinder's, else site-packages'
    nvidia/*/include, else CUDA_HOME / CUDA_PATH's; None: NVRTC's built-in headers."""
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
    candidates = [Path(entry) / "nvidia" / sub / "include" for entry in sys.path
                  for sub in ("cu13", "cuda_runtime", "cuda_nvrtc", "cu12")]
    candidates += [Path(os.environ[var]) / "include" for var in ("CUDA_HOME", "CUDA_PATH")
                   if os.environ.get(var)]
    return next((str(inc) for inc in candidates if (inc / "cuda_fp16.h").is_file()), None)


def compile_options() -> tuple[str, ...]:
    """The options of every compile but the arch: :data:`NVRTC_OPTIONS` and -I for the CUDA
    headers (cuda_fp16.h, cuda_bf16.h), when found."""
    inc = cuda_include_dir()
    return NVRTC_OPTIONS + (() if inc is None else (f"-I{inc}",))


_PREFETCHES: dict[tuple, threading.Thread] = {}   # compiles under way, by _modules' key
_PREFETCHED: set[tuple] = set()                    # every one started
_PREFETCH_LOCK = threading.Lock()


def prefetch(pass_: str, dtype_name: str, dp: int, bt: int, device_index: int, mma: bool,
             key: bool = False, out: str = "norm_residual") -> None:
    """Compile one pass's programs (:func:`get_kernels`' arguments) into the disk cache in the
    background, once per process (a training forward asks for its backward's): NVRTC and
    files only, no CUDA call; that pass's first :func:`get_kernels` waits. Not daemon threads:
    one stopped inside NVRTC at interpreter exit crashes the process."""
    ctype = CTYPES[dtype_name]
    bt, mma = _pass_key(pass_, ctype, bt, mma)
    args = (pass_, ctype, dp, bt, device_arch(device_index), mma, key, out)
    with _PREFETCH_LOCK:
        if args in _PREFETCHED:
            return
        _PREFETCHED.add(args)
        thread = _PREFETCHES[args] = threading.Thread(target=_compile_into_cache, args=args,
                                                      name="ttt-cupy-prefetch")
    thread.start()


def _compile_into_cache(pass_, ctype, dp, bt, arch, mma, key, out) -> None:
    _compile_programs(pass_, list(pass_names(pass_, ctype, dp, bt, mma, key, out).values()),
                      arch)


def _compile_programs(pass_: str, names: list[str], arch: str) -> None:
    """Compile each name expression the disk cache lacks as a program of its own, a thread
    each; failures are left for the load (:func:`_modules`) to meet again."""
    from .config import config
    from .diskcache import compile_into

    args = (config().cache_dir, source(pass_))
    options = compile_options()
    threads = [threading.Thread(target=compile_into, args=(*args, [name], options, arch),
                                name="ttt-cupy-compile") for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _prefetched(args: tuple) -> bool:
    """Wait for the background compile of ``args``, if one was started; whether one was."""
    with _PREFETCH_LOCK:
        thread = _PREFETCHES.pop(args, None)
    if thread is not None:
        thread.join()
    return thread is not None


@functools.cache
def _modules(pass_: str, ctype: str, dp: int, bt: int, arch: str, mma: bool, key: bool = False,
             out: str = "norm_residual", native_params: bool = False) -> dict[str, Any]:
    """{name expression: its module} of one pass for ``arch`` (e.g. "90"), loaded from the
    disk cache once compiled (by a :func:`prefetch` under way, or now). RuntimeError when a
    program does not compile or load."""
    from .config import config
    from .diskcache import load_or_compile

    names = list(pass_names(pass_, ctype, dp, bt, mma, key, out, native_params).values())
    if not _prefetched((pass_, ctype, dp, bt, arch, mma, key, out)):
        _compile_programs(pass_, names, arch)
    code, options = source(pass_), compile_options()
    return {name: load_or_compile(config().cache_dir, code, [name], options, arch)
            for name in names}


@functools.cache
def device_arch(device_index: int) -> str:
    """The compute capability of device ``device_index`` without a dot (e.g. "90")."""
    import cupy

    return cupy.cuda.Device(device_index).compute_capability


def get_kernels(pass_: str, dtype_name: str, dp: int, bt: int, device_index: int,
                mma: bool, key: bool = False, out: str = "norm_residual",
                native_params: bool = False) -> Mapping[str, Any]:
    """{kernel: :class:`cupy.RawKernel`} of one pass (``"fwd"``, ``"bwd"`` or ``"dec"``) on
    device ``device_index``; compiled on first use, then the same read-only table and kernel
    objects at every call (CuPy's ``get_function`` builds a new RawKernel each time)."""
    _check_pass(pass_)
    if dtype_name not in CTYPES:
        raise TypeError(f"dtype: expected one of {sorted(CTYPES)}, got {dtype_name}")
    for what, value, allowed in (("D_PAD", dp, D_PADS), ("chunk_size", bt, BLOCK_TS)):
        if value not in allowed:
            raise ValueError(f"{what}: expected one of {allowed}, got {value}")
    _check_variant(key, out)
    ctype = CTYPES[dtype_name]
    bt, mma = _pass_key(pass_, ctype, bt, mma)
    native = native_params and ctype != "float"   # (P = T = float: the default instance)
    return _kernel_table(pass_, ctype, dp, bt, device_index, device_arch(device_index), mma,
                         key, out, native)


def _pass_key(pass_: str, ctype: str, bt: int, mma: bool) -> tuple[int, bool]:
    """(BT, mma) as the caches key a pass: no MMA for float, neither (0, False) for ``dec``."""
    if pass_ == DECODE_PASS:
        return 0, False
    return bt, mma and ctype != "float"


@functools.cache
def _kernel_table(pass_: str, ctype: str, dp: int, bt: int, device_index: int, arch: str,
                  mma: bool, key: bool = False, out: str = "norm_residual",
                  native_params: bool = False) -> Mapping[str, Any]:
    import cupy

    with cupy.cuda.Device(device_index):
        modules = _modules(pass_, ctype, dp, bt, arch, mma, key, out, native_params)
        names = pass_names(pass_, ctype, dp, bt, mma, key, out, native_params)
        return MappingProxyType({k: modules[name].get_function(name)
                                 for k, name in names.items()})
