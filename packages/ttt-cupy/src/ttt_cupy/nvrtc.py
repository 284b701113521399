"""NVRTC through cuda-python: a program's compile with its name expressions, its cubin or PTX,
its log (for :mod:`ttt_cupy.diskcache` and the compile check, ``tools/nvrtc_check.py``;
imports nothing of the package)."""

from __future__ import annotations

import contextlib

SOURCE_NAME = "ttt_cupy_pass.cu"   # NVRTC's name for a program


class NvrtcError(RuntimeError):
    """cuda-python is missing or an NVRTC step failed; the message holds the NVRTC log."""


def bindings():
    """cuda-python's NVRTC module (NvrtcError without cuda-python)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        try:
            from cuda import nvrtc  # cuda-python < 12.6
        except ImportError as err:
            raise NvrtcError(
                "cuda-python is not installed: pip install './packages/ttt-cupy[compile-check]'"
            ) from err
    return nvrtc


def version() -> str:
    """NVRTC's version, e.g. ``"13.5"``."""
    _, major, minor = bindings().nvrtcVersion()
    return f"{major}.{minor}"


def check(result, what: str, nvrtc, prog=None) -> tuple:
    """An NVRTC call's values after its status; NvrtcError (with ``prog``'s log) if it failed."""
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        text = log(nvrtc, prog) if prog is not None else ""
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise NvrtcError(f"{what}: {msg.decode() if isinstance(msg, bytes) else msg}\n{text}")
    return result[1:]


def output(nvrtc, prog, kind: str) -> bytearray:
    """The compiled program's ``kind``: "CUBIN" or "PTX"."""
    (size,) = check(getattr(nvrtc, f"nvrtcGet{kind}Size")(prog), f"nvrtcGet{kind}Size", nvrtc)
    data = bytearray(size)
    check(getattr(nvrtc, f"nvrtcGet{kind}")(prog, data), f"nvrtcGet{kind}", nvrtc)
    return data


def log(nvrtc, prog) -> str:
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    # (a fresh buffer, never b" " * size: for size 1 that is CPython's shared one-byte b" ",
    # and NVRTC's write would turn every b" " of the process into b"\x00")
    buf = bytearray(size)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.decode(errors="replace").rstrip("\x00").strip()


@contextlib.contextmanager
def program(code: str, names: list[str], options: list[str], target: str):
    """``code`` compiled with ``names`` as name expressions, ``options`` and ``-arch=target``:
    yields ``(nvrtc, program, {name: lowered name})``; NvrtcError when a step fails."""
    nvrtc = bindings()
    (prog,) = check(nvrtc.nvrtcCreateProgram(code.encode(), SOURCE_NAME.encode(), 0, [], []),
                    "nvrtcCreateProgram", nvrtc)
    try:
        for name in names:
            check(nvrtc.nvrtcAddNameExpression(prog, name.encode()),
                  f"nvrtcAddNameExpression({name})", nvrtc)
        opts = [o.encode() for o in (*options, f"-arch={target}")]
        check(nvrtc.nvrtcCompileProgram(prog, len(opts), opts),
              f"nvrtcCompileProgram({names}, {target})", nvrtc, prog)
        lowered = {}
        for name in names:
            (low,) = check(nvrtc.nvrtcGetLoweredName(prog, name.encode()),
                           f"nvrtcGetLoweredName({name})", nvrtc)
            lowered[name] = low.decode() if isinstance(low, bytes) else str(low)
        yield nvrtc, prog, lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cubin(code: str, names: list[str], arch: str,
          options: tuple[str, ...] | list[str]) -> tuple[bytes, dict[str, str]]:
    """(cubin for sm_``arch``, {name expression: lowered name}) of ``code``."""
    with program(code, names, list(options), f"sm_{arch}") as (nvrtc, prog, lowered):
        return bytes(output(nvrtc, prog, "CUBIN")), lowered
