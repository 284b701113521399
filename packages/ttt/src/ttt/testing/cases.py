"""The conformance suite's cases and their inputs: shapes, dtypes, options, fresh random
tensors (never zeros), and which inputs require grad."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

from ttt.arguments import GRAD_INPUTS

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
DTYPE_NAMES = {F32: "fp32", BF16: "bf16", F16: "fp16", F64: "fp64"}
DEFAULT_EPS = 1e-6

OUTPUT_FORMS = ("norm_residual", "query_residual", "raw")
"""The op's output forms (``output=``); the first is its default."""
STATE_NAMES = ("initial_state", "initial_state_bias")


@dataclass(frozen=True)
class Case:
    B: int
    T: int
    H: int
    D: int
    chunk: int
    dtype: torch.dtype
    states: bool = True          # initial states given (and so their gradients checked)
    eta_tensor: bool = True      # eta a tensor (else a float, no gradient)
    seq_lens: tuple[int, ...] | None = None   # packed varlen batch (B == 1)
    final_state: bool = True
    scale: float | None = None   # None: the op's default D ** -0.5
    eps: float = DEFAULT_EPS
    eta_key: bool = False        # a random positive per-key factor eta_key (never ones)
    output: str = OUTPUT_FORMS[0]

    @property
    def big(self) -> bool:
        """Long sequences: deselected on CPU (``-m "not big"``)."""
        return self.T >= 2048

    @property
    def N(self) -> int:  # noqa: N802 - the op's name for it
        return len(self.seq_lens) if self.seq_lens else self.B

    @property
    def state_dtype(self) -> torch.dtype:
        return F64 if self.dtype == F64 else F32

    @property
    def id(self) -> str:
        shape = (f"varlen{list(self.seq_lens)}".replace(" ", "") if self.seq_lens
                 else f"B{self.B}")
        options = (f"{'' if self.scale is None else f'-s{self.scale:g}'}"
                   f"{'' if self.eps == DEFAULT_EPS else f'-eps{self.eps:g}'}"
                   f"{'-etakey' if self.eta_key else ''}"
                   f"{'' if self.output == OUTPUT_FORMS[0] else f'-{self.output}'}")
        return (f"{shape}-T{self.T}-H{self.H}-D{self.D}-c{self.chunk}-"
                f"{DTYPE_NAMES[self.dtype]}{'-h0' if self.states else ''}"
                f"{'-etaT' if self.eta_tensor else '-etaF'}"
                f"{'' if self.final_state else '-nofinal'}{options}")

    @property
    def seed(self) -> int:
        """A seed fixed per case (``hash`` of a str changes with every process)."""
        return zlib.crc32(self.id.encode())

    def param(self):
        marks = [pytest.mark.big] if self.big else []
        return pytest.param(self, id=self.id, marks=marks)


def _dense_cases() -> list[Case]:
    cases = []
    dims = (16, 32, 60, 64, 96)
    i = 0
    for chunk in (16, 32, 64):
        for T in (2 * chunk, 2 * chunk + chunk // 2 + 3, chunk - 3, 1):
            D, H, B = dims[i % len(dims)], 1 + i % 4, 1 + i % 3
            for j, dtype in enumerate((F32, BF16, F16)):
                # float16 runs without initial states only on the small shapes below:
                # a zero state makes the gradients outgrow float16 on longer ones
                states = (i + j) % 2 == 0 or dtype == F16
                cases.append(Case(B, T, H, D, chunk, dtype, states=states,
                                  eta_tensor=(i + j) % 3 != 2))
            i += 1
    # every dtype with and without states, eta tensor and float, on one shape
    for dtype in (F32, BF16, F16):
        for states in (True, False):
            for eta_tensor in (True, False):
                cases.append(Case(2, 40, 2, 32, 16, dtype, states, eta_tensor))
    cases.append(Case(2, 40, 2, 32, 16, F32, final_state=False))
    cases.append(Case(1, 24, 2, 16, 16, F64))
    # a head dim that is no multiple of 4: no row of any dtype is 16-byte aligned (the
    # kernels' element-wise paths, e.g. cupy's 4-byte staged row copies)
    for dtype in (F32, BF16):
        cases.append(Case(1, 40, 2, 50, 16, dtype))
    return cases


def _varlen_cases() -> list[Case]:
    cases = []
    for lens, chunk in (((1,), 16), ((5, 16, 1, 33), 16), ((16, 16), 16),
                        ((40, 7, 32), 32), ((3, 64, 70), 64)):
        for dtype in (F32, BF16, F16):
            cases.append(Case(1, sum(lens), 2, 32, chunk, dtype, seq_lens=lens))
    for dtype in (F32, BF16, F16):   # a constant (float) eta on packed batches too
        cases.append(Case(1, 58, 2, 32, 16, dtype, seq_lens=(20, 38), eta_tensor=False))
    cases.append(Case(1, 21, 2, 16, 16, F32, states=False, seq_lens=(9, 12)))
    return cases


def _scale_eps_cases() -> list[Case]:
    """Non-default ``scale`` and ``eps`` for every dtype, dense and packed, with and
    without states: a backend ignoring either (or using one eps for both norms) fails."""
    cases = []
    for dtype in (F32, BF16, F16, F64):
        for seq_lens in (None, (13, 27)):
            for states in (True, False):
                for scale, eps in ((0.3, 1e-2), (1.0, 1e-3)):
                    B = 1 if seq_lens else 2
                    cases.append(Case(B, 40, 2, 32, 16, dtype, states=states,
                                      seq_lens=seq_lens, scale=scale, eps=eps))
    return cases


def _wide_cases() -> list[Case]:
    """Head dim 128 (the widest most kernels take) and 256 on short sequences."""
    return [
        Case(1, 40, 2, 128, 16, F32),
        Case(2, 24, 1, 128, 32, F16),
        Case(1, 70, 2, 128, 64, BF16),
        Case(1, 45, 2, 128, 16, F32, seq_lens=(20, 25), states=False),
        Case(1, 45, 1, 128, 16, BF16, seq_lens=(30, 15), scale=0.3, eps=1e-3),
        Case(1, 64, 1, 256, 16, F32),
        Case(1, 40, 1, 256, 32, BF16),
    ]


def _long_cases() -> list[Case]:
    return [
        Case(2, 2048, 2, 64, 16, F32),
        Case(2, 2048, 2, 64, 16, BF16),
        Case(1, 2048, 2, 64, 64, F16),
        Case(1, 2048, 1, 128, 32, BF16, eta_tensor=False),
        Case(1, 2100, 2, 64, 16, F32, seq_lens=(1000, 1, 1099)),
        Case(1, 2304, 2, 128, 64, BF16, seq_lens=(2200, 104)),
    ]


def _eta_key_output_cases() -> list[Case]:
    """The per-key factor ``eta_key`` and every output form in every dtype, dense and packed
    (partial last chunks), with and without initial states, eta as a tensor and a float."""
    cases = []
    for dtype in (F32, BF16, F16, F64):
        cases += [
            Case(2, 37, 2, 32, 16, dtype, eta_key=True),
            Case(1, 45, 2, 32, 16, dtype, seq_lens=(20, 25), eta_key=True,
                 output="query_residual"),
            Case(2, 37, 2, 32, 16, dtype, states=False, eta_key=True, output="raw"),
            Case(1, 45, 2, 32, 16, dtype, seq_lens=(9, 36), states=False,
                 output="query_residual"),
            Case(1, 45, 2, 32, 16, dtype, seq_lens=(20, 25), eta_tensor=False, eta_key=True,
                 output="raw"),
        ]
    return cases


ORACLE_CASES = (_dense_cases() + _varlen_cases() + _scale_eps_cases() + _wide_cases()
                + _long_cases() + _eta_key_output_cases())
if len({c.id for c in ORACLE_CASES}) != len(ORACLE_CASES):
    raise RuntimeError("ttt.testing: two oracle cases share an id")


@dataclass(frozen=True)
class Variant:
    """What a test asks of one case: which outputs the loss reads (``cotangents``: "both",
    "o" with the final states requested but unused, or "states" with ``o`` unused) and
    which inputs require grad (``grads`` None: every differentiable input)."""

    name: str
    cotangents: str = "both"
    grads: frozenset[str] | None = None

    def applies_to(self, case: Case) -> bool:
        if self.cotangents != "both" and not case.final_state:
            return False
        return all(name in differentiable_names(case) for name in self.grads or ())


VARIANTS = (
    Variant("all"),
    Variant("loss-o-states-unused", cotangents="o"),
    Variant("loss-states-only", cotangents="states"),
    Variant("only-q", grads=frozenset({"q"})),
    Variant("only-eta", grads=frozenset({"eta"})),
    Variant("only-eta-key", grads=frozenset({"eta_key"})),
    Variant("only-states", grads=frozenset(STATE_NAMES)),
    Variant("only-w-b-states-unused", cotangents="o", grads=frozenset({"w", "b"})),
)


ETA_KEY_VARIANTS = ("all", "loss-states-only", "only-eta-key")
"""The variants of the cases with eta_key (besides ``all``: the loss through the final
states only, and eta_key alone requiring grad)."""


def _variant_family() -> list[Case]:
    """Cases run with every variant: each dtype, dense and packed, with and without states,
    a partial last chunk, non-default scale and eps on half of them."""
    family = []
    for dtype in (F32, BF16, F16, F64):
        family += [Case(2, 37, 2, 32, 16, dtype),
                   Case(2, 37, 2, 32, 16, dtype, states=False, scale=0.5, eps=1e-3),
                   Case(1, 45, 2, 32, 16, dtype, seq_lens=(20, 25), scale=1.0, eps=1e-2),
                   Case(1, 45, 2, 32, 16, dtype, seq_lens=(9, 36), states=False)]
    return family


def oracle_params() -> list:
    """(case, variant) parameters: every case with ``all``, the family with every variant,
    the cases with eta_key with ``ETA_KEY_VARIANTS``.
    Params of one case share an xdist group (one oracle computation per worker)."""
    params = []
    family = set(_variant_family())
    for case in ORACLE_CASES + [c for c in _variant_family() if c not in ORACLE_CASES]:
        if case in family:
            variants = VARIANTS
        elif case.eta_key:
            variants = [v for v in VARIANTS if v.name in ETA_KEY_VARIANTS]
        else:
            variants = VARIANTS[:1]
        for variant in variants:
            if variant.applies_to(case):
                marks = [pytest.mark.xdist_group(case.id)]
                if case.big:
                    marks.append(pytest.mark.big)
                params.append(pytest.param(case, variant, id=f"{case.id}-{variant.name}",
                                           marks=marks))
    return params


def differentiable_names(case: Case) -> tuple[str, ...]:
    """The inputs of the case that can have a gradient."""
    names = ["q", "k", "v", "w", "b"]
    if case.eta_tensor:
        names.append("eta")
    if case.eta_key:
        names.append("eta_key")
    if case.states:
        names += list(STATE_NAMES)
    return tuple(names)


def make_inputs(case: Case, device, seed: int = 0) -> dict:
    """Fresh random inputs in the case's dtype (never zeros); keys as the op's arguments."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, D, dt = case.B, case.T, case.H, case.D, case.dtype

    def rand(*shape, scale=1.0, offset=0.0, uniform=False):
        x = torch.rand(*shape, generator=g, dtype=F64) if uniform else \
            torch.randn(*shape, generator=g, dtype=F64)
        return (offset + scale * x)

    # d eta outgrows float16's range (65504) with a zero initial state (the first chunk's
    # LayerNorm sees constant rows: rstd = eps ** -0.5) and on long sequences (it sums
    # over everything after the token): keep eta float32 there, as mixed-precision models do.
    eta_dtype = F32 if (dt == F16 and (not case.states or case.big)) else dt
    q = rand(B, T, H, D)
    k = rand(B, T, H, D)
    k = k / k.norm(dim=-1, keepdim=True)
    inputs = dict(
        q=q.to(dt), k=k.to(dt), v=rand(B, T, H, D).to(dt),
        w=rand(H, D, scale=0.1, offset=1.0).to(dt), b=rand(H, D, scale=0.1).to(dt),
        eta=rand(B, T, H, 1, scale=0.1, uniform=True).to(eta_dtype) if case.eta_tensor else 0.05,
        chunk_size=case.chunk, output_final_state=case.final_state,
    )
    if case.eta_key:   # positive, around 1, never ones: a backend ignoring it fails
        inputs["eta_key"] = rand(B, T, H, 1, scale=1.0, offset=0.5, uniform=True).to(eta_dtype)
    if case.output != OUTPUT_FORMS[0]:
        inputs["output"] = case.output
    if case.scale is not None:
        inputs["scale"] = case.scale
    if case.eps != DEFAULT_EPS:
        inputs["eps"] = case.eps
    if case.states:
        inputs["initial_state"] = rand(case.N, H, D, D, scale=0.1).to(case.state_dtype)
        inputs["initial_state_bias"] = rand(case.N, H, 1, D, scale=0.1).to(case.state_dtype)
    if case.seq_lens:
        offsets = [0]
        for n in case.seq_lens:
            offsets.append(offsets[-1] + n)
        inputs["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def with_requires_grad(inputs: dict, names=GRAD_INPUTS) -> dict:
    """Copies of the inputs; the floating tensors named in ``names`` require grad."""
    out = dict(inputs)
    for name in GRAD_INPUTS:
        t = inputs.get(name)
        if isinstance(t, torch.Tensor):
            out[name] = t.detach().clone().requires_grad_(name in names)
    return out


def differentiable(inputs: dict) -> dict:
    """Copies of the inputs with requires_grad set on every floating tensor."""
    return with_requires_grad(inputs)


def grad_leaves(inputs: dict) -> list[tuple[str, torch.Tensor]]:
    return [(n, inputs[n]) for n in GRAD_INPUTS
            if isinstance(inputs.get(n), torch.Tensor) and inputs[n].requires_grad]


def segment_spans(case: Case) -> list[tuple[int, int, int]]:
    """(batch row, start, stop) of every sequence of the case."""
    if not case.seq_lens:
        return [(row, 0, case.T) for row in range(case.B)]
    spans, start = [], 0
    for length in case.seq_lens:
        spans.append((0, start, start + length))
        start += length
    return spans


def chunk_spans(case: Case) -> list[tuple[int, int, int]]:
    """(batch row, start, stop) of every chunk of every sequence (a partial last one too)."""
    return [(row, s, min(s + case.chunk, stop)) for row, start, stop in segment_spans(case)
            for s in range(start, stop, case.chunk)]
