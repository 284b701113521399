"""Input checks for ``chunk_ttt_linear``: one place, run once per call, before any backend.

Every failure raises ``TypeError`` (wrong kind of object, wrong dtype) or ``ValueError``
(wrong shape, value or device), naming the argument, what was expected and what came.
"""

from __future__ import annotations

import math
import numbers

import torch

from .problem import OUTPUTS, Problem

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _require_tensor(name: str, value, rank: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-d tensor, got shape {tuple(value.shape)}")
    if value.dtype not in _FLOAT_DTYPE_SET:
        raise TypeError(f"{name}: expected a floating dtype {[_name(d) for d in FLOAT_DTYPES]}, "
                        f"got {_name(value.dtype)}")
    return value


def _require_shape(name: str, value: torch.Tensor, shape: tuple[int, ...], meaning: str):
    if value.shape != shape:                    # (torch.Size is a tuple)
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({meaning}), "
                         f"got {tuple(value.shape)}")


def _require_device(name: str, value: torch.Tensor, device: torch.device):
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), "
                         f"got one on {value.device}")


def _is_tensor_of(t, shape: tuple[int, ...], dtypes, device: torch.device) -> bool:
    """Whether ``t`` is a tensor of exactly ``shape``, a dtype in ``dtypes`` and on ``device``:
    the common case, checked in one expression; the detailed checks run only when it fails,
    to name what differs."""
    return (isinstance(t, torch.Tensor) and t.shape == shape and t.dtype in dtypes
            and t.device == device)


def _check_keys_values(k, v, shape: torch.Size, dtype: torch.dtype, device: torch.device):
    """Raise the error that says how ``k`` or ``v`` differs from q (``shape``, ``dtype``,
    ``device``)."""
    B, T, H, D = shape
    k = _require_tensor("k", k, 4)
    v = _require_tensor("v", v, 4)
    if k.shape[-1] != v.shape[-1]:
        raise ValueError(f"k, v: the key dim must equal the value dim (K == V), got "
                         f"K = {k.shape[-1]} and V = {v.shape[-1]}")
    _require_shape("k", k, (B, T, H, D), "[B, T, H, D] like q")
    _require_shape("v", v, (B, T, H, D), "[B, T, H, D] like q")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {_name(dtype)} (the dtype of q), "
                            f"got {_name(t.dtype)}")
        _require_device(name, t, device)


def _check_norm_parameters(w, b, HD: tuple[int, int], device: torch.device):
    """Raise the error that says what is wrong with ``w`` or ``b`` (``[H, D]``, floating,
    on q's device)."""
    _require_tensor("w", w, 2)
    _require_tensor("b", b, 2)
    _require_shape("w", w, HD, "[H, D]")
    _require_shape("b", b, HD, "[H, D]")
    _require_device("w", w, device)
    _require_device("b", b, device)


def _positive_float(name: str, value) -> float:
    if type(value) is not float and (isinstance(value, bool)
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name}: expected a positive float, got {type(value).__name__}")
    value = float(value)
    if not 0 < value < math.inf:                # (NaN fails both; dynamo traces it)
        raise ValueError(f"{name}: expected a positive finite float, got {value}")
    return value


def _check_cu_seqlens(cu_seqlens, B: int, T: int, device: torch.device) -> tuple[int, ...]:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected an int32/int64 torch.Tensor, "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {_name(cu_seqlens.dtype)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-d tensor [N + 1] with N >= 1, "
                         f"got shape {tuple(cu_seqlens.shape)}")
    _require_device("cu_seqlens", cu_seqlens, device)
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


def _check_eta_key(eta_key, shape: tuple[int, ...], device: torch.device):
    if eta_key is None or _is_tensor_of(eta_key, shape, _FLOAT_DTYPE_SET, device):
        return
    if not isinstance(eta_key, torch.Tensor):
        raise TypeError(f"eta_key: expected a [B, T, H, 1] tensor or None, "
                        f"got {type(eta_key).__name__}")
    _require_tensor("eta_key", eta_key, 4)
    _require_shape("eta_key", eta_key, shape, "[B, T, H, 1] like eta")
    _require_device("eta_key", eta_key, device)


def _check_output(output) -> str:
    if not isinstance(output, str) or output not in OUTPUTS:
        raise ValueError(f"output: expected one of {list(OUTPUTS)}, got {output!r}")
    return output


def _check_states(initial_state, initial_state_bias, NHD: tuple[int, int, int],
                  dtype: torch.dtype, device: torch.device, what_n: str):
    """The initial states given (either may be None): float32 (or float64 with float64
    inputs) ``[N, H, D, D]`` and ``[N, H, 1, D]``, N sequences (``what_n``)."""
    N, H, D = NHD
    state_dtypes = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)
    for name, state, shape, meaning in (
            ("initial_state", initial_state, (N, H, D, D), "[N, H, D, D]"),
            ("initial_state_bias", initial_state_bias, (N, H, 1, D), "[N, H, 1, D]")):
        if state is None or _is_tensor_of(state, shape, state_dtypes, device):
            continue
        _require_tensor(name, state, 4)
        if tuple(state.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} ({meaning}, N = {N} {what_n}),"
                             f" got {tuple(state.shape)}")
        if state.dtype not in state_dtypes:
            raise TypeError(f"{name}: expected dtype {[_name(d) for d in state_dtypes]}, "
                            f"got {_name(state.dtype)}")
        _require_device(name, state, device)


MAX_CONSTANT_ETAS = 4
"""The constant ``eta`` tensors kept at most (CPU only, see :func:`_constant_eta`)."""
_CONSTANT_ETAS: dict[tuple, torch.Tensor] = {}


def _constant_eta(value: float, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """``torch.full(shape, value)``: on the CPU one tensor per value, shape and dtype, kept
    while nothing wrote to it (its version counter stays 0), not made again per call; made
    outside inference mode (an inference tensor has no version counter, and autograd cannot
    save one). On other devices a new tensor each call: one kept there would be read by
    kernels of other streams and CUDA graphs, unordered with the kernel that filled it;
    under torch.compile too (the graph makes its own)."""
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


def _usual_tensors(k, v, w, b, eta, eta_key, shape: torch.Size, dtype: torch.dtype,
                   device: torch.device) -> bool:
    """Whether q (``shape``, ``dtype``, ``device``) has a floating dtype, heads and a head
    dim, and k, v, w, b, eta (a tensor or a float) and eta_key (a tensor or None) pass
    every check of :func:`_check_tensors`: the common case, checked in one expression; the
    checks that name what differs run only where it fails."""
    B, T, H, D = shape
    HD, eta_shape = (H, D), (B, T, H, 1)
    tensor, floating = torch.Tensor, _FLOAT_DTYPE_SET
    return (dtype in floating and H >= 1 and D >= 1
            and isinstance(k, tensor) and isinstance(v, tensor) and isinstance(w, tensor)
            and isinstance(b, tensor)
            and k.shape == shape and v.shape == shape and k.dtype == dtype
            and v.dtype == dtype and w.shape == HD and b.shape == HD
            and w.dtype in floating and b.dtype in floating
            and k.device == device and v.device == device and w.device == device
            and b.device == device
            and ((isinstance(eta, tensor) and eta.shape == eta_shape
                  and eta.dtype in floating and eta.device == device)
                 or (type(eta) is float and math.isfinite(eta)))
            and (eta_key is None or (isinstance(eta_key, tensor) and eta_key.shape == eta_shape
                                     and eta_key.dtype in floating
                                     and eta_key.device == device)))


def _eta_of_float(value, shape: torch.Size, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The constant eta tensor of a (finite) float ``value``, for q of ``shape``, ``dtype``
    and ``device``: float32 (float64 for float64 inputs) keeps the constant exact to float32
    precision."""
    B, T, H, _ = shape
    eta_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return _constant_eta(float(value), (B, T, H, 1), eta_dtype, device)


def _check_tensors(q, k, v, w, b, eta, eta_key) -> torch.Tensor:
    """Raise the first error of the checks of q, k, v, w, b, eta and eta_key, in this
    order; else ``eta`` as a tensor (a float's constant tensor)."""
    q = _require_tensor("q", q, 4)
    shape, dtype, device = q.shape, q.dtype, q.device
    B, T, H, D = shape
    if not (_is_tensor_of(k, shape, (dtype,), device)
            and _is_tensor_of(v, shape, (dtype,), device)):
        _check_keys_values(k, v, shape, dtype, device)
    if H < 1 or D < 1:
        raise ValueError(f"q: expected [B, T, H, D] with H >= 1 heads and head dim D >= 1 "
                         f"(B and T may be 0), got shape {tuple(q.shape)}")
    if not (_is_tensor_of(w, (H, D), _FLOAT_DTYPE_SET, device)
            and _is_tensor_of(b, (H, D), _FLOAT_DTYPE_SET, device)):
        _check_norm_parameters(w, b, (H, D), device)

    if isinstance(eta, torch.Tensor):
        if not _is_tensor_of(eta, (B, T, H, 1), _FLOAT_DTYPE_SET, device):
            _require_tensor("eta", eta, 4)
            _require_shape("eta", eta, (B, T, H, 1), "[B, T, H, 1]")
            _require_device("eta", eta, device)
    elif type(eta) is float or (isinstance(eta, numbers.Real) and not isinstance(eta, bool)):
        if not math.isfinite(float(eta)):
            raise ValueError(f"eta: expected a finite float, got {eta}")
        eta = _eta_of_float(eta, shape, dtype, device)
    else:
        raise TypeError(f"eta: expected a [B, T, H, 1] tensor or a float, "
                        f"got {type(eta).__name__}")
    _check_eta_key(eta_key, (B, T, H, 1), device)
    return eta


def _usual_options(scale, eps, chunk_size, output_final_state, output) -> bool:
    """Whether the options pass every check of :func:`_check_options` as they are (a float
    ``scale`` or None, a float ``eps``, an int ``chunk_size``, a bool, an output form): the
    common case, in one expression."""
    return ((scale is None or (type(scale) is float and 0 < scale < math.inf))
            and type(eps) is float and 0 < eps < math.inf
            and type(chunk_size) is int and chunk_size >= 1
            and type(output_final_state) is bool and type(output) is str and output in OUTPUTS)


def _check_options(scale, eps, chunk_size, output_final_state, output, D: int
                   ) -> tuple[float, float, int]:
    """Raise the first error of the checks of ``output``, ``scale``, ``eps``, ``chunk_size``
    and ``output_final_state``, in this order; else ``(scale, eps, chunk_size)`` as a float
    (``D ** -0.5`` for None), a float and an int."""
    _check_output(output)
    scale = D ** -0.5 if scale is None else _positive_float("scale", scale)
    eps = _positive_float("eps", eps)
    if type(chunk_size) is not int and (isinstance(chunk_size, bool)
                                        or not isinstance(chunk_size, numbers.Integral)):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state: expected a bool, "
                        f"got {type(output_final_state).__name__}")
    return scale, eps, int(chunk_size)


def _usual_states(initial_state, initial_state_bias, NHD: tuple[int, int, int],
                  device: torch.device) -> bool:
    """Whether each initial state is None or a float32 tensor of its shape on ``device``
    (which :func:`_check_states` passes): the common case, in one expression."""
    N, H, D = NHD
    tensor, float32 = torch.Tensor, torch.float32
    return ((initial_state is None
             or (isinstance(initial_state, tensor) and initial_state.shape == (N, H, D, D)
                 and initial_state.dtype == float32 and initial_state.device == device))
            and (initial_state_bias is None
                 or (isinstance(initial_state_bias, tensor)
                     and initial_state_bias.shape == (N, H, 1, D)
                     and initial_state_bias.dtype == float32
                     and initial_state_bias.device == device)))


def _any_requires_grad(q, k, v, w, b, eta, eta_key, initial_state, initial_state_bias
                       ) -> bool:
    """Whether any of the inputs (the last three may be None) requires grad."""
    return (q.requires_grad or k.requires_grad or v.requires_grad or w.requires_grad
            or b.requires_grad or eta.requires_grad
            or (eta_key is not None and eta_key.requires_grad)
            or (initial_state is not None and initial_state.requires_grad)
            or (initial_state_bias is not None and initial_state_bias.requires_grad))


def make_problem(q, k, v, w, b, eta, *, scale=None, eps=1e-6, chunk_size=16,
                 initial_state=None, initial_state_bias=None, output_final_state=False,
                 cu_seqlens=None, eta_key=None, output="norm_residual") -> Problem:
    """Check every argument of :func:`ttt.chunk_ttt_linear` (same names, same defaults) and
    return the contiguous :class:`Problem` backends receive. Public: a backend's tests (or
    the conformance suite) ask ``backend.not_supported_reasons(ttt.make_problem(...))``.

    Each group of arguments is first checked in one expression for the common case (see
    :func:`_usual_tensors`); where that fails, the checks that raise the first error, in
    the order of the arguments, run (and pass what the common case leaves out, such as
    numpy numbers)."""
    if not (isinstance(q, torch.Tensor) and q.dim() == 4):
        _require_tensor("q", q, 4)
    shape, dtype, device = q.shape, q.dtype, q.device
    B, T, H, D = shape
    eta_is_tensor = isinstance(eta, torch.Tensor)
    if not _usual_tensors(k, v, w, b, eta, eta_key, shape, dtype, device):
        eta = _check_tensors(q, k, v, w, b, eta, eta_key)
    elif not eta_is_tensor:
        eta = _eta_of_float(eta, shape, dtype, device)
    if _usual_options(scale, eps, chunk_size, output_final_state, output):
        scale = D ** -0.5 if scale is None else scale
    else:
        scale, eps, chunk_size = _check_options(scale, eps, chunk_size, output_final_state,
                                                output, D)

    if cu_seqlens is not None:
        seq_lens = _check_cu_seqlens(cu_seqlens, B, T, device)
        cu_seqlens = cu_seqlens.to(torch.int64).contiguous()
    else:
        seq_lens = (T,) * B

    if initial_state is not None or initial_state_bias is not None:
        NHD = (len(seq_lens), H, D)
        if not _usual_states(initial_state, initial_state_bias, NHD, device):
            _check_states(initial_state, initial_state_bias, NHD, dtype, device,
                          "sequences in cu_seqlens" if cu_seqlens is not None else "batch")
    requires_grad = torch.is_grad_enabled() and _any_requires_grad(
        q, k, v, w, b, eta, eta_key, initial_state, initial_state_bias)
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
