"""The ``cupy`` backend: registered, kernels not written yet.

It loads (so ``ttt.available_backends()`` lists it) and declines every problem with the
reason, so automatic selection passes it over and an explicit choice says why.
"""

from __future__ import annotations

import torch

from ttt import Backend, Capabilities


class CupyBackend(Backend):
    name = "cupy"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        chunk_sizes=frozenset({16, 32, 64}),
        max_head_dim=128,
    )

    def unavailable_reason(self) -> str | None:
        return "the CUDA kernels of the cupy backend are not written yet (issue: CuPy backend)"

    def versions(self) -> dict[str, str]:
        try:
            import cupy
        except ImportError:
            return {"cupy": "not installed"}
        return {"cupy": cupy.__version__}
