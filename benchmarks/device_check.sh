#!/usr/bin/env bash
# The engine's checks on a lent GPU in one call of the device tool, under 8 minutes with the installs
# (docs/performance.md, "On an H200"). Run from the repository root on the device machine, with beside the tree:
# the wheels the image lacks in .whl (benchmarks/device_wheels.txt), the tokenizer in .dev/tokenizer, and the
# "before" engine's tree in .dev/before (`mkdir -p .dev/before && git archive REF core benchmarks | tar -x -C
# .dev/before`, REF written to .dev/before/REF). Steps, each with its own time limit (one that hangs costs only
# its own), cut to what is left of BUDGET seconds from the script's start (default 450, installs included; a step
# with under 20 s left is skipped):
#   gpu-kernels             the GPU kernels alone (today's, aligned, the new one): rows bitwise across layouts, time
#                           (in a dry run: each lowered for CUDA)
#   contract[-before|-ws]   benchmarks.bench on the contract (2,000-token query, 500 items of 20): items/s, and
#                           |query cached - computed| of the scores
#   sglang[-before|-ws]     sglang's PR shape: 128 requests of a 300-token query and 10 items of 20, together
#   check                   packscore check --profile: the op table (device time per op kind)
#   service                 packscore serve --embedded, 24 contract jobs through POST /jobs: items/s
# -ws: the new GPU kernel (PACKSCORE_GPU_KERNEL=ws), run on a device unless the caller sets PACKSCORE_GPU_KERNEL to
# another value, and in a dry run only when the caller sets it to ws; otherwise today's kernel alone runs and the
# summary says why. Logs go to $OUT/logs.tgz, the profile to
# $OUT/profile, the summary to $OUT/summary.json (printed last). STEPS: the steps to run (default: all).
# DEVICE_CHECK_DRY=1: every step on the CPU with the bundled model and tiny shapes (tests/test_device_check.py).
set -u
OUT=${OUT:-/tmp/device-out}
LOGS=${LOGS:-/tmp/device-logs}
DRY=${DEVICE_CHECK_DRY:-0}
BUDGET=${BUDGET:-450}
rm -rf "$LOGS" && mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ "$DRY" = 1 ]; then  # the bundled model on the CPU, shapes that take seconds
  export JAX_PLATFORMS=cpu WARMUP=none  # the service compiles its programs when its jobs need them
  MODEL=tiny-random DTYPE=float32 CONTRACT="50 10 5" SGLANG="4 30 3 5" JOB_SHAPE="40 8 5" REPEATS=1
  PEAK=(--peak-size 256)
  BEFORE=${BEFORE:-.dev/before}; [ -d "$BEFORE" ] || BEFORE=.  # the tree itself stands in for "before"
else
  if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
  fi
  MODEL=/tmp/qwen3-0.6b-random DTYPE=bfloat16 CONTRACT="2000 500 20" SGLANG="128 300 10 20" JOB_SHAPE="2000 500 20"
  BEFORE=${BEFORE:-.dev/before}
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
NEW_KERNEL=${PACKSCORE_GPU_KERNEL-ws}  # on a device the new kernel runs too; the dry run asks for it by name
[ "$DRY" = 1 ] && NEW_KERNEL=${PACKSCORE_GPU_KERNEL:-}
unset PACKSCORE_GPU_KERNEL  # today's kernel unless a step names the new one
if [ "$NEW_KERNEL" = ws ] && grep -rqs PACKSCORE_GPU_KERNEL core/; then
  echo "ws: run (PACKSCORE_GPU_KERNEL=ws)" >"$LOGS/kernels.txt"
else
  echo "ws: not run: PACKSCORE_GPU_KERNEL is '${NEW_KERNEL}' (ws runs when it is ws and core/ reads it); today's kernel only" \
    >"$LOGS/kernels.txt"
  NEW_KERNEL=
fi
step() {  # step NAME SECONDS COMMAND...: its output in NAME.log, its exit status and time in steps.txt
  local name=$1 limit=$2 start=$SECONDS left=$((BUDGET - SECONDS))
  shift 2
  case " ${STEPS:-$name} " in *" $name "*) ;; *) return ;; esac
  if [ "$left" -lt 20 ]; then
    echo "$name skipped ${limit}s-limit 0s budget" | tee -a "$LOGS/steps.txt"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "$name rc=$? ${limit}s-limit $((SECONDS - start))s" | tee -a "$LOGS/steps.txt"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}
echo "dry=$DRY model=$MODEL dtype=$DTYPE contract=$CONTRACT sglang=$SGLANG before=$BEFORE $(cat "$BEFORE/REF" 2>/dev/null)" \
  >"$LOGS/setup.txt"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  $PY -c 'import jax, flax; print(jax.__version__, flax.__version__, jax.devices())' 2>&1; } >"$LOGS/gpu.txt"
if [ "$DRY" != 1 ]; then
  step checkpoint 90 $PY -m benchmarks.random_checkpoint "$MODEL" --tokenizer .dev/tokenizer
fi
export MODEL DTYPE COMPILE_CACHE_DIR=/tmp/compile-cache
read -r P N L <<<"$CONTRACT"
read -r SR SP SN SL <<<"$SGLANG"
ONE=(-P "$P" -N "$N" -L "$L" --dtype "$DTYPE" --model "$MODEL" --repeats "${REPEATS:-2}" --single-items 1 --transformers-items 0 ${PEAK[@]+"${PEAK[@]}"})
MANY=(-R "$SR" -P "$SP" -N "$SN" -L "$SL" --dtype "$DTYPE" --model "$MODEL" --repeats "${REPEATS:-2}" ${PEAK[@]+"${PEAK[@]}"})
BEFORE_MODULE=benchmarks.bench  # core.bench in trees that predate benchmarks/
[ -f "$BEFORE/benchmarks/bench.py" ] || BEFORE_MODULE=core.bench
IN_BEFORE=(bash -c 'cd "$0" && exec "$@"' "$BEFORE" $PY -m $BEFORE_MODULE)  # its cwd first on sys.path
step gpu-kernels 60 $PY -m benchmarks.gpu_kernels
step contract 90 $PY -m benchmarks.bench "${ONE[@]}"
step sglang 90 $PY -m benchmarks.bench "${MANY[@]}"
if [ -n "$NEW_KERNEL" ]; then
  step contract-ws 90 env PACKSCORE_GPU_KERNEL=ws $PY -m benchmarks.bench "${ONE[@]}"
  step sglang-ws 90 env PACKSCORE_GPU_KERNEL=ws $PY -m benchmarks.bench "${MANY[@]}"
fi
step check 150 $PY -m packscore.cli check --profile --profile-dir "$OUT/profile" --json
read -r JP JN JL <<<"$JOB_SHAPE"
step service 150 $PY -m benchmarks.service_jobs --jobs 24 -P "$JP" -N "$JN" -L "$JL" --model "$MODEL"
if [ -d "$BEFORE" ]; then
  step contract-before 90 "${IN_BEFORE[@]}" "${ONE[@]}"
  step sglang-before 90 "${IN_BEFORE[@]}" "${MANY[@]}"
else
  echo "before: not run: no $BEFORE" >>"$LOGS/setup.txt"
fi
$PY -m benchmarks.device_summary "$LOGS" "$OUT/summary.json"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
