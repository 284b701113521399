"""``chunk_ttt_linear`` as two PyTorch custom ops, ``ttt::chunk_ttt_linear_fwd`` and
``ttt::chunk_ttt_linear_bwd``, opaque to dynamo and inductor.

The forward op returns the output, the final states and the tensors the backend keeps for
its backward (``saved``, a list; the fake implementation builds them from the backend's
``saved_shapes``); the autograd formula hands ``saved`` to the backward op. The backend is
chosen before the op (``ttt.ops``) and comes in by name; the op's arguments are plain
tensors, numbers, strings and ``seq_lens`` (a packed batch's lengths as host ints, empty
for a dense one), so nothing in the ops reads the device. Autocast is off inside both ops:
the inputs arrive in the dtypes the wrapper chose.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .arguments import GRAD_INPUTS, GRADIENT_FIELDS, OPTIONS, TENSORS, GradNeeds, declared
from .problem import Problem, attribute_reader, state_shapes
from .registry import load_backend

_NAMES = (*TENSORS, *OPTIONS)
_SEQ_LENS = OPTIONS.index("seq_lens")
_TENSOR_ARGS = len(TENSORS)
_ETA_IS_TENSOR = OPTIONS.index("eta_is_tensor")


def problem_of(args, requires_grad: bool) -> Problem:
    """The Problem the wrapper validated, re-created from the ops' tensors and options
    ``args`` (which the wrapper made from it, so unchecked: see ``Problem._of_fields``)."""
    fields = dict(zip(_NAMES, args))
    del fields["backend"]
    if fields["cu_seqlens"] is None:
        B, T = fields["q"].shape[:2]
        fields["seq_lens"] = (T,) * B
    else:
        fields["seq_lens"] = tuple(fields["seq_lens"])
    fields["requires_grad"] = requires_grad
    return Problem._of_fields(fields)


_tensors = attribute_reader(TENSORS)                # the forward op's tensor arguments
_option_fields = attribute_reader(OPTIONS[:-1])     # (backend: no Problem field)


def _options(problem: Problem, backend: str) -> tuple:
    """The forward op's options and ``needs_backward`` for ``problem`` on ``backend``."""
    options = list(_option_fields(problem))
    options[_SEQ_LENS] = list(problem.seq_lens) if problem.is_varlen else []
    return (*options, backend, problem.requires_grad)


def arguments(problem: Problem, backend: str) -> tuple:
    """The forward op's arguments for a validated ``problem`` on backend ``backend``."""
    return (*_tensors(problem), *_options(problem, backend))


def device_type(t: torch.Tensor) -> str:
    """``t.device.type``: for a CUDA tensor from its flag ``is_cuda``, which costs a fraction
    of a device object's ``type`` (and which dynamo reads as a constant)."""
    return "cuda" if t.is_cuda else t.device.type


def autocast_on(t) -> bool:
    """Whether an autocast region is on for tensor ``t``'s device type (False for no
    tensor, or where autocast raises: meta)."""
    if not isinstance(t, torch.Tensor):
        return False
    kind = device_type(t)
    if kind in ("cpu", "cuda"):
        return torch.is_autocast_enabled(kind)
    try:
        return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    except RuntimeError:
        return False


def no_autocast(t: torch.Tensor, autocast: bool):
    """Autocast off for ``t``'s device type where ``autocast`` (a region is on for it); no
    region to enter where it is off already, the common case."""
    if autocast:
        return torch.autocast(device_type(t), enabled=False)
    return _NOTHING_TO_SWITCH


_NOTHING_TO_SWITCH = contextlib.nullcontext()   # (reusable, reentrant)


_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradNestedTensor))


def _with_autograd():
    """A custom op's implementation runs below the autograd dispatch key, where no graph is
    recorded; a backend's backward may differentiate with autograd (the reference backend
    recomputes its forward), so it runs with the autograd keys back in place (torch has no
    public guard for it; torch.func.vjp would record, but dispatch modes such as opcheck's
    cannot see into it)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    return torch._C._ForceDispatchKeyGuard(include, exclude - _AUTOGRAD_KEYS)


def _forward_impl(*args) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``(o, [final_state, final_state_bias] or [], saved or [])`` from the backend
    ``args`` name; ``args``: the tensors and options, then ``needs_backward``."""
    return _run_forward(problem_of(args[:-1], args[-1]), args[-2], autocast_on(args[0]))


def _run_forward(problem: Problem, backend: str, autocast: bool):
    """The forward op's work on its arguments' Problem; ``autocast``: whether an autocast
    region is on for the problem's device type (switched off around the backend)."""
    chosen = load_backend(backend)
    needs_backward = problem.requires_grad
    with no_autocast(problem.q, autocast):
        o, ht, hbt, saved = chosen.forward(problem, needs_backward=needs_backward)
    saved = list(saved) if needs_backward else []
    finals = [ht.contiguous(), hbt.contiguous()] if problem.output_final_state else []
    return o.contiguous(), finals, saved


_FWD_SCHEMA = (f"({declared(_NAMES)}, bool needs_backward) "
               "-> (Tensor, Tensor[], Tensor[])")
_BWD_SCHEMA = (f"(Tensor do, Tensor? dht, Tensor? dhbt, {declared(TENSORS)}, Tensor[] saved, "
               f"{declared(OPTIONS)}, bool[] needs) -> Tensor[]")
"""The ops' schemas, given explicitly: an implementation takes its arguments as ``*args``."""

chunk_ttt_linear_fwd = torch.library.custom_op("ttt::chunk_ttt_linear_fwd", mutates_args=(),
                                               schema=_FWD_SCHEMA)(_forward_impl)


@chunk_ttt_linear_fwd.register_fake
def _fwd_fake(*args):
    problem = problem_of(args[:-1], args[-1])
    q, finals = problem.q, []
    if problem.output_final_state:
        finals = [q.new_empty(shape, dtype=problem.state_dtype)
                  for shape in state_shapes(problem.N, problem.H, problem.D)]
    saved = []
    if problem.requires_grad:
        saved = [q.new_empty(shape, dtype=dtype)
                 for shape, dtype in load_backend(args[-2]).saved_shapes(problem)]
    return torch.empty_like(q), finals, saved


_GRADIENT_FIELDS = tuple(GRADIENT_FIELDS[name] for name in GRAD_INPUTS)
_grad_needs = functools.cache(GradNeeds.of_flags)   # (frozen: one per pattern of flags)


def _backward_parts(args):
    """The backward op's ``args`` as (cotangents, tensors, saved, options, needs)."""
    return (args[:3], args[3:3 + _TENSOR_ARGS], args[3 + _TENSOR_ARGS],
            args[4 + _TENSOR_ARGS:-1], args[-1])


def _backward_impl(*args) -> list[torch.Tensor]:
    """The gradients of the inputs ``needs`` marks (GRAD_INPUTS order), each in its input's
    dtype; ``args``: the cotangents ``do``, ``dht``, ``dhbt`` (the last two None when
    absent), the forward's tensors, what it saved, its options and ``needs``."""
    (do, dht, dhbt), tensors, saved, options, needs = _backward_parts(args)
    problem = problem_of((*tensors, *options), True)
    backend = options[-1]
    with no_autocast(problem.q, autocast_on(problem.q)), _with_autograd():
        grads = load_backend(backend).backward(problem, list(saved), do.contiguous(), dht,
                                               dhbt, _grad_needs(tuple(needs)))
    result = []
    for name, need, field, like in zip(GRAD_INPUTS, needs, _GRADIENT_FIELDS, tensors):
        if not need:
            continue
        grad = getattr(grads, field)
        if grad is None:
            raise RuntimeError(f"backend {backend!r} returned no gradient for {name}")
        result.append((grad if grad.dtype == like.dtype else grad.to(like.dtype)).contiguous())
    return result


chunk_ttt_linear_bwd = torch.library.custom_op("ttt::chunk_ttt_linear_bwd", mutates_args=(),
                                               schema=_BWD_SCHEMA)(_backward_impl)


@chunk_ttt_linear_bwd.register_fake
def _bwd_fake(*args):
    _, tensors, _, _, needs = _backward_parts(args)
    return [torch.empty_like(like) for need, like in zip(needs, tensors) if need]


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)        # absent cotangents stay None
    tensors, options = inputs[:_TENSOR_ARGS], inputs[_TENSOR_ARGS:-1]   # (not needs_backward)
    ctx.options = options                   # seq_lens .. backend: the backward op's options
    ctx.eta_is_tensor = options[_ETA_IS_TENSOR]
    ctx.save_for_backward(*tensors, *output[2])


def _backward(ctx, do, d_finals, _d_saved):
    tensors = ctx.saved_tensors
    inputs, saved = tensors[:_TENSOR_ARGS], list(tensors[_TENSOR_ARGS:])
    grad_flags = list(ctx.needs_input_grad[:len(GRAD_INPUTS)])
    grad_flags[GRAD_INPUTS.index("eta")] &= bool(ctx.eta_is_tensor)
    grad_flags = [flag and t is not None for flag, t in zip(grad_flags, inputs)]
    # (an empty seq_lens counts as a list of tensors, a non-empty one as one leaf)
    # (then the other options' and needs_backward's)
    no_option_grads = ([] if not ctx.options[0] else None, *(None,) * len(OPTIONS))
    if not any(grad_flags):
        return (*(None,) * _TENSOR_ARGS, *no_option_grads)
    dht, dhbt = d_finals if d_finals is not None and len(d_finals) else (None, None)
    grads = iter(backward((
        torch.zeros_like(inputs[0]) if do is None else do,
        None if dht is None else dht.contiguous(),
        None if dhbt is None else dhbt.contiguous(), *inputs, saved, *ctx.options,
        grad_flags)))
    result = [next(grads) if flag else None for flag in grad_flags]
    return (*result, None, *no_option_grads)


chunk_ttt_linear_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ the eager shortcut
# Where the dispatcher would only run its generic Python glue on the way to the
# implementation (docs/api.md, "under torch.compile and autocast"), the calls below do what
# it does directly: the implementation below the autograd keys, the outputs' aliasing check,
# setup_context and the backward formula in an autograd.Function.

_PLAIN_OR_ABSENT = frozenset({torch.Tensor, torch.nn.Parameter, type(None)})
"""The types of the op's tensor arguments that a call may take the shortcut with."""

SHORTCUT_AVAILABLE = (hasattr(torch._library.utils, "_c_check_aliasing_constraint")
                      and hasattr(torch._C, "_AutoDispatchBelowAutograd"))
"""Whether this torch has the private APIs the shortcut uses (torch 2.5 and 2.6 lack
``_c_check_aliasing_constraint``); without them every call takes the op."""


def eager_and_plain(tensors, first: torch.Tensor) -> bool:
    """Whether the dispatcher would take an op on ``tensors`` straight to its autograd
    formula and implementation, nothing watching or transforming it. ``tensors`` (None
    where absent) are on the device of ``first``, one of them: the validated inputs, their
    cotangents and what the backend saved; so ``first`` alone says whether it is meta.
    (Backends' own custom ops ask it too, e.g. the Triton TTT-MLP forward's.)"""
    if not SHORTCUT_AVAILABLE:
        return False
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._autograd._profiler_enabled()
            or torch._C._get_tracing_state() is not None
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    return _PLAIN_OR_ABSENT.issuperset(map(type, tensors)) and not first.is_meta


def _checked(name: str, args: tuple, run, *run_args):
    """``run(*run_args)``, the op ``name``'s work on ``args``, below the autograd keys; its
    outputs checked as the op's are (against the tensors among ``args``: the rest cannot
    alias)."""
    with torch._C._AutoDispatchBelowAutograd():
        result = run(*run_args)
    torch._library.utils._c_check_aliasing_constraint(name, args, {}, result)
    return result


class _EagerForward(torch.autograd.Function):
    """The forward op's autograd node for an eager call that needs a backward: its
    implementation, ``_setup_context`` and ``_backward``; the op's tensor arguments, then
    its options in one tuple, the Problem and the autocast flag; the outputs flat
    (``o, *finals, *saved``)."""

    @staticmethod
    def forward(ctx, *arguments):
        *tensors, options, problem, autocast = arguments
        o, finals, saved = _checked("chunk_ttt_linear_fwd", tuple(tensors), _run_forward,
                                    problem, options[-2], autocast)
        _setup_context(ctx, (*tensors, *options), (o, finals, saved))
        ctx.final_count = len(finals)
        return (o, *finals, *saved)

    @staticmethod
    def backward(ctx, do, *d_rest):
        grads = _backward(ctx, do, list(d_rest[:ctx.final_count]), None)
        return (*grads[:_TENSOR_ARGS], None, None, None)     # (options, problem, autocast)


def forward(problem: Problem, backend: str, autocast: bool
            ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The forward op for a validated ``problem`` on backend ``backend``:
    ``(o, finals, saved)``; ``autocast``: whether an autocast region is on for the
    problem's device type (the wrapper read it)."""
    tensors = _tensors(problem)
    if not eager_and_plain(tensors, problem.q):
        return chunk_ttt_linear_fwd(*tensors, *_options(problem, backend))
    if not (torch.is_grad_enabled() and problem.requires_grad):
        return _checked("chunk_ttt_linear_fwd", tensors, _run_forward, problem, backend,
                        autocast)
    o, *rest = _EagerForward.apply(*tensors, _options(problem, backend), problem, autocast)
    final_count = 2 if problem.output_final_state else 0
    return o, rest[:final_count], rest[final_count:]


def backward(args: tuple) -> list[torch.Tensor]:
    """The backward op on ``args``; the op itself where a graph of it is to be recorded
    (a double backward, which it refuses)."""
    if torch.is_grad_enabled() or not eager_and_plain(
            (*args[:3 + _TENSOR_ARGS], *args[3 + _TENSOR_ARGS]), args[3]):
        return chunk_ttt_linear_bwd(*args)
    return _checked("chunk_ttt_linear_bwd", args, _backward_impl, *args)
