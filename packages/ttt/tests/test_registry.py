"""The backend registry: choice by call, context, environment; errors that say what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest
import torch

import ttt
from ttt import registry


class _FakeMetadata:
    """Stands in for importlib.metadata inside ttt.registry only (triton and others keep
    the real one)."""

    EntryPoint = metadata.EntryPoint

    def __init__(self, eps):
        self._eps = eps

    def entry_points(self, group=None, **_):
        return [ep for ep in self._eps if group in (None, ep.group)]


def _inputs(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g).to(device, dtype) for _ in range(3))
    return dict(q=q, k=k, v=v, w=torch.ones(2, 16, dtype=dtype, device=device),
                b=torch.zeros(2, 16, dtype=dtype, device=device), eta=0.1)


def test_default_choice_is_auto_and_cpu_goes_to_reference(monkeypatch):
    monkeypatch.delenv("TTT_BACKEND", raising=False)
    assert ttt.get_backend() == "auto"
    problem = ttt.make_problem(**_inputs())
    assert registry.select_backend(problem).name == "reference"


def test_set_backend_as_call_and_as_with_block(monkeypatch):
    monkeypatch.delenv("TTT_BACKEND", raising=False)
    with ttt.set_backend("reference") as choice:
        assert choice.name == "reference"
        assert ttt.get_backend() == "reference"
        with ttt.set_backend(None):
            assert ttt.get_backend() == "auto"
        assert ttt.get_backend() == "reference"
    assert ttt.get_backend() == "auto"
    token = ttt.set_backend("reference")
    try:
        assert ttt.get_backend() == "reference"
    finally:
        token.__exit__(None, None, None)
    assert ttt.get_backend() == "auto"


def test_environment_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv("TTT_BACKEND", "reference")
    assert ttt.get_backend() == "reference"
    with ttt.set_backend("auto"):
        assert ttt.get_backend() == "auto"


def test_unknown_name_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("TTT_BACKEND", "bogus")
    q = torch.randn(1, 16, 1, 16)
    with pytest.raises(registry.UnknownBackendError,
                       match=r"^TTT_BACKEND: unknown backend 'bogus'"):
        ttt.chunk_ttt_linear(q, q, q, torch.ones(1, 16), torch.zeros(1, 16), 0.1)


def test_context_is_per_thread():
    import threading
    seen = []
    with ttt.set_backend("reference"):
        t = threading.Thread(target=lambda: seen.append(ttt.get_backend()))
        t.start()
        t.join()
    # a new thread starts from the default context, not from this one's choice
    assert seen == [os.environ.get("TTT_BACKEND") or "auto"]


def test_unknown_backend_is_a_value_error_listing_known_ones():
    with pytest.raises(ValueError, match="unknown backend 'nope'.*reference"):
        ttt.set_backend("nope")
    with pytest.raises(ValueError, match="unknown backend"):
        ttt.chunk_ttt_linear(**_inputs(), backend="nope")


def test_missing_backend_raises_import_error_with_pip_command(monkeypatch):
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "ghost", registry.KnownBackend(
        "ttt_ghost_backend_not_installed:Backend", "pip install ./packages/ttt-ghost", 5))
    registry._LOADED.pop("ghost", None)
    with pytest.raises(ImportError, match=r"pip install \./packages/ttt-ghost"):
        ttt.set_backend("ghost")
    status = ttt.available_backends()["ghost"]
    assert not status.available and "pip install ./packages/ttt-ghost" in status.reason
    # automatic choice passes over it
    o, _, _ = ttt.chunk_ttt_linear(**_inputs())
    assert o.shape == (1, 20, 2, 16)


def test_unsupported_inputs_name_every_reason(monkeypatch):
    class Picky(ttt.Backend):
        name = "picky"
        capabilities = ttt.Capabilities(devices=frozenset({"cuda"}),
                                        dtypes=frozenset({torch.float16}),
                                        chunk_sizes=frozenset({64}))

    monkeypatch.setitem(registry._LOADED, "picky", Picky())
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "picky",
                        registry.KnownBackend("x:y", "pip install picky", 1))
    with pytest.raises(ttt.BackendNotSupportedError) as info:
        ttt.chunk_ttt_linear(**_inputs(), backend="picky")
    message = str(info.value)
    for words in ("device 'cpu'", "dtype float32", "chunk_size 16"):
        assert words in message
    assert isinstance(info.value, ValueError)


def test_entry_point_backends_are_discovered(monkeypatch, tmp_path):
    module = tmp_path / "ttt_fake_plugin.py"
    module.write_text(textwrap.dedent("""
        import ttt
        from ttt.reference import ReferenceBackend

        class FakeBackend(ReferenceBackend):
            name = "fake"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = metadata.EntryPoint("fake", "ttt_fake_plugin:FakeBackend", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_ENTRY_POINTS", None)
    monkeypatch.setattr(registry, "metadata", _FakeMetadata([ep]))
    assert "fake" in ttt.available_backends()
    o, _, _ = ttt.chunk_ttt_linear(**_inputs(), backend="fake")
    ref, _, _ = ttt.chunk_ttt_linear(**_inputs(), backend="reference")
    assert torch.equal(o, ref)
    registry._LOADED.pop("fake", None)
    monkeypatch.setattr(registry, "_ENTRY_POINTS", None)


def test_entry_point_may_not_shadow_a_builtin(monkeypatch):
    ep = metadata.EntryPoint("reference", "somewhere_else:Backend", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_ENTRY_POINTS", None)
    monkeypatch.setattr(registry, "metadata", _FakeMetadata([ep]))
    with pytest.warns(UserWarning, match="built-in backend name"):
        names = registry.known_names()
    assert names.count("reference") == 1
    monkeypatch.setattr(registry, "_ENTRY_POINTS", None)


def test_import_does_no_gpu_work_and_loads_no_backend():
    code = ("import sys, ttt; "
            "bad = [m for m in ('triton', 'cupy', 'ttt_triton', 'ttt_cupy') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registry_errors_are_their_own_classes(monkeypatch):
    with pytest.raises(registry.UnknownBackendError) as unknown:
        ttt.load_backend("nope")
    assert isinstance(unknown.value, ValueError)
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "ghost", registry.KnownBackend(
        "ttt_ghost_backend_not_installed.backend:Backend", "pip install ./packages/ttt-ghost", 5))
    with pytest.raises(registry.BackendNotInstalledError) as missing:
        ttt.load_backend("ghost")
    assert isinstance(missing.value, ImportError)
    assert missing.value.reason == (
        "module 'ttt_ghost_backend_not_installed' cannot be imported (No module named "
        "'ttt_ghost_backend_not_installed'); install with: pip install ./packages/ttt-ghost")


@pytest.mark.parametrize("err, hints, reason", [
    (ModuleNotFoundError("No module named 'numpy'", name="numpy"),
     {"triton": "pip install triton"},
     "module 'numpy' cannot be imported (No module named 'numpy'); "
     "install with: pip install numpy"),
    (ModuleNotFoundError("No module named 'triton.language'", name="triton.language"),
     {"triton": "pip install 'triton>=3'"},
     "module 'triton.language' cannot be imported (No module named 'triton.language'); "
     "install with: pip install 'triton>=3'"),
    (ImportError("something odd"), {}, "an import failed (something odd)"),
])
def test_import_failure_reason_names_the_module_and_its_hint(err, hints, reason):
    assert registry.import_failure_reason(err, hints) == reason


def test_missing_device_reason(monkeypatch):
    gpu_only = ttt.Capabilities(devices=frozenset({"cuda"}), dtypes=frozenset({torch.float32}))
    backend = type("GpuOnly", (ttt.Backend,), {"capabilities": gpu_only})()
    monkeypatch.setattr(registry, "present_device_types", lambda: frozenset({"cpu", "meta"}))
    assert registry.missing_device_reason(backend) == "installed, needs a CUDA GPU"
    assert registry.missing_device_reason(ttt.load_backend("reference")) is None
    monkeypatch.setattr(registry, "present_device_types", lambda: frozenset({"cpu", "cuda"}))
    assert registry.missing_device_reason(backend) is None


def test_declared_capabilities_are_the_classes(monkeypatch, tmp_path):
    """The class's declaration, without making an instance; a backend whose class declares
    none (a property) is loaded and asked."""
    from ttt.reference import ReferenceBackend

    assert registry.declared_capabilities("reference") is ReferenceBackend.capabilities
    (tmp_path / "ttt_fake_property_backend.py").write_text(textwrap.dedent("""
        import torch
        import ttt

        class Backend(ttt.Backend):
            name = "prop"

            @property
            def capabilities(self):
                return ttt.Capabilities(devices=frozenset({"cpu"}),
                                        dtypes=frozenset({torch.float16}))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.KNOWN_BACKENDS, "prop", registry.KnownBackend(
        "ttt_fake_property_backend:Backend", "pip install prop", 5))
    monkeypatch.delitem(registry._LOADED, "prop", raising=False)
    assert registry.declared_capabilities("prop").dtypes == frozenset({torch.float16})
    registry._LOADED.pop("prop", None)


def test_backend_modules_import_without_their_engines():
    """Reading every installed built-in backend's declared capabilities imports neither
    triton nor cupy (both blocked here)."""
    code = ("import sys; sys.modules['triton'] = None; sys.modules['cupy'] = None\n"
            "import importlib.util\n"
            "from ttt import registry\n"
            "for name, known in registry.KNOWN_BACKENDS.items():\n"
            "    if importlib.util.find_spec(known.target.split('.')[0].split(':')[0]):\n"
            "        print(name, sorted(registry.declared_capabilities(name).devices))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "reference" in out.stdout
