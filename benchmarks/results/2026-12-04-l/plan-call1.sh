#!/usr/bin/env bash
# Next GPU session, call 1 (prepared in session 15, no GPU then): host time and CUDA API calls
# of main's launcher, then the host series applied (benchmarks/results/2026-12-04-l/
# cupy-host-series.patch: driver launches, the overlap helpers, the forward's prologue kernel and
# one workspace): the cupy suite, host time again with driver and with CuPy launches.
# carry: [".dev", ".whl"]; timeout 590.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e packages/ttt -e packages/ttt-triton -e packages/ttt-cupy 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S="8,2048,12,64 4,4096,16,64"
echo "== host, main ($(git rev-parse --short HEAD 2>/dev/null))"
timeout 120 python3 benchmarks/host_time.py --backends cupy triton --shapes $S --api 2>&1 | grep -E "^\||^- |H200"
git apply benchmarks/results/2026-12-04-l/cupy-host-series.patch 2>/dev/null \
  || patch -p1 < benchmarks/results/2026-12-04-l/cupy-host-series.patch | tail -3
git diff --stat | tail -1
echo "== suite (series)"
timeout 300 python3 -m pytest shared_tests packages/ttt-cupy/tests --backend cupy -q -n 16 > /tmp/suite.log 2>&1
grep -E "^FAILED|^ERROR|^E  |passed|failed" /tmp/suite.log | head -30
cp /tmp/suite.log $OUT/suite-series.log
echo "== host, series (driver launches)"
timeout 90 python3 benchmarks/host_time.py --backends cupy --shapes $S --api 2>&1 | grep -E "^\||^- "
echo "== host, series (TTT_CUPY_LAUNCH=cupy)"
TTT_CUPY_LAUNCH=cupy timeout 60 python3 benchmarks/host_time.py --backends cupy --shapes $S 2>&1 | grep -E "^\|"
