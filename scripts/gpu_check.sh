#!/usr/bin/env bash
# GPU check: build the kernel, run the GPU tests, compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over
# many small kernel calls, a quick kernel benchmark, then convert generated checkpoints of every supported kind and run
# `marlin-convert verify --gpu 0` on each; a short table comes last.
# Exact command (repo root, on a machine with an NVIDIA GPU of compute capability >= 8.0, nvcc and ninja):
#     bash scripts/gpu_check.sh            # OUT=/some/dir to keep the logs there (default: ./bench_out)
# Settings (environment): OUT (logs and reports), PYTHON (default python3), SKIP_BENCH=1 (no benchmark), SKIP_TESTS=1
# and SKIP_SANITIZER=1 (no GPU tests, no compute-sanitizer: for a run that owes only the other steps; the summary
# says "skipped"),
# GPU_TEST_SHARDS (pytest processes the GPU tests are split over, run at once on the one GPU, default 3),
# GPU_TEST_TIMEOUT (seconds each of them may take, default 480), E2E_JOBS
# (end-to-end checkpoints converted and verified at once, default 4), E2E_TIMEOUT (seconds each conversion and each
# verify may take before its row says FAILED, default 300). Exit status 0 only when the GPU tests, the sanitizer and
# every end-to-end row pass (or were skipped as asked); 2, with one line, where torch sees no CUDA GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
E2E_JOBS=${E2E_JOBS:-4} E2E_TIMEOUT=${E2E_TIMEOUT:-300}
[[ $E2E_JOBS =~ ^[1-9][0-9]*$ ]] || { echo "E2E_JOBS=$E2E_JOBS: expected a positive integer" >&2; exit 2; }
[[ $E2E_TIMEOUT =~ ^[1-9][0-9]*$ ]] || { echo "E2E_TIMEOUT=$E2E_TIMEOUT: expected a positive integer" >&2; exit 2; }
# a signal to this script stops its background jobs too (the sanitizer tools, the end-to-end jobs: they would go on
# writing into $OUT): each job's child (the `timeout` around a command, which passes the signal on) and the job itself
stop_jobs() {
  local pid
  for pid in $(jobs -p); do pkill -TERM -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; done
  return 0
}
trap stop_jobs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# ---- 0. a CUDA GPU torch can see, or one line and exit 2 (not the kernel build's traceback)
# (why: the probe's last line, "torch 2.13.0+cpu, built without CUDA" or the error that stopped it)
probe="import torch as t; print(f'torch {t.__version__}, ' + (f'CUDA {t.version.cuda}' if t.version.cuda else"
probe+=" 'built without CUDA')); raise SystemExit(not t.cuda.is_available())"
if ! why=$($PY -W ignore -c "$probe" 2>&1); then  # (-W ignore: torch's warning on a machine with no driver would be
                                                    # the last line)
  echo "gpu_check: no CUDA GPU visible to torch (${why##*$'\n'}); run it on a machine with an NVIDIA GPU" >&2; exit 2
fi
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

# ---- 2. GPU tests (the kernel against its reference; verify on converted checkpoints)
# the GPU tests as GPU_TEST_SHARDS pytest processes at once on the one GPU (MARLIN_TEST_SHARD=i/n, tests/conftest.py:
# every n-th test each; most of a test's time is its CPU reference), each with its own log and temporary directory
# (GPU_TEST_TIMEOUT seconds each at most: a hung shard, say a lock chain that never ends, is stopped and named)
shards=${GPU_TEST_SHARDS:-3} shard_timeout=${GPU_TEST_TIMEOUT:-480}
[[ $shards =~ ^[1-9][0-9]*$ ]] || { echo "GPU_TEST_SHARDS=$shards: expected a positive integer" >&2; exit 2; }
[[ $shard_timeout =~ ^[1-9][0-9]*$ ]] || { echo "GPU_TEST_TIMEOUT=$shard_timeout: expected a positive integer" >&2; exit 2; }
rm -f "$OUT"/pytest_gpu_*.log  # (an earlier run's shard logs must not add to this run's counts)
if [ "${SKIP_TESTS:-0}" = 1 ]; then
  RESULT[gpu_tests]="skipped (SKIP_TESTS=1)"
  shards=0
fi
start=$(date +%s)
shard_pids=()
for ((i = 0; i < shards; i++)); do
  MARLIN_TEST_SHARD=$i/$shards timeout "$shard_timeout" $PY -m pytest -m gpu -v -p no:cacheprovider \
    --basetemp "$OUT/pytest_tmp_$i" tests/ > "$OUT/pytest_gpu_$i.log" 2>&1 &
  shard_pids+=($!)
done
tests_ok=1 shard_codes=""
for ((i = 0; i < shards; i++)); do
  code=0
  wait "${shard_pids[$i]}" || code=$?
  [ "$code" = 0 ] || tests_ok=0
  shard_codes+="${shard_codes:+ }$code"
done
count() {  # the sum over the shards' pytest summaries of "<N> $1"
  local f total=0 n
  for f in "$OUT"/pytest_gpu_[0-9]*.log; do
    n=$(grep -E '^=+ .* in [0-9.]+s' "$f" | tail -1 | grep -Eo "[0-9]+ $1" | grep -Eo '^[0-9]+' || true)
    total=$((total + ${n:-0}))
  done
  echo "$total"
}
if (( shards > 0 )); then
  cat "$OUT"/pytest_gpu_[0-9]*.log > "$OUT/pytest_gpu.log"
  grep -E '^(FAILED|ERROR) ' "$OUT/pytest_gpu.log" || true
  tests_summary="$(count passed) passed, $(count failed) failed, $(count error) errors, $(count skipped) skipped in $shards \
processes (exit codes: $shard_codes; 124: stopped after ${shard_timeout} s), $(( $(date +%s) - start )) s"
  echo "GPU tests: $tests_summary"
  if [ $tests_ok = 1 ]; then
    RESULT[gpu_tests]="ok: $tests_summary"
  else
    RESULT[gpu_tests]="FAILED: $tests_summary"
  fi
fi

# ---- 2b. compute-sanitizer over small calls of every kind (scripts/sanitize_kernel.py; the kernel is built already,
# and only the marlin_ kernels (pipelined and direct) are instrumented): memcheck, racecheck, synccheck and initcheck,
# run at once on the one GPU (each its own process and log). racecheck and synccheck are slow: they get the --few subset
# (synccheck finds barriers that threads reach at different instructions, e.g. a warp-specialised block's roles at
# their own __syncthreads, undefined for its .aligned form: kernel/NOTES.md); initcheck gets inputs made on the host
# (writes of the uninstrumented torch kernels are not tracked). racecheck's reports go through racecheck_triage.py.
if [ "${SKIP_SANITIZER:-0}" = 1 ]; then
  RESULT[sanitizer]="skipped (SKIP_SANITIZER=1)"
elif command -v compute-sanitizer > /dev/null; then
  san_status=ok san_summary=""
  san_tools=(memcheck racecheck synccheck initcheck)
  declare -A san_pid
  for tool in "${san_tools[@]}"; do
    few=(); [[ $tool == racecheck || $tool == synccheck ]] && few=(--few)
    [[ $tool == initcheck ]] && few=(--host-inputs)
    compute-sanitizer --tool "$tool" --kernel-name kns=marlin_ --error-exitcode 3 \
      $PY scripts/sanitize_kernel.py "${few[@]}" > "$OUT/sanitizer_$tool.log" 2>&1 &
    san_pid[$tool]=$!
  done
  for tool in "${san_tools[@]}"; do
    code=0 triaged=""
    wait "${san_pid[$tool]}" || code=$?
    # racecheck's reports of a cp.async write against a peer's cluster store after a cluster barrier are the tool's
    # (scripts/racecheck_cluster_control.cu shows it): racecheck_triage.py lets those through, and only those, while
    # its control still shows them, and only with every call's result right (exit 3 = reports, not wrong results)
    if [[ $tool == racecheck && $code == 3 ]] && grep -q ' calls, 0 wrong' "$OUT/sanitizer_$tool.log"; then
      if triaged=$($PY scripts/racecheck_triage.py "$OUT/sanitizer_$tool.log" --expect-reports \
                      --control-dir "$OUT/racecheck_control"); then
        code=0
      fi
      triaged="; ${triaged#racecheck_triage: }"
    fi
    if [ "$code" != 0 ]; then
      san_status=FAILED; tail -20 "$OUT/sanitizer_$tool.log"
    fi
    san_summary+="$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1 \
                          | sed 's/^=* *//' | tr -s ' ' || true) \
($(grep -o '[0-9]* calls, [0-9]* wrong' "$OUT/sanitizer_$tool.log" | tail -1 || true)$triaged); "
  done
  RESULT[sanitizer]="$san_status (${san_summary%; })"
else
  RESULT[sanitizer]="not run (compute-sanitizer not on PATH)"
fi

# ---- 3. quick kernel benchmark (full table: python3 scripts/bench_kernel.py)
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  $PY scripts/bench_kernel.py --quick 2>&1 | tee "$OUT/bench_quick.log" || RESULT[bench]="FAILED"
  RESULT[bench]=${RESULT[bench]:-"ok: $(grep -A2 'geometric-mean' "$OUT/bench_quick.log" | tail -1 | tr -s ' ')"}
fi

# ---- 4. end to end: generate GPTQ checkpoints of every supported kind, convert, verify on the GPU
E2E="$OUT/e2e"
rm -rf "$E2E" && mkdir -p "$E2E"
$PY - "$E2E" <<'PYEOF'
import sys
from pathlib import Path
sys.path.insert(0, "scripts")
import make_gptq_checkpoint as gen
root = Path(sys.argv[1])


def mixed_dynamic():
    """GPTQModel-style `dynamic`: down_proj 8-bit, up_proj group 32, o_proj not quantized, lm_head 8-bit g32."""
    spec = gen.tiny_llama(num_layers=1, hidden=512, intermediate=1536, vocab=512, group_size=128)
    spec.dynamic = {"+:.*down_proj": {"bits": 8}, "+:.*up_proj": {"group_size": 32}, "-:.*o_proj": {}}
    o_proj = next(lin for lin in spec.linears if lin.name.endswith("o_proj"))
    spec.linears.remove(o_proj)  # a plain float16 weight [N, K], as GPTQModel writes an excluded module
    spec.extras.append(gen.TensorSpec(f"{o_proj.name}.weight", (o_proj.out_features, o_proj.in_features), "float16"))
    for lin in spec.linears:
        if lin.name.endswith("down_proj"):
            lin.bits = 8
        if lin.name.endswith("up_proj"):
            lin.group_size = 32
    return gen.with_quantized_lm_head(spec)


def autoround(packing, sym, zero_format):
    """AutoRound's own format (config.json alone, quant_method "auto-round", `packing`): k_proj 8-bit by an
    extra_config entry, the rest 4-bit group 128, block_name_to_quantize "model.layers"."""
    spec = gen.tiny_llama(num_layers=1, hidden=1024, intermediate=2816, vocab=512, group_size=128, sym=sym,
                          zero_format=zero_format, config_location="config")
    k_proj = next(lin for lin in spec.linears if lin.name.endswith("k_proj"))
    k_proj.bits = 8
    spec.quantization_extra = {"quant_method": "auto-round", "packing_format": packing, "data_type": "int",
                               "block_name_to_quantize": "model.layers", "extra_config": {k_proj.name: {"bits": 8}}}
    return spec

cases = {
    "dense-g128-actorder": gen.tiny_llama(num_layers=2, hidden=1024, intermediate=2816, vocab=512, group_size=128,
                                          act_order=True, shards=2),
    "dense-channelwise-v2": gen.tiny_llama(num_layers=1, hidden=1024, intermediate=2816, vocab=512, group_size=-1,
                                           zero_format="v2", checkpoint_format_label="gptq_v2"),
    "dense-g32-bf16": gen.tiny_llama(num_layers=1, hidden=512, intermediate=1536, vocab=512, group_size=32,
                                     scale_dtype="bfloat16"),
    "dense-g64-k-eq-g": gen.CheckpointSpec(linears=[gen.LinearSpec("model.layers.0.mlp.down_proj", 64, 192),
                                                    gen.LinearSpec("model.layers.0.mlp.up_proj", 256, 320)],
                                           extras=[], group_size=64),
    "moe-stacked-actorder": gen.qwen3_moe(num_layers=1, num_experts=8, hidden=512, expert_intermediate=256,
                                          stacked=True, act_order=True, group_size=128),
    "moe-per-expert": gen.qwen3_moe(num_layers=1, num_experts=16, hidden=512, expert_intermediate=256,
                                    group_size=128),
    # issue 7: shapes that don't tile (zero padding), K = 1000 and N = 1000, plain and act-order
    "padded-k1000-n1000-g128": gen.CheckpointSpec(
        linears=[gen.LinearSpec("model.layers.0.mlp.down_proj", 1000, 1000),
                 gen.LinearSpec("model.layers.0.mlp.up_proj", 1008, 8608)], extras=[], group_size=128),
    "padded-k1000-actorder": gen.CheckpointSpec(
        linears=[gen.LinearSpec("model.layers.0.mlp.down_proj", 1000, 1000)], extras=[], group_size=128,
        act_order=True),
    # issue 9: 8-bit, asymmetric v1 / v2, a bf16 model, mixed bits from `dynamic` with a quantized lm_head
    "dense-int8-g128": gen.tiny_llama(num_layers=1, hidden=1024, intermediate=2816, vocab=512, bits=8),
    "dense-asym-v1-g64": gen.tiny_llama(num_layers=1, hidden=1024, intermediate=2816, vocab=512, group_size=64,
                                        sym=False, zero_format="v1"),
    "dense-asym-v2-int8-actorder": gen.tiny_llama(num_layers=1, hidden=512, intermediate=1536, vocab=512, bits=8,
                                                  sym=False, zero_format="v2", checkpoint_format_label="gptq_v2",
                                                  act_order=True),
    "dense-bf16-model": gen.tiny_llama(num_layers=1, hidden=1024, intermediate=2816, vocab=512,
                                       scale_dtype="bfloat16", extra_dtype="bfloat16"),
    "dense-mixed-dynamic": mixed_dynamic(),
    # AutoRound's own format: its GPTQ packing (zero points minus 1) and its asymmetric packing (as they are)
    "autoround-gptq-sym": autoround("auto_round:auto_gptq", True, "v1"),
    "autoround-asym-v2": autoround("auto_round", False, "v2"),
}
for name, spec in cases.items():
    gen.write_checkpoint(root / f"{name}-gptq", spec)
print("generated", ", ".join(cases))
PYEOF
# real producer output (tests/fixtures, README there): every GPTQModel and llm-compressor case, without the
# producer's reference file (it is not part of the checkpoint)
for fixture in tests/fixtures/gptqmodel/*/ tests/fixtures/llmcompressor/*/; do
  producer=$(basename "$(dirname "$fixture")")
  dest="$E2E/fx-$producer-$(basename "$fixture")-gptq"
  cp -r "$fixture" "$dest" && rm -f "$dest/reference_dequant.safetensors"
done
# each checkpoint converted and verified in its own job, E2E_JOBS at a time (default 4; the GPU takes several verify
# processes at once): the loop one by one took about 200 s of the script's 550 on an H200 machine
e2e_one() {  # name src: convert, verify, and write the row's status and summary to $OUT/e2e_row_$name
  local name=$1 src=$2 status extra=()
  [[ "$name" == moe-per-expert ]] && extra=(--stack-experts)
  if timeout "$E2E_TIMEOUT" $PY -m marlin_convert.cli.app "$src" "$E2E/$name-marlin" -q "${extra[@]}" \
        > "$OUT/convert_$name.log" 2>&1 &&
     timeout "$E2E_TIMEOUT" $PY -m marlin_convert.cli.app verify "$E2E/$name-marlin" --gpu 0 --batch 1,16,128 -q \
        --source "$src" --json "$OUT/verify_$name.json" > "$OUT/verify_$name.log" 2>&1; then
    status=ok
  else
    status=FAILED; tail -n 5 "$OUT/convert_$name.log" "$OUT/verify_$name.log" || true
  fi
  summary=$($PY -c "
import json, sys
try:
    r = json.load(open('$OUT/verify_$name.json'))
except OSError:
    print('no report'); sys.exit()
errs = [c['relative_error'] for x in r['results'] for c in x['kernel'] if c['batch']]
print(f\"{r['layers_checked']} checked, {len(r['failures'])} failed, worst rel err {max(errs):.2e}\" if errs else 'no kernel runs')
")
  printf "%s\n%s\n" "$status" "$summary" > "$OUT/e2e_row_$name"
}
names=()
for src in "$E2E"/*-gptq; do
  name=$(basename "$src" -gptq)
  names+=("$name")
  rm -f "$OUT/e2e_row_$name" "$OUT/verify_$name.json"  # (a failed run must not show an earlier run's report)
  while (( $(jobs -rp | wc -l) >= E2E_JOBS )); do wait -n || true; done
  e2e_one "$name" "$src" &
done
wait
e2e_failed=0
e2e_rows=()
for name in "${names[@]}"; do
  { read -r status; read -r summary; } < "$OUT/e2e_row_$name" 2>/dev/null || { status=FAILED; summary="no result"; }
  [[ $status == ok ]] || e2e_failed=1
  e2e_rows+=("$(printf "  %-34s %-7s %s" "$name" "$status" "$summary")")
done
RESULT[e2e]=$([ $e2e_failed = 0 ] && echo "ok (${#e2e_rows[@]} checkpoints converted and verified)" || echo "FAILED")

# ---- final short table
echo
echo "== gpu_check summary =="
for key in build gpu_tests sanitizer bench e2e; do
  printf '%-10s %s\n' "$key" "${RESULT[$key]:-not run}"
done
printf '%s\n' "${e2e_rows[@]}"
[[ "${RESULT[gpu_tests]}" == ok* || "${RESULT[gpu_tests]}" == skipped* ]] &&
  [[ "${RESULT[e2e]}" == ok* && "${RESULT[sanitizer]}" != FAILED* ]]
