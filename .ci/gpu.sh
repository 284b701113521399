#!/usr/bin/env bash
# One call on the offline GPU runner (torch, triton preinstalled; nox and fla-core carried
# as wheels in .whl/, which git ignores: the device tool must carry it, carry=[".whl"],
# or nox is missing there): install our packages, run the conformance suite for the reference
# and triton backends on CUDA tensors (big cases included), then the benchmarks.
#   bash .ci/gpu.sh [stages...]     stages: info demo ref triton triton_fused cupy cupy_simt
#                                   tune bench
#                                   (default: info ref triton bench)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ttt-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
stages=${*:-info ref triton bench}
XDIST=${XDIST:--n 8}
for stage in $stages; do
  case $stage in
    info)
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
      python3 -m pip install -q --no-deps --no-build-isolation -e packages/ttt \
        -e packages/ttt-triton -e packages/ttt-cupy 2>&1 | tail -3
      python3 -m ttt info 2>&1 | tee "$OUT/info.log" ;;
    demo)
      timeout ${DEMO_TIMEOUT:-120} python3 -m nox --no-venv -s demo 2>&1 \
        | tee "$OUT/demo.log" | tail -25 ;;
    ref)
      timeout ${REF_TIMEOUT:-200} python3 -m nox --no-venv -s "tests(backend='reference')" -- \
        -q $XDIST 2>&1 | tee "$OUT/tests-reference.log" | tail -15 ;;
    triton)
      timeout ${TRITON_TIMEOUT:-300} python3 -m nox --no-venv -s "tests(backend='triton')" -- \
        -q $XDIST 2>&1 | tee "$OUT/tests-triton.log" | tail -40 ;;
    triton_fused)   # the same suite with the fused chains forced on (launcher.FUSED), after
                    # any TTT_TRITON_TUNE of the caller (e.g. a candidate chain_stages=2)
      timeout ${TRITON_TIMEOUT:-300} env \
        TTT_TRITON_TUNE=${TTT_TRITON_TUNE:+$TTT_TRITON_TUNE,}fuse=1,fuse_bwd=1 python3 -m nox \
        --no-venv -s "tests(backend='triton')" -- -q $XDIST 2>&1 \
        | tee "$OUT/tests-triton-fused.log" | tail -40 ;;
    cupy)   # the CUDA C++ backend's suite and own tests on the GPU (tests/test_gpu_schedules.py
            # forces every schedule: fused, segmented, overlapped, plain)
      timeout ${CUPY_TIMEOUT:-300} python3 -m nox --no-venv \
        -s "tests(backend='cupy')" -- -q $XDIST 2>&1 | tee "$OUT/tests-cupy.log" | tail -40 ;;
    cupy_simt)   # the same with the SIMT fp32 kernels for half inputs (TTT_CUPY_MMA=0)
      timeout ${CUPY_TIMEOUT:-300} env TTT_CUPY_MMA=0 python3 -m nox --no-venv \
        -s "tests(backend='cupy')" -- -q $XDIST 2>&1 | tee "$OUT/tests-cupy-simt.log" \
        | tail -40 ;;
    tune)   # Triton launch tunables: every TUNE setting, then FLA chunk, in one run
      for t in ${TUNE:-"S_out=64,S_grads=32" "S_out=32,S_grads=32" "S_out=64,S_grads=64"}; do
        echo "== TTT_TRITON_TUNE=$t"
        timeout ${BENCH_TIMEOUT:-240} env TTT_TRITON_TUNE=$t python3 benchmarks/run.py \
          --backends triton --no-check --no-plot --rep 50 --warmup 20 \
          --out "$OUT/tune-${t//[,=]/_}" 2>&1 | tail -9
      done
      timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/run.py --backends fla.chunk --no-check \
        --no-plot --rep 50 --warmup 20 --out "$OUT/tune-fla" 2>&1 | tail -9 ;;
    bench)
      # the runner's copy has no .git: pass the commit, e.g. TTT_COMMIT=$(git rev-parse HEAD)
      timeout ${BENCH_TIMEOUT:-240} python3 -m nox --no-venv -s bench -- --out "$OUT/bench" \
        2>&1 | tee "$OUT/bench.log" | tail -40 ;;
  esac
done
