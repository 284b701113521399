"""What gets benchmarked: every ttt backend that runs here, and FLA when it is installed.

A provider is a name and a function ``(q, k, v, w, b, eta) -> o`` with chunk size fixed.
``support(...)`` says, before anything runs, why a provider cannot take a problem.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import ttt

FLA_VARIANTS = {
    "fla.fused_chunk": "fused_chunk_ttt_linear",
    "fla.chunk": "chunk_ttt_linear",
}
FLA_INSTALL_HINT = "pip install fla-core einops"
SLOW_BACKENDS = ("reference",)   # benchmarked only when named in --backends

OpFn = Callable[..., torch.Tensor]


@dataclass
class Provider:
    name: str
    kind: str                                   # "ttt" or "fla"
    fn: OpFn                                    # (q, k, v, w, b, eta) -> o
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def is_fla(self) -> bool:
        return self.kind == "fla"

    def support(self, q, k, v, w, b, eta, chunk_size: int) -> str | None:
        """Why this provider cannot take these inputs (None: it can, as far as we know)."""
        if self.kind != "ttt":
            if q.shape[-1] > 128:
                return "head dim above 128 is refused by FLA"
            return None
        backend_name = self.name.removeprefix("ttt.")
        make_problem = getattr(ttt, "make_problem", None)
        if make_problem is None:     # an older ttt (a compare.py base): the call will say
            return None
        problem = make_problem(q, k, v, w, b, eta, chunk_size=chunk_size)
        reasons = ttt.load_backend(backend_name).not_supported_reasons(problem)
        return "; ".join(reasons) if reasons else None


def _ttt_provider(name: str, chunk_size: int, versions: dict[str, str]) -> Provider:
    def fn(q, k, v, w, b, eta):
        return ttt.chunk_ttt_linear(q, k, v, w, b, eta, chunk_size=chunk_size, backend=name)[0]

    return Provider(f"ttt.{name}", "ttt", fn, dict(versions))


def fla_version() -> str | None:
    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import fla

        return str(getattr(fla, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - only a version string
        return None


def _fla_providers(chunk_size: int) -> tuple[list[Provider], str | None]:
    """FLA's two variants, or ([], why FLA is absent)."""
    try:
        module = importlib.import_module("fla.ops.ttt")
    except Exception as exc:  # noqa: BLE001 - absent or broken: both are a report line
        return [], f"{type(exc).__name__}: {exc} (install with: {FLA_INSTALL_HINT})"
    version = fla_version() or "unknown"
    providers = []
    for name, attribute in FLA_VARIANTS.items():
        op = getattr(module, attribute, None)
        if op is None:
            continue

        def fn(q, k, v, w, b, eta, _op=op):
            return _op(q, k, v, w, b, eta, chunk_size=chunk_size)[0]

        providers.append(Provider(name, "fla", fn, {"fla-core": version}))
    if not providers:
        return [], f"fla.ops.ttt has none of {sorted(FLA_VARIANTS.values())}"
    return providers, None


@dataclass
class Discovery:
    providers: list[Provider]
    skipped: dict[str, str]        # provider or backend name -> why it is not benchmarked
    fla_absent: str | None         # why FLA is not benchmarked (None: it is)


def discover(requested: list[str] | None, chunk_size: int) -> Discovery:
    """Providers to run. ``requested`` None: all available ttt backends but the slow ones,
    plus both FLA variants. Names: a ttt backend (``triton`` or ``ttt.triton``), ``fla``
    (both variants), ``fla.fused_chunk``, ``fla.chunk``, ``all`` (everything, slow included).
    """
    statuses = ttt.available_backends()
    want_all = requested is not None and "all" in requested
    if requested is None or want_all:
        ttt_names = [n for n in statuses if want_all or n not in SLOW_BACKENDS]
        fla_names = list(FLA_VARIANTS)
    else:
        ttt_names, fla_names = [], []
        for raw in requested:
            name = raw.strip()
            if name == "fla":
                fla_names.extend(FLA_VARIANTS)
            elif name in FLA_VARIANTS:
                fla_names.append(name)
            elif name:
                ttt_names.append(name.removeprefix("ttt."))

    providers: list[Provider] = []
    skipped: dict[str, str] = {}
    for name in dict.fromkeys(ttt_names):
        status = statuses.get(name)
        if status is None:
            skipped[f"ttt.{name}"] = (f"unknown backend (known: {sorted(statuses)}; "
                                      f"FLA: fla, {', '.join(FLA_VARIANTS)})")
        elif not status.available:
            skipped[f"ttt.{name}"] = status.reason or "unavailable"
        else:
            providers.append(_ttt_provider(name, chunk_size, status.versions))

    fla_absent = None
    if fla_names:
        found, fla_absent = _fla_providers(chunk_size)
        for name in dict.fromkeys(fla_names):
            match = [p for p in found if p.name == name]
            if match:
                providers.extend(match)
            elif fla_absent is None:
                skipped[name] = "not in this fla version"
    else:
        fla_absent = "not requested (--backends)"
    return Discovery(providers, skipped, fla_absent)
