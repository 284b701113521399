"""Bounds on the relative error ``||x - ref|| / ||ref||`` against the float64 oracle, per
input dtype: ``(outputs and final states, gradients)``. The conformance suite and
``python -m ttt demo`` both judge by this one table."""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-2, 5e-2),
    torch.float16: (5e-3, 2e-2),
    torch.float64: (1e-10, 1e-9),
}
