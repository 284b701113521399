"""The op's arguments, in the custom ops' order: the one table that the ops' schemas and
argument lists, the differentiable inputs, :class:`GradNeeds` and :class:`Gradients` are
made from."""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass

import torch


@dataclass(frozen=True)
class Argument:
    """One argument of the custom ops: its name (a :class:`ttt.Problem` field's, but for
    ``backend``), its type in a ``torch.library`` schema and, for a differentiable input,
    its :class:`Gradients` field."""

    name: str
    schema: str
    gradient: str | None = None


ARGUMENTS = (
    Argument("q", "Tensor", "dq"),
    Argument("k", "Tensor", "dk"),
    Argument("v", "Tensor", "dv"),
    Argument("w", "Tensor", "dw"),
    Argument("b", "Tensor", "db"),
    Argument("eta", "Tensor", "deta"),
    Argument("eta_key", "Tensor?", "deta_key"),
    Argument("initial_state", "Tensor?", "dh0"),
    Argument("initial_state_bias", "Tensor?", "dhb0"),
    Argument("cu_seqlens", "Tensor?"),
    Argument("seq_lens", "SymInt[]"),     # host ints of a packed batch, [] for a dense one
    Argument("scale", "float"),
    Argument("eps", "float"),
    Argument("chunk_size", "SymInt"),
    Argument("output_final_state", "bool"),
    Argument("eta_is_tensor", "bool"),
    Argument("output", "str"),
    Argument("backend", "str"),
)
"""The forward op's arguments but its last (``bool needs_backward``): tensors first, then
the options. The backward op takes the cotangents, these tensors, the saved tensors, these
options and one flag per differentiable input (``_custom_op``)."""

TENSORS = tuple(a.name for a in ARGUMENTS if a.schema.startswith("Tensor"))
OPTIONS = tuple(a.name for a in ARGUMENTS if not a.schema.startswith("Tensor"))
GRAD_INPUTS = tuple(a.name for a in ARGUMENTS if a.gradient)
"""The differentiable inputs, by argument name, in the ops' order."""
GRADIENT_FIELDS = {a.name: a.gradient for a in ARGUMENTS if a.gradient}
"""The :class:`Gradients` field of each input in :data:`GRAD_INPUTS` (``"q"`` -> ``"dq"``)."""


def declared(names) -> str:
    """``names`` as a schema's declarations, e.g. ``"Tensor q, Tensor k"``."""
    kinds = {a.name: a.schema for a in ARGUMENTS}
    return ", ".join(f"{kinds[name]} {name}" for name in names)


def _of_flags(cls, flags) -> GradNeeds:
    """The GradNeeds of ``flags``, one bool per input in :data:`GRAD_INPUTS` order."""
    return cls(**dict(zip(GRAD_INPUTS, flags, strict=True)))


GradNeeds = make_dataclass(
    "GradNeeds", [(name, bool, True) for name in GRAD_INPUTS], frozen=True,
    namespace={"of_flags": classmethod(_of_flags),
               "__doc__": "Which gradients autograd asks for: one flag per differentiable "
                          "input (GRAD_INPUTS), all True by default."})


def _of(self, name: str) -> torch.Tensor | None:
    """The gradient of input ``name`` (one of :data:`GRAD_INPUTS`)."""
    return getattr(self, GRADIENT_FIELDS[name])


Gradients = make_dataclass(
    "Gradients", [(field, "torch.Tensor | None", None) for field in GRADIENT_FIELDS.values()],
    kw_only=True,
    namespace={"of": _of,
               "__doc__": "The gradients a backend returns, by name (dq, dk, dv, dw, db, "
                          "deta, deta_key, dh0, dhb0); None where not asked for or not "
                          "applicable."})

GradNeeds.__module__ = Gradients.__module__ = __name__
