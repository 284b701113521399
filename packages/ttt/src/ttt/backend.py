"""The interface every backend implements (:class:`Backend`: ``forward``, ``backward``,
``saved_shapes``, ``warmup_shapes``, ``chunk_ttt_mlp``) and its declared
:class:`Capabilities`; the contract of each method, and what the core does around it:
docs/backends.md."""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .arguments import Gradients, GradNeeds
from .errors import import_failure_reason
from .problem import Problem
from .validation import dtype_name, positive_int


@dataclass(frozen=True)
class Capabilities:
    """What a backend can take (``max_head_dim``, ``chunk_sizes`` None: any).
    ``ops``: the operators it provides, of ``"ttt_linear"`` (``forward`` and ``backward``)
    and ``"ttt_mlp"`` (``chunk_ttt_mlp``).
    ``deterministic``: identical calls give bitwise identical results (the suite checks it).
    ``eta_key``: takes the per-key factor; ``outputs``: forms of ``ttt.problem.OUTPUTS``."""

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    ops: frozenset[str] = frozenset({"ttt_linear"})
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
        if problem.op not in self.ops:
            why.append(f"op {problem.op!r} not provided (provides {sorted(self.ops)})")
        if problem.device.type not in self.devices:
            why.append(f"device {problem.device.type!r} not supported "
                       f"(supports {sorted(self.devices)})")
        if problem.dtype not in self.dtypes:
            names = sorted(dtype_name(d) for d in self.dtypes)
            why.append(f"dtype {dtype_name(problem.dtype)} not supported (supports {names})")
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
    """One warm-up call's batch: ``sequences`` of ``seq_len`` tokens, dense or ``packed``."""

    sequences: int
    seq_len: int
    packed: bool = False

    def __post_init__(self) -> None:
        positive_int("WarmupShape.sequences", self.sequences)
        positive_int("WarmupShape.seq_len", self.seq_len)


WARMUP_CHAINS = (32, 64, 128, 256, 1024)
"""(sequence, head) chain counts: kernel backends switch kernels (fused chains, checkpoint
groups, overlapped or segmented schedules) at thresholds within this range."""
WARMUP_LONG_CHAIN_CHUNKS = 2**15        # chunks over all chains of each long shape
WARMUP_TWO_GROUP_CHUNKS = 16            # past 16 chunks, a sequence spans two groups


def generic_warmup_shapes(heads: int, chunk_size: int) -> list[WarmupShape]:
    """The default warm-up layouts (docs/warmup.md, "batch layouts")."""
    shapes = [WarmupShape(1, 2 * chunk_size + chunk_size // 2),
              WarmupShape(1, WARMUP_TWO_GROUP_CHUNKS * chunk_size + chunk_size // 2)]
    for chains in WARMUP_CHAINS:
        sequences = math.ceil(chains / heads)
        chunks = math.ceil(WARMUP_LONG_CHAIN_CHUNKS / (sequences * heads))
        shapes += [WarmupShape(sequences, 1), WarmupShape(sequences, chunk_size + chunk_size // 2),
                   WarmupShape(sequences, chunks * chunk_size)]
    return shapes + [WarmupShape(s.sequences, s.seq_len, packed=True) for s in shapes]


class Backend:
    """Base class for backends. Subclasses set ``name`` and ``capabilities``, and
    ``engines`` when they run on modules that may be missing."""

    name: str = "?"
    capabilities: Capabilities
    engines: Mapping[str, str] = MappingProxyType({})
    """Module -> install hint (``{"triton": "pip install triton"}``), read by the default
    ``unavailable_reason`` and ``versions``."""

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot run at all on this machine (None: it can)."""
        for module, hint in self.engines.items():
            try:
                importlib.import_module(module)
            except ImportError as err:
                return import_failure_reason(err, {module.partition(".")[0]: hint})
        return None

    def versions(self) -> dict[str, str]:
        """Versions of the engines that import, for reports."""
        found = {}
        for module in self.engines:
            try:
                found[module] = importlib.import_module(module).__version__
            except ImportError:
                pass
        return found

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Why this backend cannot take ``problem``; empty when it can."""
        unavailable = self.unavailable_reason()
        return ([unavailable] if unavailable else []) + self.capabilities.reasons(problem)

    def forward(self, problem: Problem, needs_backward: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                           Sequence[torch.Tensor]]:
        """``(o, final_state, final_state_bias, saved)``: the states None unless
        ``problem.output_final_state``; ``saved``, new tensors for ``backward``."""
        raise NotImplementedError

    def saved_shapes(self, problem: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shapes and dtypes of the tensors ``forward`` saves for ``problem``."""
        return []

    def warmup_shapes(self, heads: int, head_dim: int, chunk_size: int,
                      dtype: torch.dtype) -> list[WarmupShape]:
        """Batch layouts whose calls compile every kernel variant such calls may use."""
        return generic_warmup_shapes(heads, chunk_size)

    def chunk_ttt_mlp(self, problem) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    def backward(self, problem: Problem, saved: list[torch.Tensor], do: torch.Tensor,
                 dht: torch.Tensor | None, dhbt: torch.Tensor | None,
                 needs: GradNeeds) -> Gradients:
        """``do`` contiguous, never None; ``dht``, ``dhbt`` None when not requested or not
        used; the gradients ``needs`` leaves out may be None."""
        raise NotImplementedError

