"""Bounds on the error against the float64 oracle, per input dtype.

``TOLERANCES[dtype] = (outputs and final states, gradients)``: bounds on the relative error
``||x - ref|| / ||ref||`` of whole tensors, for the conformance suite and ``python -m ttt
demo``; each sequence's and chunk's RMS error against the tensor's RMS is bounded by
``SEGMENT_FACTOR`` times that (``ttt.testing.compare``).
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (3e-6, 2e-5),
    torch.bfloat16: (1e-2, 5e-2),
    torch.float16: (5e-3, 1e-2),
    torch.float64: (1e-12, 1e-11),
}
"""Largest errors measured on CPU (the reference backend, every case of the suite, T = 2048
included; the Triton backend under its interpreter, the cases up to T = 163): float32
4.1e-7 / 1.3e-6, float16 2.4e-4 / 3.5e-4 (the rounding of the result to float16), bfloat16
(reference) 1.8e-3 / 2.8e-3, float64 3.8e-16 / 2.2e-15. The bounds leave room for GPU kernels
that round intermediate tiles to the input dtype for tensor-core dots (float16, bfloat16)."""

SEGMENT_FACTOR = 8.0
"""Measured: a segment's error up to 2.3 times the whole tensor's relative error on the
short cases, 13 times on d eta of a packed T = 2100 batch (1.4e-5 against float32's 2e-5)."""
