"""The backend registry: choice by call, context, environment; errors that say what to do."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings
from importlib import metadata

import pytest
import torch

import ttt
from ttt import choice, registry, status
from ttt.reference import ReferenceBackend


class _FakeMetadata:
    """Stands in for importlib.metadata inside ttt.registry only (triton and others keep
    the real one)."""

    EntryPoint = metadata.EntryPoint

    def __init__(self, eps):
        self._eps = eps

    def entry_points(self, group=None, **_):
        return [ep for ep in self._eps if group in (None, ep.group)]


@pytest.fixture
def entry_points(monkeypatch):
    """``entry_points(*eps)``: the group's entry points are these alone, read again; after
    the test, the real ones are read again."""

    def use(*eps):
        monkeypatch.setattr(registry, "metadata", _FakeMetadata(list(eps)))
        registry.clear_cache()

    yield use
    monkeypatch.undo()
    registry.clear_cache()


def _inputs(dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=g).to(device, dtype) for _ in range(3))
    return dict(q=q, k=k, v=v, w=torch.ones(2, 16, dtype=dtype, device=device),
                b=torch.zeros(2, 16, dtype=dtype, device=device), eta=0.1)


def test_default_choice_is_auto_and_cpu_goes_to_reference(monkeypatch):
    monkeypatch.delenv("TTT_BACKEND", raising=False)
    assert ttt.get_backend() == "auto"
    problem = ttt.make_problem(**_inputs())
    assert choice.select_backend(problem).name == "reference"


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


def test_missing_backend_raises_import_error_with_pip_command(register):
    register("ghost", "ttt_ghost_backend_not_installed:Backend",
             install_hint="pip install ./packages/ttt-ghost", priority=5)
    with pytest.raises(ImportError, match=r"pip install \./packages/ttt-ghost"):
        ttt.set_backend("ghost")
    status = ttt.available_backends()["ghost"]
    assert not status.available and "pip install ./packages/ttt-ghost" in status.reason
    # automatic choice passes over it
    o, _, _ = ttt.chunk_ttt_linear(**_inputs())
    assert o.shape == (1, 20, 2, 16)


def test_unsupported_inputs_name_every_reason(register):
    class Picky(ttt.Backend):
        name = "picky"
        capabilities = ttt.Capabilities(devices=frozenset({"cuda"}),
                                        dtypes=frozenset({torch.float16}),
                                        chunk_sizes=frozenset({64}))

    register("picky", Picky(), priority=1)
    with pytest.raises(ttt.BackendNotSupportedError) as info:
        ttt.chunk_ttt_linear(**_inputs(), backend="picky")
    message = str(info.value)
    for words in ("device 'cpu'", "dtype float32", "chunk_size 16"):
        assert words in message
    assert isinstance(info.value, ValueError)


def test_entry_point_backends_are_discovered(monkeypatch, tmp_path, entry_points):
    module = tmp_path / "ttt_fake_plugin.py"
    module.write_text(textwrap.dedent("""
        import ttt
        from ttt.reference import ReferenceBackend

        class FakeBackend(ReferenceBackend):
            name = "fake"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    entry_points(metadata.EntryPoint("fake", "ttt_fake_plugin:FakeBackend",
                                     registry.ENTRY_POINT_GROUP))
    assert "fake" in ttt.available_backends()
    o, _, _ = ttt.chunk_ttt_linear(**_inputs(), backend="fake")
    ref, _, _ = ttt.chunk_ttt_linear(**_inputs(), backend="reference")
    assert torch.equal(o, ref)
    entry_points()                  # the package removed: its backend goes with the cache
    with pytest.raises(ttt.UnknownBackendError):
        ttt.load_backend("fake")


def test_entry_point_may_not_shadow_a_builtin(entry_points):
    entry_points(metadata.EntryPoint("reference", "somewhere_else:Backend",
                                     registry.ENTRY_POINT_GROUP))
    with pytest.warns(UserWarning, match="built-in backend name"):
        names = registry.known_names()
    assert names.count("reference") == 1


def test_import_does_no_gpu_work_and_loads_no_backend():
    code = ("import sys, ttt; "
            "bad = [m for m in ('triton', 'cupy', 'ttt_triton', 'ttt_cupy') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_registry_errors_are_their_own_classes(register):
    with pytest.raises(registry.UnknownBackendError) as unknown:
        ttt.load_backend("nope")
    assert isinstance(unknown.value, ValueError)
    register("ghost", "ttt_ghost_backend_not_installed.backend:Backend",
             install_hint="pip install ./packages/ttt-ghost", priority=5)
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
    monkeypatch.setattr(status, "present_device_types", lambda: frozenset({"cpu", "meta"}))
    assert status.missing_device_reason(backend) == "installed, needs a CUDA GPU"
    assert status.missing_device_reason(ttt.load_backend("reference")) is None
    monkeypatch.setattr(status, "present_device_types", lambda: frozenset({"cpu", "cuda"}))
    assert status.missing_device_reason(backend) is None


def test_declared_capabilities_are_the_classes(monkeypatch, tmp_path, register):
    """The class's declaration, without making an instance; a backend whose class declares
    none (a property) is loaded and asked."""
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
    register("prop", "ttt_fake_property_backend:Backend")
    assert registry.declared_capabilities("prop").dtypes == frozenset({torch.float16})


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


class _Renamed(ttt.Backend):
    """The reference backend's capabilities under another name; never asked to compute."""

    capabilities = ReferenceBackend.capabilities

    def __init__(self, name: str):
        self.name = name


def test_a_registered_backend_runs_by_name_until_its_registration_ends():
    backend = ReferenceBackend()
    with ttt.register_backend("mine", backend) as registration:
        assert registration.name == "mine"
        assert ttt.load_backend("mine") is backend
        assert "mine" in ttt.available_backends() and "mine" in registry.known_names()
        o, _, _ = ttt.chunk_ttt_linear(**_inputs(), backend="mine")
        with ttt.set_backend("mine"):
            assert choice.select_backend(ttt.make_problem(**_inputs())) is backend
    with pytest.raises(ttt.UnknownBackendError, match="unknown backend 'mine'"):
        ttt.load_backend("mine")
    handle = ttt.register_backend("mine", ReferenceBackend)      # a factory, made on first use
    assert isinstance(ttt.load_backend("mine"), ReferenceBackend)
    ttt.unregister_backend("mine")
    assert "mine" not in ttt.available_backends()
    handle.__exit__(None, None, None)                               # (nothing left to undo)


def test_a_registered_backend_takes_its_place_in_the_automatic_choice(register):
    problem = ttt.make_problem(**_inputs())
    register("late", _Renamed("late"), priority=2000)
    assert choice.select_backend(problem).name == "reference"
    register("early", _Renamed("early"), priority=5)
    assert choice.select_backend(problem).name == "early"         # the kept choice dropped


def test_a_builtin_name_is_replaced_only_when_asked_and_comes_back():
    reference = ttt.load_backend("reference")
    with pytest.raises(ValueError, match=r"'reference' exists already.*replace=True"):
        ttt.register_backend("reference", _Renamed("reference"))
    with ttt.register_backend("reference", _Renamed("reference"), priority=1000, replace=True):
        assert isinstance(ttt.load_backend("reference"), _Renamed)
        with pytest.raises(ValueError, match="exists already"):
            ttt.register_backend("reference", _Renamed("reference"))
    assert type(ttt.load_backend("reference")) is type(reference)


def test_a_replaced_registration_comes_back_when_its_replacement_ends(register):
    first, second = _Renamed("mine"), _Renamed("mine")
    register("mine", first)
    register("mine", first)                   # the same registration again: no conflict
    with pytest.raises(ValueError, match="'mine' exists already"):
        ttt.register_backend("mine", second)
    with ttt.register_backend("mine", second, replace=True):
        assert ttt.load_backend("mine") is second
    assert ttt.load_backend("mine") is first


def test_an_entry_point_name_is_replaced_only_when_asked(entry_points, register):
    entry_points(metadata.EntryPoint("plugged", "ttt_plugged_nowhere:Backend",
                                     registry.ENTRY_POINT_GROUP))
    with pytest.raises(ValueError, match="'plugged' exists already"):
        ttt.register_backend("plugged", _Renamed("plugged"))
    register("plugged", _Renamed("plugged"), replace=True)
    assert ttt.load_backend("plugged").name == "plugged"


@pytest.mark.parametrize("args, options, error, words", [
    ((None, _Renamed("x")), {}, ValueError, "name must be a non-empty str"),
    (("", _Renamed("x")), {}, ValueError, "name must be a non-empty str"),
    (("auto", _Renamed("x")), {}, ValueError, "name must be a non-empty str other than 'auto'"),
    (("x", 3), {}, TypeError, "backend must be a ttt.Backend"),
    (("x", "no_colon"), {}, ValueError, "backend must name 'module:attribute'"),
    (("x", _Renamed("x")), {"priority": "1"}, TypeError, "priority must be an int"),
    (("x", _Renamed("x")), {"priority": True}, TypeError, "priority must be an int"),
    (("x", _Renamed("x")), {"install_hint": 1}, TypeError, "install_hint must be a str"),
])
def test_bad_registrations_name_the_argument(args, options, error, words):
    with pytest.raises(error, match=f"^register_backend: {words}"):
        ttt.register_backend(*args, **options)
    assert "x" not in registry.known_names()


def test_unregistering_a_name_not_registered_is_a_value_error():
    for name in ("reference", "never_registered"):
        with pytest.raises(ValueError, match=f"unregister_backend: {name!r} was not registered"):
            ttt.unregister_backend(name)


def test_the_builtin_table_is_read_only():
    with pytest.raises(TypeError):
        ttt.KNOWN_BACKENDS["mine"] = registry.KnownBackend("x:y", "pip install mine", 1)


class _OnGpu:
    """A problem as a GPU's tensors would make it (only its device differs)."""

    device = torch.device("cuda")

    def __init__(self, problem):
        self._problem = problem

    def __getattr__(self, name):
        return getattr(self._problem, name)


class _RefusesItsLength(_Renamed):
    def not_supported_reasons(self, problem):
        return [f"refuses length {problem.T}"]


class _TakesAll(_Renamed):
    def not_supported_reasons(self, problem):
        return []


def test_each_new_reason_for_passing_a_backend_over_warns_once(register):
    """Passed over for lengths 12 and 21 (the same characters, two reasons): each warns,
    once, until the choices are dropped."""
    register("picky", _RefusesItsLength("picky"), priority=-3)
    register("takes_all", _TakesAll("takes_all"), priority=-2)

    def choose(T):
        q = torch.randn(1, T, 2, 16)
        inputs = {**_inputs(), "q": q, "k": q, "v": q}
        return choice.select_backend(_OnGpu(ttt.make_problem(**inputs)))

    for T in (12, 21):
        with pytest.warns(UserWarning, match=f"using backend 'takes_all'; skipped picky: "
                                             f"refuses length {T}$"):
            choose(T)
    registry.clear_cache()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        choose(12)
        choose(5)                   # another signature, another reason: one more warning
        choose(5 + 0)
    assert [str(w.message).rpartition(" ")[2] for w in seen] == ["12", "5"]


class _LinearOnly(ReferenceBackend):
    name = "linear_only"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities,
                                       ops=frozenset({"ttt_linear"}))


def test_each_op_is_chosen_by_its_own_capabilities(register):
    """A backend without TTT-MLP takes the linear calls it comes first for, never the MLP
    call of the same shapes (whose choice is kept apart); asked by name, it says why."""
    register("linear_only", _LinearOnly(), priority=5)
    inputs = _inputs()
    assert choice.select_backend(ttt.make_problem(**inputs)).name == "linear_only"
    mlp = ttt.mlp.make_mlp_problem(**inputs)
    assert choice.select_backend(mlp).name == "reference"
    assert choice.select_backend(ttt.make_problem(**inputs)).name == "linear_only"
    with pytest.raises(ttt.BackendNotSupportedError,
                       match=r"op 'ttt_mlp' not provided \(provides \['ttt_linear'\]\)"):
        ttt.chunk_ttt_mlp(**inputs, backend="linear_only")
