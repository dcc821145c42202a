#!/usr/bin/env bash
# The multi-GPU validation: 8 GPUs of one machine, under torchrun, in under 13 minutes
# (benchmarks/_gpu_multi.py says what each stage checks):
#   env, readme (the README's torchrun script at 2 and 8 ranks), resume (8 -> 4 -> 2 ranks),
#   hsdp (2x4 equals 1x8), kill (kill -9 of a rank in backward: the others exit naming the
#   collective), tp (examples/train_tp.py on dp4 x tp2, AdamW and Muon, resumed exactly),
#   fsdp_bench (benchmarks/fsdp.py's zero3 and hsdp --torchrun vs FSDP2 on NCCL);
# writes OUT/report.md and OUT/report.json (each stage's log beside them).
#
#   bash benchmarks/gpu_multi.sh [OUT]            # default OUT: benchmarks/results/gpu_multi
#   bash benchmarks/gpu_multi.sh --dry-run [OUT]  # print the stages, run nothing
#   bash benchmarks/gpu_multi.sh --cpu [OUT]      # rehearse with gloo CPU ranks (2 at most)
#
# Python: $PYTHON, else .venv/bin/python, else python3. Exit status 0 when no stage failed.
set -uo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$ROOT"
exec env PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/_gpu_multi.py "$@"
