#!/usr/bin/env bash
# Next GPU session, call 2: the three-way table (FLA, cupy, triton; all five shapes) of the
# working tree as it is (the host series checked out as for plan-call1.sh, or main), after a
# cProfile of the forward at 8,2048. carry [".dev", ".whl"], timeout 590; the table goes to
# $OUT/threeway.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e packages/ttt -e packages/ttt-triton -e packages/ttt-cupy 2>&1 | tail -2
echo "== cProfile of the forward (8,2048)"
timeout 90 python3 benchmarks/host_time.py --backends cupy triton --shapes 8,2048,12,64 --iters 100 --cprofile 25 2>&1 | tail -56
timeout 450 python3 benchmarks/run.py --backends fla.chunk cupy triton --no-check --no-plot --rep 20 --warmup 5 \
  --shapes 32,2048,16,64 4,4096,8,128 4,4096,16,64 1,32768,16,64 8,2048,12,64 --out $OUT/threeway 2>&1 \
  | grep -E "^\| |^[A-Za-z]" | head -40
