#!/usr/bin/env bash
# One device call: environment, the cuda-marked tests, the timing scripts. Writes everything under $OUT.
# usage: scripts/gpu_run.sh [pytest-args...]   (default: -m cuda tests/)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit ${COMMIT:-unknown} (plus uncommitted changes: ${DIRTY:-none})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
[ -f probe_gpu.py ] && python3 probe_gpu.py 2>&1 | tee "$OUT/probe.txt"
# one process per test file: a CUDA error is sticky and would fail every later test of the process
for f in ${TESTS:-tests/test_*.py}; do
  grep -q "cuda" "$f" || continue
  python3 -m pytest -q -rs -s -p no:cacheprovider -m cuda "$f" "$@" 2>&1 | tee -a "$OUT/pytest.txt" | tail -6
  echo "pytest $f exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.txt"
done
for script in ${BENCH:-}; do
  echo "== $script"
  python3 benchmarks/$script.py --out "$OUT/$script.json" 2>&1 | tee "$OUT/$script.txt" | tail -30
done
