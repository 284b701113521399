"""The command line: ``python -m ttt info``, ``capabilities``, ``demo`` and ``warmup``;
expected errors in one line on stderr with exit status 2."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import ttt
from ttt import cli, registry
from ttt.reference import ReferenceBackend

REPO = Path(__file__).resolve().parents[3]
CAPABILITIES_DOC = REPO / "docs" / "capabilities.md"


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ttt", *args], capture_output=True,
                          text=True, env=env)


def _one_line_error(capsys, argv) -> str:
    """Runs ``main(argv)``, checks it failed with one line on stderr and exit status 2, and
    returns that line."""
    status = cli.main(argv)
    err = capsys.readouterr().err
    assert status == 2, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert err.startswith(f"python -m ttt {argv[0]}: error: ")
    return err


class _Fake(ttt.Backend):
    """A backend of the given capabilities that is never asked to compute."""

    def __init__(self, name, devices=("cpu",), dtypes=(torch.float32,), unavailable=None):
        self.name = name
        self.capabilities = ttt.Capabilities(devices=frozenset(devices),
                                             dtypes=frozenset(dtypes))
        self._unavailable = unavailable

    def unavailable_reason(self):
        return self._unavailable


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_info_lists_backends():
    out = _run("info")
    assert out.returncode == 0, out.stderr
    assert "reference" in out.stdout and "torch" in out.stdout and "device:" in out.stdout
    assert "reference  available" in out.stdout


def test_info_says_a_gpu_only_backend_needs_a_gpu(capsys, register, no_gpu):
    register("gpuonly", _Fake("gpuonly", devices=("cuda",)), priority=1)
    assert cli.main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "gpuonly" in x)
    assert line.split() == ["gpuonly", "installed,", "needs", "a", "CUDA", "GPU"]
    status = ttt.available_backends()["gpuonly"]
    assert not status.available and status.installed


def test_info_names_the_module_that_failed_to_import(capsys, monkeypatch, tmp_path, register):
    """A backend package that imports but lacks a dependency: the dependency is named with
    its own install hint, not the backend's; a backend package that is missing: the
    backend's hint."""
    (tmp_path / "ttt_fake_needs_dep.py").write_text("import ttt_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register("needsdep", "ttt_fake_needs_dep:Backend",
             install_hint="pip install ./packages/ttt-needsdep", priority=5)
    register("absent", "ttt_fake_absent_package:Backend",
             install_hint="pip install ./packages/ttt-absent", priority=6)
    assert cli.main(["info"]) == 0
    lines = {x.split()[0]: x for x in capsys.readouterr().out.splitlines() if x.startswith("  ")}
    assert "not installed: module 'ttt_missing_dependency_xyz'" in lines["needsdep"]
    assert "install with: pip install ttt_missing_dependency_xyz" in lines["needsdep"]
    assert "./packages/ttt-needsdep" not in lines["needsdep"]
    assert "not installed: module 'ttt_fake_absent_package'" in lines["absent"]
    assert "install with: pip install ./packages/ttt-absent" in lines["absent"]


def test_info_gives_an_unavailable_backends_reason(capsys, register):
    register("noengine", _Fake("noengine",
                               unavailable="engine cannot be imported; pip install engine"))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "noengine   unavailable: engine cannot be imported; pip install engine" in out


def test_unknown_backend_is_one_line(capsys):
    err = _one_line_error(capsys, ["demo", "--backend", "nope"])
    assert "unknown backend 'nope'" in err and "reference" in err


def test_backend_not_installed_is_one_line(capsys, register):
    register("ghost", "ttt_ghost_backend_not_installed:Backend",
             install_hint="pip install ./packages/ttt-ghost", priority=5)
    err = _one_line_error(capsys, ["demo", "--backend", "ghost"])
    assert "backend 'ghost' cannot run here: not installed" in err
    assert "pip install ./packages/ttt-ghost" in err


def test_unavailable_backend_is_one_line(capsys, register):
    register("noengine", _Fake("noengine", unavailable="engine cannot be imported"))
    err = _one_line_error(capsys, ["demo", "--backend", "noengine"])
    assert "backend 'noengine' cannot run here: unavailable: engine cannot be imported" in err


def test_unsupported_inputs_are_one_line(capsys, register):
    register("picky", _Fake("picky", dtypes=(torch.float16,)))
    err = _one_line_error(capsys, ["demo", "--backend", "picky", "--device", "cpu",
                                   "--dtype", "fp32", "--seq-len", "8", "--head-dim", "8"])
    assert "backend 'picky' cannot take these inputs" in err and "dtype float32" in err


def test_cuda_device_without_a_gpu_is_one_line(capsys, no_gpu):
    err = _one_line_error(capsys, ["demo", "--device", "cuda"])
    assert "--device cuda: no CUDA GPU on this machine" in err


def test_unknown_device_is_one_line(capsys):
    err = _one_line_error(capsys, ["demo", "--device", "tpu"])
    assert "--device: expected cpu or cuda[:N], got 'tpu'" in err


def test_gpu_backend_without_a_gpu_is_one_line(capsys, register, no_gpu):
    register("gpuonly", _Fake("gpuonly", devices=("cuda",)), priority=1)
    err = _one_line_error(capsys, ["demo", "--backend", "gpuonly"])
    assert "backend 'gpuonly' cannot run here: installed, needs a CUDA GPU" in err


@pytest.mark.skipif(importlib.util.find_spec("ttt_triton") is None,
                    reason="the triton backend (packages/ttt-triton) is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_triton_demo_on_a_cpu_only_machine_is_one_line():
    """The real backend, process and entry point: one line, exit status 2."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = _run("demo", "--backend", "triton", env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    why = ("installed, needs a CUDA GPU" if importlib.util.find_spec("triton")
           else "unavailable: module 'triton' cannot be imported")
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"python -m ttt demo: error: backend 'triton' cannot run "
                               f"here: {why}"), out.stderr


def test_unexpected_errors_still_raise(monkeypatch):
    def broken(_args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "cmd_info", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["info"])


def test_demo_checks_against_the_oracle():
    out = _run("demo", "--device", "cpu", "--seq-len", "40", "--heads", "2", "--head-dim", "16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "demo passed" in out.stdout and "dq" in out.stdout


def test_capabilities_has_a_row_per_builtin_backend(capsys):
    assert cli.main(["capabilities"]) == 0
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ")]
    assert rows[0].split(" | ")[:4] == ["| backend", "ops", "devices", "dtypes"]
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == list(registry.KNOWN_BACKENDS)
    reference = next(r for r in rows if r.startswith("| reference |"))
    assert "float64" in reference and "| any | any |" in reference
    assert reference.startswith("| reference | ttt_linear, ttt_mlp |")


def test_capabilities_do_not_depend_on_the_machine(monkeypatch):
    """The GPU backends' declared capabilities, also under the Triton interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plain = _run("capabilities")
    interpreted = _run("capabilities", env={**os.environ, "TRITON_INTERPRET": "1"})
    assert plain.returncode == interpreted.returncode == 0, plain.stderr + interpreted.stderr
    assert plain.stdout == interpreted.stdout


BACKEND_MODULES = [registry.KNOWN_BACKENDS[n].target.partition(":")[0]
                   for n in ("reference", "triton", "cupy")]
MISSING_MODULES = [m for m in BACKEND_MODULES if importlib.util.find_spec(m.split(".")[0]) is None]


@pytest.mark.skipif(bool(MISSING_MODULES), reason=(
    f"docs/capabilities.md lists every built-in backend; not importable here: "
    f"{MISSING_MODULES} (install packages/ttt-triton and packages/ttt-cupy, --no-deps is "
    f"enough)"))
def test_capabilities_doc_is_the_commands_output():
    out = _run("capabilities")
    assert out.returncode == 0, out.stderr
    assert CAPABILITIES_DOC.read_text() == out.stdout, textwrap.dedent(f"""
        docs/capabilities.md is stale; regenerate it: {cli.CAPABILITIES_COMMAND}""")


# --- python -m ttt warmup --------------------------------------------------------------------

WARMUP_SMALL = ["warmup", "--backend", "reference", "--device", "cpu", "--head-dim", "16",
                "--heads", "2", "--quiet"]


def test_warmup_prints_what_it_compiled():
    out = _run(*WARMUP_SMALL, "--dtype", "fp32", "--dtype", "bf16", "--chunk-size", "16")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("warmed up float32 D=16 chunk=16 H=2 on reference "
                               "(forward + backward, 24 calls): ")
    assert lines[1].startswith("warmed up bfloat16 D=16 chunk=16 H=2 on reference")
    assert lines[-1].startswith("warmup: 2 configuration(s) on cpu in ")
    assert out.stderr == ""                                # --quiet (and not a terminal)


def test_warmup_forward_only(capsys):
    assert cli.main([*WARMUP_SMALL, "--dtype", "fp32", "--no-backward"]) == 0
    out = capsys.readouterr()
    assert "(forward, 12 calls)" in out.out and out.err == ""


def test_warmup_ttt_mlp(capsys):
    """``--op ttt_mlp`` (repeatable, with ttt_linear): TTT-MLP's calls, 4 layouts x 6 forms."""
    assert cli.main([*WARMUP_SMALL, "--dtype", "fp32", "--no-backward", "--op", "ttt_mlp",
                     "--op", "ttt_linear"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("warmed up ttt_mlp float32 D=16 chunk=16 H=2 on reference "
                               "(forward, 24 calls): ")
    assert lines[1].startswith("warmed up float32 D=16 chunk=16 H=2 on reference "
                               "(forward, 12 calls): ")


def test_warmup_lists_default_dtypes_the_backend_cannot_take(capsys, register):
    class _Fp32Reference(ReferenceBackend):
        name = "fp32only"
        capabilities = replace(ReferenceBackend.capabilities,
                               dtypes=frozenset({torch.float32}))

    register("fp32only", _Fp32Reference())
    assert cli.main(["warmup", "--backend", "fp32only", "--device", "cpu", "--head-dim",
                     "16", "--heads", "1"]) == 0
    out = capsys.readouterr().out
    assert "warmed up float32 D=16" in out
    assert "skipped bfloat16 D=16 chunk=16 H=1: " in out and "dtype bfloat16" in out


@pytest.mark.parametrize("argv, words", [
    (["warmup", "--backend", "nope"], "unknown backend 'nope'"),
    (["warmup", "--device", "tpu"], "--device: expected cpu or cuda"),
    (["warmup", "--backend", "reference", "--device", "cpu", "--head-dim", "16",
      "--heads", "1", "--chunk-size", "16", "--dtype", "fp64", "--quiet"], None),
])
def test_warmup_errors_are_one_line(capsys, argv, words):
    if words is None:          # fp64 on the reference: fine (a control for the others)
        assert cli.main(argv) == 0
        return
    assert words in _one_line_error(capsys, argv)


def test_warmup_unsupported_dtype_is_one_line(capsys, register):
    register("fp32fake", _Fake("fp32fake"))
    line = _one_line_error(capsys, ["warmup", "--backend", "fp32fake", "--device", "cpu",
                                    "--dtype", "bf16", "--head-dim", "16"])
    assert "dtype bfloat16 not supported" in line


def test_warmup_cuda_without_a_gpu_is_one_line(capsys, no_gpu):
    assert "no CUDA GPU" in _one_line_error(capsys, ["warmup", "--device", "cuda"])


def test_warmup_bad_number_is_a_usage_error():
    out = _run("warmup", "--head-dim", "0")
    assert out.returncode == 2 and "--head-dim: expected a positive integer" in out.stderr
