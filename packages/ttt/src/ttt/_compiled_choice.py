"""The backend's choice while torch.compile traces ``chunk_ttt_linear``: dynamo traces
neither the ContextVar nor backend code, so the choice runs once per trace as a constant
of the graph, from plain values. Imported only while compiling (the decorator imports
dynamo)."""

from __future__ import annotations

import torch

from ._custom_op import problem_of
from .arguments import GRAD_INPUTS
from .choice import select_backend
from .errors import BackendNotSupportedError
from .problem import as_mlp_problem, state_shapes


def _stand_in(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` with one element of storage, for the backend's choice."""
    return torch.empty_strided(shape, [0] * len(shape), dtype=dtype, device=device)


@torch.compiler.assume_constant_result
def compiled_backend_name(signature: tuple, requested: str | None) -> str:
    """The choice for a Problem of stand-in tensors rebuilt from ``Problem.signature()``.
    Batch size and length (maybe dynamic), scale and eps are not in it: a dense stand-in
    holds one chunk, a packed one the call's lengths; scale ``D ** -0.5``, eps ``1e-6``."""
    (H, D, dtypes, device, chunk_size, output_final_state, packed_lens, eta_is_tensor,
     requires_grad, output, *mlp) = signature          # (mlp: TTT-MLP's op and hidden)
    seq_lens = (chunk_size,) if packed_lens is None else tuple(packed_lens)
    B, T, N = 1, sum(seq_lens), len(seq_lens)
    shapes = dict(q=(B, T, H, D), k=(B, T, H, D), v=(B, T, H, D), w=(H, D), b=(H, D),
                  eta=(B, T, H, 1), eta_key=(B, T, H, 1))
    shapes["initial_state"], shapes["initial_state_bias"] = state_shapes(N, H, D)
    t = {name: None if dtype is None else _stand_in(shapes[name], dtype, device)
         for name, dtype in zip(GRAD_INPUTS, dtypes)}
    cu_seqlens = None if packed_lens is None else _stand_in((N + 1,), torch.int64, device)
    problem = problem_of((*(t[name] for name in GRAD_INPUTS), cu_seqlens, seq_lens,
                          D ** -0.5, 1e-6, chunk_size, output_final_state, eta_is_tensor,
                          output, None), requires_grad)
    if mlp:                             # TTT-MLP's: its state of width hidden (zeros)
        problem = as_mlp_problem(problem, None, mlp[1], requires_grad)
    try:
        return select_backend(problem, requested).name
    except BackendNotSupportedError as err:
        raise type(err)(
            f"{err} [chosen while torch.compile traced the call: its batch size and length "
            f"are not known there, the ones shown are stand-ins]") from None
