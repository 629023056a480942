#!/usr/bin/env bash
# One device call: environment, the cuda-marked tests, the timing scripts. Writes everything under $OUT.
# usage: scripts/gpu_run.sh [pytest-args...]   (default: -m cuda tests/)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  git rev-parse HEAD 2>/dev/null || echo "commit: (not a git checkout)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -rs -p no:cacheprovider "${@:-"-m" "cuda" "tests/"}" 2>&1 | tee "$OUT/pytest.txt" | tail -25
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.txt"
for script in ${BENCH:-}; do
  echo "== $script"
  python3 benchmarks/$script.py --out "$OUT/$script.json" 2>&1 | tee "$OUT/$script.txt" | tail -30
done
