#!/usr/bin/env bash
# Issue 54's GPU row: ours at --quantize fp8 beside ours in bf16, in one script on the lent
# NVIDIA machine, at Wan 2.1 T2V 1.3B's real size (random weights), 480 x 832 x 81, 3 steps.
# Run from the repository root there, with ./.whl carried (tools/gpu_wheels.sh):
#     bash benchmarks/gpu_fp8.sh          # device tool: carry [".whl"], timeout_s 540
#
# Why a script of its own: on 2026-11-27 gpu_check.sh's fp8 row did not finish (placement
# 47 s, then the step's compile still running after ~180 s). This one
#   1. builds the checkpoint in the background (CPU only) while (PROBE=1)
#   2. benchmarks/fp8_probe.py compiles and times one quantized linear per Wan layer shape
#      under three XLA flag sets (default, no Triton GEMM, no autotuning), for the record;
#   3. runs ours in bf16 twice (the baselines, same script, same card): with XLA's default
#      GEMMs (Triton, autotuned) and with cuBLAS (--xla_gpu_enable_triton_gemm=false, the
#      flag an fp8 run sets itself: quantize.prefer_cublas_fp8), then
#   4. ours with --quantize fp8, its log live in $OUT/fp8.log;
#   5. compares fp8 against each bf16 run, and the two bf16 runs, in 0-255 levels, with
#      s/step, cold start and peak device memory (benchmarks/gpu_fp8_compare.py).
# Budgets (timeout): probe 150 s, bf16 150 s each, fp8 200 s: ~650 s worst case with the
# probe (over one device call: run PROBE=1 only to diagnose), ~300 s without (H200, 2026-11-27).
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
  if [[ -n "${PROBE:-}" ]]; then
    echo "== probe ($SECONDS s in)"
    timeout -k 10 150 "$PY" benchmarks/fp8_probe.py --tokens "$TOKENS" --timeout 45 \
      > "$OUT/probe.log" 2>&1
    echo "== probe: exit $? at $SECONDS s"
    cut -c1-600 "$OUT/probe.log"
  fi
  wait "$build"
  echo "== checkpoint: exit $? at $SECONDS s"; tail -n 2 "$OUT/checkpoint.log"

  ours bf16 150
  # bf16 with cuBLAS GEMMs too (the flag fp8 runs get: quantize.prefer_cublas_fp8), so the
  # fp8 ratio compares the same GEMM library
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" ours bf16-cublas 150
  ours fp8 200 --quantize fp8  # no XLA_FLAGS of ours: generate_flax.py adds the flag itself
  for base in bf16 bf16-cublas; do
    "$PY" benchmarks/gpu_fp8_compare.py "/tmp/gpu_fp8/$base" /tmp/gpu_fp8/fp8 | tee "$OUT/$base-vs-fp8.txt"
  done
  "$PY" benchmarks/gpu_fp8_compare.py /tmp/gpu_fp8/bf16 /tmp/gpu_fp8/bf16-cublas \
    | tee "$OUT/bf16-vs-cublas.txt"
  echo "== gpu_fp8 done at $SECONDS s"
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu_fp8.log"
