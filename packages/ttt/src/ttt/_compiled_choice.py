"""The backend's choice while torch.compile traces a call of ``chunk_ttt_linear``.

Dynamo does not trace the registry (its choice lives in a ContextVar) nor backend code: the
choice runs once per trace as a constant of the graph (``assume_constant_result``), from a
signature of plain values. Imported only while compiling (the decorator imports dynamo).
"""

from __future__ import annotations

import torch

from ._custom_op import GRAD_INPUTS
from .problem import Problem
from .registry import select_backend


def _stand_in(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` with one element of storage, for the backend's choice."""
    return torch.empty_strided(shape, [0] * len(shape), dtype=dtype, device=device)


@torch.compiler.assume_constant_result
def compiled_backend_name(signature: tuple, requested: str | None) -> str:
    """The backend's choice while torch.compile traces: run once, kept by the graph. The
    signature (plain values) rebuilds a Problem of stand-in tensors with the call's shapes,
    dtypes, device and options."""
    (shapes, dtypes, device, scale, eps, chunk_size, output_final_state, seq_lens, varlen,
     eta_is_tensor, requires_grad, output) = signature
    t = {name: None if shape is None else _stand_in(shape, dtype, device)
         for name, shape, dtype in zip(GRAD_INPUTS, shapes, dtypes)}
    cu_seqlens = _stand_in((len(seq_lens) + 1,), torch.int64, device) if varlen else None
    problem = Problem(q=t["q"], k=t["k"], v=t["v"], w=t["w"], b=t["b"], eta=t["eta"],
                      scale=scale, eps=eps, chunk_size=chunk_size,
                      initial_state=t["initial_state"],
                      initial_state_bias=t["initial_state_bias"],
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      seq_lens=seq_lens, eta_is_tensor=eta_is_tensor,
                      requires_grad=requires_grad, eta_key=t["eta_key"], output=output)
    return select_backend(problem, requested).name
