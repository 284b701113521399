"""Compile every kernel instance of the cupy backend with NVRTC, without a GPU or a driver.

    python -m tools.nvrtc_check                  # every instance, sm_80 and sm_90 cubins

compiles one program per (pass, dtype, D_PAD, BT) holding every instance the backend compiles
at run time (the half types' tensor-core and SIMT ones; fwd_decode per dtype and D_PAD), for
each ``--arch`` (default sm_80 and sm_90), to cubins or with ``--ptx-only ARCH`` to PTX only.
It checks the C++ traits against the generated table and that a kernel's PTX holds tf32
``mma.sync`` exactly when it is a tensor-core instance. Needs ``pip install
'./packages/ttt-cupy[compile-check]'``; exits 1 with the NVRTC log on the first failure.
``--pass``, ``--dtype``, ``--d-pad`` and ``--chunk`` select some programs. The backend's
tests (packages/ttt-cupy/tests/test_nvrtc_compile.py) run it on every kernel variant.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from ttt_cupy._traits_table import FIELDS, TRAITS
from ttt_cupy.compile import (
    BLOCK_TS,
    CTYPES,
    D_PADS,
    DECODE_KERNEL,
    DECODE_PASS,
    OUT_FORMS,
    PASSES,
    compile_options,
    cuda_include_dir,
    pass_names,
    source,
)
from ttt_cupy.diskcache import NvrtcError, bindings, log, output
from ttt_cupy.diskcache import program as nvrtc_program

DEFAULT_ARCHS = ("80", "90")

CheckError = NvrtcError   # a compile or a check of its output failed (with the NVRTC log)


@dataclass
class Compiled:
    arch: str
    names: dict[str, str]          # name expression -> lowered (mangled) name
    cubin_bytes: int
    log: str
    mma: dict[str, int]            # name expression -> tf32 mma.sync instructions in its PTX


MMA_PTX = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"


def is_mma_instance(name: str) -> bool:
    """Whether a name expression is a tensor-core instance (fourth template argument true)."""
    if name.startswith(f"ttt_linear_{DECODE_KERNEL}<"):
        return False
    args = name[name.index("<") + 1:name.rindex(">")].replace(" ", "").split(",")
    return len(args) >= 4 and args[3] == "true"


def mma_counts(ptx: str, lowered: dict[str, str]) -> dict[str, int]:
    """{name expression: tf32 mma.sync instructions in its kernel's PTX}."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\S+?)\s*\(", ptx)]
    ends = [pos for pos, _ in starts[1:]] + [len(ptx)]
    bodies = {sym: ptx[pos:end] for (pos, sym), end in zip(starts, ends)}
    missing = [f"{low} ({name})" for name, low in lowered.items() if low not in bodies]
    if missing:
        raise CheckError(f"no .entry {missing[0]} in the PTX")
    return {name: bodies[low].count(MMA_PTX) for name, low in lowered.items()}


def smem_asserts() -> str:
    """static_asserts tying the C++ traits to :mod:`ttt_cupy._traits_table`."""
    return "\n" + "\n".join(
        f"static_assert(ttt::Traits<{dp}, {bt}>::{field} == {value}ull, "
        f"\"_traits_table.py is stale: Traits<{dp}, {bt}>::{field}\");"
        for (dp, bt), row in TRAITS.items() for field, value in zip(FIELDS, row)) + "\n"


def compile_instance(code: str, names: list[str], arch: str, options: list[str],
                     ptxas_verbose: bool = False, cubin: bool = True) -> Compiled:
    """Compile ``code`` with ``names`` to a cubin for sm_``arch`` (``cubin`` False: PTX only)."""
    target = f"sm_{arch}" if cubin else f"compute_{arch}"
    verbose = ["--ptxas-options=-v"] if ptxas_verbose and cubin else []
    with nvrtc_program(code, names, [*options, *verbose], target) as (nvrtc, prog, lowered):
        size = len(output(nvrtc, prog, "CUBIN")) if cubin else 0
        if cubin and size <= 0:
            raise CheckError(f"empty cubin for {names} on sm_{arch}")
        ptx = output(nvrtc, prog, "PTX").decode(errors="replace")
        return Compiled(arch, lowered, size, log(nvrtc, prog), mma_counts(ptx, lowered))


def _compile_task(task) -> tuple[tuple[str, str, int, int], Compiled]:
    code, program, names, arch, options, ptxas_verbose, cubin = task
    return program, compile_instance(code, list(names), arch, list(options), ptxas_verbose,
                                     cubin)


def variants() -> list[tuple[bool, str]]:
    """Every (key, out) variant, the default first."""
    return [(key, out) for key in (False, True) for out in OUT_FORMS]


def program_names(pass_: str, ctype: str, dp: int, bt: int, key: bool = False,
                  out: str = "norm_residual") -> list[str]:
    """Every name expression the backend may launch for one (pass, type, D_PAD, BT, variant):
    for half types also the SIMT instances (``dec``: the ``native_params`` one)."""
    names = list(pass_names(pass_, ctype, dp, bt, ctype != "float", key, out).values())
    if ctype != "float":
        native = pass_ == DECODE_PASS
        names += [n for n in pass_names(pass_, ctype, dp, bt, False, key, out, native).values()
                  if n not in names]
    return names


def instances(passes=None, dtypes=None, d_pads=None,
              block_ts=None) -> list[tuple[str, str, int, int]]:
    """(pass, C++ type, D_PAD, BT) of every program, or of those in the given passes, dtype
    names, D_PADs, BTs (None: all; ``dec``'s, BT 0, whatever the BTs)."""
    return [(pass_, ct, dp, bt) for pass_ in PASSES if passes is None or pass_ in passes
            for name, ct in CTYPES.items() if dtypes is None or name in dtypes
            for dp in D_PADS if d_pads is None or dp in d_pads
            for bt in ((0,) if pass_ == DECODE_PASS else BLOCK_TS)
            if pass_ == DECODE_PASS or block_ts is None or bt in block_ts]


DEFAULT_VARIANT = (False, "norm_residual")   # (eta_key given, the output form)


def programs(only: dict | None = None, variants=(DEFAULT_VARIANT,),
             skip_default: bool = False) -> list[tuple[tuple[str, str, int, int], list[str]]]:
    """((pass, C++ type, D_PAD, BT), name expressions) of each program :func:`instances`
    selects with ``only``: the instances of ``variants``, each once (``skip_default``: less
    the default variant's; programs left empty are left out)."""
    result = []
    for program in instances(**(only or {})):
        default = set(program_names(*program)) if skip_default else set()
        names: list[str] = []
        for variant in variants:
            names += [n for n in program_names(*program, *variant)
                      if n not in default and n not in names]
        if names:
            result.append((program, names))
    return result


def run(archs=DEFAULT_ARCHS, jobs: int = 0, ptxas_verbose: bool = False,
        out=sys.stdout, ptx_only=(), only: dict | None = None,
        variants=(DEFAULT_VARIANT,), skip_default: bool = False) -> dict[str, int]:
    """Compile :func:`programs` (PTX only for ``ptx_only``); {arch: instances compiled}."""
    nvrtc = bindings()
    _, major, minor = nvrtc.nvrtcVersion()
    inc = cuda_include_dir()
    options = list(compile_options())
    codes = {pass_: source(pass_) + smem_asserts() for pass_ in PASSES}
    print(f"NVRTC {major}.{minor}; CUDA headers: {inc or 'NVRTC built-ins'}; "
          f"options {options}", file=out)
    jobs = jobs or os.cpu_count() or 1
    counts = {}
    for arch in archs:
        start = time.perf_counter()
        cubin = arch not in ptx_only
        tasks = [(codes[program[0]], program, tuple(names), arch, tuple(options), ptxas_verbose,
                  cubin) for program, names in programs(only, variants, skip_default)]
        if jobs > 1:
            # processes: the bindings hold the GIL while NVRTC compiles
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                results = list(pool.map(_compile_task, tasks))
        else:
            results = [_compile_task(t) for t in tasks]
        for _, c in results:
            for name, count in c.mma.items():
                if (count > 0) != is_mma_instance(name):
                    raise CheckError(f"{name} on sm_{arch}: {count} tf32 mma.sync in its PTX "
                                     f"(expected {'some' if is_mma_instance(name) else 'none'})")
        n = sum(len(c.names) for _, c in results)
        n_mma = sum(is_mma_instance(name) for _, c in results for name in c.names)
        counts[arch] = n
        built = (f"{sum(c.cubin_bytes for _, c in results) / 1e6:.1f} MB of cubin" if cubin
                 else f"PTX for compute_{arch} only")
        print(f"sm_{arch}: {n} kernel instances compiled ({n_mma} with tf32 mma.sync; "
              f"{len(results)} programs, {built}, {time.perf_counter() - start:.1f} s)",
              file=out)
        if ptxas_verbose:
            for (pass_, ct, dp, bt), c in results:
                for line in c.log.splitlines():
                    if re.search(r"Used \d+ registers|spill", line):
                        print(f"  {pass_} {ct:>13} D_PAD={dp:<3} BT={bt:<2} {line.strip()}",
                              file=out)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.nvrtc_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", action="append", dest="archs", metavar="SM",
                        help="compute capability without a dot (repeatable; default 80 and 90)")
    parser.add_argument("--ptx-only", action="append", default=[], metavar="SM",
                        help="compile this arch to PTX only, without ptxas (repeatable)")
    parser.add_argument("--jobs", type=int, default=0,
                        help="parallel compile processes (default: cpus)")
    parser.add_argument("--ptxas-verbose", action="store_true",
                        help="print registers and spills of every kernel")
    parser.add_argument("--pass", action="append", dest="passes", choices=list(PASSES),
                        help="compile only this pass's programs (repeatable; default: all)")
    parser.add_argument("--dtype", action="append", dest="dtypes", choices=list(CTYPES),
                        help="only this input dtype (repeatable; default: all)")
    parser.add_argument("--d-pad", action="append", dest="d_pads", type=int, choices=D_PADS,
                        help="only this padded head dim (repeatable; default: all)")
    parser.add_argument("--chunk", action="append", dest="block_ts", type=int, choices=BLOCK_TS,
                        help="only this chunk size BT (repeatable; default: all)")
    parser.add_argument("--eta-key", action="store_true",
                        help="the eta_key variant's instances (KEY)")
    parser.add_argument("--output", default="norm_residual", choices=list(OUT_FORMS),
                        help="the output form's instances (OUT; default: norm_residual)")
    args = parser.parse_args(argv)
    archs = tuple(args.archs or DEFAULT_ARCHS)
    if set(args.ptx_only) - set(archs):
        parser.error(f"--ptx-only {sorted(set(args.ptx_only) - set(archs))}: not among the "
                     f"archs compiled, {list(archs)}")
    try:
        only = dict(passes=args.passes, dtypes=args.dtypes, d_pads=args.d_pads,
                    block_ts=args.block_ts)
        counts = run(archs, args.jobs, args.ptxas_verbose, ptx_only=tuple(args.ptx_only),
                     only=only, variants=[(args.eta_key, args.output)])
    except CheckError as err:
        print(f"nvrtc_check FAILED: {err}", file=sys.stderr)
        return 1
    total = sum(counts.values())
    print(f"OK: {total} kernel instances compiled "
          + ", ".join(f"sm_{a}: {n}" for a, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
