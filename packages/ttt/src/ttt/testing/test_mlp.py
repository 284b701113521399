"""TTT-MLP (``ttt.chunk_ttt_mlp``, op ``"ttt_mlp"``): outputs, the final state and every
gradient against the float64 oracle ``ttt.oracle.oracle_chunk_ttt_mlp``, bad states, an
empty batch and unchanged inputs. The plugin runs these tests for backends that declare the
op and skips them, with that reason, for the others."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ttt

from ..oracle import oracle_chunk_ttt_mlp
from ..tolerances import TOLERANCES
from .cases import BF16, F16, F32, F64, Case, make_inputs
from .compare import expect, expect_close
from .test_layer import (
    HEADS,
    MINI_BATCH,
    WIDTH,
    _model,
    check_cuda_graph_training_step,
    check_generation_cache,
)

MLP_STATE = ("W1", "b1", "W2", "b2")


@dataclasses.dataclass(frozen=True)
class MlpCase:
    case: Case                    # shapes, dtype and options (its ``states``: a given state)
    hidden: int                   # the inner MLP's width F

    @property
    def id(self) -> str:
        return f"{self.case.id}-F{self.hidden}"


MLP_CASES = [
    MlpCase(Case(2, 37, 2, 16, 16, F32, eta_key=True), 64),          # F = 4 D, partial chunk
    MlpCase(Case(1, 45, 2, 8, 8, F32, seq_lens=(5, 0, 40), output="query_residual"), 32),
    MlpCase(Case(2, 20, 2, 8, 16, F64, eta_tensor=False, output="raw"), 24),   # F = 3 D
    MlpCase(Case(1, 24, 2, 8, 16, F64, states=False, final_state=False), 32),  # zero state
    MlpCase(Case(2, 33, 2, 16, 32, BF16, eta_key=True), 64),
    MlpCase(Case(1, 40, 2, 16, 16, F16, seq_lens=(17, 23)), 32),
    MlpCase(Case(1, 50, 2, 12, 16, F32, seq_lens=(20, 0, 30), output="query_residual"), 36),
    MlpCase(Case(2, 40, 2, 32, 32, F32, eta_tensor=False, output="raw"), 128),   # 2 blocks
    MlpCase(Case(1, 30, 2, 16, 16, F32, states=False, final_state=False, eta_key=True), 64),
    MlpCase(Case(1, 20, 1, 64, 16, F16, eta_key=True), 200),     # partial hidden blocks
    MlpCase(Case(1, 18, 1, 128, 16, F16, output="raw"), 80),     # at head dims 64, 128
]

MLP_STEP_CASES = [   # generation steps: one token per sequence, checked without autograd
    MlpCase(Case(2, 1, 2, 16, 16, F32, eta_key=True), 64),
    MlpCase(Case(1, 2, 2, 8, 16, F16, seq_lens=(1, 0, 1), output="query_residual"), 36),
    MlpCase(Case(3, 1, 2, 32, 16, BF16, output="raw"), 128),
    MlpCase(Case(2, 1, 2, 16, 16, F32, states=False, eta_tensor=False), 64),
    MlpCase(Case(2, 1, 2, 64, 16, F32), 256),
    MlpCase(Case(1, 1, 2, 128, 16, F32, eta_key=True, output="raw"), 400),   # partial block
]


def mlp_inputs(mc: MlpCase, device, seed: int = 0) -> dict:
    """Fresh random inputs of ``chunk_ttt_mlp`` (never zeros): the case's, with an MLP
    initial state (W1, W2 scaled to keep activations of order one) when it has states."""
    case = mc.case
    inputs = make_inputs(dataclasses.replace(case, states=False), device, seed)
    if case.states:
        g = torch.Generator(device="cpu").manual_seed(seed + 1)
        N, H, D, F = case.N, case.H, case.D, mc.hidden
        shapes = ((N, H, D, F), (N, H, 1, F), (N, H, F, D), (N, H, 1, D))
        scales = (D ** -0.5, 0.1, F ** -0.5, 0.1)
        inputs["initial_state"] = tuple(
            (s * torch.randn(shape, generator=g, dtype=F64)).to(case.state_dtype).to(device)
            for shape, s in zip(shapes, scales))
    return inputs


def _leaves(inputs: dict) -> dict[str, torch.Tensor]:
    """Copies of the floating tensor inputs that require grad, by name (the state's by
    ``MLP_STATE``)."""
    leaves = {name: t for name, t in inputs.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    leaves.update(zip(MLP_STATE, inputs.get("initial_state", ())))
    return {name: t.detach().clone().requires_grad_() for name, t in leaves.items()}


def _with(inputs: dict, leaves: dict) -> dict:
    out = {**inputs, **{n: t for n, t in leaves.items() if n not in MLP_STATE}}
    if "initial_state" in inputs:
        out["initial_state"] = tuple(leaves[n] for n in MLP_STATE)
    return out


def _skip_unsupported(inputs: dict, backend) -> None:
    reasons = backend.not_supported_reasons(ttt.mlp.make_mlp_problem(**inputs))
    if reasons:
        pytest.skip(f"{backend.name} declares: {'; '.join(reasons)}")


def _oracle(mc: MlpCase, inputs: dict, leaves: dict, device) -> tuple:
    """The oracle's o and final state of ``inputs`` with ``leaves`` (float64 copies, by
    name, that require grad: returned too)."""
    case = mc.case
    as64 = {n: t.detach().to(F64).requires_grad_() for n, t in leaves.items()}
    ref_inputs = _with({k: (v.to(F64) if isinstance(v, torch.Tensor) and v.is_floating_point()
                            else v) for k, v in inputs.items()
                        if k not in ("chunk_size", "output_final_state")}, as64)
    state = ref_inputs.pop("initial_state", None)
    if state is None:
        N, H, D, F = case.N, case.H, case.D, mc.hidden
        state = tuple(torch.zeros(s, dtype=F64, device=device)
                      for s in ((N, H, D, F), (N, H, 1, F), (N, H, F, D), (N, H, 1, D)))
    o_ref, final_ref = oracle_chunk_ttt_mlp(**ref_inputs, initial_state=state,
                                            chunk_size=case.chunk)
    return o_ref, final_ref, as64


def _expect_outputs(mc: MlpCase, o, final, o_ref, final_ref) -> tuple[list, list]:
    """o and the final state against the oracle's; returns the outputs compared and their
    references."""
    case = mc.case
    out_tol = TOLERANCES[case.dtype][0]
    expect(o.dtype == case.dtype and o.shape == o_ref.shape,
           f"o: {o.dtype} {tuple(o.shape)}, expected {case.dtype} {tuple(o_ref.shape)}")
    expect_close("o", o, o_ref, out_tol)
    outputs, refs = [o], [o_ref]
    if case.final_state:
        for name, got, want in zip(MLP_STATE, final, final_ref):
            expect(got.dtype == case.state_dtype, f"final {name}: dtype {got.dtype}")
            expect_close(f"final {name}", got, want, out_tol)
        outputs += list(final)
        refs += list(final_ref)
    else:
        expect(final is None, "final_state: expected None without output_final_state")
    return outputs, refs


@pytest.mark.parametrize("mc", [pytest.param(mc, id=mc.id)
                                for mc in MLP_CASES + MLP_STEP_CASES])
def test_mlp_forward_matches_oracle(mc: MlpCase, ttt_backend, ttt_backend_name, ttt_device):
    """Without autograd (inference, prefill and generation steps: a backend may take other
    paths there): o and the final state against the oracle."""
    inputs = mlp_inputs(mc, ttt_device, seed=mc.case.seed + 7)
    _skip_unsupported(inputs, ttt_backend)
    leaves = _leaves(inputs)
    with torch.no_grad():
        o, final = ttt.chunk_ttt_mlp(**inputs, backend=ttt_backend_name)
        o_ref, final_ref, _ = _oracle(mc, inputs, leaves, ttt_device)
    _expect_outputs(mc, o, final, o_ref, final_ref)


@pytest.mark.parametrize("mc", [pytest.param(mc, id=mc.id) for mc in MLP_CASES])
def test_mlp_matches_oracle(mc: MlpCase, ttt_backend, ttt_backend_name, ttt_device):
    """o, the final state (W1, b1, W2, b2) and the gradients of every input and initial state
    tensor, for random cotangents on o and the final state, against the oracle."""
    case = mc.case
    inputs = mlp_inputs(mc, ttt_device, seed=case.seed)
    _skip_unsupported(inputs, ttt_backend)
    leaves = _leaves(inputs)
    o, final = ttt.chunk_ttt_mlp(**_with(inputs, leaves), backend=ttt_backend_name)
    o_ref, final_ref, as64 = _oracle(mc, inputs, leaves, ttt_device)
    outputs, refs = _expect_outputs(mc, o, final, o_ref, final_ref)
    g = torch.Generator(device="cpu").manual_seed(case.seed + 2)
    cotangents = [torch.randn(r.shape, generator=g, dtype=F64).to(ttt_device) for r in refs]
    grads = torch.autograd.grad(outputs, list(leaves.values()),
                                [c.to(x.dtype) for c, x in zip(cotangents, outputs)],
                                allow_unused=True)
    want = torch.autograd.grad(refs, list(as64.values()),
                               [c.to(x.dtype).to(F64) for c, x in zip(cotangents, outputs)],
                               allow_unused=True)
    for name, got, ref in zip(leaves, grads, want):
        if ref is None or not ref.any():
            continue                            # e.g. eta as a float: a constant
        expect(got is not None, f"d{name}: no gradient")
        expect(got.dtype == leaves[name].dtype, f"d{name}: dtype {got.dtype}")
        expect_close(f"d{name}", got, ref, TOLERANCES[case.dtype][1])


@pytest.mark.parametrize(("which", "change", "error", "words"), [
    ("W1", lambda s: s[:, :, :-1], ValueError, "initial_state.W1"),
    ("b1", lambda s: s[..., :-1], ValueError, "initial_state.b1"),
    ("W2", lambda s: s.double(), TypeError, "initial_state.W2: expected dtype"),
    ("b2", lambda s: s[:1], ValueError, "initial_state.b2"),
])
def test_mlp_bad_state_raises(which, change, error, words, ttt_backend_name, ttt_device):
    """A state tensor of the wrong shape or dtype: an error naming it."""
    mc = MLP_CASES[0]
    inputs = mlp_inputs(mc, ttt_device)
    state = list(inputs["initial_state"])
    state[MLP_STATE.index(which)] = change(state[MLP_STATE.index(which)])
    with pytest.raises(error, match=words.replace(".", r"\.")):
        ttt.chunk_ttt_mlp(**{**inputs, "initial_state": tuple(state)},
                          backend=ttt_backend_name)
    with pytest.raises(TypeError, match="a tuple \\(W1, b1, W2, b2\\)"):
        ttt.chunk_ttt_mlp(**{**inputs, "initial_state": tuple(state[:3])},
                          backend=ttt_backend_name)


def test_mlp_inputs_unchanged_and_empty_batch(ttt_backend_name, ttt_device):
    """No input is written; a batch without tokens returns copies of the initial state."""
    inputs = mlp_inputs(MLP_CASES[0], ttt_device)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    state = tuple(s.clone() for s in inputs["initial_state"])
    ttt.chunk_ttt_mlp(**inputs, backend=ttt_backend_name)
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            expect(torch.equal(value, inputs[name]), f"{name} was modified")
    for name, s, given in zip(MLP_STATE, state, inputs["initial_state"]):
        expect(torch.equal(s, given), f"initial_state.{name} was modified")
    empty = {k: (v[:, :0] if isinstance(v, torch.Tensor) and v.dim() == 4 else v)
             for k, v in inputs.items()}
    o, final = ttt.chunk_ttt_mlp(**empty, backend=ttt_backend_name)
    expect(o.shape[1] == 0, "o of an empty batch")
    for name, f, s in zip(MLP_STATE, final, state):
        expect(torch.equal(f, s) and f.data_ptr() != s.data_ptr(),
               f"final {name} of an empty batch: a copy of the initial one")


def test_mlp_packed_batch_equals_each_sequence_alone(ttt_backend, ttt_backend_name,
                                                    ttt_device):
    """A packed batch (an empty sequence among them) gives each sequence's output and final
    state of a call on that sequence alone (the first packed case the backend takes)."""
    for mc in MLP_CASES:
        inputs = mlp_inputs(mc, ttt_device, seed=5)
        if (mc.case.seq_lens and 0 in mc.case.seq_lens and not
                ttt_backend.not_supported_reasons(ttt.mlp.make_mlp_problem(**inputs))):
            break
    else:
        pytest.skip(f"{ttt_backend.name} takes none of the packed cases with an empty sequence")
    o, final = ttt.chunk_ttt_mlp(**inputs, backend=ttt_backend_name)
    offsets = inputs["cu_seqlens"].tolist()
    bound = TOLERANCES[mc.case.dtype][0]
    for n, (start, stop) in enumerate(zip(offsets[:-1], offsets[1:])):
        alone = {k: (v[:, start:stop] if isinstance(v, torch.Tensor) and v.dim() == 4 else v)
                 for k, v in inputs.items() if k != "cu_seqlens"}
        alone["initial_state"] = tuple(s[n:n + 1] for s in inputs["initial_state"])
        o_n, final_n = ttt.chunk_ttt_mlp(**alone, backend=ttt_backend_name)
        if stop > start:
            expect_close(f"o of sequence {n}", o[:, start:stop], o_n, bound)
        for name, f, f_n in zip(MLP_STATE, final, final_n):
            expect_close(f"final {name} of sequence {n}", f[n:n + 1], f_n, bound)


def test_mlp_strided_views(ttt_backend_name, ttt_device):
    """Strided views give the contiguous inputs' results bitwise."""
    inputs = mlp_inputs(MLP_CASES[0], ttt_device, seed=3)
    o, final = ttt.chunk_ttt_mlp(**inputs, backend=ttt_backend_name)
    views = {k: (v.transpose(1, 2).contiguous().transpose(1, 2)
                 if k in ("q", "k", "v") else v) for k, v in inputs.items()}
    o_views, final_views = ttt.chunk_ttt_mlp(**views, backend=ttt_backend_name)
    expect(torch.equal(o, o_views) and all(map(torch.equal, final, final_views)),
           "strided views: results differ from the contiguous inputs'")


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_mlp_autocast(grad, ttt_backend, ttt_backend_name, ttt_device):
    """Under autocast q, k and v are cast to its dtype (o in it, the state float32), as a
    call on the cast tensors."""
    inputs = mlp_inputs(MLP_CASES[0], ttt_device, seed=3)
    cast = {k: (v.to(BF16) if k in ("q", "k", "v") else v) for k, v in inputs.items()}
    _skip_unsupported(cast, ttt_backend)
    if grad:
        inputs = _with(inputs, _leaves(inputs))
        cast = _with(cast, _leaves(cast))
    device_type = torch.device(ttt_device).type
    with torch.autocast(device_type, dtype=BF16):
        o_auto, final_auto = ttt.chunk_ttt_mlp(**inputs, backend=ttt_backend_name)
    o_cast, final_cast = ttt.chunk_ttt_mlp(**cast, backend=ttt_backend_name)
    expect(o_auto.dtype == BF16 and all(f.dtype == F32 for f in final_auto),
           f"autocast: o {o_auto.dtype}, state {[f.dtype for f in final_auto]}")
    expect(torch.equal(o_auto, o_cast) and all(map(torch.equal, final_auto, final_cast)),
           "autocast: results differ from a call on the cast q, k, v")


def test_mlp_compiles_as_one_graph_without_grad(ttt_backend_name, ttt_device):
    """torch.compile(fullgraph=True) of a call without autograd (inference) gives the eager
    results (aot_eager: dynamo and AOT autograd)."""
    inputs = mlp_inputs(MLP_CASES[0], ttt_device, seed=4)

    def call(**kwargs):
        o, final = ttt.chunk_ttt_mlp(**kwargs, backend=ttt_backend_name)
        return o, *final

    with torch.no_grad():
        got = torch.compile(call, fullgraph=True, backend="aot_eager")(**inputs)
        want = call(**inputs)
    for name, g, w in zip(("o", *MLP_STATE), got, want):
        expect_close(f"compiled {name}", g, w, TOLERANCES[MLP_CASES[0].case.dtype][0])


def test_mlp_compiles_as_one_graph(ttt_backend_name, ttt_device):
    """torch.compile(fullgraph=True) of a dense call gives the eager results and gradients
    (aot_eager: dynamo and AOT autograd)."""
    inputs = mlp_inputs(MLP_CASES[0], ttt_device, seed=4)
    leaves = _leaves(inputs)

    def call(**kwargs):
        o, final = ttt.chunk_ttt_mlp(**kwargs, backend=ttt_backend_name)
        return o, *final

    got = torch.compile(call, fullgraph=True, backend="aot_eager")(**_with(inputs, leaves))
    want = call(**_with(inputs, leaves))
    bound = TOLERANCES[MLP_CASES[0].case.dtype][0]
    for name, g, w in zip(("o", *MLP_STATE), got, want):
        expect_close(f"compiled {name}", g, w, bound)
    probe = [torch.randn_like(w) for w in want]
    grads = torch.autograd.grad(got, list(leaves.values()), probe, allow_unused=True)
    grads_eager = torch.autograd.grad(want, list(leaves.values()), probe, allow_unused=True)
    for name, g, w in zip(leaves, grads, grads_eager):
        if w is not None:
            expect_close(f"compiled d{name}", g, w, TOLERANCES[MLP_CASES[0].case.dtype][1])


def _skip_unless_mlp_layer_runs(backend, device) -> None:
    """Skip with the backend's reasons for TTTMLP's calls (eta_key, query_residual)."""
    mc = MlpCase(Case(2, 8, HEADS, WIDTH // HEADS, MINI_BATCH, F32, eta_key=True,
                      output="query_residual"), 4 * (WIDTH // HEADS))
    _skip_unsupported(mlp_inputs(mc, device), backend)


@torch.no_grad()
def test_mlp_layer_generation_cache(ttt_backend, ttt_backend_name, ttt_device):
    """A model of two ``ttt.nn.TTTMLP`` layers: prefill of 19 tokens (a partial chunk), then
    7 tokens one at a time through a TTTCache (across a chunk boundary), equals one
    forward."""
    _skip_unless_mlp_layer_runs(ttt_backend, ttt_device)
    check_generation_cache(_model(ttt_backend_name, ttt_device, layer=ttt.nn.TTTMLP),
                           ttt_device, T=26, prefill=19)


def test_mlp_layer_cuda_graph_training_step(ttt_backend, ttt_backend_name, ttt_device):
    """The same model's training step captured in a CUDA graph and replayed equals eager."""
    if ttt_device.type != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    _skip_unless_mlp_layer_runs(ttt_backend, ttt_device)
    check_cuda_graph_training_step(_model(ttt_backend_name, ttt_device, layer=ttt.nn.TTTMLP),
                                   ttt_backend, ttt_device)
