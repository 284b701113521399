"""Meta tensors: the op and the layer give outputs of the right shapes and dtypes on the meta
device (deferred initialisation, shape tracing), as the reference backend declares."""

from __future__ import annotations

import warnings

import pytest
import torch

import ttt
from ttt.nn import TTTCache, TTTLinear


def _inputs(B=2, T=21, H=2, D=8, dtype=torch.float32, device="meta", eta_tensor=True,
            states=True, eta_key=False):
    def make(*shape, dt=dtype):
        return torch.randn(*shape, dtype=dt, device=device)

    inputs = dict(q=make(B, T, H, D), k=make(B, T, H, D), v=make(B, T, H, D),
                  w=make(H, D), b=make(H, D),
                  eta=make(B, T, H, 1) if eta_tensor else 0.1, chunk_size=8)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if states:
        inputs["initial_state"] = make(B, H, D, D, dt=state_dtype)
        inputs["initial_state_bias"] = make(B, H, 1, D, dt=state_dtype)
    if eta_key:
        inputs["eta_key"] = make(B, T, H, 1)
    return inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float64])
@pytest.mark.parametrize("eta_tensor", [True, False])
def test_op_on_meta_tensors_gives_shapes_and_dtypes(dtype, eta_tensor):
    inputs = _inputs(dtype=dtype, eta_tensor=eta_tensor)
    o, ht, hbt = ttt.chunk_ttt_linear(**inputs, output_final_state=True)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert (o.device.type, o.shape, o.dtype) == ("meta", (2, 21, 2, 8), dtype)
    assert (ht.device.type, ht.shape, ht.dtype) == ("meta", (2, 2, 8, 8), state_dtype)
    assert (hbt.device.type, hbt.shape, hbt.dtype) == ("meta", (2, 2, 1, 8), state_dtype)


def test_op_on_meta_matches_the_cpu_call():
    cpu = _inputs(device="cpu", eta_key=True)
    meta = {n: t.to("meta") if isinstance(t, torch.Tensor) else t for n, t in cpu.items()}
    for output in ("norm_residual", "query_residual", "raw"):
        want = ttt.chunk_ttt_linear(**cpu, output=output, output_final_state=True)
        got = ttt.chunk_ttt_linear(**meta, output=output, output_final_state=True)
        for w, g in zip(want, got):
            assert (g.device.type, g.shape, g.dtype) == ("meta", w.shape, w.dtype)


def test_backward_on_meta_tensors_gives_gradients_of_the_inputs_shapes():
    inputs = _inputs(eta_key=True)
    leaves = {n: t.requires_grad_() for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    o, ht, hbt = ttt.chunk_ttt_linear(**inputs, output_final_state=True)
    grads = torch.autograd.grad([o.sum() + ht.sum() + hbt.sum()], list(leaves.values()))
    for (name, leaf), grad in zip(leaves.items(), grads):
        assert (grad.device.type, grad.shape, grad.dtype) == ("meta", leaf.shape,
                                                              leaf.dtype), name


def test_meta_under_an_autocast_region():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _, _ = ttt.chunk_ttt_linear(**_inputs())
    assert o.shape == (2, 21, 2, 8) and o.device.type == "meta"


def test_meta_is_no_reason_to_warn_about_skipped_backends():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ttt.chunk_ttt_linear(**_inputs())


def test_meta_cu_seqlens_is_a_clear_error():
    inputs = _inputs(B=1, states=False)
    with pytest.raises(ValueError, match=r"cu_seqlens: .*meta"):
        ttt.chunk_ttt_linear(**inputs, cu_seqlens=torch.tensor([0, 5, 21], device="meta"))


def test_layer_forward_under_the_meta_device():
    with torch.device("meta"):
        layer = TTTLinear(32, 4, 8, use_gate=True)
        x = torch.randn(2, 19, 32)
        y = layer(x)
    assert (y.device.type, y.shape, y.dtype) == ("meta", (2, 19, 32), torch.float32)
    y.sum().backward()
    assert layer.W1.grad.shape == layer.W1.shape and layer.W1.grad.device.type == "meta"


def test_layer_cache_under_the_meta_device():
    with torch.device("meta"), torch.no_grad():
        layer = TTTLinear(32, 4, 8)
        x = torch.randn(2, 12, 32)
        cache = TTTCache()
        assert layer(x[:, :11], cache=cache).shape == (2, 11, 32)
        assert layer(x[:, 11:], cache=cache).shape == (2, 1, 32)
    assert cache.seen_tokens == 12


def test_deferred_initialisation_from_meta():
    """Build on meta, materialise on the CPU with to_empty and initialise with
    reset_parameters (the fixed token_idx buffer included): the layer runs, and with the
    state dict of a layer built on the CPU it computes what that layer computes."""
    with torch.device("meta"):
        deferred = TTTLinear(32, 4, 8)
    deferred = deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    eager = TTTLinear(32, 4, 8)
    assert torch.equal(deferred.token_idx, eager.token_idx)
    x = torch.randn(2, 19, 32)
    assert deferred(x).isfinite().all()
    deferred.load_state_dict(eager.state_dict())
    assert torch.equal(deferred(x), eager(x))


def test_shapes_traced_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = _inputs(device="cpu")
    with FakeTensorMode() as mode:
        fake = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                for n, t in real.items()}
        o, ht, hbt = ttt.chunk_ttt_linear(**fake, output_final_state=True)
    assert o.shape == (2, 21, 2, 8) and ht.shape == (2, 2, 8, 8) and hbt.shape == (2, 2, 1, 8)
