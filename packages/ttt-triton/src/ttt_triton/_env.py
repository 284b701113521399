"""Where the kernels run: on a CUDA GPU, or in Triton's interpreter on CPU tensors (tests)."""

from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``, Triton's own switch:
    kernels on CPU tensors, for tests), as the environment says now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def kernels_interpreted() -> bool:
    """Whether this process's kernels run in Triton's interpreter: :func:`interpreting` when
    first asked (by the launcher, after importing the kernels). ``triton.jit`` reads the
    switch once, when it makes a kernel, so the kernels keep that mode whatever the
    environment says later; the launcher's per-call paths ask this, not the environment."""
    return interpreting()
