#!/usr/bin/env bash
# One call on the offline GPU runner (torch, triton, cupy preinstalled; nox and fla-core
# as wheels in .whl/, a git-ignored folder sent along with the working tree, or nox is
# missing there; so are the cupy backend's NVRTC bindings: cuda-python, cuda-bindings,
# cuda-core and cuda-pathfinder wheels for the runner's Python, e.g. `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
# 'cuda-python==13.4.4' 'cuda-bindings~=13.4.4' 'cuda-core~=1.2' 'cuda-pathfinder~=1.1'`):
# install our packages, run the conformance suite for every backend on CUDA tensors (big
# cases included), then the benchmarks. Stops at the first stage that fails (a failing
# command anywhere in a pipe fails its stage); a backend that cannot run
# on the GPU fails its suite. Each suite stage runs in two steps: every test but the
# whole_device ones with $XDIST workers (default 8), then the whole_device tests alone
# (one process holding up to about 60 GiB of device memory: docs/testing.md).
#   bash .ci/gpu.sh [stages...]     stages: info demo ref triton cupy cupy_simt bench compare
#                                   (default: info ref triton cupy bench)
# Stage compare (python -m benchmarks.compare): an A/B of a base revision's packages, carried in
# .ab/base, against this tree's, in the same run on this GPU. The runner's copy has no .git,
# so prepare the base on your machine, from the repository root:
#   mkdir -p .ab/base && git archive REV packages | tar -x -C .ab/base
#   git rev-parse REV > .ab/base/REVISION          # the header names the base by it
#   echo .ab >> "$(git rev-parse --git-path info/exclude)"   # once: git ignores .ab
# send .ab (and .whl) along with the working tree, then run e.g.
# `TTT_COMMIT=$(git rev-parse HEAD) bash .ci/gpu.sh info compare`; COMPARE_ARGS adds options (e.g. "--backends cupy --shapes 8,2048,12,64").
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ttt-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
stages=${*:-info ref triton cupy bench}
XDIST=${XDIST:--n 8}

suite() {  # suite BACKEND LOG [ENV...]: the nox tests session, shared then whole_device
  # (-v: each failure is named in the log as it happens, so a run cut short by the time
  # limit still names its failures)
  local backend=$1 log=$2; shift 2
  { timeout ${SUITE_TIMEOUT:-400} env "$@" python3 -m nox --no-venv \
      -s "tests(backend='$backend')" -- -v -rfE $XDIST \
      -m "not whole_device" &&
    timeout ${SUITE_TIMEOUT:-400} env "$@" python3 -m nox --no-venv \
      -s "tests(backend='$backend')" -- -v -rfE -n 0 \
      -m whole_device; } 2>&1 | tee "$OUT/$log" | grep -E "FAILED|ERROR|[0-9]+ (passed|failed|errors?)"
}
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
      suite reference tests-reference.log ;;
    triton)
      suite triton tests-triton.log ;;
    cupy)   # the CUDA C++ backend's suite and own tests on the GPU (tests/test_gpu_schedules.py
            # forces every schedule: fused, segmented, overlapped, plain)
      suite cupy tests-cupy.log ;;
    cupy_simt)   # the same with the SIMT fp32 kernels for half inputs (TTT_CUPY_MMA=0)
      suite cupy tests-cupy-simt.log TTT_CUPY_MMA=0 ;;
    bench)
      # the runner's copy has no .git: pass the commit, e.g. TTT_COMMIT=$(git rev-parse HEAD)
      timeout ${BENCH_TIMEOUT:-900} python3 -m nox --no-venv -s bench -- --out "$OUT/bench" \
        2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    compare)
      [ -d .ab/base/packages ] || { echo "compare: no .ab/base/packages (see the header)" >&2
                                    exit 2; }
      # this tree's packages for the parent too, installed (stage info) or not
      src=$PWD/packages/ttt/src:$PWD/packages/ttt-triton/src:$PWD/packages/ttt-cupy/src
      PYTHONPATH=$src${PYTHONPATH:+:$PYTHONPATH} \
        timeout ${COMPARE_TIMEOUT:-540} python3 -m benchmarks.compare --base-tree .ab/base \
        --out "$OUT/compare" ${COMPARE_ARGS:-} 2>&1 | tee "$OUT/compare.log" | tail -60 ;;
    *)
      echo "unknown stage: $stage" >&2
      exit 2 ;;
  esac
done
