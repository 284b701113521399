"""The interface every backend implements, and its declared capabilities.

A backend is an object with a ``name``, a :class:`Capabilities` and three methods:

``forward(problem, needs_backward) -> (o, final_state, final_state_bias, saved)``
    the whole operator (inner TTT recurrence *and* the output form). ``o`` has the input
    dtype; the states are None unless ``problem.output_final_state``. ``saved`` is a list
    (or tuple) of tensors the backend wants back in ``backward``: new tensors, none of them
    an input or a view of one, with the shapes and dtypes ``saved_shapes`` declares (only
    used when ``needs_backward``; anything, e.g. ``[]``, otherwise).

``saved_shapes(problem) -> [(shape, dtype), ...]``
    what ``forward(problem, needs_backward=True)`` saves, on the problem's device, without
    running it: the custom op's fake implementation (torch.compile) builds ``saved`` from
    it. The default is ``[]`` (a backend that saves nothing).

``warmup_shapes(heads, head_dim, chunk_size, dtype) -> [WarmupShape, ...]`` (optional)
    the batch layouts whose calls, forward and backward, compile every kernel variant a
    call of these heads, head dim, chunk size and dtype may use (``ttt.warmup`` runs them).
    The default, :func:`generic_warmup_shapes`, spans few and many (sequence, head) chains,
    short and long sequences, dense and packed batches.

``backward(problem, saved, do, dht, dhbt, needs) -> Gradients``
    ``saved`` is the forward's list; ``do`` is the cotangent of ``o`` (contiguous, never
    None); ``dht`` and ``dhbt`` those of the final states (None when they were not
    requested or not used). ``needs`` is a :class:`GradNeeds`; gradients not needed may be
    returned as None, needed ones may not.

The core (`ttt.ops`, `ttt._custom_op`) owns validation, the custom op and its autograd,
autocast and dtype casts of gradients; nothing in the core special-cases a backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .arguments import Gradients, GradNeeds
from .problem import Problem


@dataclass(frozen=True)
class Capabilities:
    """What a backend can take. ``max_head_dim`` None means any; ``chunk_sizes`` None any.
    ``deterministic``: repeated identical calls give bitwise identical results (the suite
    checks it when declared). ``eta_key``: takes the per-key learning-rate factor;
    ``outputs``: the output forms it computes (``ttt.problem.OUTPUTS``)."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    max_head_dim: int | None = None
    chunk_sizes: frozenset[int] | None = None
    varlen: bool = True
    varlen_backward: bool = True
    backward: bool = True
    deterministic: bool = True
    eta_key: bool = False
    outputs: frozenset[str] = frozenset({"norm_residual"})
    notes: tuple[str, ...] = field(default_factory=tuple)

    def reasons(self, problem: Problem) -> list[str]:
        """Why a backend with these capabilities cannot take ``problem`` (empty: it can)."""
        why = []
        if problem.device.type not in self.devices:
            why.append(f"device {problem.device.type!r} not supported "
                       f"(supports {sorted(self.devices)})")
        if problem.dtype not in self.dtypes:
            names = sorted(str(d).replace("torch.", "") for d in self.dtypes)
            why.append(f"dtype {str(problem.dtype).replace('torch.', '')} not supported "
                       f"(supports {names})")
        if self.max_head_dim is not None and problem.D > self.max_head_dim:
            why.append(f"head dim {problem.D} above the maximum {self.max_head_dim}")
        if self.chunk_sizes is not None and problem.chunk_size not in self.chunk_sizes:
            why.append(f"chunk_size {problem.chunk_size} not supported "
                       f"(supports {sorted(self.chunk_sizes)})")
        if problem.is_varlen and not self.varlen:
            why.append("cu_seqlens (variable-length batches) not supported")
        if problem.requires_grad and not self.backward:
            why.append("backward not supported")
        if problem.requires_grad and problem.is_varlen and not self.varlen_backward:
            why.append("backward of cu_seqlens (variable-length) batches not supported")
        if problem.eta_key is not None and not self.eta_key:
            why.append("eta_key (per-key factor of the inner learning rate) not supported")
        if problem.output not in self.outputs:
            why.append(f"output {problem.output!r} not supported (supports "
                       f"{sorted(self.outputs)})")
        return why


@dataclass(frozen=True)
class WarmupShape:
    """The batch layout of one warm-up call: ``sequences`` sequences of ``seq_len`` tokens
    each, as a dense ``[sequences, seq_len]`` batch or, when ``packed``, one packed batch
    (``cu_seqlens``)."""

    sequences: int
    seq_len: int
    packed: bool = False

    def __post_init__(self) -> None:
        for name in ("sequences", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"WarmupShape.{name}: expected an int, got "
                                f"{type(value).__name__}")
            if value < 1:
                raise ValueError(f"WarmupShape.{name}: expected a positive int, got {value}")


WARMUP_CHAINS = (32, 64, 128, 256, 1024)
"""(sequence, head) chain counts of the generic warm-up shapes: kernel backends choose other
kernels (fused chains, longer checkpoint groups, overlapped or segmented schedules) by the
number of chains and their length, at thresholds within this range."""

WARMUP_LONG_CHAIN_CHUNKS = 2**15
"""Chunks over all chains of each long generic warm-up shape."""

WARMUP_TWO_GROUP_CHUNKS = 16
"""Whole chunks of the generic warm-up's second one-sequence shape (one more, partial, comes
after them): past 16 in all, so that its few chains span two checkpoint groups, as a long
sequence's do (the cupy backend overlaps only such chains; the 2.5-chunk shape's one group
runs plain)."""


def generic_warmup_shapes(heads: int, chunk_size: int) -> list[WarmupShape]:
    """The default warm-up shapes for ``heads`` heads and ``chunk_size``: one sequence of
    2.5 chunks and one of :data:`WARMUP_TWO_GROUP_CHUNKS` and a half; for each of
    :data:`WARMUP_CHAINS` (at least that many chains), sequences of one token (a generation
    step), short ones (1.5 chunks) and long ones (:data:`WARMUP_LONG_CHAIN_CHUNKS` chunks in
    all); each as a dense and as a packed batch."""
    shapes = [WarmupShape(1, 2 * chunk_size + chunk_size // 2),
              WarmupShape(1, WARMUP_TWO_GROUP_CHUNKS * chunk_size + chunk_size // 2)]
    for chains in WARMUP_CHAINS:
        sequences = math.ceil(chains / heads)
        chunks = math.ceil(WARMUP_LONG_CHAIN_CHUNKS / (sequences * heads))
        shapes += [WarmupShape(sequences, 1), WarmupShape(sequences, chunk_size + chunk_size // 2),
                   WarmupShape(sequences, chunks * chunk_size)]
    return shapes + [WarmupShape(s.sequences, s.seq_len, packed=True) for s in shapes]


class Backend:
    """Base class for backends. Subclasses set ``name`` and ``capabilities``."""

    name: str = "?"
    capabilities: Capabilities

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all on this machine (None: it can)."""
        return None

    def versions(self) -> dict[str, str]:
        """Versions of the engine(s) the backend uses, for reports."""
        return {}

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Why this backend cannot take ``problem``; empty when it can."""
        why = []
        unavailable = self.unavailable_reason()
        if unavailable:
            why.append(unavailable)
        why.extend(self.capabilities.reasons(problem))
        return why

    def forward(self, problem: Problem, needs_backward: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                           Sequence[torch.Tensor]]:
        raise NotImplementedError

    def saved_shapes(self, problem: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors ``forward`` saves for ``problem``."""
        return []

    def warmup_shapes(self, heads: int, head_dim: int, chunk_size: int,
                      dtype: torch.dtype) -> list[WarmupShape]:
        """Batch layouts whose forward and backward compile every kernel variant that calls
        with these heads, head dim, chunk size and dtype may use (see ``ttt.warmup``)."""
        return generic_warmup_shapes(heads, chunk_size)

    def backward(self, problem: Problem, saved: list[torch.Tensor], do: torch.Tensor,
                 dht: torch.Tensor | None, dhbt: torch.Tensor | None,
                 needs: GradNeeds) -> Gradients:
        raise NotImplementedError

