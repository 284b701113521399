"""The LayerNorm-L2 inner loss both inner models train on, the op's output forms and the
loop over chunks and sequences, in PyTorch (the reference backend's and
``ttt.reference_mlp``'s)."""

from __future__ import annotations

import torch

from .problem import state_dtype


def layer_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    mean = x.mean(-1, keepdim=True)
    centered = x - mean
    rstd = torch.rsqrt((centered * centered).mean(-1, keepdim=True) + eps)
    return centered * rstd, rstd


def layer_norm_l2_grad(z, k, v, w, b, eps: float) -> torch.Tensor:
    """The inner loss's gradient with respect to the prediction ``z`` (rows of [.., L, D]):
    the closed form of ``1/2 ||LN(z) * w + b - (v - k)||^2``."""
    x_hat, rstd = layer_norm_stats(z, eps)
    y = (x_hat * w + b - v + k) * w
    return rstd * (y - y.mean(-1, keepdim=True) - x_hat * (y * x_hat).mean(-1, keepdim=True))


def output_form(output: str, z: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor, eps: float) -> torch.Tensor:
    """z [B, H, T, D] to the requested output form (q unscaled, like z)."""
    if output == "raw":
        return z
    z_hat, _ = layer_norm_stats(z, eps)
    residual = q if output == "query_residual" else z
    return residual + z_hat * w + b


def _sequences(chunk, state, q, k, v, eta, key, w, b, scale, eps, chunk_size, seq_lens):
    """z [N, H, T, D] and the final state of equal-length sequences [N, H, T, ...], or of
    the packed sequences ``seq_lens`` of a [1, H, T, ...] batch, by ``chunk``."""
    if seq_lens is not None:
        results, start = [], 0
        for n, length in enumerate(seq_lens):
            rows = slice(start, start + length)
            results.append(_sequences(
                chunk, tuple(s[n:n + 1] for s in state), q[:, :, rows], k[:, :, rows],
                v[:, :, rows], eta[:, :, rows], None if key is None else key[:, :, rows],
                w, b, scale, eps, chunk_size, None))
            start += length
        z = torch.cat([r[0] for r in results], 2)
        return z, tuple(torch.cat(parts) for parts in zip(*(r[1] for r in results)))
    pieces = []
    for start in range(0, q.shape[2], chunk_size):
        rows = slice(start, start + chunk_size)
        z, state = chunk(state, q[:, :, rows] * scale, k[:, :, rows], v[:, :, rows],
                         eta[:, :, rows], None if key is None else key[:, :, rows], w, b, eps)
        pieces.append(z)
    return (torch.cat(pieces, 2) if pieces else q.new_zeros(q.shape)), state


def chunked(chunk, q, k, v, w, b, eta, eta_key, state, scale, eps, chunk_size, seq_lens,
            output):
    """``(o, final state)`` of the inner model whose step over one chunk of every
    (sequence, head) is ``chunk(state, q, k, v, eta, eta_key, w, b, eps) -> (z, state)``
    (q scaled; [N, H, L, ...] each, w and b [1, H, 1, D]): q, k, v [B, T, H, D], eta and
    eta_key (or None) [B, T, H, 1], ``state`` the initial one, ``seq_lens`` those of a
    packed batch (None: dense). Computes in the state dtype; ``o`` in q's dtype."""
    cdt = state_dtype(q.dtype)
    H, D = q.shape[2:]
    q_t, k_t, v_t, eta_t = (t.to(cdt).transpose(1, 2) for t in (q, k, v, eta))   # [B, H, T, .]
    key = None if eta_key is None else eta_key.to(cdt).transpose(1, 2)
    w4, b4 = (t.to(cdt).reshape(1, H, 1, D) for t in (w, b))
    z, final = _sequences(chunk, tuple(s.to(cdt) for s in state), q_t, k_t, v_t, eta_t, key,
                          w4, b4, scale, eps, chunk_size, seq_lens)
    return output_form(output, z, q_t, w4, b4, eps).transpose(1, 2).to(q.dtype), final
