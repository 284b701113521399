"""How the suite judges a backend's tensor against the float64 oracle's.

Two measures, both bounded per dtype by :mod:`ttt.tolerances`:

- the whole tensor's relative error ``||x - ref|| / ||ref||``;
- the worst *segment error* over the tensor's sequences and over their chunks (a partial
  last chunk too): ``rms(x_s - ref_s) / rms(ref)``, a segment's RMS error against the whole
  tensor's RMS. A fault confined to one chunk or one sequence of a long batch, diluted in
  the whole tensor's norm, stands out here. Per-sequence tensors (final states, their
  gradients) are judged per sequence.
"""

from __future__ import annotations

import math

import torch

from ..tolerances import SEGMENT_FACTOR
from .cases import Case, chunk_spans, segment_spans
from .expected import OUTPUT_NAMES

F64 = torch.float64


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64 (the plain ``||x - ref||`` when ref is zero)."""
    x, ref = x.detach().to(F64), ref.detach().to(F64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}")
    denom = ref.norm().item()
    err = (x - ref).norm().item()
    return err / denom if denom > 0 else err


def expect(condition: object, message: str) -> None:
    """The suite's check: AssertionError with ``message`` unless ``condition`` holds (an
    ``assert`` statement would vanish under ``python -O``)."""
    if not condition:
        raise AssertionError(message)


def expect_close(label: str, x: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    """``rel_error(x, ref) <= bound``, else AssertionError naming ``label`` and both."""
    err = rel_error(x, ref)
    expect(err <= bound, f"{label}: relative error {err:.3e} > {bound:.1e}")


def _rms(t: torch.Tensor) -> float:
    return t.norm().item() / math.sqrt(max(t.numel(), 1))


def segment_errors(x: torch.Tensor, ref: torch.Tensor, case: Case, per_sequence_rows: bool
                   ) -> list[tuple[str, float]]:
    """(segment label, segment error) of every sequence and chunk. ``per_sequence_rows``:
    the tensor's first axis is the sequence (final states and their gradients); else it is
    ``[B, T, ...]`` and segments are token ranges."""
    x, ref = x.detach().to(F64), ref.detach().to(F64)
    whole = _rms(ref)
    if whole == 0:
        return []
    if per_sequence_rows:
        return [(f"sequence {n}", _rms(x[n] - ref[n]) / whole) for n in range(x.shape[0])]
    found = []
    for n, (row, start, stop) in enumerate(segment_spans(case)):
        err = _rms(x[row, start:stop] - ref[row, start:stop]) / whole
        found.append((f"sequence {n} (tokens {start}:{stop})", err))
    for row, start, stop in chunk_spans(case):
        err = _rms(x[row, start:stop] - ref[row, start:stop]) / whole
        found.append((f"chunk at tokens {start}:{stop} of row {row}", err))
    return found


class Judge:
    """Collects every failure of one test, so that a report names them all at once."""

    def __init__(self, case: Case):
        self.case = case
        self.failures: list[str] = []
        self.errors: dict[str, tuple[float, float]] = {}   # label -> (whole, worst segment)

    def close(self, label: str, x: torch.Tensor | None, ref: torch.Tensor, tol: float,
              per_sequence_rows: bool = False, segments: bool = True) -> None:
        """x against ref: finite, whole relative error <= tol, every segment error <=
        SEGMENT_FACTOR * tol."""
        if x is None:
            if ref.detach().abs().max().item() == 0:
                return                        # autograd's None is a zero gradient
            self.failures.append(f"{label}: missing (None)")
            return
        if not torch.isfinite(x).all():
            self.failures.append(f"{label}: non-finite values")
            return
        err = rel_error(x, ref)
        worst_label, worst = "", 0.0
        if not err <= tol:
            self.failures.append(f"{label}: relative error {err:.3e} > {tol:.0e}")
        if segments:
            for where, seg in segment_errors(x, ref, self.case, per_sequence_rows):
                if seg > worst:
                    worst_label, worst = where, seg
            bound = SEGMENT_FACTOR * tol
            if worst > bound:
                self.failures.append(f"{label}: {worst_label}: segment error {worst:.3e} > "
                                     f"{bound:.0e} (whole tensor {err:.3e})")
        self.errors[label] = (err, worst)

    def dtype(self, label: str, x: torch.Tensor | None, expected: torch.dtype) -> None:
        if x is not None and x.dtype != expected:
            self.failures.append(f"{label}: dtype {x.dtype}, expected {expected}")

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def outputs(self, outputs: tuple, expected: dict, tol: float) -> None:
        """``(o, final_state, final_state_bias)`` of a call of the case against ``expected``
        (by ``OUTPUT_NAMES``): o's dtype and shape, every value within ``tol``; the final
        states None unless the case asks for them."""
        case = self.case
        o, ht, hbt = outputs
        if o.dtype != case.dtype or tuple(o.shape) != tuple(expected["o"].shape):
            self.fail(f"o: dtype/shape {o.dtype}/{tuple(o.shape)}, expected "
                      f"{case.dtype}/{tuple(expected['o'].shape)}")
        self.close("o", o, expected["o"], tol)
        if not case.final_state:
            if ht is not None or hbt is not None:
                self.fail("final states returned though output_final_state=False")
            return
        for name, x in zip(OUTPUT_NAMES[1:], (ht, hbt)):
            self.dtype(name, x, case.state_dtype)
            self.close(name, x, expected[name], tol, per_sequence_rows=True)

    def check(self, what: str) -> None:
        if self.failures:
            raise AssertionError(f"{what}: " + "; ".join(self.failures))
