#!/usr/bin/env bash
# Next GPU session, call 1 (prepared in session 15, which had no GPU). Before `run`, here:
#   git checkout -b host-series main && git am benchmarks/results/2026-12-04-l/cupy-host-series.patch
#   rm -rf .dev/main-cupy && git archive main packages/ttt-cupy | tar -x -C /tmp && mv /tmp/packages/ttt-cupy .dev/main-cupy
# then run this with carry [".dev", ".whl"], timeout 590 (the device's copy has no git).
# It measures main's launcher (host time, CUDA API calls per forward), then the series: the
# cupy suite, host time with driver launches and with CuPy's.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
PIP="python3 -m pip install -q --no-deps --no-build-isolation"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
S="8,2048,12,64 4,4096,16,64"
$PIP -e packages/ttt -e packages/ttt-triton -e .dev/main-cupy 2>&1 | tail -2
echo "== host, main's cupy package"
timeout 120 python3 benchmarks/host_time.py --backends cupy triton --shapes $S --api 2>&1 | grep -E "^\||^- |H200"
$PIP -e packages/ttt-cupy 2>&1 | tail -2
python3 -c "import ttt_cupy.compile as c; print('series installed:', hasattr(c, 'get_prep_kernel'))"
echo "== suite (series)"
timeout 300 python3 -m pytest shared_tests packages/ttt-cupy/tests --backend cupy -q -n 16 > /tmp/suite.log 2>&1
grep -E "^FAILED|^ERROR|^E  |passed|failed" /tmp/suite.log | head -30
cp /tmp/suite.log $OUT/suite-series.log
echo "== host, series (driver launches)"
timeout 90 python3 benchmarks/host_time.py --backends cupy --shapes $S --api 2>&1 | grep -E "^\||^- "
echo "== host, series (TTT_CUPY_LAUNCH=cupy)"
TTT_CUPY_LAUNCH=cupy timeout 60 python3 benchmarks/host_time.py --backends cupy --shapes $S 2>&1 | grep -E "^\|"
