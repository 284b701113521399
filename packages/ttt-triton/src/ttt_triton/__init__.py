"""ttt-triton: Triton kernels (forward and backward) for ttt's chunked TTT-linear.

Importing this package is cheap: it imports neither triton nor CUDA. The backend class
lives in :mod:`ttt_triton.backend`; kernels load on first use.
"""

__version__ = "0.1.0"
