"""``ttt.warmup``: runs forward and backward per configuration, batch layout and call form;
its generic warm-up shapes reach every launch choice the kernel backends' rules make for
real shapes (so that after a warm-up a real call compiles nothing new)."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import ttt
from ttt import WarmupShape, _warmup_workers, registry
from ttt.backend import generic_warmup_shapes
from ttt.reference import ReferenceBackend
from ttt.warmup import (
    DEFAULT_HEAD_DIMS,
    FORMS,
    Config,
    ProgressBar,
    _call_groups,
    _Plan,
    mlp_warmup_shapes,
    param_dtypes,
    warmup,
)


class _Recorder(ReferenceBackend):
    """The reference backend, recording every problem it is asked to compute."""

    name = "recorder"

    def __init__(self):
        self.calls = []

    def forward(self, problem, needs_backward):
        self.calls.append(("forward", problem, needs_backward))
        return super().forward(problem, needs_backward)

    def backward(self, problem, saved, do, dht, dhbt, needs):
        self.calls.append(("backward", problem, dht is not None))
        return super().backward(problem, saved, do, dht, dhbt, needs)

    def chunk_ttt_mlp(self, problem):
        self.calls.append(("mlp", problem, torch.is_grad_enabled()))
        return super().chunk_ttt_mlp(problem)


@pytest.fixture
def recorder(register):
    backend = _Recorder()
    register(backend.name, backend, priority=1)
    return backend


SMALL = [WarmupShape(1, 20), WarmupShape(3, 16, packed=True)]


def test_reference_warmup_runs_every_form(recorder):
    report = warmup("recorder", dtypes=[torch.float32, torch.bfloat16], head_dims=[16],
                    chunk_sizes=[16], heads=[2], device="cpu", shapes=SMALL)
    assert [e.config.dtype for e in report.entries] == [torch.float32, torch.bfloat16]
    fp32_calls = len(SMALL) * len(FORMS) * 2
    assert [e.calls for e in report.entries] == [fp32_calls, 2 * fp32_calls]  # bf16: 2 pairs
    assert report.skipped == [] and report.device == torch.device("cpu")
    forwards = [(p, grad) for kind, p, grad in recorder.calls if kind == "forward"]
    backwards = [(p, dht) for kind, p, dht in recorder.calls if kind == "backward"]
    assert len(forwards) == 3 * fp32_calls and len(backwards) == 3 * fp32_calls // 2
    bf16 = [p for p, _ in forwards if p.q.dtype == torch.bfloat16]
    assert {(p.w.dtype, p.eta.dtype) for p in bf16} == {(torch.bfloat16, torch.bfloat16),
                                                       (torch.float32, torch.float32)}
    assert all(p.b.dtype == p.w.dtype for p in bf16)
    assert all(p.eta_key.dtype == p.eta.dtype for p in bf16 if p.eta_key is not None)
    assert {grad for _, grad in forwards} == {False, True}           # inference and training
    assert {p.is_varlen for p, _ in forwards} == {False, True}        # dense and packed
    assert {p.N for p, _ in forwards} == {1, 3}
    assert {(p.initial_state is not None, p.output_final_state) for p, _ in forwards} == {
        (False, False), (True, False), (False, True), (True, True)}
    layer = [p for p, _ in forwards if p.eta_key is not None]        # the TTTLinear layer's
    assert {p.output for p in layer} == {"query_residual"}
    assert {(p.initial_state is not None, p.output_final_state) for p in layer} == {
        (True, False), (True, True)}                                 # training, with a cache
    assert {dht for _, dht in backwards} == {False, True}             # final-state cotangents
    assert all(p.q.dtype in (torch.float32, torch.bfloat16) and p.D == 16 and p.H == 2
               for p, _ in forwards)


def test_mlp_warmup_runs_every_form(recorder):
    """``ops=("ttt_mlp",)``: TTT-MLP's calls, every form (its four-tensor states, the
    TTTMLP layer's eta_key and output), on its own layouts (mlp_warmup_shapes) or those
    given, with and without gradients, and no TTT-Linear call."""
    report = warmup("recorder", dtypes=[torch.float32], head_dims=[8], heads=[2],
                    device="cpu", ops=["ttt_mlp"])
    (entry,) = report.entries
    assert entry.config.op == "ttt_mlp"
    assert entry.config.describe().startswith("ttt_mlp float32 D=8")
    shapes = mlp_warmup_shapes(16)
    assert {(s.sequences, s.seq_len, s.packed) for s in shapes} == {
        (1, 40, False), (2, 1, False), (1, 40, True), (2, 1, True)}
    assert entry.calls == len(shapes) * len(FORMS) * 2
    assert {kind for kind, _, _ in recorder.calls} == {"mlp"}
    problems = [p for _, p, _ in recorder.calls]
    assert len(problems) == entry.calls and {p.hidden for p in problems} == {32}
    assert {(p.mlp_state is not None, p.output_final_state) for p in problems} == {
        (False, False), (True, False), (False, True), (True, True)}
    assert {p.output for p in problems if p.eta_key is not None} == {"query_residual"}
    assert {grad for _, _, grad in recorder.calls} == {False, True}
    assert {(p.N, p.is_varlen) for p in problems} == {(1, False), (2, False), (1, True),
                                                      (2, True)}
    recorder.calls.clear()
    both = warmup("recorder", dtypes=[torch.float32], head_dims=[8], heads=[2], device="cpu",
                  shapes=SMALL, ops=("ttt_linear", "ttt_mlp"), backward=False)
    assert [e.config.op for e in both.entries] == ["ttt_linear", "ttt_mlp"]
    assert {kind for kind, _, _ in recorder.calls} == {"forward", "mlp"}


def test_mlp_warmup_in_workers(recorder):
    """The workers' calls carry the op (the JSON of call_of)."""
    report = warmup("reference", dtypes=[torch.float32], head_dims=[8], heads=[1],
                    device="cpu", shapes=SMALL[:1], workers=2, ops=["ttt_mlp"],
                    backward=False)
    assert report.workers == 2 and report.entries[0].config.op == "ttt_mlp"


def test_forward_only(recorder):
    report = warmup("recorder", dtypes=[torch.float32], head_dims=[16], heads=[1],
                    backward=False, device="cpu", shapes=SMALL)
    assert report.entries[0].calls == len(SMALL) * len(FORMS)
    assert all(kind == "forward" and not grad for kind, _, grad in recorder.calls)


def test_one_shot_iterables(recorder):
    """Iterators are read once: every dtype gets every head dim, chunk size and head count."""
    report = warmup("recorder", dtypes=iter([torch.float32, torch.float64]),
                    head_dims=iter([16]), chunk_sizes=iter([16]), heads=iter([1]),
                    backward=False, device="cpu", shapes=SMALL[:1])
    assert [(e.config.dtype, e.config.head_dim) for e in report.entries] == [
        (torch.float32, 16), (torch.float64, 16)]


def test_layer_form_only_where_declared(recorder, monkeypatch):
    monkeypatch.setattr(recorder, "capabilities", replace(recorder.capabilities,
                                                          eta_key=False))
    warmup("recorder", dtypes=[torch.float32], head_dims=[16], heads=[1], device="cpu",
           shapes=SMALL[:1])
    assert all(p.eta_key is None for _, p, _ in recorder.calls)


def test_reference_default_shapes_and_defaults():
    """The reference backend compiles nothing: its warm-up is two small calls per form."""
    report = ttt.warmup("reference", dtypes=[torch.float32], head_dims=[16], heads=[2],
                        device="cpu")
    assert report.entries[0].backend == "reference"
    assert report.entries[0].calls == 2 * len(FORMS) * 2
    assert DEFAULT_HEAD_DIMS == (64, 128)
    assert param_dtypes(torch.float16) == [(torch.float16, torch.float16),
                                           (torch.float32, torch.float32)]
    assert param_dtypes(torch.float32) == [(torch.float32, torch.float32)]
    assert param_dtypes(torch.float64) == [(torch.float64, torch.float64)]


def test_default_dtypes_the_backend_cannot_take_are_skipped(recorder, monkeypatch):
    monkeypatch.setattr(recorder, "capabilities", replace(
        recorder.capabilities, dtypes=frozenset({torch.float32})))
    report = warmup("recorder", head_dims=[16], heads=[1], device="cpu", shapes=SMALL[:1])
    assert [e.config.dtype for e in report.entries] == [torch.float32]
    assert [c.dtype for c, _ in report.skipped] == [torch.bfloat16]
    assert "dtype bfloat16 not supported" in report.skipped[0][1]
    with pytest.raises(ttt.BackendNotSupportedError, match="bfloat16"):
        warmup("recorder", dtypes=[torch.bfloat16], head_dims=[16], heads=[1], device="cpu",
               shapes=SMALL[:1])


def test_workers_run_the_calls_then_this_process_loads(recorder):
    """With workers, child processes run every call first (each reports each call done),
    then this process runs them all again."""
    seen = []
    report = warmup("reference", dtypes=[torch.float32], head_dims=[16], heads=[2],
                    device="cpu", shapes=SMALL, workers=2,
                    progress=lambda done, total, label: seen.append((done, total, label)))
    calls = len(SMALL) * len(FORMS) * 2
    assert report.workers == 2 and report.entries[0].calls == calls
    in_children = [done for done, _, label in seen if "compiling in 2 processes" in label]
    assert in_children == list(range(calls + 1))       # every call, counted as it ended
    assert seen[-1] == (2 * calls, 2 * calls, "done")


def test_call_groups_share_no_kernel_class():
    """The workers' call groups: one per parameter dtypes, dense or packed layout and plain
    or layer form (each part of every kernel's specialisation), every call in exactly one."""
    config = Config(torch.bfloat16, 64, 16, 4)
    layouts = [WarmupShape(2, 40), WarmupShape(2, 40, packed=True), WarmupShape(8, 1)]
    calls = [(layout, form, params, grad) for layout in layouts for form in FORMS
             for params in param_dtypes(torch.bfloat16) for grad in (False, True)]
    groups = _call_groups([_Plan(config, "triton", calls)])
    assert sum(len(g) for g in groups) == len(calls)
    classes = []
    for group in groups:
        kinds = {(tuple(c["params"]), c["layout"][2], c["form"].startswith("layer"))
                 for c in group}
        assert len(kinds) == 1
        classes += kinds
    assert len(classes) == len(set(classes)) == 2 * 2 * 2


def test_deal_keeps_groups_whole_and_splits_only_when_short_of_groups():
    groups = [[_call(f"a{i}") for i in range(6)], [_call(f"b{i}") for i in range(4)],
              [_call("c0"), _call("c1")], [_call("d0")]]
    shares = _warmup_workers.deal(groups, 3)
    assert _names(shares) == _names((groups[0], groups[1], groups[2] + groups[3]))
    shares = _warmup_workers.deal([[_call(f"a{i}") for i in range(6)]], 4)   # one group
    assert sorted(sum(_names(shares), [])) == sorted(f"a{i}" for i in range(6))
    assert sorted(len(s) for s in shares) == [1, 1, 2, 2]
    assert _warmup_workers.deal([[_call("x")]], 3) == [[_call("x")], [], []]


def test_split_parts_calls_by_initial_then_final_states_then_gradients():
    """A group is split where its calls' kernels differ most: initial states given or not,
    then final states returned or not, then gradients or not; then alternately."""
    calls = [_call(f"{form.name} {grad}", form.name, grad) for form in FORMS
             for grad in (False, True)]
    plain = [c for c in calls if not FORMS_BY_NAME[c["form"]].layer]
    layer = [c for c in calls if FORMS_BY_NAME[c["form"]].layer]
    assert _names(_warmup_workers.split(plain)) == [
        ["final False", "final True", "plain False", "plain True"],
        ["initial False", "initial True", "states False", "states True"]]
    assert _names(_warmup_workers.split(layer)) == [
        ["layer False", "layer True"], ["layer_cache False", "layer_cache True"]]
    assert _names(_warmup_workers.split(layer[:2])) == [["layer False"], ["layer True"]]
    same = [_call(f"x{i}") for i in range(5)]
    assert _names(_warmup_workers.split(same)) == [["x0", "x2", "x4"], ["x1", "x3"]]


def test_a_half_dtype_configuration_deals_out_to_the_default_cap_evenly():
    """One bf16 configuration's 8 groups (4 of them twice the others) make
    DEFAULT_MAX_WORKERS equal shares, each of one group and one initial-states setting."""
    config = Config(torch.bfloat16, 64, 16, 4)
    layouts = [WarmupShape(2, 40), WarmupShape(2, 40, packed=True)]
    calls = [(layout, form, params, grad) for layout in layouts for form in FORMS
             for params in param_dtypes(torch.bfloat16) for grad in (False, True)]
    shares = _warmup_workers.deal(_call_groups([_Plan(config, "triton", calls)]),
                                  _warmup_workers.DEFAULT_MAX_WORKERS)
    assert _warmup_workers.DEFAULT_MAX_WORKERS == 12
    assert [len(share) for share in shares] == [len(calls) // 12] * 12
    for share in shares:
        assert len({(tuple(c["params"]), c["layout"][2], FORMS_BY_NAME[c["form"]].layer,
                     FORMS_BY_NAME[c["form"]].initial) for c in share}) == 1


def test_default_workers_one_per_core_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert _warmup_workers.default_workers(cuda, 816) == _warmup_workers.DEFAULT_MAX_WORKERS
    assert _warmup_workers.default_workers(cuda, 5) == 5
    assert _warmup_workers.default_workers(cpu, 816) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert _warmup_workers.default_workers(cuda, 816) == 4


FORMS_BY_NAME = {form.name: form for form in FORMS}


def _call(name: str, form: str = "plain", grad: bool = False) -> dict:
    """A stand-in for a worker call (``_warmup_workers.call_of``): the fields ``split``
    reads, and a name."""
    return {"name": name, "form": form, "grad": grad}


def _names(shares) -> list[list[str]]:
    return sorted(sorted(c["name"] for c in share) for share in shares)


def test_a_failed_worker_warns_and_this_process_runs_every_call(recorder):
    """A backend that exists only in this process is unknown to a new one: its workers
    fail, say why, and this process still runs (and compiles) every call."""
    with pytest.warns(RuntimeWarning, match="worker process failed .*recorder"):
        report = warmup("recorder", dtypes=[torch.float32], head_dims=[16], heads=[1],
                        device="cpu", shapes=SMALL[:1], workers=2, backward=False)
    assert report.workers == 2
    assert len(recorder.calls) == report.entries[0].calls == len(FORMS)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(workers=0), ValueError, "workers: expected a positive int or None, got 0"),
    (dict(workers=True), TypeError, "workers: expected a positive int or None, got bool"),
    (dict(head_dims=[0]), ValueError, "head_dims"),
    (dict(heads=[]), ValueError, "heads"),
    (dict(chunk_sizes=[True]), TypeError, "chunk_sizes"),
    (dict(dtypes=[torch.int32]), TypeError, "dtypes"),
    (dict(device="gpu0"), ValueError, "device"),
    (dict(backward=1), TypeError, "backward"),
    (dict(shapes=[(1, 16)]), TypeError, "shapes"),
    (dict(ops="ttt_mlp"), TypeError, "ops: expected an iterable of op names"),
    (dict(ops=["ttt_rnn"]), ValueError, "ops: expected names among"),
    (dict(ops=[]), ValueError, "ops: expected at least one op"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        warmup("reference", **{"dtypes": [torch.float32], "head_dims": [16], "heads": [1],
                                "device": "cpu", **kwargs})


def test_warmup_shape_checks():
    with pytest.raises(ValueError, match="WarmupShape.seq_len"):
        WarmupShape(1, 0)
    with pytest.raises(TypeError, match="WarmupShape.sequences: expected an int, got float"):
        WarmupShape(1.0, 16)


def test_progress_bar():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = ProgressBar(tty)
    bar(0, 4, "a")
    bar(4, 4, "done")
    assert "[" + "." * ProgressBar.WIDTH + "] 0/4 a" in tty.getvalue()
    assert tty.getvalue().endswith("\n") and "4/4 done" in tty.getvalue()
    quiet, pipe = Tty(), io.StringIO()
    ProgressBar(quiet, quiet=True)(1, 2, "x")
    ProgressBar(pipe)(1, 2, "x")
    assert quiet.getvalue() == "" and pipe.getvalue() == ""


TRITON_SCRIPT = """
import torch, ttt
from ttt import WarmupShape
report = ttt.warmup("triton", head_dims=[16], heads=[2], device="cpu",
                    shapes=[WarmupShape(1, 20), WarmupShape(2, 16, packed=True)])
print([(str(e.config.dtype), e.backend, e.calls) for e in report.entries])
print([str(c.dtype) for c, _ in report.skipped])
"""


INTERPRETER_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def add_one(x, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x + offsets, tl.load(x + offsets, mask=mask) + 1, mask=mask)

x = torch.arange(5, dtype=torch.float32)
add_one[(1,)](x, 5, BLOCK=8)
assert x.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0], x
"""


def _interpreter_failure(env: dict) -> str | None:
    """Why Triton's interpreter cannot run a trivial kernel here (None: it can). Some
    Triton releases' interpreters fail with newer NumPy (triton 3.6 with numpy 2.5:
    ``only 0-dimensional arrays can be converted to Python scalars``)."""
    out = subprocess.run([sys.executable, "-c", INTERPRETER_PROBE], capture_output=True,
                         text=True, env=env, timeout=300)
    if out.returncode == 0:
        return None
    last = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
    return f"Triton's interpreter cannot run a trivial kernel here: {last}"


def test_triton_interpreter_warmup():
    """Under TRITON_INTERPRET=1 (set before triton is imported: a new process)."""
    pytest.importorskip("triton", reason="triton is not installed")
    pytest.importorskip("ttt_triton", reason="ttt-triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    why = _interpreter_failure(env)
    if why:
        pytest.skip(why)
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    entries, skipped = out.stdout.splitlines()[-2:]
    forms = [f for f in FORMS if not f.layer or _declares_layer_form("triton")]
    calls = 2 * len(forms) * 2                     # 2 shapes, fp32 (1 parameter dtype), fwd+bwd
    assert entries == repr([("torch.float32", "triton", calls)])
    assert skipped == repr(["torch.bfloat16"])                  # the interpreter: no bf16


def _declares_layer_form(name: str) -> bool:
    caps = registry.declared_capabilities(name)
    return caps.eta_key and "query_residual" in caps.outputs


# --- the generic shapes against the kernel backends' launch rules --------------------------

HEADS = (1, 4, 12, 16, 32)
REAL_SEQUENCES = (1, 2, 3, 8, 16, 64, 256)
REAL_LENGTHS = (1, 16, 200, 2048, 8192, 32768)


def _problem(N, T, H, D, chunk, dtype, packed):
    """A problem on the meta device (shapes only), dense or packed."""
    q = torch.empty(N, T, H, D, device="meta", dtype=dtype)
    w = torch.empty(H, D, device="meta")
    eta = torch.empty(N, T, H, 1, device="meta", dtype=dtype)
    dense = ttt.make_problem(q, q, q, w, w, eta, chunk_size=chunk)
    if not packed:
        return dense
    q = torch.empty(1, N * T, H, D, device="meta", dtype=dtype)
    return replace(dense, q=q, k=q, v=q, eta=eta.reshape(1, N * T, H, 1),
                   cu_seqlens=torch.empty(N + 1, device="meta", dtype=torch.int64),
                   seq_lens=(T,) * N)


def _reached(rule, H, D, chunk, dtype):
    """(the rule's choices over the generic warm-up shapes, those over a sweep of real
    shapes, dense and packed) for one configuration; the rule's key includes packing."""
    def key(p):
        return (p.is_varlen, rule(p))

    warm = {key(_problem(s.sequences, s.seq_len, H, D, chunk, dtype, s.packed))
            for s in generic_warmup_shapes(H, chunk)}
    real = {key(_problem(N, T, H, D, chunk, dtype, packed)) for N in REAL_SEQUENCES
            for T in REAL_LENGTHS for packed in (False, True)}
    return warm, real


@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_generic_shapes_reach_every_triton_choice(H, D, chunk, dtype):
    pytest.importorskip("triton", reason="triton is not installed")
    tuning = pytest.importorskip("ttt_triton.ops.ttt_linear.tuning",
                                 reason="ttt-triton is not installed")
    BD = max(16, 1 << (D - 1).bit_length())

    def rule(p):                      # the specialisations: G, the fused chains, fwd_decode
        G = tuning.checkpoint_interval(p, BD, tuning.DEFAULT_TUNING)
        return (G, tuning.row_step(p, False, tuning.DEFAULT_TUNING),
                tuning.fused_forward(p, False, tuning.DEFAULT_TUNING),
                tuning.fused_forward(p, True, tuning.DEFAULT_TUNING),
                tuning.fused_backward(p, tuning.DEFAULT_TUNING))

    warm, real = _reached(rule, H, D, chunk, dtype)
    assert real <= warm, f"real shapes reach {sorted(real - warm)}, the warm-up does not"


@pytest.mark.parametrize("H", HEADS)
@pytest.mark.parametrize("D", [64, 128])
def test_generic_shapes_reach_every_cupy_schedule(H, D):
    placement = pytest.importorskip("ttt_cupy.placement", reason="ttt-cupy is not installed")
    smem = 227 * 1024

    def rule(p):
        groups = max(math.ceil(math.ceil(n / p.chunk_size) / placement.CKPT_INTERVAL)
                     for n in p.seq_lens)
        fwd = [placement.forward_plan(p, groups, save) for save in (False, True)]
        bwd = placement.backward_plan(p, groups, 1, True, smem)
        return tuple((plan.fuse, plan.overlap, len(plan.segments) > 1)
                     for plan in (*fwd, bwd))

    # each pass's schedule on its own (what a call warms: its kernels, their opt-ins, the
    # side streams): a decode step's inference forward is fused while its training forward
    # and backward are not, so the three together are no schedule of their own
    warm, real = ({(varlen, i, plan) for varlen, plans in reached for i, plan in enumerate(plans)}
                  for reached in _reached(rule, H, D, 16, torch.bfloat16))
    assert real <= warm, f"real shapes reach {sorted(real - warm)}, the warm-up does not"
