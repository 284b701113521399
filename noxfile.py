"""nox sessions for ttt.

CPU machine (CI, laptops): each session makes a pip-based venv, installs torch 2.13 (CPU),
``packages/ttt`` and only the backend it tests:

    nox -s lint tests          # ruff, then the conformance suite per backend (small cases)
    nox -s "tests(backend='triton')"   # one backend (Triton runs in its interpreter on CPU)
    nox -s demo                # python -m ttt demo
    nox -s build               # wheels + sdists in dist/, checked, installed and tried
    nox -s oldest_torch        # the core and the reference suite on the oldest torch we support

Offline GPU runner (torch, triton, cupy preinstalled, no package registry): run on the
current interpreter; the sessions then install only our packages, editable, without deps,
and run every case, big ones included, on the GPU:

    nox --no-venv -s "tests(backend='triton')"
    nox --no-venv -s bench

Extra arguments after ``--`` go to pytest (e.g. ``-- -x -k varlen``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", "tests"]
nox.options.error_on_missing_interpreters = False

TORCH = "torch==2.13.0"
OLDEST_TORCH = "torch==2.5.1"
"""The oldest torch ``packages/ttt`` supports (its pyproject's lower bound). PyPI has only a
CUDA build of it for Linux (about 3 GB with its CUDA libraries; it runs on a CPU machine), so
CI does not run this session; run it when a change touches the custom op, dynamo or autocast.
On it (and on 2.6) the custom op's eager shortcut is off (it lacks the shortcut's private
APIs): every call takes the op."""
TEST_DEPS = ["pytest>=7", "pytest-xdist", "numpy"]
CPU_WORKERS = ["-n", "auto", "--dist", "loadgroup"]
"""pytest-xdist workers for CPU runs (one per core; a CI machine has 2); the tests of one
oracle case share a worker (its float64 oracle runs once). Extra arguments after ``--`` come
later and win (e.g. ``-- -n 0``)."""
CPU_THREADS = {"OMP_NUM_THREADS": "1"}
"""With ``CPU_WORKERS``: one thread per worker for torch's and NumPy's CPU kernels. The
workers take every core already; threads of their own on top spin-wait for each other, and
the tests' small ops then take several times as long."""

# backend -> (its package, what it needs on a CPU machine, environment for CPU runs,
#             the backend's own tests besides the conformance suite,
#             whether the suite's cases run on a CPU machine)
BACKENDS = {
    "reference": ([], [], {}, ["packages/ttt/tests"], True),
    "triton": (["packages/ttt-triton"], ["triton"], {"TRITON_INTERPRET": "1"},
               ["packages/ttt-triton/tests"], True),
    # on CPU: NVRTC compiles every kernel instance (sm_90 cubins, sm_80 PTX), g++ runs the
    # kernels' C++ (CPU emulation; TTT_REQUIRE_TOOLCHAIN=1: a missing NVRTC or g++ fails
    # the session), and the suite's cases skip with the backend's reason (no GPU)
    "cupy": (["packages/ttt-cupy[compile-check]"], [], {"TTT_REQUIRE_TOOLCHAIN": "1"},
             ["packages/ttt-cupy/tests"], False),
}


DECLARATIONS_ONLY = ["packages/ttt-triton", "packages/ttt-cupy"]
"""Installed without their engines (no triton, no cupy) in the reference session on CPU: their
declared capabilities import cheaply, and packages/ttt/tests checks docs/capabilities.md
against every built-in backend's declaration."""


def _offline(session: nox.Session) -> bool:
    """True with ``nox --no-venv``: the GPU runner, where nothing can be downloaded."""
    return session.venv_backend == "none"


def _python(session: nox.Session) -> str:
    """The venv's python, or with --no-venv the interpreter running nox (which may be the
    only one named python3 on a GPU runner)."""
    return sys.executable if _offline(session) else "python"


def _install(session: nox.Session, packages: list[str], deps: list[str]) -> None:
    ours = ["packages/ttt", *packages]
    if _offline(session):
        editable = [arg for path in ours for arg in ("-e", path)]
        session.run(_python(session), "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", *editable)
        return
    session.install(TORCH, *TEST_DEPS, *deps)
    session.install(*ours)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    if not _offline(session):
        session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
@nox.parametrize("backend", list(BACKENDS))
def tests(session: nox.Session, backend: str) -> None:
    """The conformance suite for one backend, plus that backend's own tests."""
    packages, deps, cpu_env, own_tests, suite_on_cpu = BACKENDS[backend]
    _install(session, packages, deps)
    if backend == "reference" and not _offline(session):
        session.install("--no-deps", *DECLARATIONS_ONLY)
    paths = ["shared_tests", *own_tests]
    if _offline(session):
        # GPU runner: every case, big ones included; a backend that cannot run is an error
        env, selection = {}, []
    else:
        env, selection = {**CPU_THREADS, **cpu_env}, ["-m", "not big", *CPU_WORKERS]
        if not suite_on_cpu:
            selection.append("--ttt-allow-unavailable")
    session.run(_python(session), "-m", "pytest", *paths, "--backend", backend, *selection,
                *session.posargs, env=env)


@nox.session
def oldest_torch(session: nox.Session) -> None:
    """packages/ttt's tests and the reference backend's suite on ``OLDEST_TORCH`` (CPU)."""
    session.install(OLDEST_TORCH, *TEST_DEPS)
    # the CUDA build brings its own triton; the session is the core's and the reference
    # backend's, with the GPU backends as declarations only, as in the reference session
    session.run("python", "-m", "pip", "uninstall", "-q", "-y", "triton")
    session.install("--no-deps", "packages/ttt", *DECLARATIONS_ONLY)
    session.run("python", "-m", "pytest", "shared_tests", "packages/ttt/tests",
                "--backend", "reference", "-m", "not big", *CPU_WORKERS, *session.posargs,
                env=CPU_THREADS)


@nox.session
def demo(session: nox.Session) -> None:
    """python -m ttt demo on the best backend installed here."""
    _install(session, ["packages/ttt-triton"] if _offline(session) else [], [])
    session.run(_python(session), "-m", "ttt", "info")
    session.run(_python(session), "-m", "ttt", "demo", *session.posargs)


GENERATION_BENCHMARKS = {
    "decode.md": ["-m", "benchmarks.decode"],
    "host_time.md": ["-m", "tools.host_time", "gpu", "--shapes", "4,1,16,64", "2,1024,8,64",
                     "--iters", "300"],
    "cold_start.md": ["-m", "benchmarks.cold_start", "--dtype", "bf16", "--head-dim", "64",
                      "--heads", "4", "--shape", "2,256", "--timeout", "200"],
    "mlp.md": ["-m", "benchmarks.mlp"],
}
"""The bench session's tables besides run.py's (each module's markdown, in the same folder):
a decode step, the host time of short calls (a maintainers' tool, ``tools/host_time.py gpu``,
whose table docs/benchmarks.md quotes), a new process's first call (empty caches, a
second process, after ``python -m ttt warmup``) at the bf16 head-dim-64 configuration, and
TTT-MLP (forward, forward+backward and a generation step per backend)."""


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks on a GPU (every installed backend, and FLA when fla-core is installed):
    ``python -m benchmarks.run`` with the arguments after ``--``, then, unless ``--quick``,
    the ``GENERATION_BENCHMARKS`` into the same ``--out`` folder."""
    _install(session, ["packages/ttt-triton"], ["triton", "einops"])
    python = _python(session)
    session.run(python, "-m", "benchmarks.run", *session.posargs)
    if "--quick" in session.posargs:
        return
    out = Path("benchmarks/results")
    if "--out" in session.posargs[:-1]:
        out = Path(session.posargs[session.posargs.index("--out") + 1])
    for name, command in GENERATION_BENCHMARKS.items():
        with open(out / name, "w") as table:
            session.run(python, *command, stdout=table, stderr=None)  # progress: stderr


PACKAGES = ["packages/ttt", "packages/ttt-triton", "packages/ttt-cupy"]
DIST = Path("dist")


@nox.session
def build(session: nox.Session) -> None:
    """Release check: wheels and sdists of the three packages in ``dist/`` (``python -m
    build``), their metadata checked (``twine check --strict``), the wheels installed into a
    fresh venv with ``TORCH`` (the GPU backends' without their engines, which a CPU machine
    cannot use) and ``python -m ttt info`` and ``demo`` run there, outside the checkout."""
    session.install("build", "twine")
    shutil.rmtree(DIST, ignore_errors=True)
    for package in PACKAGES:
        session.run("python", "-m", "build", "--outdir", str(DIST), package)
    built = sorted(str(p) for p in DIST.iterdir())
    session.run("twine", "check", "--strict", *built)
    wheels = {p.name.partition("-")[0]: str(p.resolve()) for p in DIST.glob("*.whl")}
    if sorted(wheels) != ["ttt", "ttt_cupy", "ttt_triton"]:
        session.error(f"expected one wheel per package in {DIST}, found {sorted(wheels)}")
    fresh = Path(session.create_tmp()).resolve() / "wheels-venv"
    session.run(sys.executable, "-m", "venv", "--clear", str(fresh), external=True)
    python = str(fresh / "bin" / "python")
    session.run(python, "-m", "pip", "install", "-q", TORCH, wheels["ttt"], external=True)
    session.run(python, "-m", "pip", "install", "-q", "--no-deps", wheels["ttt_triton"],
                wheels["ttt_cupy"], external=True)
    session.chdir(fresh)                  # import the installed packages, not the checkout
    session.run(python, "-m", "ttt", "info", external=True)
    session.run(python, "-m", "ttt", "demo", "--seq-len", "64", *session.posargs,
                external=True)
