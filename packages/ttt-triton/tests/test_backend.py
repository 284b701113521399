"""The triton backend object: its declared capabilities, reasons stated once, import
failures that name the module, and imports that stay cheap."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import ttt
from ttt_triton.backend import CAPABILITIES, MAX_HEAD_DIM, TritonBackend


def _problem(D, dtype=torch.float32):
    x = torch.randn(1, 20, 2, D, dtype=dtype)
    return ttt.make_problem(x, x, x, torch.ones(2, D), torch.zeros(2, D), 0.1)


def _python_prints(code: str, env: dict | None = None) -> str:
    """What a fresh python running ``code`` prints (stripped); it must exit 0."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_declared_for_cuda_the_interpreter_adds_cpu(monkeypatch):
    assert TritonBackend.capabilities is CAPABILITIES
    assert CAPABILITIES.devices == {"cuda"}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert TritonBackend().capabilities.devices == {"cuda"}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = TritonBackend().capabilities
    assert interpreted.devices == {"cuda", "cpu"}
    assert interpreted.dtypes == CAPABILITIES.dtypes


def test_head_dim_reason_is_stated_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reasons = TritonBackend().not_supported_reasons(_problem(2 * MAX_HEAD_DIM))
    assert [r for r in reasons if "head dim" in r] == [
        f"head dim {2 * MAX_HEAD_DIM} above the maximum {MAX_HEAD_DIM}"]


def test_bfloat16_is_refused_under_the_interpreter_only(monkeypatch):
    problem = _problem(16, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert any("bfloat16" in r for r in TritonBackend().not_supported_reasons(problem))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not any("bfloat16" in r for r in TritonBackend().not_supported_reasons(problem))


def test_missing_triton_is_named_with_its_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    reason = TritonBackend().unavailable_reason()
    assert reason.startswith("module 'triton' cannot be imported")
    assert reason.endswith("install with: pip install triton")


def test_a_missing_dependency_of_triton_is_named_not_triton(tmp_path):
    """A triton that cannot import one of its own dependencies: the reason names that
    module and its hint, not "pip install triton"."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("import ttt_missing_dependency_xyz\n")
    code = ("from ttt_triton.backend import TritonBackend; "
            "print(TritonBackend().unavailable_reason())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    assert _python_prints(code, env) == (
        "module 'ttt_missing_dependency_xyz' cannot be imported (No module named "
        "'ttt_missing_dependency_xyz'); install with: pip install ttt_missing_dependency_xyz")


def test_backend_module_needs_no_triton_and_launcher_no_backend():
    """The backend module imports without triton; the launcher does not import the backend
    module (both read the interpreter switch from ttt_triton._env)."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import ttt_triton.backend\n"
            "del sys.modules['triton']; del sys.modules['ttt_triton.backend']\n"
            "import ttt_triton.ops.ttt_linear.launcher\n"
            "print('ttt_triton.backend' in sys.modules)\n")
    assert _python_prints(code) == "False"


def test_the_kernels_keep_the_mode_of_the_switch_when_first_asked(monkeypatch):
    """triton.jit reads TRITON_INTERPRET when it makes a kernel: the launcher's per-call
    paths ask ``kernels_interpreted``, fixed at its first answer, not the environment."""
    from ttt_triton import _env

    before = _env.kernels_interpreted()
    try:
        for first in ("1", "0"):
            _env.kernels_interpreted.cache_clear()
            monkeypatch.setenv("TRITON_INTERPRET", first)
            assert _env.kernels_interpreted() is (first == "1")
            monkeypatch.setenv("TRITON_INTERPRET", "0" if first == "1" else "1")
            assert _env.kernels_interpreted() is (first == "1")
            assert _env.interpreting() is (first != "1")
    finally:
        _env.kernels_interpreted.cache_clear()
        monkeypatch.setenv("TRITON_INTERPRET", "1" if before else "0")
        assert _env.kernels_interpreted() is before
