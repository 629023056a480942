#!/usr/bin/env bash
# One GPU run: the environment, the cuda-marked tests, the timing scripts. Writes everything under $OUT.
# usage: [COMMIT=id TESTS="files" BENCH="scripts" PARALLEL=1] scripts/gpu_run.sh [pytest-args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit ${COMMIT:-unknown} (plus uncommitted changes: ${DIRTY:-none})"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
# one process per test file: a CUDA error is sticky and would fail every later test of the process.
# PARALLEL=1 runs the files side by side (one GPU is big enough; saves device time, not for timings)
# each file's log joins $OUT/pytest.txt as it finishes, whole (flock), so a run stopped by a time limit keeps them
run_tests() {
  log="/tmp/pytest.$(basename "$1").txt"
  python3 -m pytest -q -rs -s -p no:cacheprovider -m cuda "$1" "${@:2}" > "$log" 2>&1
  rc=$?  # 5: pytest collected nothing, the file only names CUDA (a CPU test of an error message)
  echo "pytest $1 exit: $rc$([ $rc = 5 ] && echo ' (no cuda-marked tests)')" >> "$log"
  if command -v flock > /dev/null; then flock "$OUT/pytest.txt" -c "cat '$log' >> '$OUT/pytest.txt'"; else cat "$log" >> "$OUT/pytest.txt"; fi
}
# files with CUDA tests: marked directly, or through a shared `devices()` parametrization (tests/cache/test_cache_step.py)
: > "$OUT/pytest.txt"
FILES=$(for f in ${TESTS:-$(find tests -name "test_*.py" | sort)}; do grep -qE "cuda|devices\(\)" "$f" && echo "$f"; done)
for f in $FILES; do
  if [ "${PARALLEL:-0}" = 1 ]; then run_tests "$f" "$@" & else run_tests "$f" "$@"; fi
done
wait
grep -a "exit:\| passed\| failed" "$OUT/pytest.txt"
# BENCH: scripts under benchmarks/, without .py: decode_step, diagnostics/step_kernels, ...
for script in ${BENCH:-}; do
  name=$(basename "$script")
  echo "== $script"
  python3 benchmarks/$script.py --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.txt" | tail -30
done
