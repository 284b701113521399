"""The ``triton`` backend of ttt: fused Triton kernels for the forward and the backward.

Importing this module is cheap: triton and the kernels are imported on first use.
On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ttt import Backend, Capabilities, Gradients, GradNeeds, Problem
from ttt.problem import OUTPUTS

from ._env import interpreting

MAX_HEAD_DIM = 128
"""The fp32 state [D, D] and its cotangent live in registers of one program: D = 256 would
need 256 KiB for the state alone, more than a streaming multiprocessor's register file."""

CAPABILITIES = Capabilities(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    max_head_dim=MAX_HEAD_DIM,
    chunk_sizes=frozenset({16, 32, 64}),
    varlen=True,
    varlen_backward=True,
    backward=True,
    deterministic=True,
    eta_key=True,
    outputs=frozenset(OUTPUTS),
    ops=frozenset({"ttt_linear", "ttt_mlp"}),
    notes=(
        "fp32 state and accumulation; IEEE dots for float32 inputs",
        "sequential chains carry only the state; outputs and gradients come from "
        "group-parallel kernels walking G = 16 or 32 chunks from fp32 state slots "
        "and the stored LayerNorm xhat, r (kept for the backward)",
        "with many (sequence, head) chains the chain kernels also write the outputs "
        "and dk, dv (tuning.FUSED)",
        "a generation step (no backward, every sequence within one chunk: "
        "ttt.schedule.generation_step) is one launch, fwd_decode or the forward chain "
        "writing the outputs; two (fwd_chain, fwd_out) for float32 at head dim 128 or "
        "chunk 64 past fwd_decode's rows (tuning.IEEE_WIDE)",
        f"head dims 1..{MAX_HEAD_DIM} (tiles padded to a power of two >= 16); "
        "D = 256 does not fit the state in one program's registers",
        "eta_key and the output forms are compile-time switches of the same kernels: "
        "without eta_key, norm_residual compiles to the code it had before them",
        "the backward computes only the gradients autograd asks for (frozen w, b; no "
        "initial state; a float eta): unneeded stores, buffers and kernels are left out; "
        "each pattern of needed gradients compiles its own kernel variants on first use "
        "(ttt.warmup compiles the every-gradient one)",
        "cpu only under the Triton interpreter (TRITON_INTERPRET=1), for tests",
        "ttt_mlp: one program per (sequence, head) streams the fp32 state from global "
        "memory in hidden blocks; a forward is one launch (with checkpoint slots every 16 "
        "chunks when autograd needs them; a generation step of one token per sequence "
        "without autograd: ops.ttt_mlp.fwd_decode, no padded chunk, in a CUDA graph split "
        "over programs where chains are fewer than SMs, eager past padded head dim 64 the "
        "chain), the backward one launch that recomputes each group's states from its "
        "slot; the backward takes chunk tiles up to "
        "ops.ttt_mlp.launcher.BACKWARD_MAX_TILE (shared memory): chunk 64 at head dims "
        "above 64 runs forward only",
    ),
)
"""As declared on a CUDA machine; under the Triton interpreter an instance adds cpu."""

TRITON_INSTALL_HINT = "pip install triton"


class TritonBackend(Backend):
    """Two sequential chain kernels (one program per (sequence, head)) carry the fp32 state
    forward and its cotangent backward; three group-parallel kernels (one program per group
    of G chunks and head) replay groups from fp32 state slots for the outputs and the
    gradients. With many chains, the chains do the outputs (and dk, dv) themselves."""

    name = "triton"
    capabilities = CAPABILITIES
    engines = {"triton": TRITON_INSTALL_HINT}

    def __init__(self) -> None:
        if interpreting():    # Triton's interpreter runs the kernels on CPU tensors (tests)
            self.capabilities = replace(CAPABILITIES,
                                        devices=CAPABILITIES.devices | {"cpu"})

    def versions(self) -> dict[str, str]:
        found = super().versions()
        return {**found, "interpreter": str(interpreting())} if found else found

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        why = super().not_supported_reasons(problem)
        if interpreting() and problem.dtype == torch.bfloat16:
            why.append("bfloat16 not supported under the Triton interpreter "
                       "(TRITON_INTERPRET=1): its tl.dot gives wrong results on bf16 tiles")
        if not why and problem.op == "ttt_mlp" and problem.requires_grad:
            # (the kernels' own limits, asked only where they can run: they import triton)
            from .ops.ttt_mlp.launcher import BACKWARD_MAX_TILE, backward_fits

            if not backward_fits(problem.D, problem.chunk_size):
                why.append(f"ttt_mlp backward at head dim {problem.D} with chunk_size "
                           f"{problem.chunk_size}: its kernel needs more shared memory than a "
                           f"GPU block has (chunk_size x head dim padded to a power of two at "
                           f"most {BACKWARD_MAX_TILE}; a smaller chunk_size fits)")
        return why

    def forward(self, problem: Problem, needs_backward: bool):
        from .ops.ttt_linear import ttt_linear_fwd

        o, ht, hbt, saved = ttt_linear_fwd(problem, save_for_backward=needs_backward)
        return o, ht, hbt, [] if saved is None else saved.tensors()

    def saved_shapes(self, problem: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
        from .ops.ttt_linear.launcher import saved_shapes

        return saved_shapes(problem)

    def backward(self, problem: Problem, saved: list[torch.Tensor], do: torch.Tensor,
                 dht: torch.Tensor | None, dhbt: torch.Tensor | None,
                 needs: GradNeeds) -> Gradients:
        from .ops.ttt_linear import ttt_linear_bwd
        from .ops.ttt_linear.launcher import Saved

        # only the gradients autograd asks for (needs), each a fresh tensor
        return ttt_linear_bwd(problem, Saved.of(problem, saved), do, dht, dhbt, needs=needs)

    def chunk_ttt_mlp(self, problem):
        """TTT-MLP by the kernels of :mod:`.ops.ttt_mlp`, differentiable by autograd."""
        from .ops.ttt_mlp import ttt_mlp_fwd

        return ttt_mlp_fwd(problem)
