"""The backend's one compile path: NVRTC through cuda-python (a program's compile with its
name expressions, its cubin or PTX, its log; the compile check ``tools/nvrtc_check.py`` uses
it too), and the compiled programs on disk, shared between processes (CuPy's own cache never
serves programs compiled with ``name_expressions``).

A program's cubin is stored under :attr:`CupyConfig.cache_dir <ttt_cupy.config.CupyConfig>`,
keyed by :func:`cache_key`, as ``<key>-<sha256 of the cubin, 16 hex>.cubin`` and then
``<key>.json`` (the lowered names, the cubin's name and hash): an entry exists once its
``.json`` does. Files are written beside their place and moved in with ``os.replace``. A
missing or damaged entry is compiled and stored again; where the directory cannot be written,
the cubin loads from a temporary file. Imports nothing of the package.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

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


def nvrtc_version() -> str:
    """NVRTC's version, e.g. ``"13.5"`` (a seam the tests replace)."""
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


def compile_cubin(code: str, names: list[str], arch: str,
                  options: tuple[str, ...] | list[str]) -> tuple[bytes, dict[str, str]]:
    """(cubin for sm_``arch``, {name expression: lowered name}) of ``code`` (a seam the tests
    replace)."""
    with program(code, names, list(options), f"sm_{arch}") as (nvrtc, prog, lowered):
        return bytes(output(nvrtc, prog, "CUBIN")), lowered


FORMAT = 1
"""The entries' format; part of the key, so that a new format never reads an old entry."""


def cache_key(code: str, names: list[str], options: tuple[str, ...] | list[str], arch: str,
              nvrtc: str) -> str:
    """sha256 over the source, the name expressions (in order), the options, the arch, the
    NVRTC version and :data:`FORMAT`."""
    spec = json.dumps({"format": FORMAT, "code": code, "names": list(names),
                       "options": list(options), "arch": str(arch), "nvrtc": nvrtc},
                      sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``, whole or not at all (a temporary file, then ``os.replace``)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def store(directory: Path, key: str, cubin: bytes, lowered: dict[str, str]) -> Path:
    """Write an entry (the cubin, then its ``.json``); returns the cubin's path."""
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(cubin).hexdigest()
    path = directory / f"{key}-{digest[:16]}.cubin"
    try:
        same = hashlib.sha256(path.read_bytes()).hexdigest() == digest
    except OSError:
        same = False
    if not same:
        write_atomic(path, cubin)
    meta = {"format": FORMAT, "cubin": path.name, "sha256": digest, "lowered": lowered}
    write_atomic(directory / f"{key}.json", json.dumps(meta, sort_keys=True).encode())
    return path


def lookup(directory: Path, key: str, names: list[str]) -> tuple[Path, dict[str, str]] | None:
    """(the cubin's path, the lowered names) of a valid entry, or None (missing, corrupt, for
    other names, or a cubin whose hash differs)."""
    try:
        meta = json.loads((directory / f"{key}.json").read_bytes())
        lowered = meta["lowered"]
        if meta["format"] != FORMAT or set(lowered) != set(names) \
                or not all(isinstance(v, str) and v for v in lowered.values()):
            return None
        path = directory / meta["cubin"]
        if path.parent != directory or \
                hashlib.sha256(path.read_bytes()).hexdigest() != meta["sha256"]:
            return None
        return path, dict(lowered)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class CachedModule:
    """A module loaded from a cubin whose ``get_function`` takes the name expression."""

    def __init__(self, module: Any, kernels: dict[str, Any], path: Path):
        self.module, self.kernels, self.path = module, kernels, path

    def get_function(self, name: str) -> Any:
        return self.kernels[name]


def _load(path: Path, lowered: dict[str, str]) -> CachedModule:
    import cupy

    module = cupy.RawModule(path=str(path))
    kernels = {}
    for name, low in lowered.items():
        kernel = module.get_function(low)
        kernel.kernel  # noqa: B018 - loads the function now, so that a failure shows here
        kernels[name] = kernel
    return CachedModule(module, kernels, path)


def compile_into(directory: Path, code: str, names: list[str], options: tuple[str, ...],
                 arch: str) -> None:
    """Compile and store the program unless cached: NVRTC and files only, no CUDA call. Any
    failure is left for :func:`load_or_compile` to meet again."""
    try:
        key = cache_key(code, names, options, arch, nvrtc_version())
        if lookup(directory, key, names) is None:
            store(directory, key, *compile_cubin(code, names, arch, options))
    except Exception:  # noqa: BLE001 - ahead-of-time work only: the load path decides
        pass


def load_or_compile(directory: Path, code: str, names: list[str],
                    options: tuple[str, ...], arch: str) -> CachedModule:
    """The program from the cache, compiled and stored first if missing. RuntimeError when
    cuda-python is missing, NVRTC fails or the driver does not load the cubin."""
    try:
        key = cache_key(code, names, options, arch, nvrtc_version())
        found = lookup(directory, key, names)
        if found is None:
            cubin, lowered = compile_cubin(code, names, arch, options)
            try:
                found = store(directory, key, cubin, lowered), lowered
            except OSError:  # (an unwritable cache directory)
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / f"{key}.cubin"
                    path.write_bytes(cubin)
                    return _load_checked(path, lowered, arch)
    except (ImportError, NvrtcError) as err:
        raise RuntimeError(f"NVRTC could not compile {names} for sm_{arch}:\n{err}") from err
    # (an intact entry that does not load, say for a driver older than the NVRTC that built
    # it, would not load compiled again either)
    return _load_checked(*found, arch)


def _load_checked(path: Path, lowered: dict[str, str], arch: str) -> CachedModule:
    try:
        return _load(path, lowered)
    except Exception as err:
        raise RuntimeError(
            f"the CUDA driver does not load {path} (NVRTC {nvrtc_version()}, sm_{arch}): "
            f"{err}. A driver older than that NVRTC needs the cuda-python and NVRTC of its "
            f"CUDA version (pip install 'ttt-cupy[cuda12]' or '[cuda13]')") from err
