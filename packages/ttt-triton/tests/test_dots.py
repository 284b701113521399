"""The kernels' float32 products (``common.mm``, ``common.mm_acc``): IEEE dots, plain and in
K blocks (``ieee_kblocks``, float32 at head dim 128), against float64 products. Runs on CUDA
when there is a GPU, else in the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from launcher_cases import DEVICE  # noqa: E402

from ttt_triton.ops.ttt_linear.common import mm, mm_acc  # noqa: E402

if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)


@triton.jit
def _products_kernel(a_ptr, b_ptr, c_ptr, ab_ptr, acc_ptr, M: tl.constexpr, K: tl.constexpr,
                     N: tl.constexpr, PREC: tl.constexpr):
    o_m, o_k, o_n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    b_a = tl.load(a_ptr + o_m[:, None] * K + o_k[None, :])                 # [M, K]
    b_b = tl.load(b_ptr + o_k[:, None] * N + o_n[None, :])                 # [K, N]
    b_c = tl.load(c_ptr + o_m[:, None] * N + o_n[None, :])                 # [M, N]
    tl.store(ab_ptr + o_m[:, None] * N + o_n[None, :], mm(b_a, b_b, PREC))
    tl.store(acc_ptr + o_m[:, None] * N + o_n[None, :], mm_acc(b_a, b_b, b_c, PREC))


@pytest.mark.parametrize("prec", ["ieee", "ieee_kblocks"])
@pytest.mark.parametrize("M,K,N", [(16, 16, 32), (16, 128, 128), (64, 128, 64), (32, 64, 16)])
def test_float32_products_are_ieee(prec, M, K, N):
    """Both forms of IEEE float32 products agree with float64 ones to float32 rounding
    (the K blocks change only the order of the sums), for ``mm`` and ``mm_acc``."""
    g = torch.Generator().manual_seed(M * K + N)
    a, b, c = (torch.randn(shape, generator=g) for shape in ((M, K), (K, N), (M, N)))
    ab, acc = torch.empty(M, N), torch.empty(M, N)
    tensors = [t.to(DEVICE) for t in (a, b, c, ab, acc)]
    _products_kernel[(1,)](*tensors, M, K, N, prec)
    want_ab = a.double() @ b.double()
    for got, want in ((tensors[3], want_ab), (tensors[4], want_ab + c.double())):
        err = ((got.cpu().double() - want).norm() / want.norm()).item()
        assert err < 1e-6, f"{prec} {M}x{K}x{N}: relative error {err:.2e}"
