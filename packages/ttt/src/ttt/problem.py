"""The validated inputs of one call, as every backend receives them: built once per call
by ``ttt.validation``; its tensors are contiguous and never to be written by a backend."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields

import torch

from .arguments import GRAD_INPUTS


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The state dtype of ``dtype`` inputs: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def state_shapes(N, H, D, hidden=None) -> tuple[tuple, ...]:
    """The inner model's state: TTT-Linear's ``[N, H, D, D], [N, H, 1, D]`` or, of hidden
    width F, TTT-MLP's ``[N, H, D, F], [N, H, 1, F], [N, H, F, D], [N, H, 1, D]`` (of sizes,
    or of the sizes' names for a message)."""
    if hidden is None:
        return (N, H, D, D), (N, H, 1, D)
    F = hidden
    return (N, H, D, F), (N, H, 1, F), (N, H, F, D), (N, H, 1, D)


def attribute_reader(names: tuple[str, ...]):
    """A function reading attributes ``names`` of an object as a tuple: by one attrgetter
    (one C call), or one by one while torch.compile traces (dynamo cannot trace one)."""
    getter = operator.attrgetter(*names)

    def read(obj) -> tuple:
        if torch.compiler.is_compiling():
            return tuple(getattr(obj, name) for name in names)
        return getter(obj)

    return read


OUTPUTS = ("norm_residual", "query_residual", "raw")
"""The output forms, with z the inner model's prediction for the scaled query:
``"norm_residual"`` z + LN(z) * w + b; ``"query_residual"`` q + LN(z) * w + b (q as given,
before ``scale``); ``"raw"`` z."""


@dataclass(frozen=True)
class Problem:
    """One call of ``chunk_ttt_linear`` after validation (docs/backends.md), built by
    :func:`ttt.make_problem` (the dataclass constructor checks nothing).

    ``q, k, v [B, T, H, D]`` in the input dtype; ``w, b [H, D]`` any floating dtype;
    ``eta [B, T, H, 1]`` always a tensor (a float's constant where not ``eta_is_tensor``);
    ``initial_state [N, H, D, D]``, ``initial_state_bias [N, H, 1, D]`` or None, in the
    state dtype; ``cu_seqlens [N + 1]`` int64 or None, ``seq_lens`` the N lengths as host
    ints; ``eta_key [B, T, H, 1]`` or None (no factor); ``output`` one of :data:`OUTPUTS`.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor
    eta: torch.Tensor
    scale: float
    eps: float
    chunk_size: int
    initial_state: torch.Tensor | None
    initial_state_bias: torch.Tensor | None
    output_final_state: bool
    cu_seqlens: torch.Tensor | None
    seq_lens: tuple[int, ...]
    eta_is_tensor: bool
    requires_grad: bool = field(default=False)
    eta_key: torch.Tensor | None = None
    output: str = "norm_residual"
    op = "ttt_linear"          # the operator (``Capabilities.ops``): MlpProblem's "ttt_mlp"

    @classmethod
    def _of_fields(cls, fields: dict) -> Problem:
        """``Problem(**fields)`` for a new dict of every field, already checked, which
        becomes its ``__dict__``: without the frozen dataclass's ``object.__setattr__`` per
        field, as the core builds a few per call. Under ``torch.compile`` the plain
        constructor (dynamo cannot trace ``__dict__.update``). Core only."""
        if torch.compiler.is_compiling():
            return cls(**fields)
        problem = object.__new__(cls)
        problem.__dict__.update(fields)
        return problem

    B = property(lambda self: self.q.shape[0])      # (q: [B, T, H, D])
    T = property(lambda self: self.q.shape[1])
    H = property(lambda self: self.q.shape[2])
    D = property(lambda self: self.q.shape[3])
    N = property(lambda self: len(self.seq_lens))   # sequences: B, or len(cu_seqlens) - 1
    dtype = property(lambda self: self.q.dtype)
    device = property(lambda self: self.q.device)
    is_varlen = property(lambda self: self.cu_seqlens is not None)

    @property
    def state_dtype(self) -> torch.dtype:
        return state_dtype(self.q.dtype)

    def signature(self) -> tuple:
        """What the backend's choice reads of this problem as plain values, but its batch
        size and length, scale and eps (``ttt.choice._choice_key`` adds those); under
        torch.compile the choice is made from it alone (``ttt._compiled_choice``). Head
        count and dim through ``operator.index``: there they specialize, a guard each."""
        shape = self.q.shape
        dtypes = tuple([None if t is None else t.dtype for t in _grad_inputs(self)])
        return (operator.index(shape[2]), operator.index(shape[3]), dtypes,
                self.q.device, self.chunk_size, self.output_final_state,
                self.seq_lens if self.cu_seqlens is not None else None, self.eta_is_tensor,
                self.requires_grad, self.output)

    def chunk_counts(self) -> list[int]:
        """Chunks per sequence (a partial last chunk counts as one)."""
        return [-(-length // self.chunk_size) for length in self.seq_lens]

    def describe(self) -> str:
        kind = f"varlen N={self.N}" if self.is_varlen else f"B={self.B}"
        return (f"{kind} T={self.T} H={self.H} D={self.D} chunk={self.chunk_size} "
                f"dtype={str(self.dtype).replace('torch.', '')} device={self.device}")


_grad_inputs = attribute_reader(GRAD_INPUTS)


@dataclass(frozen=True)
class MlpProblem(Problem):
    """One call of :func:`ttt.chunk_ttt_mlp` after validation: a :class:`ttt.Problem` (its
    ``initial_state`` and ``initial_state_bias`` None) and the inner MLP's initial state
    ``mlp_state`` (``W1 [N, H, D, F]``, ``b1 [N, H, 1, F]``, ``W2 [N, H, F, D]``,
    ``b2 [N, H, 1, D]``, float32; float64 for float64 inputs; None: zeros) of hidden width
    ``hidden`` (F)."""

    mlp_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    hidden: int = 0
    op = "ttt_mlp"

    def signature(self) -> tuple:
        return (*super().signature(), self.op, self.hidden)

    def describe(self) -> str:
        return f"{self.op} hidden={self.hidden} {super().describe()}"

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return state_shapes(self.N, self.H, self.D, self.hidden)


_PROBLEM_FIELDS = tuple(f.name for f in fields(Problem))


def as_mlp_problem(problem: Problem, state, hidden: int, requires_grad: bool) -> MlpProblem:
    """``problem`` (no linear states) as TTT-MLP's, with ``state`` (checked) of width
    ``hidden``."""
    values = {name: getattr(problem, name) for name in _PROBLEM_FIELDS}
    values.update(requires_grad=requires_grad, mlp_state=state, hidden=hidden)
    return MlpProblem._of_fields(values)


def mlp_initial_states(problem: MlpProblem) -> tuple[torch.Tensor, ...]:
    """The initial state in the state dtype (the given tensors where of that dtype), or
    zeros."""
    if problem.mlp_state is not None:
        return tuple(s.to(problem.state_dtype) for s in problem.mlp_state)
    return tuple(torch.zeros(shape, dtype=problem.state_dtype, device=problem.device)
                 for shape in problem.state_shapes())
