"""TTT-Linear and TTT-MLP: the sequence-mixing layers of "Learning to (Learn at Test Time)",
with the parameters, names and shapes of the official implementation
(test-time-training/ttt-lm-pytorch, ``ttt.py``), so its state dicts load unchanged. What
they compute and how each piece maps to the official code: docs/nn.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..mlp import HIDDEN_FACTOR, STATE_NAMES, chunk_ttt_mlp
from ..ops import chunk_ttt_linear
from ..problem import state_dtype, state_shapes
from ..validation import positive_int
from .cache import LayerState, TTTCache
from .rotary import apply_rotary, rotary_cos_sin, sequence_positions

INNER_EPS = 1e-6        # LayerNorm eps of the inner loss and the output norm (official)


def _positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name}: expected a positive float, got {value}")
    return float(value)


class TTTLinear(nn.Module):
    """The official TTT-Linear layer on :func:`ttt.chunk_ttt_linear` (``scale = 1``,
    ``eta_key`` the token's learning rate, ``output="query_residual"``); its arguments:
    docs/nn.md. ``backend``: a ttt backend name for every call, None: the registry's choice.
    """

    def __init__(self, width: int, num_heads: int, mini_batch_size: int = 16, *,
                 rope_theta: float = 10000.0, ttt_base_lr: float = 1.0, use_gate: bool = False,
                 backend: str | None = None, device=None, dtype=None) -> None:
        super().__init__()
        width = positive_int("width", width)
        num_heads = positive_int("num_heads", num_heads)
        if width % num_heads:
            raise ValueError(f"num_heads: expected a divisor of width = {width}, got {num_heads}")
        if (width // num_heads) % 2:
            raise ValueError(f"num_heads: the head dim width / num_heads must be even for the "
                             f"rotary pairs, got {width} / {num_heads} = {width // num_heads}")
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend: expected a backend name or None, "
                            f"got {type(backend).__name__}")
        self.width, self.num_heads = width, num_heads
        self.head_dim = width // num_heads
        self.mini_batch_size = positive_int("mini_batch_size", mini_batch_size)
        self.rope_theta = _positive_float("rope_theta", rope_theta)
        self.ttt_base_lr = _positive_float("ttt_base_lr", ttt_base_lr)
        self.use_gate = bool(use_gate)
        self.backend = backend
        self._make_parameters(device, dtype)
        self.reset_parameters()

    def _make_parameters(self, device, dtype) -> None:
        H, D, C, K = self.num_heads, self.head_dim, self.width, self.mini_batch_size
        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(C, C, bias=False, **factory)
        self.k_proj = nn.Linear(C, C, bias=False, **factory)
        self.v_proj = nn.Linear(C, C, bias=False, **factory)
        self.o_proj = nn.Linear(C, C, bias=False, **factory)
        if self.use_gate:
            self.g_proj = nn.Linear(C, C, bias=False, **factory)
        self.post_norm = nn.LayerNorm(C, eps=INNER_EPS, **factory)
        token_idx = torch.empty(K, device=device, dtype=dtype or torch.float32)   # (1 / (p + 1))
        self.register_buffer("token_idx", token_idx, persistent=False)
        self.learnable_token_idx = nn.Parameter(torch.empty(K, **factory))
        self.learnable_ttt_lr_weight = nn.Parameter(torch.empty(H, 1, C, **factory))
        self.learnable_ttt_lr_bias = nn.Parameter(torch.empty(H, 1, **factory))
        self.ttt_norm_weight = nn.Parameter(torch.empty(H, D, **factory))
        self.ttt_norm_bias = nn.Parameter(torch.empty(H, D, **factory))
        for name, shape in self._state_shapes().items():
            setattr(self, name, nn.Parameter(torch.empty(shape, **factory)))

    _hidden_factor: int | None = None
    """The inner MLP's hidden width in head dims; None: the linear inner model."""

    def _state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The inner model's initial state, by its official parameter name: the op's state
        shapes (``ttt.problem.state_shapes``) without their sequence dim."""
        D = self.head_dim
        hidden = None if self._hidden_factor is None else self._hidden_factor * D
        return {name: shape[1:] for name, shape in
                zip(STATE_NAMES, state_shapes(1, self.num_heads, D, hidden))}

    def reset_parameters(self) -> None:
        """The official initialisation (the projections and post_norm keep their own)."""
        for module in self.children():      # q, k, v, o, g projections, post_norm
            module.reset_parameters()
        with torch.no_grad():
            # the fixed token_idx buffer too (not in the state dict): a layer built on the
            # meta device and materialised by to_empty() gets it here
            positions = torch.arange(1, self.mini_batch_size + 1, device=self.token_idx.device,
                                     dtype=self.token_idx.dtype)
            self.token_idx.copy_(1.0 / positions)
            self.learnable_token_idx.zero_()
            self.learnable_ttt_lr_weight.normal_(0.0, 0.02)
            self.learnable_ttt_lr_bias.zero_()
            self.ttt_norm_weight.fill_(1.0)
            self.ttt_norm_bias.zero_()
            for name in self._state_shapes():      # weights N(0, 0.02), biases zero
                param = getattr(self, name)
                param.normal_(0.0, 0.02) if name.startswith("W") else param.zero_()

    def extra_repr(self) -> str:
        return (f"width={self.width}, num_heads={self.num_heads}, "
                f"mini_batch_size={self.mini_batch_size}, rope_theta={self.rope_theta}, "
                f"ttt_base_lr={self.ttt_base_lr}, use_gate={self.use_gate}, "
                f"backend={self.backend!r}")

    def forward(self, x: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                cache: TTTCache | None = None) -> torch.Tensor:
        """``x [B, T, width]`` -> ``[B, T, width]``. ``cu_seqlens``: ``[N + 1]`` offsets of
        packed sequences along T (``B == 1``), each from ``W1, b1`` at position 0. ``cache``:
        a :class:`TTTCache` to continue from and update (not with ``cu_seqlens``)."""
        self._check_input(x, cu_seqlens, cache)
        if cache is not None:
            return self._forward_cached(x, cache)
        positions = sequence_positions(x.shape[1], x.device, cu_seqlens=cu_seqlens)
        chunk_positions = positions % self.mini_batch_size
        q, k, v, eta_key = self._project(x, chunk_positions)
        N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        z, _ = self._inner(q, k, v, eta_key, chunk_positions, self._initial_states(N, q.dtype),
                           cu_seqlens=cu_seqlens)
        return self._readout(z, x)

    def _check_input(self, x, cu_seqlens, cache) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.width or x.shape[1] < 1:
            raise ValueError(f"x: expected shape [B, T >= 1, width = {self.width}], "
                             f"got {tuple(x.shape)}")
        if cu_seqlens is not None:
            if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
                raise TypeError(f"cu_seqlens: expected a 1-d int32/int64 tensor [N + 1], "
                                f"got {type(cu_seqlens).__name__}")
            if x.shape[0] != 1:
                raise ValueError(f"cu_seqlens: packed sequences need x with batch size 1, "
                                 f"got {x.shape[0]}")
        if cache is None:
            return
        if not isinstance(cache, TTTCache):
            raise TypeError(f"cache: expected a ttt.nn.TTTCache, got {type(cache).__name__}")
        if cu_seqlens is not None:
            raise ValueError("cache: not supported with cu_seqlens (packed sequences); "
                             "pass a batch [B, T, width] instead")
        entry = cache.get(self)
        if entry is not None and entry.batch_size != x.shape[0]:
            raise ValueError(f"x: expected batch size {entry.batch_size} (the cache's), "
                             f"got {x.shape[0]}")

    def _project(self, x: torch.Tensor, chunk_positions: torch.Tensor):
        """Rotated ``q, k`` and ``v`` ``[B, T, H, D]``, key learning rates ``[B, T, H, 1]``."""
        heads = (self.num_heads, self.head_dim)
        q, k, v = (proj(x).unflatten(-1, heads) for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rotary_cos_sin(chunk_positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gate = torch.einsum("btc,hdc->bthd", x, self.learnable_ttt_lr_weight)
        gate = gate + self.learnable_ttt_lr_bias                     # [B, T, H, 1]
        eta_key = self.ttt_base_lr * torch.sigmoid(gate) / self.head_dim
        return q, k, v, eta_key

    def _token_eta(self, chunk_positions: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``e_i`` for each token, broadcast to ``like``'s ``[B, T, H, 1]``."""
        scale = torch.clamp_min(self.token_idx + self.learnable_token_idx, 0.0)   # [K]
        return scale[chunk_positions][None, :, None, None].expand_as(like)

    def _initial_states(self, count: int, q_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The inner model's state (``W1, b1``) expanded over ``count`` sequences, in the
        operator's state dtype."""
        return tuple(getattr(self, name).to(state_dtype(q_dtype)).expand(count, -1, -1, -1)
                     for name in self._state_shapes())

    def _op_arguments(self, eta_key, chunk_positions, cu_seqlens, output_final_state) -> dict:
        """The inner op's arguments but q, k, v and the state."""
        return dict(w=self.ttt_norm_weight, b=self.ttt_norm_bias,
                    eta=self._token_eta(chunk_positions, eta_key), scale=1.0, eps=INNER_EPS,
                    chunk_size=self.mini_batch_size, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens, eta_key=eta_key, output="query_residual",
                    backend=self.backend)

    def _inner(self, q, k, v, eta_key, chunk_positions, states, *, cu_seqlens=None,
               output_final_state=False):
        """The chunked inner steps from ``states``: ``q + LN(z) * w + b`` and, when asked,
        the final states (else None)."""
        z, *final = chunk_ttt_linear(
            q, k, v, initial_state=states[0], initial_state_bias=states[1],
            **self._op_arguments(eta_key, chunk_positions, cu_seqlens, output_final_state))
        return z, (tuple(final) if output_final_state else None)

    def _readout(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = self.post_norm(z.flatten(-2))                            # [B, T, width]
        if self.use_gate:
            y = F.gelu(self.g_proj(x), approximate="tanh") * y
        return self.o_proj(y)

    def _forward_cached(self, x: torch.Tensor, cache: TTTCache) -> torch.Tensor:
        """Continue the cached sequences by ``x``: pending tokens and ``x`` run from the
        committed state; full mini-batches are committed, the rest stays pending."""
        entry = cache.get(self)
        seen = 0 if entry is None else entry.seen
        positions = sequence_positions(x.shape[1], x.device, offset=seen)
        new = self._project(x, positions % self.mini_batch_size)
        if entry is None:
            entry = LayerState(self._initial_states(x.shape[0], new[0].dtype),
                               *(t[:, :0] for t in new), seen=0)
        rows = [torch.cat((old, fresh), dim=1) for old, fresh in
                zip((entry.q, entry.k, entry.v, entry.eta_key), new)]
        z, states, full = self._run_open_mini_batches(rows, entry.states)
        cache.put(self, LayerState(states, *(t[:, full:] for t in rows),
                                   seen=seen + x.shape[1]))
        return self._readout(z[:, entry.q.shape[1]:], x)

    def _run_open_mini_batches(self, rows, states):
        """``rows = [q, k, v, eta_key]`` starting a mini-batch, run from the committed states:
        the outputs, the states after the ``full`` tokens of complete mini-batches, ``full``."""
        total = rows[0].shape[1]
        full = total // self.mini_batch_size * self.mini_batch_size
        chunk_positions = torch.arange(total, device=rows[0].device) % self.mini_batch_size
        outputs = []
        if full:
            z, states = self._inner(*(t[:, :full] for t in rows), chunk_positions[:full],
                                    states, output_final_state=True)
            outputs.append(z)
        if total > full:
            z, _ = self._inner(*(t[:, full:] for t in rows), chunk_positions[full:], states)
            outputs.append(z)
        return torch.cat(outputs, dim=1), states, full


class TTTMLP(TTTLinear):
    """The official TTT-MLP layer on :func:`ttt.chunk_ttt_mlp`: :class:`TTTLinear` with the
    inner model ``gelu_tanh(x W1 + b1) W2 + b2`` of hidden width ``4 D`` and the official
    ``TTTMLP``'s parameters (``W1 [H, D, 4D]``, ``b1 [H, 1, 4D]``, ``W2 [H, 4D, D]``,
    ``b2 [H, 1, D]``)."""

    _hidden_factor = HIDDEN_FACTOR

    def _inner(self, q, k, v, eta_key, chunk_positions, states, *, cu_seqlens=None,
               output_final_state=False):
        return chunk_ttt_mlp(
            q, k, v, initial_state=states,
            **self._op_arguments(eta_key, chunk_positions, cu_seqlens, output_final_state))
