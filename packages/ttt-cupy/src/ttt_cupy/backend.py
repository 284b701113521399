"""The ``cupy`` backend of ttt: raw CUDA C++ kernels (csrc/*.cu) compiled at run time by NVRTC
and launched by CuPy, both on first use (:attr:`CupyBackend.capabilities`' notes say more)."""

from __future__ import annotations

import torch

from ttt import Backend, Capabilities, Gradients, GradNeeds, Problem
from ttt.problem import OUTPUTS

MAX_HEAD_DIM = 128
INSTALL_HINT = "pip install './packages/ttt-cupy[cuda13]' (or [cuda12])"
DEFAULT_SMEM_LIMIT = 227 * 1024
"""Opt-in shared memory per block of an H100 / H200, used when torch does not report it."""


class CupyBackend(Backend):
    """Chain kernels per (sequence, head) plus group kernels per (group of G chunks, head);
    SIMT fp32 (tf32 tensor cores for half inputs); deterministic."""

    name = "cupy"
    engines = {"cupy": INSTALL_HINT}
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        chunk_sizes=frozenset({16, 32, 64}),
        max_head_dim=MAX_HEAD_DIM,
        varlen=True,
        varlen_backward=True,
        backward=True,
        deterministic=True,
        eta_key=True,
        outputs=frozenset(OUTPUTS),
        notes=(
            "CUDA C++ compiled at run time by CuPy (NVRTC); fp32 state and SIMT arithmetic; "
            "half inputs: tf32 tensor-core dots in every kernel (TTT_CUPY_MMA=0: SIMT)",
            "chain/group split: the state chain per (sequence, head), the rest per group of "
            "G chunks; fp32 checkpoint slots every G chunks",
            "fused forward from 128 (sequence, head) chains (256 with a backward), and for "
            "every decode step (no backward, each sequence within one chunk: one launch): "
            "the chain writes the outputs, no fwd_out (placement.fused_forward)",
            "short decode steps (at most 16 rows per sequence, every dtype and head dim: "
            "placement.ROW_STEP_ROWS; more rows, in a chunk of 32 or 64, the fused chain) "
            "run fwd_decode alone: one block per (sequence, head), the state in registers, "
            "read and written once",
            "few long sequences: each pass in segments of whole groups, the chain on a side "
            "stream and each segment's group kernels beside its next segment; bitwise the "
            "results of one launch (placement.segment_plan)",
            "shared memory bounds (chunk_size, head dim): every supported shape fits an "
            "H100/H200 (227 KiB per block; at head dim > 64 with chunk_size 64 bwd_grads "
            "runs two blocks per group, each with half of the state); a smaller device "
            "refuses what does not fit",
            "compile-checked for sm_80 / sm_90 in CI; conformance suite passed on an H200 "
            "with the tensor-core, the SIMT (TTT_CUPY_MMA=0) and the forced fused forward "
            "kernels",
            "eta_key and the output forms: template variants of the kernels they change "
            "(KEY, OUT), compiled on the first call that needs them; the backward computes "
            "only the gradients asked for where the kernels allow (no bwd_grads without dk, "
            "dv, dw, db; no backward chain for dq alone)",
        ),
    )

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        why = super().not_supported_reasons(problem)
        if why or problem.device.type != "cuda":
            return why
        from .device import max_smem_optin
        from .smem import smem_reason

        limit = max_smem_optin(problem.device) or DEFAULT_SMEM_LIMIT
        reason = smem_reason(problem.D, problem.chunk_size, problem.requires_grad, limit)
        if reason:
            why.append(reason)
        return why

    def launch_device(self, problem: Problem):
        """The launcher's device seam (None: the inputs' CUDA device); the CPU tests return a
        stand-in running each launch in the C++ emulation."""
        return None

    def forward(self, problem: Problem, needs_backward: bool):
        from .launcher import ttt_linear_fwd

        o, ht, hbt, saved = ttt_linear_fwd(problem, save_for_backward=needs_backward,
                                           device=self.launch_device(problem))
        return o, ht, hbt, [] if saved is None else saved.tensors(problem)

    def saved_shapes(self, problem: Problem) -> list[tuple[tuple[int, ...], torch.dtype]]:
        from .layout import saved_shapes

        return saved_shapes(problem)

    def backward(self, problem: Problem, saved: list[torch.Tensor], do: torch.Tensor,
                 dht: torch.Tensor | None, dhbt: torch.Tensor | None,
                 needs: GradNeeds) -> Gradients:
        from .launcher import ttt_linear_bwd
        from .layout import Saved

        # only what ``needs`` asks for (None elsewhere), bitwise as in the full backward
        return ttt_linear_bwd(problem, Saved.of(problem, saved), do, dht, dhbt, needs=needs,
                              device=self.launch_device(problem))
