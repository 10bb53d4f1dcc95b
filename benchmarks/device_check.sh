#!/usr/bin/env bash
# The engine's checks on a lent GPU, in one call (docs/performance.md, "On an H200"): run from the repository root
# on the device machine, with the wheels the image lacks in .whl (benchmarks/device_wheels.txt), the bundled
# model's tokenizer saved in .dev/tokenizer, and b31e77f's engine in .dev/b31e77f (the "before":
# `git archive b31e77f core | tar -x -C .dev/b31e77f`). Each step's output goes to $OUT/logs.tgz (the device tool
# brings back at most 8 files), the profile's trace and HLO to $OUT/profile; a summary is printed last. Each step
# has its own time limit, so one that hangs costs only its own. STEPS: the steps to run (default: all, in order).
set -u
OUT=${OUT:-/tmp/device-out}
LOGS=/tmp/device-logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
step() {  # step NAME SECONDS COMMAND...: its output in NAME.log, its exit status and time in steps.txt
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  case " ${STEPS:-$name} checkpoint " in *" $name "*) ;; *) return ;; esac
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "$name rc=$? ${limit}s-limit $((SECONDS - start))s" | tee -a "$LOGS/steps.txt"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv >"$LOGS/gpu.txt" 2>&1
python3 -c 'import jax, flax, transformers; print(jax.__version__, flax.__version__, transformers.__version__)' \
  >>"$LOGS/gpu.txt" 2>&1
# LAYERS and SHAPE: a quick try of this script on a CPU (LAYERS=2 SHAPE="50 10 5").
MODEL_DIR=/tmp/qwen3-0.6b-random
read -r P N L <<<"${SHAPE:-2000 500 20}"
step checkpoint 120 python3 -m benchmarks.random_checkpoint "$MODEL_DIR" \
  --tokenizer .dev/tokenizer ${LAYERS:+--layers $LAYERS}
export MODEL=$MODEL_DIR DTYPE=bfloat16 COMPILE_CACHE_DIR=/tmp/compile-cache
BENCH=(-P "$P" -N "$N" -L "$L" --dtype bfloat16 --model "$MODEL_DIR" --single-items 1 --transformers-items 0)
# Rows that must not move with the cache: the GPU kernels alone, then in the engine (PACKSCORE_ALIGNED_KEY_TILES=1:
# the aligned kernels; XLA_FLAGS: the matmuls' algorithm fixed, cuBLAS's heuristics instead of autotuning).
step gpu-kernels 180 python3 -m benchmarks.gpu_kernels
step bench-aligned 120 env PACKSCORE_ALIGNED_KEY_TILES=1 python3 -m benchmarks.bench "${BENCH[@]}"
step check 240 python3 -m packscore.cli check --profile --profile-dir "$OUT/profile" --json
step bench 120 python3 -m benchmarks.bench "${BENCH[@]}"
step bench-ws 120 env PACKSCORE_GPU_KERNEL=ws python3 -m benchmarks.bench "${BENCH[@]}"
PINNED="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"
step bench-pinned 120 env XLA_FLAGS="$PINNED" python3 -m benchmarks.bench "${BENCH[@]}"
step bench-aligned-pinned 120 env PACKSCORE_ALIGNED_KEY_TILES=1 XLA_FLAGS="$PINNED" python3 -m benchmarks.bench \
  "${BENCH[@]}"
step bench-b31e77f 120 env PYTHONPATH=/tmp/site bash -c 'cd .dev/b31e77f && exec python3 -m core.bench "$@"' _ \
  "${BENCH[@]}"
step bench-requests 120 python3 -m benchmarks.bench "${BENCH[@]}" --requests 4
step check-aligned 200 env PACKSCORE_ALIGNED_KEY_TILES=1 python3 -m packscore.cli check --profile --json
python3 -m benchmarks.device_summary "$LOGS"
