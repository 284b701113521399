"""Input checks for ``chunk_ttt_linear``, once per call before any backend (docs/api.md): the
first broken rule of the first bad argument, in the order q, k, v, w, b, eta, eta_key,
output, scale, eps, chunk_size, output_final_state, cu_seqlens, initial states."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .problem import OUTPUTS, Problem, state_dtype, state_shapes

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)
_Q_SHAPE = ("B", "T", "H", "D")


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    return str(dtype).replace("torch.", "")


def _broken_rule(t, dtypes, shape: tuple[int, ...], device: torch.device) -> str | None:
    """The first rule ``t`` breaks, or None: ``"type"`` (a tensor), ``"floating"`` then
    ``"dtype"`` (one of ``dtypes``), ``"rank"`` then ``"shape"``, ``"device"`` (q's)."""
    if not isinstance(t, Tensor):
        return "type"
    t_dtype = t.dtype
    if t_dtype not in dtypes:
        return "floating" if t_dtype not in _FLOAT_DTYPE_SET else "dtype"
    t_shape = t.shape
    if t_shape != shape:                        # (torch.Size is a tuple)
        return "rank" if len(t_shape) != len(shape) else "shape"
    if t.device != device:
        return "device"
    return None


def _tensor_error(name: str, t, rule: str, shape: tuple, meaning: str = "",
                  device: torch.device | None = None, expected_dtype: str = "") -> Exception:
    """The error of argument ``name`` breaking ``rule``; ``meaning`` says what ``shape`` is."""
    if rule == "type":
        return TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if rule == "floating":
        return TypeError(f"{name}: expected a floating dtype "
                         f"{[dtype_name(d) for d in FLOAT_DTYPES]}, got {dtype_name(t.dtype)}")
    if rule == "rank":
        return ValueError(f"{name}: expected a {len(shape)}-d tensor, got shape {tuple(t.shape)}")
    if rule == "shape":
        return ValueError(f"{name}: expected shape {tuple(shape)} ({meaning}), "
                          f"got {tuple(t.shape)}")
    if rule == "dtype":
        return TypeError(f"{name}: expected dtype {expected_dtype}, got {dtype_name(t.dtype)}")
    return ValueError(f"{name}: expected a tensor on {device} (the device of q), "
                      f"got one on {t.device}")


def _checked_tensors(q, k, v, w, b, eta, eta_key
                     ) -> tuple[torch.Size, torch.dtype, torch.device, Tensor]:
    """q's shape, dtype and device and eta as a tensor, once q (floating, ``[B, T, H, D]``,
    H, D >= 1), k and v (q's dtype and shape), w and b (``[H, D]``), eta (a ``[B, T, H, 1]``
    tensor or a finite float) and eta_key (None or as eta) pass, all on q's device. (One
    function, not one per argument: a call costs about as much as a tensor's checks.)"""
    if not isinstance(q, Tensor):
        raise _tensor_error("q", q, "type", _Q_SHAPE)
    dtype = q.dtype
    if dtype not in _FLOAT_DTYPE_SET:
        raise _tensor_error("q", q, "floating", _Q_SHAPE)
    shape = q.shape
    if len(shape) != 4:
        raise _tensor_error("q", q, "rank", _Q_SHAPE)
    B, T, H, D = shape
    if H < 1 or D < 1:
        raise ValueError(f"q: expected [B, T, H, D] with H >= 1 heads and head dim D >= 1 "
                         f"(B and T may be 0), got shape {tuple(shape)}")
    device = q.device
    for name, t, other in (("k", k, v), ("v", v, k)):
        rule = _broken_rule(t, (dtype,), shape, device)
        if (rule == "shape" and isinstance(other, Tensor) and other.dim() == 4
                and other.shape[-1] != t.shape[-1]):      # a key dim other than the value dim
            K, V = (t, other) if name == "k" else (other, t)
            raise ValueError(f"k, v: the key dim must equal the value dim (K == V), got "
                             f"K = {K.shape[-1]} and V = {V.shape[-1]}")
        if rule is not None:
            raise _tensor_error(name, t, rule, shape, "[B, T, H, D] like q", device,
                                f"{dtype_name(dtype)} (the dtype of q)")
    for name, t in (("w", w), ("b", b)):
        rule = _broken_rule(t, _FLOAT_DTYPE_SET, (H, D), device)
        if rule is not None:
            raise _tensor_error(name, t, rule, (H, D), "[H, D]", device)
    eta_shape = (B, T, H, 1)
    if isinstance(eta, Tensor):
        rule = _broken_rule(eta, _FLOAT_DTYPE_SET, eta_shape, device)
        if rule is not None:
            raise _tensor_error("eta", eta, rule, eta_shape, "[B, T, H, 1]", device)
    else:       # a finite real number, not a bool; the state dtype keeps it exact
        if type(eta) is not float and (isinstance(eta, bool)
                                       or not isinstance(eta, numbers.Real)):
            raise TypeError(f"eta: expected a [B, T, H, 1] tensor or a float, "
                            f"got {type(eta).__name__}")
        if not math.isfinite(eta):
            raise ValueError(f"eta: expected a finite float, got {eta}")
        eta = _constant_eta(float(eta), eta_shape, state_dtype(dtype), device)
    if eta_key is not None:
        rule = _broken_rule(eta_key, _FLOAT_DTYPE_SET, eta_shape, device)
        if rule == "type":
            raise TypeError(f"eta_key: expected a [B, T, H, 1] tensor or None, "
                            f"got {type(eta_key).__name__}")
        if rule is not None:
            raise _tensor_error("eta_key", eta_key, rule, eta_shape, "[B, T, H, 1] like eta",
                                device)
    return shape, dtype, device, eta


MAX_CONSTANT_ETAS = 4          # constant eta tensors kept at most (CPU only)
_CONSTANT_ETAS: dict[tuple, Tensor] = {}


def _constant_eta(value: float, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> Tensor:
    """``torch.full(shape, value)``. On the CPU one kept per value, shape and dtype while
    nothing wrote to it (version 0), made outside inference mode (an inference tensor has no
    version counter and autograd cannot save one). Elsewhere a new one each call: one kept
    there would be read by other streams and CUDA graphs unordered with the kernel that
    filled it; under torch.compile too (the graph makes its own)."""
    if device.type != "cpu" or value == 0 or torch.compiler.is_compiling():   # (0.0, -0.0)
        return torch.full(shape, value, dtype=dtype, device=device)
    key = (value, shape, dtype)
    kept = _CONSTANT_ETAS.get(key)
    if kept is None or kept._version != 0:
        if len(_CONSTANT_ETAS) >= MAX_CONSTANT_ETAS:
            _CONSTANT_ETAS.clear()
        with torch.inference_mode(False):
            kept = torch.full(shape, value, dtype=dtype, device=device)
        _CONSTANT_ETAS[key] = kept
    return kept


def positive_int(name: str, value) -> int:
    """``value``, an int (not a bool) >= 1, else the error naming argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def _positive_float(name: str, value) -> float:
    """``value`` as a float: a positive finite real number (not a bool)."""
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}: expected a positive float, got {type(value).__name__}")
        value = float(value)
    if not 0 < value < math.inf:                # (NaN fails both; dynamo traces it)
        raise ValueError(f"{name}: expected a positive finite float, got {value}")
    return value


def _checked_options(scale, eps, chunk_size, output_final_state, output, D: int
                     ) -> tuple[float, float, int]:
    """``(scale, eps, chunk_size)`` (scale None: ``D ** -0.5``) once ``output``, ``scale``,
    ``eps``, ``chunk_size`` and ``output_final_state`` pass, in this order."""
    if not isinstance(output, str) or output not in OUTPUTS:
        raise ValueError(f"output: expected one of {list(OUTPUTS)}, got {output!r}")
    scale = D ** -0.5 if scale is None else _positive_float("scale", scale)
    eps = _positive_float("eps", eps)
    if type(chunk_size) is not int:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
            raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
        chunk_size = int(chunk_size)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state: expected a bool, "
                        f"got {type(output_final_state).__name__}")
    return scale, eps, chunk_size


def _check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device) -> tuple[int, ...]:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens: expected an int32/int64 torch.Tensor, "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, "
                        f"got {dtype_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-d tensor [N + 1] with N >= 1, "
                         f"got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise _tensor_error("cu_seqlens", cu_seqlens, "device", (), device=device)
    if cu_seqlens.is_meta:
        raise ValueError("cu_seqlens: expected a tensor with values (the offsets are read on "
                         "the host), got a meta tensor; pass the inputs and cu_seqlens on a "
                         "real device")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed batches need q with batch size B == 1 "
                         f"(sequences concatenated along T), got B = {B}")
    offsets = [int(x) for x in cu_seqlens.tolist()]  # one host sync, to check the values
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[0] == 0, got {offsets[0]}")
    if offsets[-1] != T:
        raise ValueError(f"cu_seqlens: expected cu_seqlens[-1] == T == {T}, got {offsets[-1]}")
    lengths = tuple(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets (increasing, or "
                             f"equal for an empty sequence), got "
                             f"cu_seqlens[{i}] = {offsets[i]} > cu_seqlens[{i + 1}] = "
                             f"{offsets[i + 1]}")
    return lengths


def check_states(names, states, N: int, H: int, D: int, hidden: int | None,
                 dtype: torch.dtype, device: torch.device, packed: bool) -> None:
    """Initial states of :func:`~ttt.problem.state_shapes` (``hidden`` None: TTT-Linear's,
    either of which may be None), float32 (or float64 with float64 inputs) on q's device;
    N counts the batch or the ``packed`` sequences."""
    dtypes = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)
    for i, (name, state, shape) in enumerate(zip(names, states, state_shapes(N, H, D, hidden))):
        optional = state is None and hidden is None
        rule = None if optional else _broken_rule(state, dtypes, shape, device)
        if rule is not None:
            dims = state_shapes("N", "H", "D", None if hidden is None else "F")[i]
            what_n = "sequences in cu_seqlens" if packed else "batch"
            raise _tensor_error(name, state, rule, shape,
                                f"[{', '.join(map(str, dims))}], N = {N} {what_n}", device,
                                str([dtype_name(d) for d in dtypes]))


def make_problem(q, k, v, w, b, eta, *, scale=None, eps=1e-6, chunk_size=16,
                 initial_state=None, initial_state_bias=None, output_final_state=False,
                 cu_seqlens=None, eta_key=None, output="norm_residual") -> Problem:
    """Check every argument of :func:`ttt.chunk_ttt_linear` (same names and defaults; the
    order: the module's doc) and return the contiguous :class:`Problem` backends receive.
    Public: tests ask ``backend.not_supported_reasons(ttt.make_problem(...))``."""
    eta_is_tensor = isinstance(eta, Tensor)
    shape, dtype, device, eta = _checked_tensors(q, k, v, w, b, eta, eta_key)
    B, T, H, D = shape
    scale, eps, chunk_size = _checked_options(scale, eps, chunk_size, output_final_state,
                                              output, D)
    if cu_seqlens is not None:
        seq_lens = _check_cu_seqlens(cu_seqlens, B, T, device)
        cu_seqlens = cu_seqlens.to(torch.int64).contiguous()
    else:
        seq_lens = (T,) * B
    if initial_state is not None or initial_state_bias is not None:
        check_states(("initial_state", "initial_state_bias"), (initial_state, initial_state_bias),
                     len(seq_lens), H, D, None, dtype, device, cu_seqlens is not None)
    requires_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or w.requires_grad
        or b.requires_grad or eta.requires_grad
        or (eta_key is not None and eta_key.requires_grad)
        or (initial_state is not None and initial_state.requires_grad)
        or (initial_state_bias is not None and initial_state_bias.requires_grad))
    return Problem._of_fields({
        "q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(), "w": w.contiguous(),
        "b": b.contiguous(), "eta": eta.contiguous(), "scale": scale, "eps": eps,
        "chunk_size": chunk_size,
        "initial_state": None if initial_state is None else initial_state.contiguous(),
        "initial_state_bias": (None if initial_state_bias is None
                               else initial_state_bias.contiguous()),
        "output_final_state": output_final_state, "cu_seqlens": cu_seqlens,
        "seq_lens": seq_lens, "eta_is_tensor": eta_is_tensor, "requires_grad": requires_grad,
        "eta_key": None if eta_key is None else eta_key.contiguous(), "output": output})
