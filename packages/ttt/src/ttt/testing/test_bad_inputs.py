"""Bad input raises TypeError/ValueError naming the argument: never a crash or garbage."""

from __future__ import annotations

import pytest
import torch

import ttt

from .cases import F32, F64, Case, make_inputs
from .compare import expect


def _base(device, **case):
    spec = dict(B=2, T=20, H=2, D=16, chunk=16, dtype=F32)
    spec.update(case)
    inputs = make_inputs(Case(**spec), device, seed=3)
    inputs["output_final_state"] = True
    return inputs


def _varlen(device):
    inputs = make_inputs(Case(1, 20, 2, 16, 16, F32, seq_lens=(8, 12)), device, seed=3)
    return inputs


BAD_INPUTS = {
    # name: (make the bad inputs from good ones, expected exception, words the message names)
    "q rank": (lambda x, d: {**x, "q": x["q"][0]}, ValueError, ["q", "4-d"]),
    "k shape": (lambda x, d: {**x, "k": x["k"][:, :10]}, ValueError, ["k", "shape"]),
    "K != V": (lambda x, d: {**x, "v": torch.cat([x["v"], x["v"]], -1)}, ValueError,
               ["K == V"]),
    "q not a tensor": (lambda x, d: {**x, "q": x["q"].tolist()}, TypeError, ["q", "Tensor"]),
    "integer q": (lambda x, d: {**x, "q": x["q"].to(torch.int32)}, TypeError, ["q", "int32"]),
    "dtype mismatch k": (lambda x, d: {**x, "k": x["k"].half()}, TypeError,
                         ["k", "float16", "float32"]),
    "dtype mismatch v": (lambda x, d: {**x, "v": x["v"].bfloat16()}, TypeError, ["v", "bfloat16"]),
    "w shape": (lambda x, d: {**x, "w": x["w"][:1]}, ValueError, ["w", "[H, D]"]),
    "b rank": (lambda x, d: {**x, "b": x["b"][0]}, ValueError, ["b", "2-d"]),
    "eta shape": (lambda x, d: {**x, "eta": x["eta"][..., 0]}, ValueError, ["eta", "4-d"]),
    "eta last dim": (lambda x, d: {**x, "eta": x["eta"].expand(2, 20, 2, 3)}, ValueError,
                     ["eta", "[B, T, H, 1]"]),
    "eta string": (lambda x, d: {**x, "eta": "0.1"}, TypeError, ["eta"]),
    "eta nan": (lambda x, d: {**x, "eta": float("nan")}, ValueError, ["eta"]),
    "scale zero": (lambda x, d: {**x, "scale": 0.0}, ValueError, ["scale", "positive"]),
    "scale negative": (lambda x, d: {**x, "scale": -1.0}, ValueError, ["scale"]),
    "eps negative": (lambda x, d: {**x, "eps": -1e-6}, ValueError, ["eps"]),
    "chunk_size zero": (lambda x, d: {**x, "chunk_size": 0}, ValueError, ["chunk_size"]),
    "chunk_size float": (lambda x, d: {**x, "chunk_size": 16.5}, TypeError, ["chunk_size"]),
    "state N": (lambda x, d: {**x, "initial_state": x["initial_state"][:1]}, ValueError,
                ["initial_state", "N = 2"]),
    "state bias shape": (lambda x, d: {**x, "initial_state_bias": x["initial_state_bias"][
        :, :, 0]}, ValueError, ["initial_state_bias", "4-d"]),
    "state dtype": (lambda x, d: {**x, "initial_state": x["initial_state"].half()}, TypeError,
                    ["initial_state", "float16"]),
    "output_final_state str": (lambda x, d: {**x, "output_final_state": "yes"}, TypeError,
                               ["output_final_state"]),
    "device mismatch v": (lambda x, d: {**x, "v": x["v"].to("meta")}, ValueError,
                          ["v", "meta"]),
    "device mismatch w": (lambda x, d: {**x, "w": x["w"].to("meta")}, ValueError, ["w", "meta"]),
    "device mismatch state": (lambda x, d: {**x, "initial_state": x["initial_state"].to("meta")},
                              ValueError, ["initial_state", "meta"]),
    "cu_seqlens with B != 1": (lambda x, d: {**x, "cu_seqlens": torch.tensor(
        [0, 20], device=d)}, ValueError, ["cu_seqlens", "B == 1"]),
}

VARLEN_BAD_INPUTS = {
    "cu_seqlens decreasing": (torch.tensor([0, 12, 8, 20]), ValueError,
                              ["cu_seqlens", "increasing"]),
    "cu_seqlens past T": (torch.tensor([0, 8, 24]), ValueError, ["cu_seqlens", "T"]),
    "cu_seqlens short of T": (torch.tensor([0, 8, 12]), ValueError, ["cu_seqlens", "T"]),
    "cu_seqlens not from 0": (torch.tensor([2, 8, 20]), ValueError, ["cu_seqlens", "0"]),
    "cu_seqlens float": (torch.tensor([0.0, 8.0, 20.0]), TypeError, ["cu_seqlens", "int"]),
    "cu_seqlens 2-d": (torch.tensor([[0, 8, 20]]), ValueError, ["cu_seqlens", "1-d"]),
    "cu_seqlens list": ([0, 8, 20], TypeError, ["cu_seqlens", "Tensor"]),
}


def _expect(exc_type, words, fn):
    with pytest.raises(exc_type) as info:
        fn()
    message = str(info.value)
    missing = [w for w in words if w not in message]
    expect(not missing, f"message {message!r} does not name {missing}")


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises(name, ttt_backend_name, ttt_device):
    make, exc_type, words = BAD_INPUTS[name]
    inputs = make(_base(ttt_device), ttt_device)
    _expect(exc_type, words, lambda: ttt.chunk_ttt_linear(**inputs, backend=ttt_backend_name))


@pytest.mark.parametrize("name", list(VARLEN_BAD_INPUTS))
def test_bad_cu_seqlens_raises(name, ttt_backend_name, ttt_device):
    cu_seqlens, exc_type, words = VARLEN_BAD_INPUTS[name]
    inputs = _varlen(ttt_device)
    inputs.pop("initial_state")
    inputs.pop("initial_state_bias")
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.to(ttt_device)
    inputs["cu_seqlens"] = cu_seqlens
    _expect(exc_type, words, lambda: ttt.chunk_ttt_linear(**inputs, backend=ttt_backend_name))


def test_varlen_state_count_must_match(ttt_backend_name, ttt_device):
    inputs = _varlen(ttt_device)
    inputs["initial_state"] = inputs["initial_state"][:1]
    _expect(ValueError, ["initial_state", "N = 2"],
            lambda: ttt.chunk_ttt_linear(**inputs, backend=ttt_backend_name))


def test_unsupported_float64_is_refused_with_reason(ttt_backend, ttt_backend_name, ttt_device):
    if F64 in ttt_backend.capabilities.dtypes:
        pytest.skip(f"{ttt_backend_name} supports float64 (checked against the oracle instead)")
    inputs = make_inputs(Case(1, 20, 1, 16, 16, F64), ttt_device, seed=3)
    _expect(ValueError, ["float64", ttt_backend_name],
            lambda: ttt.chunk_ttt_linear(**inputs, backend=ttt_backend_name))


def test_unsupported_chunk_size_is_refused_with_reason(ttt_backend, ttt_backend_name, ttt_device):
    sizes = ttt_backend.capabilities.chunk_sizes
    if sizes is None:
        pytest.skip(f"{ttt_backend_name} takes any chunk size (checked against the oracle)")
    bad = next(c for c in range(1, 1024) if c not in sizes)
    inputs = make_inputs(Case(1, 20, 1, 16, 16, F32), ttt_device, seed=3)
    inputs["chunk_size"] = bad
    _expect(ValueError, ["chunk_size", str(bad)],
            lambda: ttt.chunk_ttt_linear(**inputs, backend=ttt_backend_name))
