"""Every kernel instance compiles with NVRTC for sm_80 and sm_90 (no GPU, no driver needed).

Needs cuda-python and the NVRTC wheel: pip install './packages/ttt-cupy[compile-check]'.
"""

from __future__ import annotations

import io

import pytest


def _nvrtc_available() -> str | None:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        try:
            from cuda import nvrtc  # noqa: F401
        except ImportError:
            return ("cuda-python is not installed "
                    "(pip install './packages/ttt-cupy[compile-check]')")
    return None


@pytest.mark.skipif(_nvrtc_available() is not None, reason=str(_nvrtc_available()))
def test_every_instance_compiles_for_sm80_and_sm90():
    from ttt_cupy import nvrtc_check
    from ttt_cupy.compile import BLOCK_TS, CTYPES, D_PADS

    out = io.StringIO()
    try:
        counts = nvrtc_check.run(("80", "90"), out=out)
    except nvrtc_check.CheckError as err:
        pytest.fail(f"NVRTC compile failed:\n{err}\n{out.getvalue()}")
    expected = 2 * len(CTYPES) * len(D_PADS) * len(BLOCK_TS)
    assert counts == {"80": expected, "90": expected}, out.getvalue()


def test_name_expressions_and_smem_formula():
    """No NVRTC needed: names and the shared-memory budget the launcher relies on."""
    from ttt_cupy.compile import d_pad, kernel_name, smem_bytes, threads

    assert kernel_name("fwd", "__half", 64, 16) == "ttt_linear_fwd<__half, 64, 16>"
    assert [d_pad(d) for d in (1, 16, 17, 64, 100, 128)] == [16, 16, 32, 64, 128, 128]
    assert threads(128) == 256 and threads(32) == 128
    h200 = 227 * 1024
    assert smem_bytes("fwd", 128, 64) <= h200
    assert smem_bytes("bwd", 128, 16) <= h200
    assert smem_bytes("bwd", 128, 32) > h200
    assert smem_bytes("bwd", 64, 64) <= h200
    with pytest.raises(ValueError):
        d_pad(129)
