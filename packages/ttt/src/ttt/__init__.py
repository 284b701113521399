"""ttt: chunked TTT-Linear and TTT-MLP for PyTorch, with pluggable backends.

``ttt.chunk_ttt_linear(q, k, v, w, b, eta, ...)`` (and ``ttt.chunk_ttt_mlp``) runs on the
active backend (``ttt.set_backend``, ``TTT_BACKEND``, or the best installed one for the
inputs); ``ttt.register_backend`` adds a backend in this process.
Importing ttt touches no GPU and compiles nothing.
"""

from .arguments import Gradients, GradNeeds
from .backend import Backend, Capabilities, WarmupShape
from .choice import get_backend, set_backend
from .errors import (
    BackendError,
    BackendNotInstalledError,
    BackendNotSupportedError,
    BackendUnavailableError,
    UnknownBackendError,
)
from .mlp import chunk_ttt_mlp
from .ops import chunk_ttt_linear
from .problem import Problem
from .registry import KNOWN_BACKENDS, load_backend, register_backend, unregister_backend
from .status import available_backends
from .validation import make_problem
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "Backend", "BackendError", "BackendNotInstalledError", "BackendNotSupportedError",
    "BackendUnavailableError", "Capabilities", "Gradients", "GradNeeds", "KNOWN_BACKENDS",
    "Problem", "UnknownBackendError", "WarmupShape", "available_backends", "chunk_ttt_linear",
    "chunk_ttt_mlp", "get_backend", "load_backend", "make_problem", "register_backend",
    "set_backend", "unregister_backend", "warmup", "__version__",
]
