"""Every tensor a backend returns is its own: none is an input, shares storage with an input
or shares storage with another returned tensor. PyTorch's custom ops refuse such returns at
run time (``The output of this custom operator ... may not alias any inputs ... or other
returns``), so a backend that breaks this rule fails on the user's first backward; here it
fails on the backend's own ``forward`` and ``backward``, called directly, for the cases
where it is easiest to break: float32 tensors (a ``.to(torch.float32)`` that returns its
argument), parameters in float32 under half activations, one buffer reduced into several
gradients."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

import ttt

from .calls import skip_unless_supported
from .cases import BF16, DTYPE_NAMES, F16, F32, Case, make_inputs
from .compare import expect

_CASES = {
    "dense-h0": Case(2, 37, 2, 32, 16, F32),
    "varlen-h0": Case(1, 45, 2, 32, 16, F32, seq_lens=(9, 36)),
    "dense-etaF-nofinal": Case(2, 20, 2, 16, 16, F32, states=False, eta_tensor=False,
                               final_state=False),
    "varlen-etakey-query_residual": Case(1, 27, 2, 16, 16, F32, seq_lens=(20, 7),
                                         eta_key=True, output="query_residual"),
}
_PARAM_DTYPES = {"same": None, "fp32-params": F32}
_ACTIVATION_DTYPES = [pytest.param(d, id=DTYPE_NAMES[d]) for d in (F32, BF16, F16)]


def _storages(tensors) -> dict[int, str]:
    """{storage address: name} of the tensors that own memory (empty ones own none)."""
    found = {}
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and not t.is_meta:
            found.setdefault(t.untyped_storage().data_ptr(), name)
    return found


def _expect_fresh(what: str, returned: list, inputs: dict[int, str]) -> None:
    seen: dict[int, str] = {}
    for name, t in returned:
        if not isinstance(t, torch.Tensor) or not t.numel() or t.is_meta:
            continue
        address = t.untyped_storage().data_ptr()
        expect(address not in inputs,
               f"{what}: {name} shares storage with the input {inputs.get(address)}")
        expect(address not in seen,
               f"{what}: {name} shares storage with {seen.get(address)}, also returned")
        seen[address] = name


def _inputs(case: Case, activation, params, device) -> dict:
    x = make_inputs(replace(case, dtype=activation), device, seed=5)
    if params is not None:
        for name in ("w", "b", "eta", "eta_key"):
            if isinstance(x.get(name), torch.Tensor):
                x[name] = x[name].to(params)
    return x


@pytest.mark.parametrize("params", list(_PARAM_DTYPES.values()), ids=list(_PARAM_DTYPES))
@pytest.mark.parametrize("activation", _ACTIVATION_DTYPES)
@pytest.mark.parametrize("case", list(_CASES.values()), ids=list(_CASES))
def test_backend_returns_share_no_storage(case, activation, params, ttt_backend, ttt_device):
    """``forward`` and ``backward`` of the backend under test, called directly with every
    input requiring grad: outputs, final states, saved tensors and gradients are each a
    tensor of their own."""
    x = _inputs(case, activation, params, ttt_device)
    skip_unless_supported(ttt_backend, x)
    problem = ttt.make_problem(**{k: v.detach().requires_grad_(True)
                                  if isinstance(v, torch.Tensor) and v.is_floating_point()
                                  else v for k, v in x.items()})
    given = [(n, getattr(problem, n)) for n in (
        "q", "k", "v", "w", "b", "eta", "eta_key", "initial_state", "initial_state_bias",
        "cu_seqlens")]
    inputs = _storages(given)
    with torch.no_grad():
        o, ht, hbt, saved = ttt_backend.forward(problem, needs_backward=True)
    returned = [("o", o), ("final_state", ht), ("final_state_bias", hbt),
                *((f"saved[{i}]", t) for i, t in enumerate(saved))]
    _expect_fresh("forward", returned, inputs)

    g = torch.Generator(device="cpu").manual_seed(9)
    do = torch.randn(o.shape, generator=g).to(o)
    dht = None if ht is None else torch.randn(ht.shape, generator=g).to(ht)
    dhbt = None if hbt is None else torch.randn(hbt.shape, generator=g).to(hbt)
    cotangents = _storages([("do", do), ("dht", dht), ("dhbt", dhbt)])
    grads = ttt_backend.backward(problem, list(saved), do, dht, dhbt, ttt.GradNeeds())
    returned = [(f.name, getattr(grads, f.name)) for f in fields(grads)]
    # (the op's backward takes the forward's inputs, saved tensors and the cotangents)
    _expect_fresh("backward", returned,
                  {**inputs, **_storages(("saved", t) for t in saved), **cotangents})
