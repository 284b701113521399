#!/usr/bin/env bash
# Next GPU session, call 2: the three-way table (FLA, cupy, triton; all five shapes) with the
# host series applied (if call 1's suite was clean), into $OUT/threeway. timeout 590.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e packages/ttt -e packages/ttt-triton -e packages/ttt-cupy 2>&1 | tail -2
if [ "${1:-series}" = series ]; then
  git apply benchmarks/results/2026-12-04-l/cupy-host-series.patch 2>/dev/null \
    || patch -p1 < benchmarks/results/2026-12-04-l/cupy-host-series.patch | tail -3
fi
echo "== cProfile of the forward (8,2048)"
timeout 90 python3 benchmarks/host_time.py --backends cupy triton --shapes 8,2048,12,64 --iters 100 --cprofile 25 2>&1 | tail -56
timeout 480 python3 benchmarks/run.py --backends fla.chunk cupy triton --no-check --no-plot --rep 20 --warmup 5 \
  --shapes 32,2048,16,64 4,4096,8,128 4,4096,16,64 1,32768,16,64 8,2048,12,64 --out $OUT/threeway 2>&1 \
  | grep -E "^\| |^[A-Za-z]" | head -40
