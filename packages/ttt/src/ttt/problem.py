"""The validated inputs of one call, as every backend receives them.

The core (`ttt.validation`) builds a :class:`Problem` once per call; backends never see bad
input. Tensors in a Problem are contiguous and never to be written by a backend.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import torch

GRAD_INPUTS = ("q", "k", "v", "w", "b", "eta", "eta_key", "initial_state",
               "initial_state_bias")
"""The differentiable inputs of ``chunk_ttt_linear``, by argument name, in the custom op's
order: the one list of them. :class:`ttt.GradNeeds` has one field per name,
:class:`Gradients` one per name (:data:`GRADIENT_FIELDS`)."""

GRADIENT_FIELDS = {name: {"initial_state": "dh0", "initial_state_bias": "dhb0"}.get(
    name, "d" + name) for name in GRAD_INPUTS}
"""The :class:`Gradients` field holding each input's gradient (``"q"`` -> ``"dq"``; the
initial states' are ``dh0`` and ``dhb0``)."""

OUTPUTS = ("norm_residual", "query_residual", "raw")
"""The output forms, with z the inner model's prediction for the scaled query:
``"norm_residual"`` z + LN(z) * w + b; ``"query_residual"`` q + LN(z) * w + b (q as given,
before ``scale``); ``"raw"`` z."""


@dataclass(frozen=True)
class Problem:
    """One call of ``chunk_ttt_linear`` after validation.

    Built by :func:`ttt.make_problem`, the one way to a validated Problem (the op builds
    it so; a backend's tests may too). Inside the core, :meth:`_of_fields` alone builds one
    from fields already checked: the custom op re-creates the Problem the wrapper validated
    from its own arguments (``ttt._custom_op.problem_of``), and a derived one comes from
    ``dataclasses.replace``. The dataclass constructor checks nothing.

    Shapes (``D`` is the head dim, key dim == value dim):

    - ``q, k, v``: ``[B, T, H, D]``, one dtype (the *input dtype*), contiguous.
    - ``w, b``: ``[H, D]`` (the LayerNorm weight and bias, used by the inner loss and by
      the post norm-residual), any floating dtype.
    - ``eta``: ``[B, T, H, 1]`` always a tensor; when the user passed a float it is a
      constant tensor and ``eta_is_tensor`` is False (no gradient is returned for it).
    - ``initial_state``: ``[N, H, D, D]`` or None; ``initial_state_bias``: ``[N, H, 1, D]``
      or None. Float32 (float64 with float64 inputs).
    - ``cu_seqlens``: ``[N + 1]`` int64 on the inputs' device, or None; ``seq_lens`` the
      per-sequence lengths as Python ints (N of them), available without a device sync.
    - ``eta_key``: ``[B, T, H, 1]`` per-key factor of the inner learning rate, or None
      (a factor of one, computed as no factor at all).
    - ``output``: the output form, one of :data:`OUTPUTS`.
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

    @classmethod
    def _of_fields(cls, fields: dict) -> Problem:
        """The Problem of ``fields`` (a new dict holding every field by name, already
        checked: by ``make_problem``, whose result it builds, or by the wrapper whose
        Problem the custom op re-creates from its arguments), which becomes its
        ``__dict__``: the same object as ``Problem(**fields)``, built without the frozen
        dataclass's ``object.__setattr__`` per field or a call's keyword arguments, as the
        core builds a few per call (validation, the op's forward and its backward). Under
        ``torch.compile`` the plain constructor: dynamo (torch 2.11) cannot trace
        ``__dict__.update``. The core's only constructor besides ``make_problem``; nothing
        outside the core should call it."""
        if torch.compiler.is_compiling():
            return cls(**fields)
        problem = object.__new__(cls)
        problem.__dict__.update(fields)
        return problem

    @property
    def B(self) -> int:  # noqa: N802 - the field's own name
        return self.q.shape[0]

    @property
    def T(self) -> int:  # noqa: N802
        return self.q.shape[1]

    @property
    def H(self) -> int:  # noqa: N802
        return self.q.shape[2]

    @property
    def D(self) -> int:  # noqa: N802
        return self.q.shape[3]

    @property
    def N(self) -> int:  # noqa: N802
        """Number of sequences: B, or len(cu_seqlens) - 1 for packed batches."""
        return len(self.seq_lens)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def state_dtype(self) -> torch.dtype:
        return torch.float64 if self.q.dtype == torch.float64 else torch.float32

    def signature(self) -> tuple:
        """What the backend's choice reads of this problem, as plain values, but its batch
        size and length, scale and eps: head count and dim, the dtypes of
        :data:`GRAD_INPUTS` (None where absent), device, chunk size, options and the packed
        sequences' lengths (None for a dense batch). The backend choice is kept
        by it and the rest (``ttt.choice._choice_key``); under torch.compile the
        choice is made once per trace from it alone (``ttt._compiled_choice``). Head count
        and dim through ``operator.index``: there they specialize, a guard each."""
        shape = self.q.shape
        return (operator.index(shape[2]), operator.index(shape[3]), _input_dtypes(self),
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


def _input_dtypes(p: Problem) -> tuple:
    """The dtypes of ``p``'s :data:`GRAD_INPUTS` (None where absent), in that order: written
    out (a comprehension over the names costs a microsecond per call of the automatic
    choice), checked against GRAD_INPUTS at import."""
    eta_key, h0, hb0 = p.eta_key, p.initial_state, p.initial_state_bias
    return (p.q.dtype, p.k.dtype, p.v.dtype, p.w.dtype, p.b.dtype, p.eta.dtype,
            None if eta_key is None else eta_key.dtype, None if h0 is None else h0.dtype,
            None if hb0 is None else hb0.dtype)


if _input_dtypes(SimpleNamespace(**{name: SimpleNamespace(dtype=name)
                                    for name in GRAD_INPUTS})) != GRAD_INPUTS:
    raise RuntimeError("ttt.problem: _input_dtypes does not follow GRAD_INPUTS")


@dataclass
class Gradients:
    """Gradients a backend returns; None where not requested or not applicable."""

    dq: torch.Tensor | None = None
    dk: torch.Tensor | None = None
    dv: torch.Tensor | None = None
    dw: torch.Tensor | None = None
    db: torch.Tensor | None = None
    deta: torch.Tensor | None = None
    dh0: torch.Tensor | None = None
    dhb0: torch.Tensor | None = None
    deta_key: torch.Tensor | None = None

    def of(self, name: str) -> torch.Tensor | None:
        """The gradient of input ``name`` (one of :data:`GRAD_INPUTS`)."""
        return getattr(self, GRADIENT_FIELDS[name])


if {f.name for f in fields(Gradients)} != set(GRADIENT_FIELDS.values()):
    raise RuntimeError("ttt.problem: Gradients' fields do not match GRAD_INPUTS")
