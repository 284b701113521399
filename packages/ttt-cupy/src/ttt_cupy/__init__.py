"""ttt-cupy: the ``cupy`` backend of ttt (raw CUDA C++ through CuPy/NVRTC)."""

__version__ = "0.1.0"
