"""Every kernel instance compiles with NVRTC for sm_80 and sm_90 (no GPU, no driver needed),
through the compile check ``tools/nvrtc_check.py`` (imported from the repository root).

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
def test_a_compile_with_an_empty_log_leaves_the_interpreter_intact():
    """NVRTC writes its log (here only the terminating NUL) into a buffer we hand it; a
    one-byte ``b" "`` would be CPython's shared object, and every ``" ".encode()`` of the
    process would then give ``b"\\x00"``."""
    from tools import nvrtc_check

    code = 'extern "C" __global__ void empty_log_kernel() {}'
    compiled = nvrtc_check.compile_instance(code, [], "90", [], cubin=False)
    assert compiled.log == ""
    assert chr(0x20).encode()[0] == 0x20   # the shared one-byte object is still a space


EVERY_INSTANCE = [(arch, pass_, dtype) for arch in ("90", "80") for pass_ in ("bwd", "fwd", "dec")
                  for dtype in ("bfloat16", "float16", "float32")]
"""The parts of the full check, (arch, pass, dtype), one test each (sm_90 and the backward
first: the longest), so that pytest-xdist spreads them over its workers."""

ONE_SHAPE = dict(d_pads=[64], block_ts=[16])
ONE_SHAPE_PARTS = [("80", "bfloat16"), ("80", "float16"), ("80", "float32"), ("90", "float16")]
"""The parts of the full check that are ``big`` (GPU runs include them) are compiled at one
shape on CPU: sm_80, whose source differs from sm_90's only where ``__CUDA_ARCH__ >= 800``,
the same side for both; and sm_90's float16 forward and backward, the bfloat16 templates with
another T (its ``dec`` pass, and every other variant of it at one shape, stay in full)."""


def _every_instance_params():
    return [pytest.param(arch, pass_, dtype, id=f"sm{arch}-{pass_}-{dtype}",
                         marks=[pytest.mark.big] if (arch, dtype) in ONE_SHAPE_PARTS
                         and (arch, pass_) != ("90", "dec") else [])
            for arch, pass_, dtype in EVERY_INSTANCE]


def _instances(pass_: str, dtype: str) -> int:
    """The kernel instances of one pass and dtype at every (D_PAD, BT): the pass's kernels (+
    the fused forward chain), x 2 for the half types (their SIMT instances too, TTT_CUPY_MMA=0),
    + the half types' fused backward chain at D_PAD <= 64; the ``dec`` pass: fwd_decode once
    per D_PAD (no BT, SIMT only), twice for the half types (eta, w, b, eta_key in fp32 or in
    the input type: native_params)."""
    from ttt_cupy.compile import BLOCK_TS, D_PADS, DECODE_PASS, FUSED_BWD_MAX_D_PAD, PASSES

    half = dtype != "float32"
    if pass_ == DECODE_PASS:
        return len(D_PADS) * (2 if half else 1)
    per_shape = (len(PASSES[pass_]) + (pass_ == "fwd")) * (2 if half else 1)
    fused_bwd = sum(dp <= FUSED_BWD_MAX_D_PAD for dp in D_PADS) if pass_ == "bwd" and half else 0
    return (per_shape * len(D_PADS) + fused_bwd) * len(BLOCK_TS)


def _names(pass_: str, dtype: str) -> list[str]:
    """The name expressions of every instance of one pass and dtype, as the backend builds
    them (nvrtc_check.programs, the default variant)."""
    from tools import nvrtc_check

    only = dict(passes=[pass_], dtypes=[dtype])
    return [name for _, names in nvrtc_check.programs(only) for name in names]


def test_every_instance_is_in_a_part():
    """No NVRTC needed: the parts of test_every_instance_compiles cover every (arch, pass,
    dtype); each part's instances as the backend names them are distinct and as many as
    _instances counts, and together they are every instance of the default variant."""
    from tools import nvrtc_check
    from ttt_cupy.compile import CTYPES, PASSES

    assert sorted(EVERY_INSTANCE) == sorted((arch, pass_, dtype) for arch in ("80", "90")
                                            for pass_ in PASSES for dtype in CTYPES)
    parts = {(pass_, dtype): _names(pass_, dtype) for pass_ in PASSES for dtype in CTYPES}
    for (pass_, dtype), names in parts.items():
        assert len(set(names)) == len(names) == _instances(pass_, dtype), (pass_, dtype)
    every = [name for _, names in nvrtc_check.programs() for name in names]
    assert sorted(every) == sorted(name for names in parts.values() for name in names)


@pytest.mark.skipif(_nvrtc_available() is not None, reason=str(_nvrtc_available()))
@pytest.mark.parametrize(("arch", "pass_", "dtype"), _every_instance_params())
def test_every_instance_compiles(arch, pass_, dtype):
    """Every instance of the pass for the dtype, at every (D_PAD, BT): for sm_90 (the H200
    this backend is tuned on) through ptxas to cubins; for sm_80 to PTX for compute_80 (the
    front end and code generation under __CUDA_ARCH__ 800, where the arch-specific source
    differs; its ptxas run would add about 2 minutes to CI)."""
    from tools import nvrtc_check

    out = io.StringIO()
    try:
        counts = nvrtc_check.run((arch,), jobs=1, out=out, ptx_only=("80",),
                                 only=dict(passes=[pass_], dtypes=[dtype]))
    except nvrtc_check.CheckError as err:
        pytest.fail(f"NVRTC compile failed:\n{err}\n{out.getvalue()}")
    assert counts == {arch: _instances(pass_, dtype)}, out.getvalue()


@pytest.mark.skipif(_nvrtc_available() is not None, reason=str(_nvrtc_available()))
@pytest.mark.parametrize(("arch", "dtype"), ONE_SHAPE_PARTS,
                         ids=[f"sm{a}-{d}" for a, d in ONE_SHAPE_PARTS])
def test_every_kernel_compiles_at_one_shape(arch, dtype):
    """Every kernel of every pass, tensor-core and SIMT, at D_PAD 64 and chunk 16, for the
    ``big`` parts of test_every_instance_compiles (ONE_SHAPE_PARTS): to PTX for compute_80,
    through ptxas to a cubin for sm_90."""
    from tools import nvrtc_check

    out = io.StringIO()
    try:
        counts = nvrtc_check.run((arch,), jobs=1, out=out, ptx_only=("80",),
                                 only=dict(dtypes=[dtype], **ONE_SHAPE))
    except nvrtc_check.CheckError as err:
        pytest.fail(f"NVRTC compile failed:\n{err}\n{out.getvalue()}")
    # fwd: fwd_chain, fwd_out, the fused chain; bwd: bwd_local, bwd_chain, bwd_grads (+ the
    # half types' fused chain); dec: fwd_decode; x 2 for the half types (their SIMT and
    # native_params instances)
    expected = 3 + 3 + 1 if dtype == "float32" else 2 * (3 + 3 + 1) + 1
    assert counts == {arch: expected}, out.getvalue()


VARIANT_SHAPES = {  # id: (the programs, compiled through ptxas to a cubin)
    "float16-dpad64-chunk16": (dict(dtypes=["float16"], d_pads=[64], block_ts=[16]), True),
    "float32-dpad128-chunk64": (dict(dtypes=["float32"], d_pads=[128], block_ts=[64]), False),
    "bfloat16-dpad128-chunk64": (dict(dtypes=["bfloat16"], d_pads=[128], block_ts=[64]), False),
}


@pytest.mark.skipif(_nvrtc_available() is not None, reason=str(_nvrtc_available()))
@pytest.mark.parametrize("shape", list(VARIANT_SHAPES))
def test_variant_instances_compile(shape):
    """The instances of eta_key (KEY) and the output forms (OUT), built only when a call needs
    them: every kernel of both passes, tensor-core and SIMT, of every other variant, each
    instance once (nvrtc_check.programs; those the default variant has too compile in
    test_every_instance_compiles), at a fused-chain shape (D_PAD 64, chunk 16: float16)
    through ptxas to a cubin for sm_90, and at the split bwd_grads one (D_PAD 128, chunk 64:
    float32, bfloat16) to PTX for compute_90; the tf32 mma.sync where expected."""
    from tools import nvrtc_check
    from tools.nvrtc_check import variants

    only, cubin = VARIANT_SHAPES[shape]
    out = io.StringIO()
    try:
        counts = nvrtc_check.run(("90",), jobs=1, out=out, ptx_only=() if cubin else ("90",),
                                 only=only, variants=variants()[1:], skip_default=True)
    except nvrtc_check.CheckError as err:
        pytest.fail(f"NVRTC compile failed:\n{err}\n{out.getvalue()}")
    # a pass's instances that the default variant lacks: fwd_chain with KEY, fwd_out with
    # each other OUT, the fused chain with each other (KEY, OUT); bwd_local with each other
    # OUT, bwd_chain and bwd_grads with KEY (+ the half types' fused backward chain with KEY
    # at D_PAD <= 64); x 2 for the half types (their SIMT instances too); fwd_decode with
    # each other (KEY, OUT) (no BT: in every chunk's selection; SIMT only; x 2 for the half
    # types: the native_params instances too)
    fwd, bwd, dec = 1 + 2 + 5, 2 + 1 + 1, 5
    expected = {"float16-dpad64-chunk16": 2 * (fwd + bwd + dec) + 1,
                "float32-dpad128-chunk64": fwd + bwd + dec,
                "bfloat16-dpad128-chunk64": 2 * (fwd + bwd + dec)}[shape]
    assert counts == {"90": expected}, out.getvalue()


@pytest.mark.skipif(_nvrtc_available() is not None, reason=str(_nvrtc_available()))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_decode_instances_compile(dtype):
    """fwd_decode (the ``dec`` pass) of every variant (eta_key, each output form) at every
    D_PAD, through ptxas to cubins for sm_90 (its default variant for sm_80 is in
    test_every_instance_compiles), for the half types both instances (eta, w, b, eta_key in
    fp32, and in the input type: native_params); no tf32 mma.sync in any (SIMT fp32)."""
    from tools import nvrtc_check
    from tools.nvrtc_check import variants
    from ttt_cupy.compile import D_PADS

    out = io.StringIO()
    try:
        counts = nvrtc_check.run(("90",), jobs=1, out=out,
                                 only=dict(passes=["dec"], dtypes=[dtype]), variants=variants())
    except nvrtc_check.CheckError as err:
        pytest.fail(f"NVRTC compile failed:\n{err}\n{out.getvalue()}")
    per_variant = len(D_PADS) * (1 if dtype == "float32" else 2)
    assert counts == {"90": per_variant * len(variants())}, out.getvalue()
    assert "0 with tf32 mma.sync" in out.getvalue()


def test_decode_names():
    """No NVRTC needed: fwd_decode's names (``<T, D_PAD, KEY, OUT, P>``, trailing defaults
    left out: P = float unless native_params, where it is T), the ``dec`` pass's table and
    programs whatever BT and mma (both P for the half types), and the compile check's
    selection of its programs (no BT: in every chunk's)."""
    from tools.nvrtc_check import instances, is_mma_instance, program_names
    from ttt_cupy.compile import DECODE_KERNEL, DECODE_PASS, decode_name, kernel_name, pass_names

    assert decode_name("float", 64) == "ttt_linear_fwd_decode<float, 64>"
    assert decode_name("__half", 32, key=True) == "ttt_linear_fwd_decode<__half, 32, true>"
    assert decode_name("__nv_bfloat16", 128, out="raw") == \
        "ttt_linear_fwd_decode<__nv_bfloat16, 128, false, 2>"
    assert decode_name("float", 16, True, "query_residual") == \
        "ttt_linear_fwd_decode<float, 16, true, 1>"
    assert kernel_name(DECODE_KERNEL, "__half", 64, 16) == decode_name("__half", 64)
    with pytest.raises(ValueError, match="MMA"):
        kernel_name(DECODE_KERNEL, "__half", 64, 16, True)
    for bt in (16, 64):
        for mma in (False, True):
            assert pass_names(DECODE_PASS, "__half", 64, bt, mma, True, "raw") == {
                DECODE_KERNEL: "ttt_linear_fwd_decode<__half, 64, true, 2>"}
    assert decode_name("__half", 64, native_params=True) == \
        "ttt_linear_fwd_decode<__half, 64, false, 0, __half>"
    assert decode_name("__nv_bfloat16", 32, True, "raw", True) == \
        "ttt_linear_fwd_decode<__nv_bfloat16, 32, true, 2, __nv_bfloat16>"
    assert decode_name("float", 64, native_params=True) == decode_name("float", 64)
    assert kernel_name(DECODE_KERNEL, "__half", 64, 16, native_params=True) == \
        decode_name("__half", 64, native_params=True)
    with pytest.raises(ValueError, match="native_params"):
        kernel_name("fwd_chain", "__half", 64, 16, native_params=True)
    with pytest.raises(ValueError, match="native_params"):
        pass_names("fwd", "__half", 64, 16, True, native_params=True)
    assert pass_names(DECODE_PASS, "__half", 64, 16, False, native_params=True) == {
        DECODE_KERNEL: decode_name("__half", 64, native_params=True)}
    assert program_names(DECODE_PASS, "__half", 64, 16) == [
        decode_name("__half", 64), decode_name("__half", 64, native_params=True)]
    assert program_names(DECODE_PASS, "float", 64, 16, True) == [decode_name("float", 64, True)]
    assert not is_mma_instance("ttt_linear_fwd_decode<__half, 64, true, 2>")
    assert instances(passes=[DECODE_PASS], dtypes=["float32"], block_ts=[64]) == [
        (DECODE_PASS, "float", dp, 0) for dp in (16, 32, 64, 128)]
    with pytest.raises(ValueError, match="output"):
        decode_name("float", 64, out="residual")


def test_variant_names():
    """No NVRTC needed: the variant's template arguments, only where a kernel takes them, the
    default variant's names unchanged, and the programs of the variants' compile check."""
    from tools.nvrtc_check import program_names
    from ttt_cupy.compile import kernel_name, pass_names

    assert kernel_name("fwd_out", "float", 32, 16, out="raw") == \
        "ttt_linear_fwd_out<float, 32, 16, false, 2>"
    assert kernel_name("fwd_chain", "__half", 64, 16, key=True) == \
        "ttt_linear_fwd_chain<__half, 64, 16, true, false, true>"
    assert kernel_name("fwd_chain", "__half", 64, 16, out="raw") == \
        "ttt_linear_fwd_chain<__half, 64, 16, true>"   # (the unfused chain writes no output)
    assert kernel_name("fwd_chain", "float", 64, 16, fused=True, out="query_residual") == \
        "ttt_linear_fwd_chain<float, 64, 16, false, true, false, 1>"
    assert kernel_name("bwd_grads", "float", 64, 16, key=True, out="raw") == \
        "ttt_linear_bwd_grads<float, 64, 16, false, true>"
    assert kernel_name("bwd_local", "float", 64, 16, key=True) == \
        "ttt_linear_bwd_local<float, 64, 16, false>"
    assert pass_names("bwd", "__half", 32, 16, True, key=True)["bwd_chain_fused"] == \
        "ttt_linear_bwd_chain_fused<__half, 32, 16, true, true>"
    assert program_names("fwd", "__half", 16, 16, False, "norm_residual") == \
        program_names("fwd", "__half", 16, 16)
    # every variant's instances once; with skip_default, without the default's
    from tools.nvrtc_check import programs, variants

    only = dict(dtypes=["float16"], d_pads=[64], block_ts=[16])
    every = programs(only, variants())
    others = programs(only, variants()[1:], skip_default=True)
    assert [p for p, _ in every] == [p for p, _ in others] == [("fwd", "__half", 64, 16),
                                                               ("bwd", "__half", 64, 16),
                                                               ("dec", "__half", 64, 0)]
    for (program, names), (_, new) in zip(every, others):
        assert len(set(names)) == len(names) and len(set(new)) == len(new)
        assert set(names) == {n for v in variants() for n in program_names(*program, *v)}
        assert set(new) == set(names) - set(program_names(*program))
    assert programs(only) == [(p, program_names(*p)) for p, _ in every]
    with pytest.raises(ValueError, match="output"):
        kernel_name("fwd_out", "float", 32, 16, out="residual")


def test_name_expressions_and_smem_formula():
    """No NVRTC needed: names and the shared-memory budget the launcher relies on."""
    from ttt_cupy.compile import KERNELS, PASSES, d_pad, kernel_name
    from ttt_cupy.smem import grads_split, pass_smem, smem_bytes, threads, traits, traits_field

    assert KERNELS == ("fwd_chain", "fwd_out", "bwd_local", "bwd_chain", "bwd_grads")
    assert kernel_name("fwd_out", "__half", 64, 16) == "ttt_linear_fwd_out<__half, 64, 16, true>"
    assert traits_field("bwd_grads") == "kBwdGradsBytes"
    assert [d_pad(d) for d in (1, 16, 17, 60, 64, 96, 100, 128)] == [16, 16, 32, 64, 64, 128,
                                                                     128, 128]
    assert threads(128) == 256 and threads(32) == 128
    # the register-resident MMA chain: a warp per 16 state columns; other kernels unchanged
    assert [threads(dp, "fwd_chain", True) for dp in (16, 32, 64, 128)] == [32, 64, 128, 256]
    assert threads(64, "fwd_chain", False) == threads(64, "fwd_out", True) == 256
    assert [threads(dp, "bwd_chain", True) for dp in (16, 32, 64, 128)] == [32, 64, 128, 256]
    assert traits_field("fwd_chain", True) == "kFwdChainTcBytes"
    assert traits_field("fwd_chain", True, fused=True) == "kFwdChainFusedTcBytes"
    assert traits_field("fwd_chain", fused=True) == "kFwdChainFusedBytes"
    # the fused forward chain: SIMT with fwd_out's tiles; MMA the unfused one's + Q (double),
    # A, eta (double), one more round of per-warp statistics
    for dp, bt in ((16, 16), (64, 16), (128, 64)):
        assert smem_bytes("fwd_chain", dp, bt, fused=True) == smem_bytes("fwd_out", dp, bt)
        tile, square = bt * (dp + 1), bt * (bt + 1)
        assert smem_bytes("fwd_chain", dp, bt, True, fused=True) == smem_bytes(
            "fwd_chain", dp, bt, True) + 4 * (2 * tile + square + 2 * bt + 2 * (dp // 16) * bt)
    assert smem_bytes("fwd_chain", 128, 64, True, fused=True) == 227584
    # the backward chain's stage (cp.async rows): [BT, D_PAD + 4] floats for each of 6 arrays
    # and r, only where the block stays within an A100's 163 KiB; chunk 16 at every head dim
    h200, a100 = 227 * 1024, 163 * 1024
    assert smem_bytes("bwd_chain", 64, 16, True) == 4 * (4 * 16 * 65 + 12 * 4 * 16
                                                         + 6 * 16 * 68 + 16)
    staged = [(dp, bt) for dp in (16, 32, 64, 128) for bt in (16, 32, 64)
              if traits(dp, bt)["kBwdChainStage"]]
    assert len(staged) == 9 and all(bt < 64 or dp < 64 for dp, bt in staged)
    assert all(smem_bytes("bwd_chain", dp, bt, True) <= a100 for dp, bt in staged)
    with pytest.raises(ValueError, match="fused"):
        smem_bytes("fwd_out", 64, 16, fused=True)
    # an H100/H200 takes every (D_PAD, BT) both ways; an A100 no backward at D_PAD 128 and no
    # forward at (128, 64)
    for dp in (16, 32, 64, 128):
        for bt in (16, 32, 64):
            for pass_ in ("fwd", "bwd"):
                assert pass_smem(pass_, dp, bt)[1] <= h200
            assert (pass_smem("bwd", dp, bt)[1] <= a100) == (dp < 128)
            assert (pass_smem("fwd", dp, bt)[1] <= a100) == ((dp, bt) != (128, 64))
    # (128, 64): bwd_grads split over two blocks per (group, head), each with half the state
    assert [grads_split(dp, bt) for dp in (64, 128) for bt in (16, 32, 64)] == [1] * 5 + [2]
    assert smem_bytes("bwd_grads", 128, 64) == 4 * (2 * 64 * 129 + 2 * 64 * 65 + 3 * 64 * 129
                                                    + 64 * 65 + 64)
    assert smem_bytes("bwd_grads", 128, 32) == 4 * (2 * 128 * 129 + 5 * 32 * 129 + 32 * 33 + 32)
    assert pass_smem("bwd", 128, 64) == ("bwd_local", 232192)
    assert max(smem_bytes(k, 128, 32) for k in PASSES["bwd"]) <= h200
    with pytest.raises(ValueError, match="head dim"):
        d_pad(129)
    with pytest.raises(ValueError, match="kernel"):
        smem_bytes("fwd", 64, 16)


def test_mma_instances_and_switch(monkeypatch):
    """No NVRTC needed: which instance of each kernel runs for which dtype, and TTT_CUPY_MMA."""
    from tools.nvrtc_check import is_mma_instance, program_names
    from ttt_cupy.compile import kernel_name, pass_names, use_mma
    from ttt_cupy.config import MMA_ENV, CupyConfig

    assert (kernel_name("fwd_chain", "__half", 64, 16)
            == "ttt_linear_fwd_chain<__half, 64, 16, true>")
    assert (kernel_name("bwd_chain", "float", 64, 16)
            == "ttt_linear_bwd_chain<float, 64, 16, false>")
    assert (kernel_name("bwd_chain", "__nv_bfloat16", 32, 32, False)
            == "ttt_linear_bwd_chain<__nv_bfloat16, 32, 32, false>")
    with pytest.raises(ValueError, match="float"):
        kernel_name("fwd_chain", "float", 64, 16, True)
    assert use_mma("__half") and use_mma("__nv_bfloat16", "90") and use_mma("__half", 80)
    assert not use_mma("float") and not use_mma("__half", "75")
    assert not use_mma("__half", "90", requested=False)
    for env, mma in (({}, True), ({MMA_ENV: "1"}, True), ({MMA_ENV: " 0 "}, False),
                     ({MMA_ENV: ""}, True)):
        assert CupyConfig.from_env(env).mma is mma
    for bad in ("yes", "2", "off"):
        with pytest.raises(ValueError, match=MMA_ENV):
            CupyConfig.from_env({MMA_ENV: bad})
    assert pass_names("fwd", "float", 64, 16, True) == {
        "fwd_chain": "ttt_linear_fwd_chain<float, 64, 16, false>",
        "fwd_out": "ttt_linear_fwd_out<float, 64, 16, false>",
        "fwd_chain_fused": "ttt_linear_fwd_chain<float, 64, 16, false, true>"}
    assert all(n.endswith(", false>") for n in pass_names("bwd", "__half", 64, 16, False).values())
    assert all(n.endswith(", true>") for n in pass_names("bwd", "__half", 64, 16, True).values())
    assert (kernel_name("bwd_grads", "__nv_bfloat16", 128, 32)
            == "ttt_linear_bwd_grads<__nv_bfloat16, 128, 32, true>")
    with pytest.raises(ValueError, match="float"):
        kernel_name("bwd_local", "float", 64, 16, True)
    assert [is_mma_instance(n) for n in program_names("fwd", "__half", 16, 16)] == [
        True, True, True, False, False, False]
    assert (kernel_name("fwd_chain", "__half", 64, 16, True, fused=True)
            == "ttt_linear_fwd_chain<__half, 64, 16, true, true>")
    assert not is_mma_instance(kernel_name("fwd_chain", "__half", 64, 16, False, fused=True))
    assert pass_names("fwd", "float", 64, 16, True)["fwd_chain_fused"] == (
        "ttt_linear_fwd_chain<float, 64, 16, false, true>")
    assert "fwd_chain_fused" not in pass_names("bwd", "float", 64, 16, True)
    with pytest.raises(ValueError, match="fused"):
        kernel_name("fwd_out", "__half", 64, 16, fused=True)
    assert not any(is_mma_instance(n) for n in program_names("bwd", "float", 16, 16))
    # + the fused backward chain (tensor cores, D_PAD <= 64)
    assert len(program_names("bwd", "__nv_bfloat16", 16, 16)) == 7
    assert len(program_names("bwd", "__nv_bfloat16", 128, 16)) == 6
    assert pass_names("bwd", "__half", 64, 32, True)["bwd_chain_fused"] == (
        "ttt_linear_bwd_chain_fused<__half, 64, 32, true>")
    assert is_mma_instance(pass_names("bwd", "__half", 64, 32, True)["bwd_chain_fused"])
    assert "bwd_chain_fused" not in pass_names("bwd", "__half", 64, 16, False)
    assert "bwd_chain_fused" not in pass_names("bwd", "__half", 128, 16, True)


def test_smem_reason_names_the_kernel():
    from ttt_cupy.smem import smem_reason

    h200, a100 = 227 * 1024, 163 * 1024
    for D in (60, 96, 128):
        for chunk in (16, 32, 64):
            for backward in (False, True):
                assert smem_reason(D, chunk, backward, h200) is None
    assert smem_reason(96, 32, False, a100) is None
    why = smem_reason(128, 64, False, a100)     # the fused chain's MMA instance: 222 KiB
    assert why is not None and "fwd_chain" in why and "forward" in why
    assert "chunk_size 32 fits" in why
    why = smem_reason(96, 32, True, a100)
    assert why is not None and "bwd_grads" in why and "backward" in why
    assert "no chunk_size fits head dim 96" in why
    assert smem_reason(128, 64, True, None) is None


def test_schedule_is_validated():
    from ttt_cupy.config import Schedule

    with pytest.raises(ValueError, match="overlap=False"):
        Schedule(segments=2)                           # a segmented pass is not overlapped
    with pytest.raises(ValueError, match="overlap=False"):
        Schedule(segments=2, overlap=True)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="segments"):
            Schedule(segments=bad, overlap=False)
    with pytest.raises(ValueError, match="overlap_spins"):
        Schedule(overlap_spins=-1)
    with pytest.raises(TypeError, match="fuse_forward"):
        Schedule(fuse_forward=1)
    assert Schedule(segments=1, overlap=False).segments == 1


def test_fused_forward_rule():
    """No GPU needed: when the forward chain writes the outputs itself (placement.FUSED, and
    at any number of chains a forward without a backward whose sequences fit in one chunk),
    and Schedule.fuse_forward forcing it either way."""
    from types import SimpleNamespace

    from ttt.schedule import FuseThresholds, generation_step
    from ttt_cupy.config import Schedule
    from ttt_cupy.placement import FUSED, fused_forward

    def problem(N, H, lens=None):
        return SimpleNamespace(N=N, H=H, seq_lens=lens or (64,) * N, chunk_size=16)

    assert FUSED == FuseThresholds(forward_inference=128, forward_training=256, backward=256)
    assert fused_forward(problem(8, 16), False)         # 128 chains, inference
    assert not fused_forward(problem(8, 12), False)
    assert not fused_forward(problem(8, 12), True)      # training: from 256
    assert fused_forward(problem(32, 16), True)
    # decode: every sequence within one chunk, no backward: fused at any number of chains
    for lens in ((1,), (16,), (0, 16, 3), (16,) * 8):
        assert generation_step(problem(len(lens), 1, lens), False)
        assert fused_forward(problem(len(lens), 1, lens), False)
        assert not fused_forward(problem(len(lens), 1, lens), True)   # training: the rule
    for lens in ((17,), (1, 17), (16, 16, 40)):
        assert not generation_step(problem(len(lens), 1, lens), False)
        assert not fused_forward(problem(len(lens), 1, lens), False)
    for on in (True, False):
        forced = Schedule(fuse_forward=on)
        assert fused_forward(problem(1, 2), False, forced) is on
        assert fused_forward(problem(1, 2, (1,)), False, forced) is on
        assert fused_forward(problem(32, 16), True, forced) is on


def test_segment_plan():
    """No GPU needed: the group ranges of a segmented pass (placement.segment_plan) cover every
    group once, in order; one launch with many chains or one group; Schedule.segments forces
    the count."""
    from types import SimpleNamespace

    from ttt_cupy.config import Schedule
    from ttt_cupy.placement import (
        SEGMENT_MAX_CHAINS,
        SEGMENT_MIN_GROUPS,
        SEGMENTS,
        segment_plan,
    )

    many = SimpleNamespace(N=1, H=SEGMENT_MAX_CHAINS + 1, D=64)
    for D, (at_least, least) in ((50, SEGMENT_MIN_GROUPS[64]), (100, SEGMENT_MIN_GROUPS[128])):
        few = SimpleNamespace(N=1, H=16, D=D)
        for groups in (at_least, at_least + 2 * least + 1, 128, 1000):
            plan = segment_plan(few, groups)
            assert len(plan) == min(SEGMENTS, groups // least)
            assert plan[0][0] == 0 and plan[-1][1] == groups
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(plan, plan[1:]))
            assert all(b - a >= least for a, b in plan)
            forward = segment_plan(few, groups, backward=False)
            assert len(forward) == max(2, len(plan) // 2)
            assert forward[0][0] == 0 and forward[-1][1] == groups
        for groups in (1, 2 * least - 1, at_least - 1):
            assert segment_plan(few, groups) == [(0, 0)]
    few = SimpleNamespace(N=1, H=16, D=64)
    assert segment_plan(many, 128) == [(0, 0)]
    three = Schedule(overlap=False, segments=3)
    assert segment_plan(many, 128, schedule=three) == [(0, 42), (42, 85), (85, 128)]
    assert segment_plan(many, 128, False, three) == segment_plan(many, 128, schedule=three)
    assert segment_plan(few, 128, schedule=Schedule(overlap=False, segments=1)) == [(0, 0)]


def test_overlap_rule():
    """No GPU needed: when a pass runs its chain and group kernels at once
    (placement.overlapped: up to OVERLAP_MAX_CHAINS chains per pass of sequences of at least
    OVERLAP_MIN_GROUPS groups, not fused, tickets within int32), Schedule.overlap forcing it
    either way, and a forced segment count never overlapped."""
    from types import SimpleNamespace

    from ttt_cupy.config import Schedule
    from ttt_cupy.placement import (
        OVERLAP_MAX_CHAINS,
        OVERLAP_MIN_GROUPS,
        backward_plan,
        forward_plan,
        overlapped,
    )

    assert OVERLAP_MAX_CHAINS == {"forward": 96, "backward": 32} and OVERLAP_MIN_GROUPS == 2
    at_fwd, at_bwd = SimpleNamespace(N=8, H=12), SimpleNamespace(N=2, H=16)  # 96, 32 chains
    over_fwd, over_bwd = SimpleNamespace(N=97, H=1), SimpleNamespace(N=1, H=33)
    assert overlapped(at_fwd, False, 2) and not overlapped(over_fwd, False, 2)
    assert overlapped(at_bwd, False, 2, backward=True)
    assert not overlapped(over_bwd, False, 2, backward=True) and overlapped(over_bwd, False, 2)
    assert not overlapped(at_fwd, False, 1)                  # one group: nothing to overlap
    assert not overlapped(at_bwd, False, 1, backward=True)
    assert not overlapped(at_bwd, True, 2)                           # fused: no group kernel
    assert not overlapped(at_bwd, False, 2, tickets=2**31)           # past the int32 counters
    on, off = Schedule(overlap=True), Schedule(overlap=False)
    assert overlapped(over_fwd, False, 2, schedule=on)
    assert overlapped(over_bwd, False, 2, backward=True, schedule=on)
    assert overlapped(at_fwd, False, 1, schedule=on)                 # forced: one group too
    assert not overlapped(over_fwd, True, 2, schedule=on)
    assert not overlapped(at_bwd, False, 2, backward=True, schedule=off)
    # the plans: a forced segment count is a segmented pass, never an overlapped one
    p = SimpleNamespace(N=1, H=2, D=64, chunk_size=16)
    seg = Schedule(overlap=False, segments=2)
    assert forward_plan(p, 4, True, seg).segments == [(0, 2), (2, 4)]
    assert not forward_plan(p, 4, True, seg).overlap
    assert forward_plan(p, 4, True).overlap and forward_plan(p, 4, True).segments == [(0, 0)]
    assert backward_plan(p, 4, 1, True, 227 * 1024).overlap
    assert not backward_plan(p, 4, 1, True, 227 * 1024, seg).overlap
