"""Cases, inputs and comparisons of the conformance suite (shared by its test files)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

import ttt
from ttt.testing.oracle import oracle_chunk_ttt_linear
from ttt.testing.tolerances import TOLERANCES  # noqa: F401 - the suite imports it from here

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
DTYPE_NAMES = {F32: "fp32", BF16: "bf16", F16: "fp16", F64: "fp64"}


GRAD_NAMES = ("q", "k", "v", "w", "b", "eta", "initial_state", "initial_state_bias")


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

    @property
    def big(self) -> bool:
        return self.T >= 2048 or self.D >= 128

    @property
    def id(self) -> str:
        shape = (f"varlen{list(self.seq_lens)}".replace(" ", "") if self.seq_lens
                 else f"B{self.B}")
        return (f"{shape}-T{self.T}-H{self.H}-D{self.D}-c{self.chunk}-"
                f"{DTYPE_NAMES[self.dtype]}{'-h0' if self.states else ''}"
                f"{'-etaT' if self.eta_tensor else '-etaF'}"
                f"{'' if self.final_state else '-nofinal'}")

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
            cases.append(Case(1, sum(lens), 2, 32, chunk, dtype, seq_lens=lens,
                              eta_tensor=dtype != BF16))
    cases.append(Case(1, 21, 2, 16, 16, F32, states=False, seq_lens=(9, 12)))
    return cases


def _big_cases() -> list[Case]:
    return [
        Case(2, 2048, 2, 64, 16, F32),
        Case(2, 2048, 2, 64, 16, BF16),
        Case(1, 2048, 2, 64, 64, F16),
        Case(1, 100, 2, 128, 16, F32),
        Case(2, 300, 2, 128, 64, BF16),
        Case(1, 2048, 1, 128, 32, BF16, eta_tensor=False),
        Case(1, 2100, 2, 64, 16, F32, seq_lens=(1000, 1, 1099)),
        Case(1, 64, 1, 256, 16, F32),
        Case(1, 96, 2, 256, 32, BF16),
    ]


ORACLE_CASES = _dense_cases() + _varlen_cases() + _big_cases()


def make_inputs(case: Case, device, seed: int = 0) -> dict:
    """Fresh random inputs in the case's dtype (never zeros); keys as the op's arguments."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, T, H, D, dt = case.B, case.T, case.H, case.D, case.dtype
    N = len(case.seq_lens) if case.seq_lens else B

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
    state_dt = F64 if dt == F64 else F32
    if case.states:
        inputs["initial_state"] = rand(N, H, D, D, scale=0.1).to(state_dt)
        inputs["initial_state_bias"] = rand(N, H, 1, D, scale=0.1).to(state_dt)
    if case.seq_lens:
        offsets = [0]
        for n in case.seq_lens:
            offsets.append(offsets[-1] + n)
        inputs["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def differentiable(inputs: dict) -> dict:
    """Copies of the floating tensor inputs with requires_grad set."""
    out = dict(inputs)
    for name in GRAD_NAMES:
        t = inputs.get(name)
        if isinstance(t, torch.Tensor):
            out[name] = t.detach().clone().requires_grad_(True)
    return out


def grad_leaves(inputs: dict) -> list[tuple[str, torch.Tensor]]:
    return [(n, inputs[n]) for n in GRAD_NAMES
            if isinstance(inputs.get(n), torch.Tensor) and inputs[n].requires_grad]


def skip_unless_supported(backend: ttt.Backend, inputs: dict, requires_grad: bool = True):
    """Skip with the backend's own reasons when it declares these inputs unsupported."""
    args = {k: v for k, v in inputs.items()}
    args.setdefault("scale", None)
    args.setdefault("eps", 1e-6)
    with torch.set_grad_enabled(requires_grad):
        probe = {k: (v.detach().requires_grad_(requires_grad)
                     if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                 for k, v in args.items()}
        problem = ttt.make_problem(**probe)
    reasons = backend.not_supported_reasons(problem)
    if reasons:
        pytest.skip(f"{backend.name} declares: {'; '.join(reasons)}")


def run_op(backend_name: str, inputs: dict):
    return ttt.chunk_ttt_linear(**inputs, backend=backend_name)


def run_oracle(inputs: dict):
    """The oracle on float64 copies of the same (already dtype-rounded) inputs."""
    args = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().to(F64).requires_grad_(value.requires_grad)
        args[name] = value
    args.pop("output_final_state", None)
    return args, oracle_chunk_ttt_linear(**args)


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().to(F64), ref.detach().to(F64)
    if x.shape != ref.shape:
        raise AssertionError(f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}")
    denom = ref.norm().item()
    err = (x - ref).norm().item()
    return err / denom if denom > 0 else err


def check_close(label: str, x: torch.Tensor | None, ref: torch.Tensor, tol: float,
                failures: list[str]):
    if x is None:
        failures.append(f"{label}: missing (None)")
        return
    if not torch.isfinite(x).all():
        failures.append(f"{label}: non-finite values")
        return
    err = rel_error(x, ref)
    if not err <= tol:
        failures.append(f"{label}: relative error {err:.3e} > {tol:.0e}")
