"""Bounds on the error against the float64 oracle, per input dtype, for the conformance suite
and ``python -m ttt demo``; the largest errors measured: docs/testing.md, "Bounds"."""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (3e-6, 2e-5),
    torch.bfloat16: (1e-2, 5e-2),
    torch.float16: (5e-3, 1e-2),
    torch.float64: (1e-12, 1e-11),
}
"""``TOLERANCES[dtype] = (outputs and final states, gradients)``: bounds on the relative error
``||x - ref|| / ||ref||`` of whole tensors, with room for GPU kernels that round intermediate
tiles to the input dtype for tensor-core dots (float16, bfloat16)."""

SEGMENT_FACTOR = 8.0
"""Each sequence's and chunk's RMS error against the tensor's RMS is bounded by this factor
times the tolerance (``ttt.testing.compare``). Measured: a segment's error up to 2.3 times the
whole tensor's relative error on the short cases, 13 times on d eta of a packed T = 2100 batch
(1.4e-5 against float32's 2e-5)."""
