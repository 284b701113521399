"""Opt-in kernel variants compute exactly what the default kernels compute."""

from __future__ import annotations

import os

import pytest
import torch

import ttt


def _device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("needs a CUDA device or TRITON_INTERPRET=1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("lens", [None, (5, 16, 40)], ids=["dense", "varlen"])
def test_prefetch_forward_is_bitwise_equal(monkeypatch, dtype, lens):
    device = _device()
    g = torch.Generator().manual_seed(3)
    B, T, H, D = (2, 45, 2, 32) if lens is None else (1, sum(lens), 2, 32)
    N = B if lens is None else len(lens)

    def rand(*shape, s=1.0, o=0.0):
        return (o + s * torch.randn(*shape, generator=g)).to(device)

    args = dict(q=rand(B, T, H, D).to(dtype), k=rand(B, T, H, D).to(dtype),
                v=rand(B, T, H, D).to(dtype), w=rand(H, D, s=0.1, o=1.0), b=rand(H, D, s=0.1),
                eta=(0.1 * torch.rand(B, T, H, 1, generator=g)).to(device, dtype),
                initial_state=rand(N, H, D, D, s=0.1), initial_state_bias=rand(N, H, 1, D, s=0.1),
                output_final_state=True, backend="triton")
    if lens is not None:
        args["cu_seqlens"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                          device=device)
    monkeypatch.delenv("TTT_TRITON_PREFETCH", raising=False)
    default = ttt.chunk_ttt_linear(**args)
    monkeypatch.setenv("TTT_TRITON_PREFETCH", "1")
    prefetched = ttt.chunk_ttt_linear(**args)
    for name, a, b in zip(("o", "final_state", "final_state_bias"), default, prefetched):
        assert torch.equal(a, b), f"{name} differs with TTT_TRITON_PREFETCH=1"
