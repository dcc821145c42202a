#!/usr/bin/env bash
# The one-shot validation a lent GPU runs first: one H100/H200, at most 420 s, set-up included
# (benchmarks/gpu_check.py says what each stage checks and how its bounds were chosen):
#   env, single_gpu, zero3, delay, syncs, overlap_selftest, overlap, meta, memory, checkpoint,
#   nan, batch_invariance, large_shapes, tests (pytest -n 8), steps; kernels with --kernels;
# each stage in its own process with its own time limit (a failed stage does not stop the
# next), printed as it ends. It ends with the two files to bring back: OUT/summary.md (under
# 8 KB, also printed) and OUT/gpu_check.tar.gz (report.json, report.md, logs, traces).
#
#   bash benchmarks/gpu_check.sh OUT              # default OUT: benchmarks/results/gpu_check
#   bash benchmarks/gpu_check.sh --dry-run [OUT]  # print the stages, their limits, the total
#   bash benchmarks/gpu_check.sh --cpu [OUT]      # rehearse every stage on CPU (gloo, interpreter)
#
# Python: $PYTHON, else .venv/bin/python, else python3: any Python with a CUDA torch (>= 2.9),
# Triton, pytest (pytest-xdist) and hypothesis will do, offline; the repository is put on
# PYTHONPATH (nothing is installed). The exit status is 0 when no stage failed, 2 without a
# CUDA device.
set -uo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$ROOT"
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/gpu_check.py "$@"
