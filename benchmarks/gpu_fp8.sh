#!/usr/bin/env bash
# Issue 54's GPU row: ours at --quantize fp8 beside ours in bf16, in one script on the lent
# NVIDIA machine, at Wan 2.1 T2V 1.3B's real size (random weights), 480 x 832 x 81, 3 steps.
# Run from the repository root there, with ./.whl carried (tools/gpu_wheels.sh):
#     bash benchmarks/gpu_fp8.sh          # device tool: carry [".whl"], timeout_s 540
#
# Why a script of its own: on 2026-11-27 gpu_check.sh's fp8 row did not finish (placement
# 47 s, then the step's compile still running after ~180 s). This one
#   1. builds the checkpoint in the background (CPU only) while
#   2. benchmarks/fp8_probe.py compiles and times one quantized linear per Wan layer shape
#      under three XLA flag sets (default, no Triton GEMM, no autotuning) and picks one;
#   3. runs ours in bf16 (the baseline, same script, same card), then
#   4. ours with --quantize fp8 under the picked flags, its log live in $OUT/fp8.log;
#   5. compares the two runs' frames in 0-255 levels and prints s/step, cold start and peak
#      device memory of each (benchmarks/gpu_fp8_compare.py).
# Budgets (timeout): probe 150 s, bf16 150 s, fp8 200 s: worst case ~520 s with installs.
# SCALE/HEIGHT/WIDTH/FRAMES/TOKENS override the sizes (a CPU rehearsal: SCALE=cpu HEIGHT=64
# WIDTH=96 FRAMES=9 TOKENS=256 JAX_PLATFORMS=cpu).
set -uo pipefail

OUT="${OUT:-$PWD/outputs/gpu_fp8}"
SCALE="${SCALE:-real}" HEIGHT="${HEIGHT:-480}" WIDTH="${WIDTH:-832}" FRAMES="${FRAMES:-81}"
TOKENS="${TOKENS:-32760}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.85
export PYTHONUNBUFFERED=1 JAX_LOG_COMPILES=1  # each jit's compile seconds in the logs
CKPT="/tmp/realsize-wan2.1-1.3b-$SCALE"
PY="${PY:-python3}"

ours() {  # ours NAME BUDGET [FLAGS...]: generate_flax.py as realsize.py runs it, log live
  local name=$1 budget=$2 dir="/tmp/gpu_fp8/$1"
  shift 2
  rm -rf "$dir" && mkdir -p "$dir"
  echo "== $name ($SECONDS s in), XLA_FLAGS='${XLA_FLAGS:-}'"
  timeout -k 10 "$budget" "$PY" generate_flax.py --model_id "$CKPT" --dtype bfloat16 \
    --height "$HEIGHT" --width "$WIDTH" --frames "$FRAMES" --num_inference_steps 3 \
    --guidance_scale 5.0 --flow_shift 3.0 --seed 42 --scheduler unipc --attention auto \
    --num_iterations 1 --save_frames --no_plots --output_dir "$dir" "$@" 2>&1 \
    | tee "$OUT/$name.log" | tail -n 25
  echo "== $name: exit ${PIPESTATUS[0]} at $SECONDS s"
  cp "$dir"/*.json "$OUT/$name.json" 2>/dev/null
  return 0
}

main() {
  if [[ -d .whl && -z "${NO_WHEELS:-}" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || { echo "gpu_fp8: wheel install failed"; return 1; }
    export PYTHONPATH=/tmp/site
  fi
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$PY" -c "import importlib.metadata as m; print({p: m.version(p) for p in ('torch', 'jax',
      'jaxlib', 'diffusers', 'torchax', 'transformers')})"
  } 2>&1 | tee "$OUT/env.txt"

  "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import realsize as r
r.build_checkpoint(r.parse_args(['--scale', '$SCALE', '--checkpoint', '$CKPT']))" \
    > "$OUT/checkpoint.log" 2>&1 &
  local build=$!
  echo "== probe ($SECONDS s in)"
  timeout -k 10 150 "$PY" benchmarks/fp8_probe.py --tokens "$TOKENS" --timeout 45 \
    > "$OUT/probe.log" 2>&1
  echo "== probe: exit $? at $SECONDS s"
  cut -c1-600 "$OUT/probe.log"
  local flags
  flags="$(tail -n 1 "$OUT/probe.log" | "$PY" -c \
    "import json, sys; print(json.loads(sys.stdin.read())['pick_flags'])" 2>/dev/null)"
  wait "$build"
  echo "== checkpoint: exit $? at $SECONDS s"; tail -n 2 "$OUT/checkpoint.log"

  ours bf16 150
  XLA_FLAGS="${XLA_FLAGS:-} $flags" ours fp8 200 --quantize fp8
  "$PY" benchmarks/gpu_fp8_compare.py /tmp/gpu_fp8/bf16 /tmp/gpu_fp8/fp8 \
    "--xla_flags=$flags" | tee "$OUT/compare.txt"
  echo "== gpu_fp8 done at $SECONDS s"
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu_fp8.log"
