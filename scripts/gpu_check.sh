#!/usr/bin/env bash
# GPU check: build the kernel, run the GPU tests, a quick kernel benchmark, then (TODO) an end-to-end conversion.
# Exact command (repo root, on a machine with an NVIDIA GPU of compute capability >= 8.0, nvcc and ninja):
#     bash scripts/gpu_check.sh            # OUT=/some/dir to keep the logs there (default: ./bench_out)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
declare -A RESULT

# ---- 1. build the kernel (cached under ~/.cache/marlin_convert or $MARLIN_CONVERT_CACHE)
start=$(date +%s)
if $PY -c "from marlin_convert.kernel import ensure_kernel; ensure_kernel(0); print('kernel ready')" 2>&1 | tee "$OUT/build.log"; then
  RESULT[build]="ok ($(( $(date +%s) - start )) s)"
else
  RESULT[build]="FAILED"; echo "kernel build failed: see $OUT/build.log"; exit 1
fi

# ---- 2. GPU tests
if $PY -m pytest -m gpu -v tests/test_kernel_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"; then
  RESULT[gpu_tests]="ok: $(grep -Eo '[0-9]+ passed' "$OUT/pytest_gpu.log" | tail -1)"
else
  RESULT[gpu_tests]="FAILED: $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest_gpu.log" | tail -1)"
fi

# ---- 3. quick kernel benchmark (full table: python3 scripts/bench_kernel.py)
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  $PY scripts/bench_kernel.py --quick 2>&1 | tee "$OUT/bench_quick.log" || RESULT[bench]="FAILED"
  RESULT[bench]=${RESULT[bench]:-"ok: $(grep -A2 'geometric-mean' "$OUT/bench_quick.log" | tail -1 | tr -s ' ')"}
fi

# ---- 4. END-TO-END (owner: package side) --------------------------------------------------------------------
# TODO: generate a checkpoint, convert, `marlin-convert verify OUT --gpu 0`; set RESULT[e2e]="ok" / "FAILED".
# -------------------------------------------------------------------------------------------------------------

# ---- final short table
echo
echo "== gpu_check summary =="
for key in build gpu_tests bench e2e; do
  printf '%-10s %s\n' "$key" "${RESULT[$key]:-not run}"
done
[[ "${RESULT[gpu_tests]}" == ok* ]]
