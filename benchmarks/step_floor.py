"""The chain step's floor: a forward chain step with its chunk already on chip.

One step of the forward chain (``fwd_chain``) is, per (sequence, head):

    kh = k W + hb  ->  g (the LayerNorm-L2 gradient)  ->  W -= eta k^T g,  hb -= eta sum(g)

The kernel here loads one chunk's ``k`` and ``v`` and the state once, then runs that step
``steps`` times on them: no loads or stores inside the loop, the same Triton helpers
(``common.mm``, ``common.inner_grad``), dot precision and warps as the Triton backend's
chain. Its time per step is the latency of the step's math alone, the floor a chain kernel
approaches as its loads hide behind it. One program per chain, ``chains`` of them (one per
SM by default, so that each SM runs one).

    python -m benchmarks.step_floor                      # D 64, 128; chunk 16, 32, 64; bf16, fp32
    python -m benchmarks.step_floor --bd 64 --bt 16 --dtypes bf16

``benchmarks.run`` prints the floor beside each backend's ``step us``.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from benchmarks import _timing
from ttt_triton.ops.ttt_linear import tuning
from ttt_triton.ops.ttt_linear.common import inner_grad, mm

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@triton.jit
def chain_steps_kernel(k, v, w, b, h, steps, eta, eps,
                       D: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr):
    """``steps`` chain steps of chain ``program_id`` on its chunk: k, v [chains, BT, D]
    (input dtype), w, b [D], h [chains, D, D] fp32 in (the state) and out."""
    i = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, D)
    o_x = i * BT * D + o_t[:, None] * D + o_d[None, :]                    # [BT, D]
    o_dd = i * D * D + o_d[:, None] * D + o_d[None, :]                    # [D, D]
    m_2d = o_t[:, None] < BT
    b_k = tl.load(k + o_x).to(tl.float32)                                  # [BT, D]
    b_v = tl.load(v + o_x).to(tl.float32)                                  # [BT, D]
    b_w = tl.load(w + o_d).to(tl.float32)                                  # [D]
    b_b = tl.load(b + o_d).to(tl.float32)                                  # [D]
    b_W = tl.load(h + o_dd)                                                # [D, D]
    b_hb = tl.zeros([D], dtype=tl.float32)                                 # [D]
    for _ in range(steps):
        b_kh = mm(b_k, b_W, PREC) + b_hb[None, :]                          # [BT, D]
        b_g, _, _, _ = inner_grad(b_kh, b_k, b_v, b_w, b_b, m_2d, D, eps)
        b_W = b_W - eta * mm(tl.trans(b_k), b_g, PREC)
        b_hb = b_hb - eta * tl.sum(b_g, 0)
    tl.store(h + o_dd, b_W + b_hb[None, :])


def chain_steps(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                h: torch.Tensor, steps: int, eta: float = 1e-3, eps: float = 1e-6) -> None:
    """Run :func:`chain_steps_kernel` over every chain of ``k`` [chains, BT, D] (D a power
    of two), updating ``h`` [chains, D, D] fp32 in place (plus the bias state, added to
    every row of ``h`` at the end so that nothing is left unused)."""
    chains, BT, D = k.shape
    ieee = k.dtype == torch.float32
    options = tuning.launch_options("chain", D, ieee, tuning.DEFAULT_TUNING, BT=BT)
    chain_steps_kernel[(chains,)](k, v, w, b, h, steps, eta, eps, D=D, BT=BT,
                                  PREC=tuning.dot_precision(k.dtype, D), **options)


def inputs(chains: int, BT: int, D: int, dtype: torch.dtype, device, seed: int = 0):
    """Random k (rows L2-normalised), v, w, b, and a state h (entries of scale D ** -0.5)
    for ``chains`` chains."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    k = torch.nn.functional.normalize(randn(chains, BT, D), dim=-1).to(dtype)
    return (k, randn(chains, BT, D).to(dtype), 1 + 0.1 * randn(D), 0.1 * randn(D),
            D ** -0.5 * randn(chains, D, D))


@functools.cache
def floor_us(D: int, BT: int, dtype: torch.dtype, device: str = "cuda", steps: int = 4096,
             chains: int | None = None) -> float:
    """Microseconds per chain step on ``device`` (a CUDA GPU): the median of timed runs of
    ``steps`` steps, one chain per SM unless ``chains`` says otherwise."""
    device = torch.device(device)
    if chains is None:
        chains = torch.cuda.get_device_properties(device).multi_processor_count
    k, v, w, b, h = inputs(chains, BT, D, dtype, device)
    budget = _timing.Budget(warmup_ms=25, rep_ms=200, min_iters=5)
    _, median_ms, _ = _timing.bench(lambda: chain_steps(k, v, w, b, h, steps), device,
                                    budget)
    return median_ms * 1e3 / steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bd", type=int, nargs="+", default=[64, 128], help="head dims")
    parser.add_argument("--bt", type=int, nargs="+", default=[16, 32, 64], help="chunks")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=DTYPES)
    parser.add_argument("--steps", type=int, default=4096)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, "benchmarks.step_floor: needs a CUDA GPU\n")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print("| dtype | D | chunk | floor us per step |\n|---|---|---|---|")
    for name in args.dtypes:
        for D in args.bd:
            for BT in args.bt:
                us = floor_us(D, BT, DTYPES[name], steps=args.steps)
                print(f"| {name} | {D} | {BT} | {us:.3f} |")


if __name__ == "__main__":
    main()
