#!/usr/bin/env bash
# Next GPU session, call 3 (an experiment, prepared in session 15): fwd_out's tensor-core
# instance in 64-row blocks at D_PAD 64 (exp-fwd-out-64.patch, on top of the host series),
# unstaged, 2 blocks an SM, 117 registers, no spill (ptxas sm_90), against the series' staged
# 32-row blocks (3 an SM, 80 registers, 8 bytes of spill), in the same call. Before `run`, here
# (the host series checked out as for plan-call1.sh):
#   git checkout -b fwd-out-64 && git am benchmarks/results/2026-12-04-l/exp-fwd-out-64.patch
#   rm -rf .dev/exp-cupy && cp -r packages/ttt-cupy .dev/exp-cupy && git checkout host-series
# then run this with carry [".dev", ".whl"], timeout 590. Per shape: the forward's kernel
# times and do_bench (kernel_diag.py), overlap on (default) and off (plain fwd_out); then the
# cupy oracle tests with the experiment.
set -uo pipefail
export PYTHONUNBUFFERED=1
R=benchmarks/results/2026-12-04-l
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site
PIP="python3 -m pip install -q --no-deps --no-build-isolation"
$PIP -e packages/ttt -e packages/ttt-triton -e packages/ttt-cupy 2>&1 | tail -2
S="8,256,12,64 8,2048,12,64 4,4096,16,64 1,32768,16,64"
V="cupy cupy:TTT_CUPY_OVERLAP=0"
echo "== series (32-row staged fwd_out)"
timeout 150 python3 $R/kernel_diag.py "$S" "$V triton"
$PIP -e .dev/exp-cupy 2>&1 | tail -2
python3 -c "import ttt_cupy.compile as c; print('experiment installed:', hasattr(c, 'fwd_out_rows'))"
echo "== experiment (64-row fwd_out)"
timeout 150 python3 $R/kernel_diag.py "$S" "$V"
echo "== oracle tests with the experiment"
timeout 200 python3 -m pytest shared_tests/test_against_oracle.py packages/ttt-cupy/tests/test_gpu_segments.py --backend cupy -q -n 16 2>&1 | tail -3
TTT_CUPY_OVERLAP=0 timeout 120 python3 -m pytest shared_tests/test_against_oracle.py --backend cupy -q -n 16 2>&1 | tail -2
