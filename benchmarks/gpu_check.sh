#!/usr/bin/env bash
# The GPU check: benchmarks/realsize.py on the lent NVIDIA machine (H200 or H100), one
# command, about 8 minutes. Run from the repository root there, with ./.whl carried (built
# here by tools/gpu_wheels.sh, ~40 MB):
#     bash benchmarks/gpu_check.sh        # device tool: carry [".whl"], timeout_s 600
#
# Runs, most wanted first, each time-boxed (timeout) so a slow one leaves the others' files;
# all at Wan 2.1 T2V 1.3B's real size (random weights; the checkpoint, ~6 GB, is built by the
# first run in /tmp, about a minute), 480 x 832, 3 steps (the fewest that give diffusers'
# s/step two intervals between step ends), ours with --attention auto (= cudnn on a GPU):
#   1. bf16 at 81 frames (the default video length) against diffusers' eager WanPipeline and a
#      torch.compile'd one: s/step, peak memory, mean/max difference in 0-255 levels.
#      --no_float32 leaves out realsize.py's float32 row here (run 3 has it): its own compile
#      and a float32 torch.compile would not fit the budget.   Budget 300 s (expected ~250).
#   2. The same bf16 row with ours at --quantize fp8 (issue 54), against diffusers' eager
#      bf16 only.                                           Budget 140 s (expected ~110).
#   3. float32 parity at 5 frames (not the default 21: a minute, not two) against eager
#      diffusers, TF32 off on both sides.                         Budget 110 s (expected ~95).
# Worst case 550 s of runs plus ~20 s of installs: inside the device tool's 600 s.
#
# Environment: JAX_PLATFORMS=cuda; XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 (ours runs in a
# subprocess that exits before torch allocates; the rest is the CUDA context's room);
# PYTHONUNBUFFERED=1 so the log is live. Packages: the machine's own torch, jax (0.11.2 there,
# not requirements.txt's 0.10.2; the reports record the versions) and transformers; the rest
# from .whl, installed into /tmp/site as the device tool's README says.
#
# Results in $OUT (at most 8 files come back; our frames stay in /tmp, an 81-frame video is
# 388 MB): gpu_check.log (everything), env.txt (GPU, driver, versions), and per run NAME its
# realsize table NAME.json plus ours' JSON report NAME-ours-<dtype>-<frames>f.json.
set -uo pipefail

OUT="${OUT:-$PWD/outputs/gpu_check}"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 PYTHONUNBUFFERED=1
CKPT=/tmp/realsize-wan2.1-1.3b
common=(--scale real --checkpoint "$CKPT" --steps 3 --frames 5 --full_frames 81)

run() {  # run SECONDS NAME ARGS...: realsize.py time-boxed; its json and ours' reports to $OUT
  local budget=$1 name=$2
  shift 2
  local dir="/tmp/$name" report
  echo "== $name ($SECONDS s in): realsize.py ${common[*]} $*"
  timeout "$budget" python3 benchmarks/realsize.py "${common[@]}" --output_dir "$dir" "$@"
  echo "== $name: exit $? at $SECONDS s"
  [[ -f "$dir/realsize.json" ]] && cp "$dir/realsize.json" "$OUT/$name.json"
  for report in "$dir"/ours-*/*.json; do
    [[ -f "$report" ]] && cp "$report" "$OUT/$name-$(basename "$(dirname "$report")").json"
  done
  return 0
}

main() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "gpu_check: wheel install failed"; return 1; }
  export PYTHONPATH=/tmp/site
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('torch', 'jax',
      'jaxlib', 'diffusers', 'torchax', 'transformers', 'imageio-ffmpeg')})"
    python3 -c "import imageio_ffmpeg; print('ffmpeg:', imageio_ffmpeg.get_ffmpeg_exe())"
  } 2>&1 | tee "$OUT/env.txt"

  run 300 bf16 --bf16 --no_float32 --torch_compile
  run 140 bf16-fp8 --bf16 --no_float32 --quantize fp8
  run 110 float32

  echo "== gpu_check done at $SECONDS s"
  ls -la "$OUT"
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu_check.log"
