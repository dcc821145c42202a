#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU, in under 8 minutes:
#   1. set-up and environment (GPU, driver, torch, triton);
#   2. the kernel tests compiled on the GPU (TRITON_INTERPRET=0: the same cases the
#      interpreter runs in CI, against the same CPU references);
#   3. benchmarks/kernels.py: Triton vs the torch path vs torch.compile of the torch path,
#      TFLOP/s and GB/s against the device's peak;
#   4. the optimizers' step on CUDA tensors at world size 1, against torch.optim;
# and writes OUT/report.md and OUT/report.json (with each stage's log beside them).
#
#   bash benchmarks/gpu_check.sh [OUT]            # default OUT: benchmarks/results/gpu_check
#   bash benchmarks/gpu_check.sh --dry-run [OUT]  # print the stages, run nothing
#   bash benchmarks/gpu_check.sh --cpu [OUT]      # rehearse every stage on CPU (interpreter, no Triton rows)
#
# Python: $PYTHON, else .venv/bin/python, else python3 (a machine with torch, triton, pytest
# and hypothesis installed is enough: the first stage installs this package in editable
# mode, offline, if it is not importable). Each stage has a time limit (45 + 150 + 200 + 60 s);
# a stage that fails or times out is reported and the next one still runs. The exit status
# is 0 only when every stage passed.
set -uo pipefail

MODE=gpu
case "${1:-}" in
  --dry-run) MODE=dry; shift ;;
  --cpu) MODE=cpu; shift ;;
  -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/benchmarks/results/gpu_check}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$ROOT"

if [ "$MODE" = cpu ]; then
  INTERPRET=1; KERNEL_FLAGS=(--quick --no-compile)
else
  INTERPRET=0; KERNEL_FLAGS=(--quick)
fi
KERNEL_TESTS=(tests/test_kernels_ns.py tests/test_kernels_quant.py tests/test_kernels_no_triton.py)
STAGES=(env tests kernels steps)
declare -A LIMIT=([env]=45 [tests]=150 [kernels]=200 [steps]=60)
declare -A CMD=(
  [env]="($PY -c 'import vescale_optim.kernels' 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e .) && $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__); print(\"device\", torch.cuda.get_device_name() if torch.cuda.is_available() else \"none\")' && (nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true)"
  [tests]="TRITON_INTERPRET=$INTERPRET HYPOTHESIS_PROFILE=ci $PY -m pytest -q -p no:cacheprovider ${KERNEL_TESTS[*]}"
  [kernels]="$PY benchmarks/kernels.py ${KERNEL_FLAGS[*]} --sections kernels --out $OUT/kernels.json"
  [steps]="$PY benchmarks/kernels.py ${KERNEL_FLAGS[*]} --sections steps --out $OUT/steps.json"
)

if [ "$MODE" = dry ]; then
  for stage in "${STAGES[@]}"; do
    echo "[$stage] (limit ${LIMIT[$stage]} s) ${CMD[$stage]} > $OUT/$stage.log"
  done
  echo "[report] $OUT/report.md $OUT/report.json"
  for f in "${KERNEL_TESTS[@]}" benchmarks/kernels.py; do
    [ -f "$f" ] || { echo "missing $f" >&2; exit 1; }
  done
  exit 0
fi

if [ "$MODE" = gpu ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device visible to $PY; use --cpu to rehearse the stages on CPU" >&2
  exit 2
fi

mkdir -p "$OUT"
STATUS_FILE="$OUT/stages.tsv"
: > "$STATUS_FILE"
FAILED=0
for stage in "${STAGES[@]}"; do
  echo "== $stage (limit ${LIMIT[$stage]} s)"
  start=$(date +%s)
  timeout --kill-after=10 "${LIMIT[$stage]}" bash -c "${CMD[$stage]}" > "$OUT/$stage.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - start ))
  case $rc in
    0) status=passed ;;
    124|137) status=timeout ;;
    *) status="failed ($rc)" ;;
  esac
  [ "$rc" = 0 ] || FAILED=1
  printf '%s\t%s\t%s\n' "$stage" "$status" "$seconds" >> "$STATUS_FILE"
  echo "   $status in ${seconds} s; log: $OUT/$stage.log"
  tail -n 3 "$OUT/$stage.log" | sed 's/^/   | /'
done

"$PY" - "$OUT" "$MODE" <<'EOF'
import json, sys
from pathlib import Path

out, mode = Path(sys.argv[1]), sys.argv[2]
stages = [dict(zip(("stage", "status", "seconds"), line.split("\t"))) for line in
          (out / "stages.tsv").read_text().splitlines()]
md = [f"# GPU check ({mode})", "", "| stage | status | seconds |", "|---|---|---:|"]
md += [f"| {s['stage']} | {s['status']} | {s['seconds']} |" for s in stages]
report = {"mode": mode, "stages": stages}
env = (out / "env.log").read_text() if (out / "env.log").exists() else ""
md += ["", "## Environment", "", "```", env.strip(), "```"]
tests = (out / "tests.log").read_text().strip().splitlines() if (out / "tests.log").exists() else []
report["tests"] = tests[-1] if tests else None
md += ["", "## Kernel tests", "", f"`{report['tests']}`"]
for name in ("kernels", "steps"):
    path, log = out / f"{name}.json", out / f"{name}.log"
    report[name] = json.loads(path.read_text()) if path.exists() else None
    text = log.read_text() if log.exists() else ""
    tables = [line for line in text.splitlines() if line.startswith(("|", "device:", "optimizer step"))]
    md += ["", f"## {name}", "", *(tables or ["(no result; see the log)"])]
(out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
(out / "report.md").write_text("\n".join(md) + "\n")
print(f"report: {out / 'report.md'} and {out / 'report.json'}")
EOF
exit $FAILED
