"""Where the kernels run: on a CUDA GPU, or in Triton's interpreter on CPU tensors (tests)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``, Triton's own switch:
    kernels on CPU tensors, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
