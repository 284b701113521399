"""A third-party backend, installed outside this repository and registered only through the
``ttt.backends`` entry point, runs the shipped suite with one command:
``pytest --pyargs ttt.testing --ttt-backend NAME``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

PACKAGE = '''
import dataclasses

from ttt.reference import ReferenceBackend


class ProbeBackend(ReferenceBackend):
    """The reference math under another name."""

    name = "probe"


class UndeterminedBackend(ReferenceBackend):
    name = "undetermined"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities, deterministic=False)


class LinearOnlyBackend(ReferenceBackend):
    name = "linear_only"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities,
                                       ops=frozenset({"ttt_linear"}))


class MlpOnlyBackend(ReferenceBackend):
    name = "mlp_only"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities,
                                       ops=frozenset({"ttt_mlp"}))


class GpuOnlyBackend(ReferenceBackend):
    name = "gpu_only"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities,
                                       devices=frozenset({"cuda"}))
'''

ENTRY_POINTS = '''
[ttt.backends]
probe = ttt_probe:ProbeBackend
undetermined = ttt_probe:UndeterminedBackend
gpu_only = ttt_probe:GpuOnlyBackend
linear_only = ttt_probe:LinearOnlyBackend
mlp_only = ttt_probe:MlpOnlyBackend
broken = ttt_probe_missing_module:Backend
'''

FAST_SUBSET = ("(test_matches_oracle and varlen[9 and fp32 and not only) or "
               "(test_matches_oracle and B2-T37-H2-D32-c16-fp16-h0-etaT-all) or "
               "test_bad_input_raises or test_partial_chunk or test_strided or "
               "test_mlp_matches_oracle")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory outside the repository holding the package and its dist-info, as pip
    would install them."""
    root = tmp_path_factory.mktemp("third_party_site")
    (root / "ttt_probe").mkdir()
    (root / "ttt_probe" / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    info = root / "ttt_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ttt-probe\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(ENTRY_POINTS))
    return root


def _run(site: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TTT_")) and k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], cwd=site, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _suite(site: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(site, "-m", "pytest", "--pyargs", "ttt.testing", "-p", "no:cacheprovider",
                "-m", "not big", *args)


def test_the_backend_is_found_through_its_entry_point(site):
    res = _run(site, "-c", "import ttt; b = ttt.load_backend('probe'); "
                           "print(type(b).__module__, type(b).__name__, b.name); "
                           "print(sorted(ttt.available_backends()))")
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    assert first == "ttt_probe ProbeBackend probe"
    assert "'probe'" in second and "'undetermined'" in second


def test_the_shipped_suite_passes_on_it(site):
    res = _suite(site, "--ttt-backend", "probe", "-k", FAST_SUBSET)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "ttt backend: probe" in out
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 30, summary


def test_a_non_deterministic_backend_skips_the_bitwise_test(site):
    res = _suite(site, "--ttt-backend", "undetermined", "-k", "bitwise and fp32")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "2 skipped: undetermined declares deterministic=False" in out, out[-3000:]


@pytest.mark.parametrize(("name", "runs", "lacks"), [("linear_only", "oracle and fp32-h0-etaT-all",
                                                      "ttt_mlp"),
                                                     ("mlp_only", "mlp", "ttt_linear")])
def test_a_backend_of_one_op_passes_with_the_other_skipped(site, name, runs, lacks):
    """The suite runs every test of the op a backend declares; the other op's skip, each with
    the reason."""
    res = _suite(site, "--ttt-backend", name, "-k", f"({FAST_SUBSET}) or ({runs})")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary, summary
    assert f"skipped: {name} declares: op {lacks!r} not provided" in out, out[-3000:]


@pytest.mark.parametrize("name", ["broken", "no_such_backend"])
def test_a_backend_that_cannot_load_is_an_error(site, name):
    res = _suite(site, "--ttt-backend", name, "-k", "bad_input")
    out = res.stdout + res.stderr
    assert res.returncode == 4, out[-3000:]       # pytest's usage error, before any test
    assert f"ttt backend {name!r} cannot be loaded" in out, out[-3000:]


def test_a_backend_that_cannot_run_here_is_an_error_unless_allowed(site):
    """gpu_only declares CUDA only: on the CPU its suite is an error at session start; with
    --ttt-allow-unavailable it runs, every case skipped with the backend's reason."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: gpu_only runs here")
    res = _suite(site, "--ttt-backend", "gpu_only", "-k", "bitwise and fp32")
    out = res.stdout + res.stderr
    assert res.returncode == 4, out[-3000:]
    assert "ttt backend 'gpu_only' cannot run here: does not run on cpu" in out, out[-3000:]
    res = _suite(site, "--ttt-backend", "gpu_only", "--ttt-allow-unavailable",
                 "-k", "bitwise and fp32")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "2 skipped: gpu_only declares: device 'cpu' not supported" in out, out[-3000:]
