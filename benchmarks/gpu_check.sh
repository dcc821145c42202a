#!/usr/bin/env bash
# The one-shot validation a lent GPU runs first: one H100/H200, under 10 minutes
# (benchmarks/gpu_check.py says what each stage checks and how its bounds were chosen):
#   env, tests (the kernel tests compiled), zero3, syncs, overlap, memory, meta, checkpoint,
#   batch_invariance, nan, large_shapes, steps, kernels (benchmarks/kernels.py --quick);
# each stage in its own process with its own time limit (a failed stage does not stop the
# next), printed as it ends; writes OUT/report.md and OUT/report.json (each stage's log, the
# overlap stage's profiler trace overlap_trace.json beside them).
#
#   bash benchmarks/gpu_check.sh [OUT]            # default OUT: benchmarks/results/gpu_check
#   bash benchmarks/gpu_check.sh --dry-run [OUT]  # print the stages, run nothing
#   bash benchmarks/gpu_check.sh --cpu [OUT]      # rehearse every stage on CPU (gloo, interpreter)
#
# Python: $PYTHON, else .venv/bin/python, else python3: any Python with a CUDA torch, Triton,
# pytest and hypothesis will do, offline; the repository is put on PYTHONPATH (nothing is
# installed). The exit status is 0 when no stage failed, 2 without a CUDA device.
set -uo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$ROOT"
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/gpu_check.py "$@"
