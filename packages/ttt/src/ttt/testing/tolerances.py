"""Bounds on the error against the float64 oracle, per input dtype.

``TOLERANCES[dtype] = (outputs and final states, gradients)``: bounds on the whole tensor's
relative error ``||x - ref|| / ||ref||``. The conformance suite and ``python -m ttt demo``
both judge by this one table.

``SEGMENT_FACTOR``: the suite also bounds every sequence's and every chunk's RMS error
against the whole tensor's RMS (``ttt.testing.compare``) by ``SEGMENT_FACTOR`` times the
same tolerance.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (1e-2, 5e-2),
    torch.float16: (5e-3, 2e-2),
    torch.float64: (1e-10, 1e-9),
}

SEGMENT_FACTOR = 4.0
