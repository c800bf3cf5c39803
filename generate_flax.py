"""Wan 2.1 text-to-video on JAX (TPU first), through torchax and a Splash attention kernel.

One script, one flow. Each stage is one function; ``main()`` only orchestrates:

    parse_args -> validate_args -> load_pipeline -> encode_prompts -> make_mesh
    -> shard_weights -> compile_transformer_step / compile_vae_decode
    -> [denoise -> decode] x num_iterations (first = warmup) -> save_video + save_report

The model code is diffusers' PyTorch ``WanTransformer3DModel`` and ``AutoencoderKLWan``. torchax
runs them on JAX: ``torchax.interop.jax_view`` turns a torch function into a JAX function, which
we ``jax.jit`` ourselves (what ``torchax.compile`` does inside) so that shardings are explicit and
the same function can be lowered ahead of time.

Example (TPU VM, real weights):
    python generate_flax.py --model_id Wan-AI/Wan2.1-T2V-14B-Diffusers --prompt "A cat ..."

Example (CPU, tiny checkpoint):
    python generate_flax.py --model_id checkpoints/tiny-wan --height 64 --width 64 --frames 9 \
        --num_inference_steps 4
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import logging
import math
import os
import re
import sys
import tempfile
import time

import numpy as np

# Defaults in one place (Wan 2.1 model card: 720p uses flow_shift 5.0, 480p uses 3.0; 50 UniPC
# steps, CFG 5.0, 16 fps, 512 text tokens).
DEFAULTS = dict(
    model_id="Wan-AI/Wan2.1-T2V-14B-Diffusers",
    prompt="A cat walks on the grass, realistic style.",
    negative_prompt=(
        "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, "
        "images, static, overall gray, worst quality, low quality, JPEG compression residue, ugly, "
        "incomplete, extra fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, "
        "misshapen limbs, fused fingers, still picture, messy background, three legs, many people "
        "in the background, walking backwards"
    ),
    height=720,
    width=1280,
    frames=81,
    fps=16,
    num_inference_steps=50,
    guidance_scale=5.0,
    flow_shift=None,  # resolved from the resolution: see resolve_flow_shift
    seed=42,
    warmup_steps=2,
    num_iterations=1,
    output_dir="outputs",
    dtype="bfloat16",
    max_sequence_length=512,
    attention="auto",
    stage="all",
    work_dir="work",
    scan_layers=True,
    # Splash blocks for head_dim 128 at Wan's 75,600 tokens, as tuned on v6e by a public port.
    bq=3328,
    bkv=2816,
    bkv_compute=256,
)

# Wan 2.1's VAE compresses 4x in time and 8x in space; the transformer patchifies 2x2.
VAE_TEMPORAL_SCALE = 4
VAE_SPATIAL_SCALE = 8
PIXELS_PER_TOKEN_SIDE = 16

log = logging.getLogger("generate_flax")

EXIT_USAGE = 2
EXIT_RUNTIME = 1


class UsageError(Exception):
    """Bad flags: reported as one line before any model loads."""


class GenerationError(Exception):
    """A stage failed at run time (non-finite values, unreadable weights...)."""


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="generate_flax.py",
        description="Wan 2.1 text-to-video on JAX/TPU through torchax.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = DEFAULTS
    p.add_argument("--model_id", default=d["model_id"],
                   help="diffusers-format Wan 2.1 folder, or a Hub id (needs network access)")
    p.add_argument("--prompt", default=d["prompt"], help="text prompt")
    p.add_argument("--negative_prompt", default=d["negative_prompt"],
                   help="negative prompt for classifier-free guidance")
    p.add_argument("--height", type=int, default=d["height"], help="pixels, multiple of 16")
    p.add_argument("--width", type=int, default=d["width"], help="pixels, multiple of 16")
    p.add_argument("--frames", type=int, default=d["frames"], help="video frames, of the form 4n+1")
    p.add_argument("--fps", type=int, default=d["fps"], help="frames per second of the mp4")
    p.add_argument("--num_inference_steps", type=int, default=d["num_inference_steps"],
                   help="UniPC denoising steps")
    p.add_argument("--guidance_scale", type=float, default=d["guidance_scale"],
                   help="CFG scale; > 1 runs cond and uncond as one batch-2 call")
    p.add_argument("--flow_shift", type=float, default=d["flow_shift"],
                   help="UniPC flow shift; default by resolution as the Wan 2.1 model card "
                        "says: 5.0 when the shorter side is >= 720 px, else 3.0 (480p class)")
    p.add_argument("--seed", type=int, default=d["seed"],
                   help="seed of the CPU torch.Generator that draws the initial latents")
    p.add_argument("--warmup_steps", type=int, default=d["warmup_steps"],
                   help="warmup: this many denoising steps plus one VAE decode run every "
                        "compiled program once before timing; 0 skips the warmup")
    p.add_argument("--num_iterations", type=int, default=d["num_iterations"],
                   help="timed full generations after the warmup (steady state)")
    p.add_argument("--output_dir", default=d["output_dir"],
                   help="where YYYYMMDD_HHMMSS.mp4 and .json are written")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=d["dtype"],
                   help="transformer and text-encoder weights; the VAE always runs in float32")
    p.add_argument("--max_sequence_length", type=int, default=d["max_sequence_length"],
                   help="text tokens the prompt embeddings are padded to")
    p.add_argument("--attention", choices=("auto", "splash", "stock_splash", "xla"),
                   default=d["attention"],
                   help="SDPA backend: splash = our kernel, stock_splash = JAX's own splash "
                        "kernel (the trusted fallback), xla = plain XLA attention (needs "
                        "~228 GB per chip for 14B at 720p); auto = splash on TPU, else xla")
    p.add_argument("--bq", type=int, default=d["bq"],
                   help="Splash block_q: queries per kernel grid step (multiple of 128)")
    p.add_argument("--bkv", type=int, default=d["bkv"],
                   help="Splash block_kv: keys per grid step (multiple of --bkv_compute)")
    p.add_argument("--bkv_compute", type=int, default=d["bkv_compute"],
                   help="Splash block_kv_compute: keys per score tile (multiple of 128)")
    p.add_argument("--compilation_cache_dir", default=default_cache_dir(),
                   help="JAX persistent compilation cache; 'none' disables it")
    p.add_argument("--stage", choices=("all", "encode", "denoise", "decode"),
                   default=d["stage"],
                   help="all = one shot; encode / denoise / decode run one stage each, with "
                        "intermediates in --work_dir")
    p.add_argument("--work_dir", default=d["work_dir"],
                   help="folder for embeddings.safetensors, generation_config.json and "
                        "latents.safetensors")
    p.add_argument("--dry_run", action="store_true",
                   help="compile the denoising step and the VAE decode for --topology with the "
                        "real TPU compiler, no TPU and no weights; print per-chip HBM; exit 0 "
                        "if the run fits, 3 if not")
    p.add_argument("--topology", default=None,
                   help="TPU topology for --dry_run, e.g. v5e:2x4, v6e:2x4, v6e:4x4, v5p:2x2x1")
    p.add_argument("--dry_run_layers", type=int, default=None,
                   help="compile only this many transformer blocks in --dry_run (quick checks)")
    p.add_argument("--dry_run_skip_vae", action="store_true",
                   help="compile only the transformer step in --dry_run (the VAE decode's TPU "
                        "compile alone can take ~10 min on a 2-core host)")
    p.add_argument("--dry_run_exact_convs", action="store_true",
                   help="compile convolutions in --dry_run with the TPU compiler's default "
                        "effort (5-10x slower VAE compile; same HBM figures measured here)")
    p.add_argument("--vae_tiling", action="store_true",
                   help="decode with diffusers' spatial tiling in one program instead of the "
                        "default frame-chunked decode")
    p.add_argument("--scan_layers", action="store_true", default=d["scan_layers"],
                   help="run the transformer blocks as one jax.lax.scan (one compiled block "
                        "instead of 40: 4.9x faster 14B TPU compile, 30%% fewer temporaries)")
    p.add_argument("--no_scan_layers", dest="scan_layers", action="store_false",
                   default=argparse.SUPPRESS,
                   help="unroll the blocks (diffusers' own loop), for comparison")
    p.add_argument("--replicate_row_parallel", action="store_true",
                   help="replicate attention-out and FFN-down weights (drops their all-reduce)")
    p.add_argument("--fsdp", action="store_true",
                   help="also shard weights over the mesh axes tensor parallelism leaves free")
    p.add_argument("--profile_dir", default=None,
                   help="capture a jax.profiler trace of one steady-state denoising step (model "
                        "call + UniPC step) into this folder, for TensorBoard/XProf or Perfetto")
    p.add_argument("--verbose", action="store_true", help="debug logging (e.g. unsharded weights)")
    p.add_argument("--save_frames", action="store_true",
                   help="also write the float32 frames in [0, 1] as <stamp>.frames.safetensors "
                        "(lossless, for quality comparisons; the mp4 is H.264)")
    m = p.add_argument_group("multi-host (one process per host; Cloud TPU finds these itself)")
    m.add_argument("--coordinator_address", default=None,
                   help="HOST:PORT of process 0's coordinator, for jax.distributed.initialize")
    m.add_argument("--num_processes", type=int, default=None, help="processes (hosts) in all")
    m.add_argument("--process_id", type=int, default=None, help="this process, 0-based")
    p.add_argument("--dp", type=int, default=None, help="mesh axis for the CFG/data batch")
    p.add_argument("--tp", type=int, default=None, help="mesh axis for tensor (head) parallelism")
    p.add_argument("--sp", type=int, default=None, help="mesh axis for sequence parallelism")
    return p.parse_args(argv)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "wan-flax", "jax-compilation-cache")


def _fail(flag: str, value, rule: str):
    raise UsageError(f"{flag}={value!r}: {rule}")


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check every flag without loading a model; raises ``UsageError`` naming flag and rule."""
    if args.frames < 1 or (args.frames - 1) % VAE_TEMPORAL_SCALE:
        _fail("--frames", args.frames, "must be of the form 4n+1 (1, 5, 9, ..., 81)")
    for flag in ("height", "width"):
        v = getattr(args, flag)
        if v < PIXELS_PER_TOKEN_SIDE or v % PIXELS_PER_TOKEN_SIDE:
            _fail(f"--{flag}", v, "must be a positive multiple of 16 (VAE 8x times patch 2x)")
    if args.num_inference_steps < 1:
        _fail("--num_inference_steps", args.num_inference_steps, "must be >= 1")
    if not math.isfinite(args.guidance_scale) or args.guidance_scale < 0:
        _fail("--guidance_scale", args.guidance_scale, "must be a finite number >= 0")
    if args.flow_shift is not None and (not math.isfinite(args.flow_shift)
                                        or args.flow_shift <= 0):
        _fail("--flow_shift", args.flow_shift, "must be a finite number > 0")
    if args.num_iterations < 1:
        _fail("--num_iterations", args.num_iterations, "must be >= 1")
    if args.warmup_steps < 0:
        _fail("--warmup_steps", args.warmup_steps, "must be >= 0 (0 skips the warmup)")
    if args.fps < 1:
        _fail("--fps", args.fps, "must be >= 1")
    if args.max_sequence_length < 1:
        _fail("--max_sequence_length", args.max_sequence_length, "must be >= 1")
    for flag in ("dp", "tp", "sp"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            _fail(f"--{flag}", v, "must be >= 1")
    block_sizes(args)
    resolve_flow_shift(args)
    _validate_distributed(args)
    if args.profile_dir is not None:
        if args.dry_run or args.stage in ("encode", "decode"):
            _fail("--profile_dir", args.profile_dir, "needs a denoising run: --stage all or "
                  "denoise, without --dry_run")
        _validate_output_dir(args.profile_dir, flag="--profile_dir")
    if args.dry_run:
        if not args.topology or not re.fullmatch(r"(v\d+[a-z]*|tpu\d+[a-z]*):\d+x\d+(x\d+)?",
                                                 args.topology):
            _fail("--topology", args.topology, "--dry_run needs a TPU topology such as v6e:2x4 "
                  "or tpu7x:2x2x1")
        if args.dry_run_layers is not None and args.dry_run_layers < 1:
            _fail("--dry_run_layers", args.dry_run_layers, "must be >= 1")
        if model_config_dir(args.model_id) is None:
            _fail("--model_id", args.model_id, "no local folder or shipped config under "
                  "configs/ (shipped: Wan-AI/Wan2.1-T2V-14B-Diffusers, "
                  "Wan-AI/Wan2.1-T2V-1.3B-Diffusers)")
        _validate_output_dir(args.output_dir)
        return args
    _validate_model_id(args.model_id)
    _validate_output_dir(args.output_dir)
    return args


def _validate_distributed(args) -> None:
    """--coordinator_address/--num_processes/--process_id: all three or none."""
    given = [args.coordinator_address is not None, args.num_processes is not None,
             args.process_id is not None]
    if any(given) and not all(given):
        _fail("--coordinator_address/--num_processes/--process_id",
              f"{args.coordinator_address}/{args.num_processes}/{args.process_id}",
              "give all three or none (on Cloud TPU, none: JAX finds them)")
    if not any(given):
        return
    if args.num_processes < 1:
        _fail("--num_processes", args.num_processes, "must be >= 1")
    if not 0 <= args.process_id < args.num_processes:
        _fail("--process_id", args.process_id,
              f"must satisfy 0 <= id < --num_processes ({args.num_processes})")
    if not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", args.coordinator_address):
        _fail("--coordinator_address", args.coordinator_address, "must be HOST:PORT")
    if args.dry_run:
        _fail("--num_processes", args.num_processes, "--dry_run compiles for every host in "
              "one process; run it without the multi-host flags")


def resolve_flow_shift(args) -> argparse.Namespace:
    """Fill ``--flow_shift`` from the resolution when it was not given (in place).

    Wan 2.1's model card samples 720p with flow_shift 5.0 and 480p with 3.0. The class is
    read from the shorter side, so portrait and landscape agree: >= 720 px is 720p class.
    ``args.flow_shift_source`` records "flag" or "resolution".
    """
    if args.flow_shift is None:
        args.flow_shift = 5.0 if min(args.height, args.width) >= 720 else 3.0
        args.flow_shift_source = "resolution"
    else:
        args.flow_shift_source = "flag"
    return args


def block_sizes(args):
    """``custom_splash_attention.BlockSizes`` from --bq/--bkv/--bkv_compute; raises
    ``UsageError`` naming the flag when the kernel's rules reject them."""
    from custom_splash_attention import BlockSizes

    try:
        return BlockSizes(block_q=args.bq, block_kv=args.bkv, block_kv_compute=args.bkv_compute)
    except ValueError as e:
        flag = {"block_q": "--bq", "block_kv_compute": "--bkv_compute", "block_kv": "--bkv"}
        name = str(e).split(":")[0].removeprefix("BlockSizes.")
        value = getattr(args, flag.get(name, "--bq").lstrip("-"))
        raise UsageError(f"{flag.get(name, '--bq')}={value!r}: {str(e).split(': ', 1)[1]}") \
            from None


# The pinned huggingface_hub (2.4.0) installs only the `hf` command; `huggingface-cli` is gone.
DOWNLOAD_HINT = "hf download Wan-AI/Wan2.1-T2V-14B-Diffusers --local-dir PATH"


def _looks_local(model_id: str) -> bool:
    # A Hub id is exactly "org/name"; anything else (absolute, ./, ~, deeper paths) is a folder.
    return os.path.exists(model_id) or not re.fullmatch(r"[\w.-]+/[\w.-]+", model_id)


def _validate_model_id(model_id: str) -> None:
    if not _looks_local(model_id):
        return  # a Hub id: resolved by from_pretrained at load time
    if not os.path.isdir(model_id):
        _fail("--model_id", model_id,
              "local folder not found; build the tiny test checkpoint with "
              "'python tools/make_tiny_checkpoint.py --output PATH' or download real weights "
              f"with '{DOWNLOAD_HINT}'")
    missing = [f for f in ("model_index.json", "transformer/config.json", "vae/config.json")
               if not os.path.isfile(os.path.join(model_id, f))]
    if missing:
        _fail("--model_id", model_id,
              f"not a diffusers Wan folder, missing {', '.join(missing)}; download the weights "
              f"with '{DOWNLOAD_HINT}'")


def _validate_output_dir(path: str, flag: str = "--output_dir") -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        _fail(flag, path, f"must be a writable directory ({e.strerror or e})")


CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def model_config_dir(model_id: str) -> str | None:
    """A folder holding transformer/ and vae/ config.json for ``model_id``: the local folder,
    else the architecture configs this project ships for the public Wan 2.1 ids."""
    for path in (model_id, os.path.join(CONFIGS_DIR, model_id)):
        if os.path.isfile(os.path.join(path, "transformer", "config.json")):
            return path
    return None


def read_vae_config(model_id: str) -> dict:
    """The VAE's config.json as diffusers resolves it (local folder or Hub cache)."""
    from diffusers import AutoencoderKLWan

    try:
        return dict(AutoencoderKLWan.load_config(model_id, subfolder="vae"))
    except (OSError, ValueError) as e:
        raise UsageError(f"--model_id={model_id!r}: no VAE config ({e})") from None


def read_transformer_config(model_id: str) -> dict | None:
    """The transformer's config.json for a local folder, else None (Hub ids resolve later)."""
    path = os.path.join(model_id, "transformer", "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return None


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------


# Persistent-cache traffic of this process, from JAX's monitoring events.
CACHE_STATS = {"hits": 0, "misses": 0, "compile_time_saved_s": 0.0}
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
                 "/jax/compilation_cache/cache_misses": "misses"}


def _count_cache_event(event: str, **_) -> None:
    if event in _CACHE_EVENTS:
        CACHE_STATS[_CACHE_EVENTS[event]] += 1


def _count_cache_saving(event: str, seconds: float, **_) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        CACHE_STATS["compile_time_saved_s"] += seconds


def enable_compilation_cache(path: str) -> bool:
    """Turn on JAX's persistent compilation cache at ``path``; returns whether it is on.

    Every compiled program is cached (no minimum compile time or size): the VAE decode and the
    transformer step are the slow ones, and a warm process then skips XLA compilation entirely.
    Hits, misses and the compile seconds saved are counted in ``CACHE_STATS`` (the report's
    ``compilation_cache``) through ``jax.monitoring`` listeners.
    """
    if path.lower() == "none":
        return False
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not getattr(enable_compilation_cache, "listening", False):
        jax.monitoring.register_event_listener(_count_cache_event)
        jax.monitoring.register_event_duration_secs_listener(_count_cache_saving)
        enable_compilation_cache.listening = True
    return True


def quiet_known_warnings() -> None:
    """Silence three warnings that are understood and harmless, so real ones stay visible."""
    import warnings

    # torchax writes float32 RoPE products into a bf16 buffer through a JAX scatter; torch casts
    # on assignment too, so the values are the ones diffusers computes.
    warnings.filterwarnings("ignore", message="scatter inputs have incompatible types",
                            category=FutureWarning)
    # torch int64 indices become int32 under JAX's default x64=False; our sizes are far below 2^31.
    warnings.filterwarnings("ignore", message="Explicitly requested dtype int64",
                            category=UserWarning)
    # imageio-ffmpeg starts ffmpeg with fork+exec; exec follows fork at once, so JAX's threads
    # are never used in the child.
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


def _has_tpu_device_files() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


# Seconds without a heartbeat after which JAX's coordination service declares a process dead
# and stops the others (JAX's default is 100 s); heartbeats come from a background thread, so
# long compiles do not count against it.
DISTRIBUTED_HEARTBEAT_TIMEOUT_S = 30


def start_distributed(args) -> bool:
    """Join JAX's multi-controller runtime when the run spans several processes (hosts).

    With --num_processes > 1 the flags say who is who; off TPU the processes talk through
    JAX's CPU collectives (gloo). On a TPU VM without the flags, ``jax.distributed.initialize``
    finds the slice's hosts itself (a single host finds one process). Must run before any
    other JAX call. Returns whether more than one process takes part.

    Raises:
        GenerationError: the runtime could not start (coordinator unreachable...).
    """
    configure_jax_platform()
    import jax

    explicit = args.num_processes is not None
    if explicit and args.num_processes == 1:
        return False
    if not explicit and not _has_tpu_device_files():
        return False
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator_address, num_processes=args.num_processes,
            process_id=args.process_id,
            heartbeat_timeout_seconds=DISTRIBUTED_HEARTBEAT_TIMEOUT_S)
    except ValueError as e:
        if explicit:
            raise GenerationError(f"could not join the multi-host runtime: {e}") from None
        # Auto-detection found no cluster (JAX leaves the coordinator unset): a TPU host
        # outside a managed slice runs on its own chips, as it did before multi-host support.
        log.warning("no multi-host TPU slice detected (%s): using this host's chips only", e)
        return False
    except Exception as e:  # the runtime's errors are long; one line names the cause
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GenerationError(f"could not join the multi-host runtime: {first[:300]}") \
            from None
    return jax.process_count() > 1


def is_writer() -> bool:
    """Only process 0 writes files (mp4, JSON, intermediates, profile)."""
    import jax

    return jax.process_index() == 0


def to_host(x) -> np.ndarray:
    """A ``jax.Array`` as a NumPy array on this host; gathered from every process when its
    shards live on several (``multihost_utils.process_allgather``)."""
    import jax

    if x.is_fully_addressable:
        return np.array(jax.device_get(x))  # a writable copy
    from jax.experimental import multihost_utils

    return np.array(multihost_utils.process_allgather(x, tiled=True))


def configure_jax_platform() -> None:
    """Keep JAX on CPU on hosts with no TPU unless the user chose a platform.

    ``jax[tpu]`` installs libtpu everywhere; on a CPU host its probe prints a screen of
    TPU-detection errors before falling back to CPU. Setting ``JAX_PLATFORMS=cpu`` only when no
    TPU device file exists keeps real TPU errors visible on TPU VMs.
    """
    if "JAX_PLATFORMS" not in os.environ and not _has_tpu_device_files():
        os.environ["JAX_PLATFORMS"] = "cpu"


# ---------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------


STAGE_COMPONENTS = {
    "all": ("text_encoder", "transformer", "vae"),
    "encode": ("text_encoder",),
    "denoise": ("transformer",),
    "decode": ("vae",),
}


def empty_transformer(cfg: dict, dtype):
    """``WanTransformer3DModel`` of config ``cfg`` with meta parameters (no RAM for weights),
    in ``dtype`` except the modules ``from_pretrained`` keeps in float32. Buffers (RoPE tables)
    are real. The weights come later, streamed from the checkpoint into their shards."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import WanTransformer3DModel

    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    with init_empty_weights():
        transformer = WanTransformer3DModel.from_config(cfg).eval()
    # torch's Module.to, not diffusers' override, which warns about the fp32-kept modules.
    torch.nn.Module.to(transformer, dtype)
    # from_pretrained keeps a parameter in float32 when any part of its dotted name is listed
    # (module names such as "norm1", and parameters such as "scale_shift_table").
    keep = set(transformer._keep_in_fp32_modules or [])
    for name, param in transformer.named_parameters():
        if keep.intersection(name.split(".")):
            param.data = param.data.float()
    return transformer


def component_folder(model_id: str, subfolder: str) -> str:
    """Local folder of a pipeline component: ``model_id/subfolder`` for a local checkpoint,
    else that part of the Hub snapshot (from the local cache, or downloaded)."""
    if _looks_local(model_id):
        return os.path.join(model_id, subfolder)
    from huggingface_hub import snapshot_download

    return os.path.join(snapshot_download(model_id, allow_patterns=[f"{subfolder}/*"]),
                        subfolder)


def load_pipeline(args, components=STAGE_COMPONENTS["all"]):
    """Load the diffusers ``WanPipeline`` on CPU from safetensors only, with only
    ``components`` (of "text_encoder", "transformer", "vae"); the others are None.

    The transformer comes with meta weights (``empty_transformer``): ``shard_weights`` streams
    its values from the checkpoint's safetensors straight into their device shards, so no
    host holds the whole 14B checkpoint. The text encoder uses ``--dtype``; the VAE stays
    float32 as in diffusers' Wan examples (a bf16 Wan VAE under torchax fails with a conv2d
    input/bias dtype mismatch).

    Returns:
        ``diffusers.WanPipeline`` with the requested components on CPU in eval mode.

    Raises:
        GenerationError: the weights could not be found or read.
    """
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )

    dtype = getattr(torch, args.dtype)
    skip = {name: None for name in ("text_encoder", "transformer", "vae")
            if name not in components}
    if "text_encoder" not in components:
        skip["tokenizer"] = None
    try:
        if "transformer" in components:
            skip["transformer"] = empty_transformer(
                dict(WanTransformer3DModel.load_config(args.model_id, subfolder="transformer")),
                dtype)
        if "vae" in components:
            skip["vae"] = AutoencoderKLWan.from_pretrained(
                args.model_id, subfolder="vae", dtype=torch.float32, use_safetensors=True)
        pipe = WanPipeline.from_pretrained(args.model_id, dtype=dtype, use_safetensors=True,
                                           **skip)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GenerationError(
            f"--model_id={args.model_id!r}: could not load weights: {first}") from None
    # flow_shift is a sampling choice (5.0 at 720p, 3.0 at 480p), not part of the checkpoint.
    pipe.scheduler = UniPCMultistepScheduler.from_config(
        pipe.scheduler.config, flow_shift=args.flow_shift)
    # eval() only: torchax treats parameters with requires_grad=False as buffers, which would
    # hide them from the sharding rules.
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder):
        if m is not None:
            m.eval()
    return pipe


def encode_prompts(pipe, args):
    """Encode prompt and negative prompt with UMT5 on CPU, then free the text encoder.

    Runs before any SDPA override or JAX placement, so the text encoder is plain PyTorch.

    Returns:
        (prompt_embeds, negative_embeds): CPU tensors of shape
        (1, max_sequence_length, text_dim) in the transformer dtype, zero-padded past the prompt
        as ``WanPipeline`` pads them; ``negative_embeds`` is None without CFG.
    """
    import torch

    with torch.no_grad():
        prompt_embeds, negative_embeds = pipe.encode_prompt(
            prompt=args.prompt,
            negative_prompt=args.negative_prompt,
            do_classifier_free_guidance=use_cfg(args) or args.stage == "encode",
            max_sequence_length=args.max_sequence_length,
            device=torch.device("cpu"),
            dtype=getattr(torch, args.dtype),  # the transformer's dtype, as WanPipeline casts
        )
    pipe.text_encoder = None  # UMT5-XXL is ~11 GB in bf16; nothing needs it after this.
    return prompt_embeds, negative_embeds


def use_cfg(args) -> bool:
    # diffusers' WanPipeline runs the unconditional pass only when guidance_scale > 1.
    return args.guidance_scale > 1.0


@dataclasses.dataclass(frozen=True)
class MeshShape:
    dp: int
    tp: int
    sp: int


def resolve_mesh_shape(args, n_devices: int, cfg: dict | None) -> MeshShape:
    """Choose (dp, tp, sp) from flags and the device count; raises ``UsageError``.

    Default: dp = 2 when CFG doubles the batch and the device count is even (the CFG pair splits
    over dp, as earlier Wan TPU ports do), tp = the largest divisor of the rest that divides the
    head count, sp = what is left.
    """
    num_heads = cfg["num_attention_heads"] if cfg else None
    dp, tp, sp = args.dp, args.tp, args.sp
    batch = 2 if use_cfg(args) else 1
    if dp is None:
        dp = 2 if batch == 2 and n_devices % 2 == 0 and (tp or 1) * (sp or 1) * 2 <= n_devices \
            else 1
    if tp is None:
        rest = n_devices // (dp * (sp or 1)) if n_devices % (dp * (sp or 1)) == 0 else 1
        tp = max(t for t in range(1, rest + 1)
                 if rest % t == 0 and (num_heads is None or num_heads % t == 0))
    if sp is None:
        sp = n_devices // (dp * tp) if n_devices % (dp * tp) == 0 else 1
    if dp * tp * sp != n_devices:
        _fail("--dp/--tp/--sp", f"{dp}x{tp}x{sp}",
              f"the product must equal the device count {n_devices}")
    if batch % dp:
        _fail("--dp", dp, f"must divide the transformer batch ({batch}: 2 with CFG, else 1)")
    if num_heads is not None and num_heads % tp:
        _fail("--tp", tp, f"must divide the attention head count {num_heads}")
    if cfg is not None and sp > 1 and token_count(cfg, args) % sp:
        _fail("--sp", sp, f"must divide the video token count {token_count(cfg, args)} "
              f"(frames, height and width set it)")
    return MeshShape(dp, tp, sp)


def make_mesh(shape: MeshShape, devices=None):
    """A ``jax.sharding.Mesh`` with axes ("dp", "tp", "sp") over ``devices`` (default: all).

    Axes are ``AxisType.Auto``: the torch model code carries no sharding annotations, so GSPMD
    propagates shardings from the weights and inputs we place.
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    axes, sizes, types = ("dp", "tp", "sp"), (shape.dp, shape.tp, shape.sp), (AxisType.Auto,) * 3
    try:
        return jax.make_mesh(sizes, axes, axis_types=types, devices=devices)
    except NotImplementedError:
        # jax.make_mesh maps each logical axis onto whole physical torus axes, which some
        # layouts cannot do (dp2 x tp4 x sp2 on a v6e 4x4 slice: after 4 and 4 nothing is left
        # for the two 2s). Splitting a physical axis keeps ring neighbours adjacent.
        grid = mesh_utils.create_device_mesh(sizes, devices or jax.devices(),
                                             allow_split_physical_axes=True)
        return Mesh(grid, axes, axis_types=types)


# Megatron tensor parallelism for WanTransformer3DModel (torch Linear weights are (out, in)):
# column-parallel layers split output features, row-parallel layers split input features, so
# each attention/FFN block needs one all-reduce. Norms, patch embedding, modulation tables and
# proj_out are small and replicated. First match wins. The per-head RMSNorm weights follow q/k.
COLUMN_PARALLEL_RULES = (
    (r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v)\.weight$", ("tp", None)),
    (r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v)\.bias$", ("tp",)),
    (r"blocks\.\d+\.attn[12]\.norm_[qk]\.weight$", ("tp",)),
    (r"blocks\.\d+\.ffn\.net\.0\.proj\.weight$", ("tp", None)),
    (r"blocks\.\d+\.ffn\.net\.0\.proj\.bias$", ("tp",)),
    (r"condition_embedder\.(time_embedder|text_embedder)\.linear_1\.weight$", ("tp", None)),
    (r"condition_embedder\.(time_embedder|text_embedder)\.linear_1\.bias$", ("tp",)),
)
ROW_PARALLEL_RULES = (
    (r"blocks\.\d+\.attn[12]\.to_out\.0\.weight$", (None, "tp")),
    (r"blocks\.\d+\.ffn\.net\.2\.weight$", (None, "tp")),
)


def transformer_sharding_rules(*, replicate_row_parallel: bool = False) -> tuple:
    """The regex table for the Wan transformer's state dict.

    With ``replicate_row_parallel`` the attention-out and FFN-down weights are replicated: their
    all-reduce disappears at the cost of gathering the column-parallel activations first (an
    earlier TPU port of a similar video DiT measured +11% on v6e-8 for this trade).
    """
    if replicate_row_parallel:
        return COLUMN_PARALLEL_RULES
    return COLUMN_PARALLEL_RULES + ROW_PARALLEL_RULES


def sharding_specs(names_shapes: dict, rules, mesh, *, fsdp: bool = False):
    """Map parameter names to ``PartitionSpec`` by the first matching rule.

    Args:
        names_shapes: {name: shape}.
        rules: ((regex, spec tuple), ...).
        mesh: the mesh; a rule whose axis size does not divide its dimension is not applied.
        fsdp: also shard every weight of 2+ dims over the mesh axes its rule leaves unused,
            on its largest dimension that they divide (GSPMD all-gathers it before use).

    Returns:
        ({name: PartitionSpec}, {regex: matched parameter count}, [unmatched names]).
    """
    from jax.sharding import PartitionSpec as P

    specs, counts, unmatched = {}, {rx: 0 for rx, _ in rules}, []
    for name, shape in names_shapes.items():
        axes = (None,) * len(shape)
        for rx, rule_axes in rules:
            if re.search(rx, name):
                if all(a is None or shape[i] % mesh.shape[a] == 0
                       for i, a in enumerate(rule_axes)):
                    axes = tuple(rule_axes) + (None,) * (len(shape) - len(rule_axes))
                    counts[rx] += int(math.prod(shape))
                break
        else:
            unmatched.append(name)
        if fsdp and len(shape) >= 2:
            free = tuple(a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1)
            size = math.prod(mesh.shape[a] for a in free)
            free_dims = [d for d in range(len(shape)) if axes[d] is None]
            for d in sorted(free_dims, key=lambda d: -shape[d]):
                if free and shape[d] % size == 0:
                    axes = axes[:d] + (free,) + axes[d + 1:]
                    break
        specs[name] = P(*axes)
    return specs, counts, unmatched


def module_sharding_specs(module, names_shapes: dict, rules, mesh, *, fsdp: bool = False):
    """``sharding_specs`` for a module's weights; for blocks stacked by ``--scan_layers`` the
    per-layer decisions are made on the unstacked view and get an unsharded layer axis."""
    import scan_layers

    blocks = getattr(module, "blocks", None)
    if isinstance(blocks, scan_layers.ScannedBlocks):
        return scan_layers.stacked_sharding_specs(sharding_specs, names_shapes, rules, mesh,
                                                  num_layers=blocks.num_layers, fsdp=fsdp)
    return sharding_specs(names_shapes, rules, mesh, fsdp=fsdp)


def undivided_weights(specs: dict, rules) -> list:
    """Names a sharding rule matched but left replicated because the mesh does not divide
    the rule's dimensions (``sharding_specs`` skips such a rule silently)."""
    import scan_layers

    out = []
    for name, spec in specs.items():
        probe, axes = name, tuple(spec)
        if name.startswith(scan_layers.STACKED_PREFIX):  # judge on layer 0's unstacked name
            probe, axes = "blocks.0." + name[len(scan_layers.STACKED_PREFIX):], axes[1:]
        rule = next((tuple(r) for rx, r in rules if re.search(rx, probe)), None)
        if rule is not None and tuple(axes[:len(rule)]) != rule:
            out.append(name)
    return out


def place_module(module, mesh, rules=(), *, fsdp: bool = False, include=None,
                 checkpoint: str | None = None, desc: str = "weights", on_placed=None) -> dict:
    """Wrap a torch module for torchax and stream its weights into their shards on ``mesh``.

    Every weight goes straight into its ``NamedSharding``: no device holds a whole weight
    unless its spec replicates it. Without ``checkpoint`` the values come from the module's
    own torch tensors (``placement.place_tensors``), each freed once placed. With
    ``checkpoint`` the module's weights may be meta tensors: each device's slice is read from
    the safetensors files in that folder (``placement.place_from_safetensors``), so a host
    reads only what its own devices hold; stacked ``blocks.stacked.*`` weights
    (``--scan_layers``) read their layers' ``blocks.{i}.*``. Buffers (RoPE tables) are
    replicated from the module's tensors.

    Args:
        module: a torch module on CPU.
        mesh: the ("dp", "tp", "sp") mesh.
        rules: ((regex, spec), ...) for ``sharding_specs``; no rule means replicated.
        fsdp: see ``sharding_specs``.
        include: optional ``f(name) -> bool``; only those weights are placed (the rest stay
            on the host, unused by the program that gets these params).
        checkpoint: optional folder of the module's safetensors files.
        desc: progress-bar label.
        on_placed: optional ``f(name, jax.Array)`` after each weight (memory accounting).

    Returns:
        dict(module=JittableModule, params={name: jax.Array}, buffers={name: jax.Array},
        specs={name: PartitionSpec}, rule_counts={regex: parameters}, unmatched=[names],
        undivided=[names a rule matched but whose dims the mesh does not divide],
        param_bytes=weights in their run dtypes, bytes=weights and buffers,
        bytes_read=bytes read from ``checkpoint`` (None without it), seconds=wall time).

    Raises:
        GenerationError: ``checkpoint`` holds no safetensors file, or its tensor names differ
            from the module's.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    import placement

    jm = interop.JittableModule(module)
    keep = include or (lambda name: True)
    params = {k: v for k, v in jm.params.items() if keep(k)}
    buffers = {k: v for k, v in jm.buffers.items() if keep(k)}
    reader, stacked = (None, {}) if checkpoint is None else _checkpoint_reader(
        module, checkpoint, params)
    specs, counts, unmatched = module_sharding_specs(
        module, {k: v.shape for k, v in params.items()}, rules, mesh, fsdp=fsdp)
    shardings = {k: NamedSharding(mesh, specs[k]) for k in params}
    t0 = time.perf_counter()
    if reader is None:
        placed = placement.place_tensors(params, shardings, desc=desc, on_placed=on_placed)
    else:
        placed = placement.place_from_safetensors(reader, params, shardings, desc=desc,
                                                  stacked=stacked, on_placed=on_placed)
    placed_buffers = placement.place_tensors(
        buffers, {k: NamedSharding(mesh, P()) for k in buffers}, desc=f"{desc} buffers",
        on_placed=on_placed)
    param_bytes = sum(int(math.prod(t.shape)) * t.element_size() for t in params.values())
    return dict(module=jm, params=placed, buffers=placed_buffers, specs=specs,
                rule_counts=counts, unmatched=unmatched,
                undivided=undivided_weights(specs, rules), param_bytes=param_bytes,
                bytes=param_bytes + sum(t.numel() * t.element_size() for t in buffers.values()),
                bytes_read=None if reader is None else reader.bytes_read,
                seconds=time.perf_counter() - t0)


def _checkpoint_reader(module, folder: str, params: dict):
    """(``placement.SafetensorsReader`` of ``folder`` checked against ``params``' names,
    {each ``--scan_layers`` stacked weight: its layers' names in the files})."""
    import placement
    import scan_layers

    blocks = getattr(module, "blocks", None)
    stacked = {}
    if isinstance(blocks, scan_layers.ScannedBlocks):
        for name in params:
            if name.startswith(scan_layers.STACKED_PREFIX):
                leaf = name[len(scan_layers.STACKED_PREFIX):]
                stacked[name] = [f"blocks.{i}.{leaf}" for i in range(blocks.num_layers)]
    try:
        reader = placement.SafetensorsReader(folder)
    except FileNotFoundError as e:
        raise GenerationError(f"--model_id: {e}") from None
    want = {f for name in params for f in stacked.get(name, [name])}
    missing, unexpected = sorted(want - reader.keys()), sorted(reader.keys() - want)
    if missing or unexpected:
        raise GenerationError(
            f"--model_id: {folder} does not match its config: "
            + (f"missing {', '.join(missing[:3])}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {', '.join(unexpected[:3])}" if unexpected else ""))
    return reader, stacked


def shard_weights(pipe, mesh, args, fallbacks=None):
    """Stream the transformer's weights from the checkpoint into their shards on ``mesh`` by
    the Megatron table (plus FSDP with ``--fsdp``); see ``place_module``. Logs what each
    rule matched and, at debug level, every weight no rule names; weights a rule matched but
    the mesh cannot divide are reported to ``fallbacks``. Returns {"transformer": ...} as
    ``place_module`` returns it."""
    rules = transformer_sharding_rules(replicate_row_parallel=args.replicate_row_parallel)
    if args.scan_layers:
        import scan_layers

        scan_layers.scan_blocks(pipe.transformer)  # before the sp hooks, which it keeps
    out = dict(transformer=place_module(
        pipe.transformer, mesh, rules, fsdp=args.fsdp, desc="transformer",
        checkpoint=component_folder(args.model_id, "transformer")))
    t = out["transformer"]
    for rx, n in t["rule_counts"].items():
        log.info("sharding rule %-70s matched %12s parameters", rx, f"{n:,}")
    log.debug("replicated (no rule): %s", ", ".join(t["unmatched"]))
    if t["undivided"] and fallbacks is not None:
        fallbacks("weight_replicated",
                  f"{len(t['undivided'])} weight(s) stay replicated: a sharding rule matches "
                  f"but mesh {dict(mesh.shape)} does not divide their dims "
                  f"({', '.join(t['undivided'][:3])}{', ...' if len(t['undivided']) > 3 else ''})")
    if args.sp > 1:
        add_sequence_parallel_hooks(pipe.transformer, mesh)
    return out


# The VAE decode reads only these weights; the encoder (~0.2 GB float32) stays on the host.
VAE_DECODE_PREFIXES = ("decoder.", "post_quant_conv.")


def is_vae_decode_weight(name: str) -> bool:
    return name.startswith(VAE_DECODE_PREFIXES)


def place_vae(vae, mesh) -> dict:
    """Stream the VAE's decoder weights onto every device (replicated: a conv net's weights
    are small; its activations are what ``VaeDecoder`` shards). Returns as ``place_module``."""
    return place_module(vae, mesh, include=is_vae_decode_weight, desc="VAE decoder")


class Fallbacks:
    """Every silent fallback made loud: each distinct one is logged once as a warning and
    listed in the JSON report's ``fallbacks``.

    Call it as ``fallbacks(kind, detail)``; kinds: "attention_to_xla" (a call the Splash
    wrapper cannot split), "weight_replicated" (a rule the mesh cannot divide),
    "vae_decode_replicated" (a latent width the devices do not divide).
    """

    def __init__(self):
        self.items: list[dict] = []

    def __call__(self, kind: str, detail: str) -> None:
        item = dict(kind=kind, detail=detail)
        if item not in self.items:
            self.items.append(item)
            log.warning("fallback (%s): %s", kind, detail)


def add_sequence_parallel_hooks(transformer, mesh) -> list:
    """Shard the residual stream's token axis over "sp" at every block boundary.

    Each ``WanTransformerBlock`` gets a forward pre-hook that constrains its hidden states
    (batch, tokens, dim) to P("dp", "sp", None). Norms, modulation and the FFN then run on
    1/sp of the tokens; attention re-shards as its backend needs (the Splash wrapper shards
    heads over ("tp", "sp"), an all-to-all). The torch model code is untouched.

    Returns:
        the hook handles.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    sharding = NamedSharding(mesh, P("dp", "sp", None))

    def constrain(module, args):
        hidden = interop.call_jax(jax.lax.with_sharding_constraint, args[0], sharding)
        return (hidden, *args[1:])

    return [block.register_forward_pre_hook(constrain) for block in transformer.blocks]


def _cfg_step_fn(jm, *, guidance_scale: float, cfg: bool, dtype):
    """The torch function of one denoising step's model call, to be viewed as JAX and jitted.

    latents (1, C, F, H, W) float32 -> noise prediction (1, C, F, H, W) in the model dtype.
    With CFG, cond and uncond run as one batch-2 call; the guidance combination is done in the
    model dtype, exactly as ``WanPipeline`` does it.
    """
    import torch

    def step(params, buffers, latents, timestep, embeds):
        x = latents.to(dtype)  # diffusers: latent_model_input = latents.to(transformer_dtype)
        if cfg:
            x = torch.cat([x, x])  # (2, C, F, H, W): [cond, uncond]
        t = timestep.expand(x.shape[0])
        out = jm.functional_call("forward", params, buffers, hidden_states=x, timestep=t,
                                 encoder_hidden_states=embeds, return_dict=False)[0]
        if not cfg:
            return out
        cond, uncond = out.chunk(2)
        return uncond + guidance_scale * (cond - uncond)

    return step


def compile_transformer_step(weights, mesh, args, latents, timestep, embeds):
    """JIT and AOT-compile one CFG model call; returns (compiled, seconds)."""
    import jax
    import torch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    w = weights["transformer"]
    fn = _cfg_step_fn(w["module"], guidance_scale=args.guidance_scale, cfg=use_cfg(args),
                      dtype=getattr(torch, args.dtype))
    replicated = NamedSharding(mesh, P())
    param_sh = {k: NamedSharding(mesh, s) for k, s in w["specs"].items()}
    jitted = jax.jit(
        interop.jax_view(fn),
        in_shardings=(param_sh, replicated, replicated, replicated, NamedSharding(mesh, P("dp"))),
        out_shardings=replicated,
    )
    t0 = time.perf_counter()
    compiled = jitted.lower(w["params"], w["buffers"], latents, timestep, embeds).compile()
    return compiled, time.perf_counter() - t0


def _vae_full_fn(jm):
    """Torch function: normalised latents (1, 16, F', H/8, W/8) -> video (1, 3, F, H, W) in
    [-1, 1], float32, through diffusers' own ``decode`` (used with ``--vae_tiling``)."""
    import torch

    def decode(params, buffers, latents, mean, inv_std):
        z = latents.to(torch.float32) / inv_std + mean
        return jm.functional_call("decode", params, buffers, z, return_dict=False)[0]

    return decode


def _vae_chunk_fn(jm, kinds: tuple, first: bool, record: dict, spatial=None):
    """Torch function decoding ONE latent frame with the causal-conv cache as explicit state.

    diffusers' ``AutoencoderKLWan._decode`` loops over latent frames in Python, keeping each
    causal conv's last input frames in a list (``feat_cache``) whose entries are None, the
    string "Rep" (an upsampler's first chunk) or a tensor. Jitting that whole loop unrolls it:
    at 720p x 81 frames XLA then needs 88 GB of temporaries per v6e chip. Here one call decodes
    one latent frame; the tensor entries go in and out as arrays and the None/"Rep" pattern
    (``kinds``) is static, so the decode compiles to three programs (first frame, second
    frame, every later frame) whose memory is one frame's worth.

    ``record[(kinds, first)]`` receives the kinds of the cache this call returns. ``spatial``
    (a ``NamedSharding``) splits the frame's width over the mesh: GSPMD then partitions every
    conv spatially, exchanging halos, so each chip decodes 1/n of the width instead of all chips
    decoding the same frame.
    Signature of the returned function:
        (params, buffers, z (1, 16, 1, h, w), mean, inv_std, cache list)
        -> (video chunk (1, 3, 1 or 4, 8h, 8w) float32 in [-1, 1], new cache list)
    """
    import jax
    import torch
    from torchax import interop

    def run(model, z, feat):
        x = model.post_quant_conv(z)
        return model.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=first)

    def chunk(params, buffers, z, mean, inv_std, cache):
        if spatial is not None:
            z = interop.call_jax(jax.lax.with_sharding_constraint, z, spatial)
        z = z.to(torch.float32) / inv_std + mean
        tensors = iter(cache)
        feat = [None if k == "none" else "Rep" if k == "rep" else next(tensors) for k in kinds]
        out = jm.functional_call(run, params, buffers, z, feat)
        record[(kinds, first)] = tuple(
            "none" if f is None else "rep" if isinstance(f, str) else "tensor" for f in feat)
        new_cache = [f for f in feat if f is not None and not isinstance(f, str)]
        out = torch.clamp(out, min=-1.0, max=1.0)
        if spatial is not None:
            # Keep the carried cache and the frames width-sharded too, or they come back
            # replicated: at 720p the cache alone is ~8 GB per chip.
            out, *new_cache = (interop.call_jax(jax.lax.with_sharding_constraint, t, spatial)
                               for t in (out, *new_cache))
        return out, list(new_cache)

    return chunk


class VaeDecoder:
    """The Wan VAE decode on JAX: frame-chunked with an explicit cache (default) or, with
    ``tiling=True``, diffusers' spatially tiled ``decode`` in one program.

    ``compile(latents)`` AOT-compiles every program the decode needs and returns seconds
    (``latents`` and the placed weights may be ``ShapeDtypeStruct``s with ``abstract=True``, for
    a deviceless TPU compile); ``memory()`` reports the compiled programs' HBM; calling the
    object decodes (1, 16, F', H/8, W/8) float32 latents to a (1, 3, F, H, W)
    float32 video in [-1, 1] that stays on device.
    """

    def __init__(self, placed: dict, vae, mesh, *, tiling: bool = False,
                 abstract: bool = False, fallbacks=None):
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        if vae.config.patch_size is not None:
            raise GenerationError("VAE with patch_size (Wan 2.2) is not supported yet")
        self.placed, self.vae, self.tiling = placed, vae, tiling
        self.fallbacks = fallbacks
        self.replicated = NamedSharding(mesh, P())
        z = vae.config.z_dim
        mean = np.asarray(vae.config.latents_mean, np.float32).reshape(1, z, 1, 1, 1)
        inv_std = 1.0 / np.asarray(vae.config.latents_std, np.float32).reshape(1, z, 1, 1, 1)
        if abstract:  # deviceless AOT compile (dry run): shapes only
            mean, inv_std = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated)
                             for a in (mean, inv_std))
        else:
            mean, inv_std = jax.device_put((mean, inv_std), self.replicated)
        self.mean, self.inv_std = mean, inv_std
        self.num_convs = vae._cached_conv_counts["decoder"]
        self.kinds_out: dict = {}
        self.programs: dict = {}  # (kinds, first, cache shapes) -> (compiled, out cache avals)
        self._slicers: dict = {}

    def _frame(self, latents, i):
        """Latent frame i as (1, 16, 1, h, w), laid out as the chunk programs expect."""
        import jax

        sharding = self._spatial(latents.shape) or self.replicated
        if sharding not in self._slicers:
            self._slicers[sharding] = jax.jit(
                lambda z, i: jax.lax.dynamic_slice_in_dim(z, i, 1, axis=2),
                out_shardings=sharding)
        return self._slicers[sharding](latents, i)

    def _spatial(self, shape):
        """Width sharding over every mesh device when the latent width allows it, else None."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        mesh = self.replicated.mesh
        if mesh.size == 1:
            return None
        if shape[-1] % mesh.size:
            if self.fallbacks is not None:
                self.fallbacks("vae_decode_replicated",
                               f"latent width {shape[-1]} (--width / 8) does not divide over "
                               f"{mesh.size} devices: every device decodes whole frames")
            return None
        return NamedSharding(mesh, P(None, None, None, None, mesh.axis_names))

    def _args(self, z, cache):
        p = self.placed
        return (p["params"], p["buffers"], z, self.mean, self.inv_std, cache)

    def _program(self, kinds, first, z, cache):
        import jax
        from torchax import interop

        from custom_splash_attention import forced_attention

        key = (kinds, first, tuple((c.shape, str(c.dtype)) for c in cache))
        if key not in self.programs:
            fn = _vae_chunk_fn(self.placed["module"], kinds, first, self.kinds_out,
                               self._spatial(z.shape))
            with forced_attention("xla"):  # one float32 head of 384: see forced_attention
                lowered = jax.jit(interop.jax_view(fn)).lower(*self._args(z, cache))
            cache_out = lowered.out_info[1]
            spatial = self._spatial(z.shape)
            if spatial is not None:
                cache_out = [jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=spatial)
                             for c in cache_out]
            self.programs[key] = (lowered.compile(), cache_out)
        return self.programs[key]

    def compile(self, latents) -> float:
        import jax
        from torchax import interop

        from custom_splash_attention import forced_attention

        t0 = time.perf_counter()
        if self.tiling:
            self.vae.enable_tiling()
            with forced_attention("xla"):
                self.full = jax.jit(interop.jax_view(_vae_full_fn(self.placed["module"])),
                                    out_shardings=self.replicated).lower(
                    *self._args(latents, [])[:5]).compile()
            return time.perf_counter() - t0
        b, c, f, h, w = latents.shape
        z = jax.ShapeDtypeStruct((b, c, 1, h, w), latents.dtype,
                                 sharding=self._spatial(latents.shape) or self.replicated)
        kinds, cache = ("none",) * self.num_convs, []
        for i in range(f):
            _, cache = self._program(kinds, i == 0, z, cache)
            kinds = self.kinds_out[(kinds, i == 0)]
        return time.perf_counter() - t0

    def memory(self) -> dict:
        """Peak per-device bytes over the compiled programs (they run one at a time).

        Returns dict(argument_bytes, output_bytes, temp_bytes, peak_bytes, programs).
        """
        programs = [self.full] if self.tiling else [c for c, _ in self.programs.values()]
        stats = [c.memory_analysis() for c in programs]
        peak = max(stats, key=lambda m: m.argument_size_in_bytes + m.output_size_in_bytes
                   + m.temp_size_in_bytes - m.alias_size_in_bytes)
        return dict(argument_bytes=peak.argument_size_in_bytes,
                    output_bytes=peak.output_size_in_bytes, temp_bytes=peak.temp_size_in_bytes,
                    peak_bytes=peak.argument_size_in_bytes + peak.output_size_in_bytes
                    + peak.temp_size_in_bytes - peak.alias_size_in_bytes,
                    programs=len(programs))

    def __call__(self, latents):
        import jax.numpy as jnp

        if self.tiling:
            return self.full(*self._args(latents, [])[:5])
        kinds, cache, chunks = ("none",) * self.num_convs, [], []
        for i in range(latents.shape[2]):
            z = self._frame(latents, i)
            compiled, _ = self._program(kinds, i == 0, z, cache)
            out, cache = compiled(*self._args(z, cache))
            kinds = self.kinds_out[(kinds, i == 0)]
            chunks.append(out)
        return jnp.concatenate(chunks, axis=2)


def prepare_latents(pipe, args):
    """Initial noise exactly as ``WanPipeline.prepare_latents`` draws it: a CPU
    ``torch.Generator`` seeded with ``--seed``. Returns a float32 CPU tensor
    (1, 16, (frames-1)/4+1, height/8, width/8)."""
    import torch

    generator = torch.Generator("cpu").manual_seed(args.seed)
    return pipe.prepare_latents(1, pipe.transformer.config.in_channels, args.height, args.width,
                                args.frames, torch.float32, torch.device("cpu"), generator)


def timestep_array(t):
    """A scheduler timestep as a (1,) numpy array: int32 for UniPC's integer timesteps (JAX
    runs without x64), float32 otherwise; the transformer casts it to float itself."""
    import numpy as np

    a = t.reshape(1).numpy()
    return a.astype(np.int32 if a.dtype.kind in "iu" else np.float32)


def denoise_step(step, scheduler, latents, t_torch, t, embeds):
    """One denoising step: the compiled model call, then diffusers' UniPC step run eagerly on
    JAX arrays through torchax (its float32 math is exactly upstream's). Returns the next
    float32 latents as a ``jax.Array`` (not yet synchronised)."""
    import torchax

    env = torchax.default_env()
    noise_pred = step(latents, t, embeds)
    with env:
        out = scheduler.step(env.j2t_iso(noise_pred), t_torch, env.j2t_iso(latents),
                             return_dict=False)[0]
    return env.t2j_iso(out)


def denoise(step, scheduler, latents, timesteps, embeds, *, desc: str):
    """Run the UniPC loop: one compiled model call plus one scheduler step per timestep.

    Latents stay float32 between steps as in ``WanPipeline``.

    Args:
        step: compiled model call (params bound) latents, t, embeds -> noise prediction.
        scheduler: a fresh ``UniPCMultistepScheduler`` with timesteps set.
        latents: (1, 16, F', H', W') float32 ``jax.Array``.
        timesteps: [(torch timestep, (1,) ``jax.Array``)], ``scheduler.timesteps`` in order
            (a prefix of them for the warmup).

    Returns:
        final latents, float32 ``jax.Array`` (not yet synchronised).
    """
    from tqdm import tqdm

    scheduler.set_begin_index(0)
    for t_torch, t in tqdm(timesteps, desc=desc, leave=False):
        latents = denoise_step(step, scheduler, latents, t_torch, t, embeds)
    return latents


def new_scheduler(scheduler_config, num_inference_steps: int, timesteps_sharding):
    """A fresh UniPC scheduler with its timesteps set, and [(torch t, (1,) jax.Array t)]."""
    import jax
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler.from_config(scheduler_config)
    scheduler.set_timesteps(num_inference_steps)
    timesteps = [(t, jax.device_put(timestep_array(t), timesteps_sharding))
                 for t in scheduler.timesteps]
    return scheduler, timesteps


def profile_step(profile_dir: str, *, step, scheduler_config, latents0, embeds,
                 timesteps_sharding, num_inference_steps: int) -> dict:
    """Capture a ``jax.profiler`` trace of one steady-state denoising step.

    Called after the timed runs, so every program is compiled and warm. Step 0 runs untraced
    because UniPC's first step is its first-order special case; the traced step is step 1 (the
    predictor-corrector step every later step repeats), or step 0 when there is only one. The
    trace is an XSpace ``*.xplane.pb`` for TensorBoard's profile plugin / XProf plus a
    ``perfetto_trace.json.gz`` for ui.perfetto.dev, under ``profile_dir/plugins/profile/<run>/``.

    Returns dict(dir, files (paths relative to ``profile_dir``), traced_step, seconds).
    """
    import jax

    scheduler, steps = new_scheduler(scheduler_config, num_inference_steps, timesteps_sharding)
    scheduler.set_begin_index(0)
    steps = steps[:2]
    latents = latents0
    if len(steps) == 2:
        latents = denoise_step(step, scheduler, latents, *steps[0], embeds)
        latents.block_until_ready()
    before = set(_files_under(profile_dir))
    # Every process runs the step (it is one SPMD program); process 0 traces it.
    tracing = jax.profiler.trace(profile_dir, create_perfetto_trace=True) if is_writer() \
        else contextlib.nullcontext()
    with tracing:
        with jax.profiler.StepTraceAnnotation("denoising_step", step_num=len(steps) - 1):
            t0 = time.perf_counter()
            latents = denoise_step(step, scheduler, latents, *steps[-1], embeds)
            latents.block_until_ready()
            seconds = time.perf_counter() - t0
    files = sorted(set(_files_under(profile_dir)) - before)
    return dict(dir=os.path.abspath(profile_dir), files=files, traced_step=len(steps) - 1,
                seconds=seconds)


def _files_under(root: str) -> list[str]:
    return [os.path.relpath(os.path.join(d, f), root)
            for d, _, names in os.walk(root) for f in names]


def check_finite(x, stage: str) -> None:
    import jax.numpy as jnp

    if not bool(to_host(jnp.isfinite(x).all())):
        raise GenerationError(f"{stage} produced NaN or Inf values; no video was written")


def decode(vae_decode, latents):
    """VAE-decode final latents; returns the (1, 3, F, H, W) float32 video in [-1, 1]."""
    video = vae_decode(latents)
    video.block_until_ready()
    return video


def to_frames(pipe, video):
    """(1, 3, F, H, W) in [-1, 1] -> (F, H, W, 3) float32 in [0, 1], via diffusers'
    ``VideoProcessor.postprocess_video`` as ``WanPipeline`` does."""
    import torch

    frames = pipe.video_processor.postprocess_video(torch.from_numpy(to_host(video)),
                                                    output_type="np")
    return frames[0]


def output_stem(output_dir: str) -> str:
    """A fresh ``YYYYMMDD_HHMMSS`` stem in ``output_dir`` (suffix _1, _2... on a clash)."""
    stem = time.strftime("%Y%m%d_%H%M%S")
    candidate, n = stem, 0
    while any(os.path.exists(os.path.join(output_dir, candidate + ext))
              for ext in (".mp4", ".json")):
        n += 1
        candidate = f"{stem}_{n}"
    return candidate


def _atomic_write(path: str, write) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path``; never leaves a partial file."""
    root, ext = os.path.splitext(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(root)}.partial{ext}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_video(frames, path: str, fps: int) -> None:
    """Write (F, H, W, 3) [0, 1] frames as H.264 mp4 with imageio-ffmpeg, atomically."""
    from diffusers.utils import export_to_video

    _atomic_write(path, lambda tmp: export_to_video(list(frames), tmp, fps=fps))


def save_frames(frames, path: str) -> None:
    """Write (F, H, W, 3) float32 frames in [0, 1] losslessly as safetensors ("frames")."""
    from safetensors.numpy import save_file

    _atomic_write(path, lambda tmp: save_file(
        {"frames": np.ascontiguousarray(frames, np.float32)}, tmp))


def save_report(report: dict, path: str) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2, sort_keys=False)
            f.write("\n")

    _atomic_write(path, write)


def transformer_flops(cfg: dict, args) -> float:
    """Analytic FLOPs of one denoising step's model call (all CFG passes), counting
    2 FLOPs per multiply-add, as nanoGPT's MFU estimate does.

    Per block, with S video tokens, T text tokens, D = heads*head_dim, Fd = ffn_dim:
        self-attention projections q,k,v,o: 8*S*D^2;  scores and P.V: 4*S^2*D
        cross-attention q,o: 4*S*D^2;  k,v on text: 4*T*D^2;  scores and P.V: 4*S*T*D
        FFN: 4*S*D*Fd
    Embeddings and the output projection are < 0.1% at Wan sizes and are left out.
    """
    s = token_count(cfg, args)
    t = args.max_sequence_length
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    per_block = (8 * s * d * d + 4 * s * s * d + 4 * s * d * d + 4 * t * d * d
                 + 4 * s * t * d + 4 * s * d * cfg["ffn_dim"])
    return float(per_block * cfg["num_layers"] * (2 if use_cfg(args) else 1))


def token_count(cfg: dict, args) -> int:
    pt, ph, pw = cfg["patch_size"]
    f = (args.frames - 1) // VAE_TEMPORAL_SCALE + 1
    return (f // pt) * (args.height // VAE_SPATIAL_SCALE // ph) * (
        args.width // VAE_SPATIAL_SCALE // pw)


def warmup(args, *, latents0, step=None, scheduler_config=None, embeds=None,
           vae_decode=None, timesteps_sharding=None) -> dict:
    """Run every compiled program once, so the timed runs measure steady state.

    Both programs are compiled ahead of time, so the warmup needs no whole generation:
    ``--warmup_steps`` denoising steps (UniPC's first-order step 0 and its predictor-
    corrector step 1 cover every eager scheduler op) and one VAE decode of their latents.
    At 720p on v6e-8 a whole-generation warmup would cost ~4 min per run.

    Returns:
        {} with ``--warmup_steps 0``, else dict(warmup_s, warmup_denoise_s, warmup_steps,
        warmup_vae_decode_s), keys present for the stages that ran.
    """
    if args.warmup_steps == 0:
        return {}
    out, t0, latents = {}, time.perf_counter(), latents0
    if step is not None:
        scheduler, timesteps = new_scheduler(scheduler_config, args.num_inference_steps,
                                             timesteps_sharding)
        n = min(args.warmup_steps, len(timesteps))
        latents = denoise(step, scheduler, latents0, timesteps[:n], embeds, desc="warmup")
        latents.block_until_ready()
        out.update(warmup_denoise_s=time.perf_counter() - t0, warmup_steps=n)
    if vae_decode is not None:
        t1 = time.perf_counter()
        decode(vae_decode, latents)
        out["warmup_vae_decode_s"] = time.perf_counter() - t1
    out["warmup_s"] = time.perf_counter() - t0
    print(f"warmup: {out['warmup_s']:.2f} s"
          + (f" ({out['warmup_steps']} denoising steps" if "warmup_steps" in out else " (")
          + ("; VAE decode)" if vae_decode is not None else ")"))
    return out


def run_benchmark(args, *, latents0, step=None, scheduler_config=None, embeds=None,
                  vae_decode=None, timesteps_sharding=None):
    """``--num_iterations`` timed generations of the selected stages (after ``warmup``);
    returns (latents, video, runs).

    ``step`` (with ``scheduler_config``, ``embeds``) runs the denoising loop from ``latents0``;
    ``vae_decode`` decodes its result (or ``latents0`` when there is no ``step``). Every
    timing blocks on the device result (``block_until_ready``), never on dispatch.
    """
    runs, latents, video = [], latents0, None
    for i in range(args.num_iterations):
        desc = f"run {i + 1}/{args.num_iterations}"
        run = {}
        latents = latents0
        t0 = time.perf_counter()
        if step is not None:
            scheduler, timesteps = new_scheduler(scheduler_config, args.num_inference_steps,
                                                 timesteps_sharding)
            t0 = time.perf_counter()
            latents = denoise(step, scheduler, latents0, timesteps, embeds, desc=desc)
            latents.block_until_ready()
            run["denoise_s"] = time.perf_counter() - t0
            run["s_per_step"] = run["denoise_s"] / args.num_inference_steps
            check_finite(latents, "denoising (transformer + UniPC)")
        if vae_decode is not None:
            t1 = time.perf_counter()
            video = decode(vae_decode, latents)
            run["vae_decode_s"] = time.perf_counter() - t1
        run["total_s"] = time.perf_counter() - t0
        runs.append(run)
        parts = []
        if "denoise_s" in run:
            parts.append(f"denoise {run['denoise_s']:.2f} s, {run['s_per_step']:.3f} s/step")
        if "vae_decode_s" in run:
            parts.append(f"VAE decode {run['vae_decode_s']:.2f} s")
        print(f"{desc}: {run['total_s']:.2f} s ({'; '.join(parts)})")
    if video is not None:
        check_finite(video, "VAE decode")
    return latents, video, runs


def _mean(xs):
    return sum(xs) / len(xs)


def summarize(runs, timings: dict, flops_per_step: float | None, devices) -> dict:
    """Placement, compile, warmup and steady-state statistics and throughput, for the report.

    Every timed run is steady state: the programs were compiled ahead of time and run once
    by the warmup. ``cold_start_s`` is what a user waits before the first timed run starts:
    text encode + placement + compiles + warmup.
    """
    import chips

    out = dict(timings)
    out["cold_start_s"] = sum(
        v for k, v in timings.items()
        if k in ("text_encode_s", "warmup_s") or (k.startswith(("compile_", "place_"))
                                                  and k.endswith("_s")))
    out["runs"] = runs
    totals = [r["total_s"] for r in runs]
    out.update(steady_mean_s=_mean(totals), steady_min_s=min(totals), steady_max_s=max(totals))
    if "vae_decode_s" in runs[0]:
        out["steady_vae_decode_s"] = _mean([r["vae_decode_s"] for r in runs])
    if "s_per_step" in runs[0]:
        s_step = _mean([r["s_per_step"] for r in runs])
        out["steady_s_per_step"] = s_step
        out["transformer_flops_per_step"] = flops_per_step
        out["achieved_tflops"] = flops_per_step / s_step / 1e12
        # MFU = analytic model-call FLOPs per step / s/step / (chips x bf16 peak per chip);
        # the scheduler and the VAE are excluded (nanoGPT's definition).
        out["mfu"] = chips.mfu(flops_per_step, s_step, devices)
    return out


def print_summary(s: dict, device_kind: str, n_devices: int) -> None:
    print(f"\n== Summary ({n_devices} x {device_kind}) ==")
    rows = [("text encode (CPU, once)", "text_encode_s"),
            ("place transformer weights", "place_transformer_s"),
            ("place VAE weights", "place_vae_s"),
            ("compile transformer step", "compile_transformer_s"),
            ("compile VAE decode", "compile_vae_s"),
            ("warmup", "warmup_s"),
            ("cold start (all of the above)", "cold_start_s")]
    for label, key in rows:
        if key in s:
            print(f"{label + ':':<32}{s[key]:8.2f} s")
    if "place_transformer_gbps" in s:
        print(f"{'  placement rate:':<32}{s['place_transformer_gbps']:8.2f} GB/s (host -> "
              "devices, transformer)")
    if "runs" not in s:
        return
    label = f"steady state, {len(s['runs'])} run(s):"
    print(f"{label:<32}{s['steady_mean_s']:8.2f} s mean (min {s['steady_min_s']:.2f}, "
          f"max {s['steady_max_s']:.2f})")
    if "steady_s_per_step" in s:
        print(f"{'  denoise:':<32}{s['steady_s_per_step']:8.3f} s/step")
    if "steady_vae_decode_s" in s:
        print(f"{'  VAE decode:':<32}{s['steady_vae_decode_s']:8.2f} s")
    if "achieved_tflops" in s:
        mfu = f", MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else ""
        print(f"{'  transformer throughput:':<32}{s['achieved_tflops']:8.3f} TFLOP/s{mfu}")


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("jax", "jaxlib", "libtpu", "torch", "torchax", "diffusers", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Staged intermediates (--stage encode | denoise | decode)
# ---------------------------------------------------------------------------------------------

EMBEDDINGS_FILE = "embeddings.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
LATENTS_FILE = "latents.safetensors"


def config_digest(config) -> str:
    """sha256 of a diffusers config's architecture values (keys starting with "_" such as the
    diffusers version are left out), so intermediates can name the model they came from."""
    import hashlib

    clean = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def save_tensors(tensors: dict, path: str, metadata: dict) -> None:
    """Write CPU torch tensors as safetensors (bf16 round-trips exactly), atomically."""
    from safetensors.torch import save_file

    meta = {k: json.dumps(v) for k, v in metadata.items()}
    _atomic_write(path, lambda tmp: save_file(
        {k: v.detach().clone() for k, v in tensors.items()}, tmp, metadata=meta))


def load_tensors(path: str, keys, produced_by: str):
    """Read ``keys`` and the JSON metadata from a safetensors file.

    Raises:
        UsageError: one line naming the file when it is missing, truncated, corrupt or lacks a
            tensor (never a traceback from inside safetensors).
    """
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise UsageError(f"{path}: not found; run --stage {produced_by} with the same "
                         "--work_dir first")
    try:
        with safe_open(path, framework="pt") as f:
            meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
            missing = [k for k in keys if k not in f.keys()]
            if missing:
                raise UsageError(f"{path}: missing tensor(s) {', '.join(missing)}")
            return {k: f.get_tensor(k) for k in keys}, meta
    except UsageError:
        raise
    except Exception as e:  # safetensors raises several types for damaged files
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"{path}: unreadable, truncated or corrupt safetensors file "
                         f"({msg})") from None


def save_embeddings(work_dir, prompt_embeds, negative_embeds, args) -> None:
    os.makedirs(work_dir, exist_ok=True)
    gen = dict(prompt=args.prompt, negative_prompt=args.negative_prompt, model_id=args.model_id,
               max_sequence_length=args.max_sequence_length, dtype=args.dtype)
    save_tensors(dict(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_embeds),
                 os.path.join(work_dir, EMBEDDINGS_FILE), gen)
    save_report(gen, os.path.join(work_dir, GENERATION_CONFIG_FILE))


def load_embeddings(work_dir, transformer_config: dict | None, args):
    """Prompt embeddings written by ``--stage encode``; checks their shape against the
    transformer config. Returns (prompt_embeds, negative_embeds) CPU tensors (1, T, text_dim)
    and sets ``args.prompt``/``negative_prompt``/``max_sequence_length`` from the file."""
    path = os.path.join(work_dir, EMBEDDINGS_FILE)
    t, meta = load_tensors(path, ("prompt_embeds", "negative_prompt_embeds"), "encode")
    pos, neg = t["prompt_embeds"], t["negative_prompt_embeds"]
    seq = meta.get("max_sequence_length")
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape != neg.shape or pos.shape[1] != seq:
        raise UsageError(f"{path}: expected two (1, {seq}, text_dim) tensors, got "
                         f"{tuple(pos.shape)} and {tuple(neg.shape)}")
    if transformer_config and pos.shape[2] != transformer_config["text_dim"]:
        raise UsageError(f"{path}: embeddings have text_dim {pos.shape[2]}, the transformer of "
                         f"--model_id={args.model_id!r} expects {transformer_config['text_dim']}")
    args.prompt, args.negative_prompt = meta.get("prompt"), meta.get("negative_prompt")
    args.max_sequence_length = seq
    return pos, neg


LATENT_SETTINGS = ("seed", "num_inference_steps", "height", "width", "frames", "flow_shift",
                   "guidance_scale", "prompt", "negative_prompt", "model_id")


def save_latents(work_dir, latents, args, vae_config: dict) -> None:
    os.makedirs(work_dir, exist_ok=True)
    meta = {k: getattr(args, k) for k in LATENT_SETTINGS}
    meta["vae_config_sha256"] = config_digest(vae_config)
    save_tensors(dict(latents=latents), os.path.join(work_dir, LATENTS_FILE), meta)


def load_latents(work_dir, vae_config: dict, args):
    """Final latents written by ``--stage denoise``; refuses latents made for another VAE or
    whose shape disagrees with their recorded size. Sets ``args`` from the recorded settings.
    Returns the float32 CPU tensor (1, z_dim, F', H/8, W/8)."""
    path = os.path.join(work_dir, LATENTS_FILE)
    t, meta = load_tensors(path, ("latents",), "denoise")
    if meta.get("vae_config_sha256") != config_digest(vae_config):
        raise UsageError(f"{path}: made for a different VAE config than --model_id="
                         f"{args.model_id!r} (recorded model: {meta.get('model_id')!r})")
    missing = [k for k in LATENT_SETTINGS if k not in meta]
    if missing:
        raise UsageError(f"{path}: metadata lacks {', '.join(missing)}")
    for k in LATENT_SETTINGS:
        setattr(args, k, meta[k])
    expected = (1, vae_config["z_dim"], (args.frames - 1) // VAE_TEMPORAL_SCALE + 1,
                args.height // VAE_SPATIAL_SCALE, args.width // VAE_SPATIAL_SCALE)
    lat = t["latents"]
    if tuple(lat.shape) != expected:
        raise UsageError(f"{path}: expected latents of shape {expected} for "
                         f"{args.frames} frames at {args.height}x{args.width}, "
                         f"got {tuple(lat.shape)}")
    return lat.float()


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


class _Skipped(Exception):
    """--dry_run_skip_vae: the VAE row is left out of the table."""


def _abstract(tensors: dict, mesh, specs=None, dtype=None) -> dict:
    """torch tensors (meta or real) -> ``jax.ShapeDtypeStruct``s laid out on ``mesh``."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax.ops import mappings

    return {k: jax.ShapeDtypeStruct(
        tuple(v.shape), dtype or mappings.t2j_dtype(v.dtype),
        sharding=NamedSharding(mesh, (specs or {}).get(k, P()))) for k, v in tensors.items()}


def _per_chip_bytes(structs) -> int:
    """Bytes one chip holds of these sharded ``ShapeDtypeStruct``s."""
    import placement

    return sum(placement.shard_bytes(s) for s in structs)


def _memory_row(name: str, compiled, seconds: float, capacity: int) -> dict:
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(program=name, argument_bytes=m.argument_size_in_bytes,
                output_bytes=m.output_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                total_bytes=total, capacity_bytes=capacity, fits=total <= capacity,
                flops=float((cost or {}).get("flops", 0.0)), compile_s=seconds)


def _oom_row(name: str, error: Exception, seconds: float, capacity: int,
             argument_bytes: int | None = None) -> dict:
    """A compile that failed for memory, as a table row with the compiler's own figure.

    libtpu words it either "... HLO temporaries (24.48G) exceeds available HBM (15.75G)"
    (temporaries alone; ``argument_bytes``, known from the shardings, are added) or
    "Used 40.1G of 31.25G hbm" (everything). Without a figure the total is NaN.
    """
    text = str(error)
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    temp = re.search(r"temporaries \(([\d.]+)([KMGT])\)", text)
    used = re.search(r"[Uu]sed ([\d.]+)([KMGT])", text)
    temp_bytes = None
    if temp:
        temp_bytes = float(temp.group(1)) * scale[temp.group(2)]
        need = temp_bytes + (argument_bytes or 0)
    elif used:
        need = float(used.group(1)) * scale[used.group(2)]
    else:
        need = float("nan")
    return dict(program=name, argument_bytes=argument_bytes if temp else None,
                output_bytes=None, temp_bytes=temp_bytes, total_bytes=need,
                capacity_bytes=capacity, fits=False, flops=None, compile_s=seconds,
                error=text.strip().splitlines()[0][:300])


def dry_run(args) -> tuple[int, dict]:
    """Compile the denoising step and the VAE decode for ``--topology`` without a TPU.

    The transformer is built from ``--model_id``'s config with meta-device parameters
    (``accelerate.init_empty_weights``), so even 14B needs no RAM for weights; the parameters
    enter ``jit(...).lower`` as ``ShapeDtypeStruct``s carrying the real shardings, and libtpu's
    compiler (``jax.experimental.topologies``) compiles for the topology's chips.

    Returns:
        (exit code: 0 fits / 3 does not fit, report dict with a per-chip table).
    """
    for key, value in dict(TPU_ACCELERATOR_TYPE=args.topology.split(":")[0] + "-"
                           + str(math.prod(int(x) for x in args.topology.split(":")[1]
                                           .split("x"))),
                           TPU_WORKER_HOSTNAMES="localhost", TPU_SKIP_MDS_QUERY="1",
                           # No chip is opened, so concurrent compiles need not take the
                           # libtpu lock (another dry run or test may hold it).
                           ALLOW_MULTIPLE_LIBTPU_LOAD="1").items():
        os.environ.setdefault(key, value)
    if not args.dry_run_exact_convs:
        # libtpu spends 5-70 s searching for a fast emitter for every 3D conv, most of the
        # VAE's compile. Dropping that performance target gave byte-identical memory and FLOP
        # figures for the full 14B step and 720p VAE decode here, at a fifth to a tenth of
        # the compile time; a dry run needs the memory, not the fastest convs.
        os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                          " --xla_jf_convolution_performance_target=0").strip()
    configure_jax_platform()
    quiet_known_warnings()
    import jax
    import torch
    import torchax
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    import chips
    import placement
    from custom_splash_attention import install_sdpa_override

    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=args.topology)
    except Exception as e:  # libtpu missing or an unknown name
        raise UsageError(f"--topology={args.topology!r}: {str(e).splitlines()[0]}") from None
    devices = list(topo.devices)
    chip = chips.chip_for_topology(args.topology)
    if chip is None:
        _fail("--topology", args.topology, f"unknown chip; known: {', '.join(chips.CHIPS)}")
    capacity = chip.usable_hbm_bytes  # per JAX device (a v7x chip is 2 devices)
    folder = model_config_dir(args.model_id)
    cfg = dict(WanTransformer3DModel.load_config(folder, subfolder="transformer"))
    if args.dry_run_layers:
        cfg["num_layers"] = min(args.dry_run_layers, cfg["num_layers"])
    shape = resolve_mesh_shape(args, len(devices), cfg)
    args.dp, args.tp, args.sp = shape.dp, shape.tp, shape.sp
    mesh = make_mesh(shape, devices)
    attention = "splash" if args.attention == "auto" else args.attention
    install_sdpa_override(torchax.default_env(), attention=attention, mesh=mesh,
                          block_sizes=block_sizes(args), interpret=False)
    transformer = empty_transformer(cfg, getattr(torch, args.dtype))
    with init_empty_weights():
        vae = AutoencoderKLWan.from_config(
            AutoencoderKLWan.load_config(folder, subfolder="vae")).eval()
    if args.scan_layers:
        import scan_layers

        scan_layers.scan_blocks(transformer)
    if args.sp > 1:
        add_sequence_parallel_hooks(transformer, mesh)
    rules = transformer_sharding_rules(replicate_row_parallel=args.replicate_row_parallel)
    jm = interop.JittableModule(transformer)
    specs, counts, _ = module_sharding_specs(
        transformer, {k: v.shape for k, v in jm.params.items()}, rules, mesh, fsdp=args.fsdp)
    placed = dict(module=jm, specs=specs, params=_abstract(jm.params, mesh, specs),
                  buffers=_abstract(jm.buffers, mesh))
    rep = NamedSharding(mesh, P())
    f = (args.frames - 1) // VAE_TEMPORAL_SCALE + 1
    h, w = args.height // VAE_SPATIAL_SCALE, args.width // VAE_SPATIAL_SCALE
    latents = jax.ShapeDtypeStruct((1, cfg["in_channels"], f, h, w), jax.numpy.float32,
                                   sharding=rep)
    batch = 2 if use_cfg(args) else 1
    embeds = jax.ShapeDtypeStruct((batch, args.max_sequence_length, cfg["text_dim"]),
                                  getattr(jax.numpy, args.dtype),
                                  sharding=NamedSharding(mesh, P("dp")))
    t = jax.ShapeDtypeStruct((1,), jax.numpy.int32, sharding=rep)

    transformer_weights = _per_chip_bytes([*placed["params"].values(),
                                           *placed["buffers"].values()])
    rows = []
    t0 = time.perf_counter()
    print(f"compiling the transformer step ({cfg['num_layers']} blocks) for {args.topology}...",
          flush=True)
    try:
        compiled, seconds = compile_transformer_step(dict(transformer=placed), mesh, args,
                                                     latents, t, embeds)
        rows.append(_memory_row("transformer step", compiled, seconds, capacity))
    except Exception as e:  # the compiler reports real OOMs as errors
        rows.append(_oom_row("transformer step", e, time.perf_counter() - t0, capacity,
                             transformer_weights + _per_chip_bytes([latents, embeds])))
    jv = interop.JittableModule(vae)
    vae_placed = dict(module=jv, params=_abstract(
        {k: v for k, v in jv.params.items() if is_vae_decode_weight(k)}, mesh),
        buffers=_abstract({k: v for k, v in jv.buffers.items() if is_vae_decode_weight(k)},
                          mesh))
    decoder = VaeDecoder(vae_placed, vae, mesh, tiling=args.vae_tiling, abstract=True)
    t0 = time.perf_counter()
    try:
        if args.dry_run_skip_vae:
            raise _Skipped
        print(f"compiling the VAE decode for {args.topology}"
              + (" (slow: 5-70 s per 3D conv)" if args.dry_run_exact_convs else "") + "...",
              flush=True)
        seconds = decoder.compile(latents)
        mem = decoder.memory()
        rows.append(dict(program=f"VAE decode ({mem['programs']} programs, peak)",
                         argument_bytes=mem["argument_bytes"], output_bytes=mem["output_bytes"],
                         temp_bytes=mem["temp_bytes"], total_bytes=mem["peak_bytes"],
                         capacity_bytes=capacity, fits=mem["peak_bytes"] <= capacity,
                         flops=None, compile_s=seconds))
    except _Skipped:
        pass
    except Exception as e:
        rows.append(_oom_row("VAE decode", e, time.perf_counter() - t0, capacity))
    # In one process the transformer weights stay in HBM while the VAE decodes, and the VAE
    # weights while the transformer runs; the decoded chunks and their concatenation are
    # held too. The compiler sees one program at a time, so add what the others keep.
    video = 3 * args.frames * args.height * args.width * 4 // (
        len(devices) if decoder._spatial(latents.shape) is not None else 1)
    resident = {"transformer step": _per_chip_bytes([*vae_placed["params"].values(),
                                                     *vae_placed["buffers"].values()]),
                "VAE decode": transformer_weights + _per_chip_bytes([embeds]) + 2 * video}
    for r in rows:
        r["resident_bytes"] = next(v for k, v in resident.items() if r["program"].startswith(k))
        if r["total_bytes"] == r["total_bytes"]:  # not NaN (an OOM without a figure)
            r["total_bytes"] += r["resident_bytes"]
            r["fits"] = r["fits"] and r["total_bytes"] <= capacity
    fits = all(r["fits"] for r in rows)
    attention_flops = (4 * token_count(cfg, args) ** 2 * cfg["attention_head_dim"]
                       * cfg["num_attention_heads"] * cfg["num_layers"] * batch)
    report = dict(
        dry_run=True, topology=args.topology, devices=len(devices),
        chips=chips.count_chips(devices), fits=fits,
        libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS", ""),
        vae_checked=not args.dry_run_skip_vae,
        settings={**vars(args), "attention": attention}, mesh=dataclasses.asdict(shape),
        layers_compiled=cfg["num_layers"], tokens=token_count(cfg, args), per_chip=rows,
        analytic_transformer_flops_per_step=transformer_flops(cfg, args),
        analytic_self_attention_flops_per_step=float(attention_flops),
        sharding_rule_matches=counts, versions=versions())
    # What each host reads from the checkpoint for its own devices (weights stream slice by
    # slice, so a host never holds more than the largest slice beyond what is placed).
    per_host, largest = placement.per_host_bytes(
        [*placed["params"].values(), *placed["buffers"].values(),
         *vae_placed["params"].values(), *vae_placed["buffers"].values()])
    report["hosts"] = dict(count=len(per_host), weight_bytes=[per_host[p] for p in
                                                               sorted(per_host)],
                           largest_slice_bytes=largest)
    return (0 if fits else 3), report


def print_dry_run(report: dict) -> None:
    gib = lambda b: "-" if b is None else f"{b / 2**30:7.2f}"  # noqa: E731
    chips = f"{report['chips']} chips" + (f", {report['devices']} devices"
                                          if report["devices"] != report["chips"] else "")
    print(f"\n== Dry run: {report['topology']} ({chips}), mesh "
          f"dp{report['mesh']['dp']} tp{report['mesh']['tp']} sp{report['mesh']['sp']}, "
          f"{report['layers_compiled']} blocks, {report['tokens']} tokens ==")
    print(f"{'program':<34}{'args GiB':>9}{'out GiB':>9}{'temp GiB':>9}{'kept GiB':>9}"
          f"{'total':>9}{'HBM':>9}  {'fits':<5}{'compile s':>10}")
    for r in report["per_chip"]:
        print(f"{r['program']:<34}{gib(r['argument_bytes']):>9}{gib(r['output_bytes']):>9}"
              f"{gib(r['temp_bytes']):>9}{gib(r['resident_bytes']):>9}{gib(r['total_bytes']):>9}"
              f"{gib(r['capacity_bytes']):>9}  {'yes' if r['fits'] else 'NO':<5}"
              f"{r['compile_s']:>10.1f}")
    step = report["per_chip"][0]
    if step.get("flops"):
        print(f"XLA FLOPs per step per chip (Pallas kernels count 0): {step['flops']:.3e}")
    print(f"analytic FLOPs per step (all chips): "
          f"{report['analytic_transformer_flops_per_step']:.3e} "
          f"(self-attention {report['analytic_self_attention_flops_per_step']:.3e})")
    for r in report["per_chip"]:
        if not r["fits"]:
            print(f"{r['program']}: does not fit: {r['total_bytes'] / 2**30:.1f} GiB needed, "
                  f"{r['capacity_bytes'] / 2**30:.2f} GiB available"
                  + (f" ({r['error']})" if r.get("error") else ""))
    hosts = report["hosts"]
    print(f"host RAM for weights: each of {hosts['count']} host(s) reads "
          f"{max(hosts['weight_bytes']) / 2**30:.2f} GiB of slices for its own devices, "
          f"streamed (largest slice {hosts['largest_slice_bytes'] / 2**30:.2f} GiB)")
    print("kept = HBM other stages hold meanwhile (the other model's weights, decoded frames)")
    print("verdict:", "fits" if report["fits"] else "does not fit",
          "" if report["vae_checked"] else "(transformer only: --dry_run_skip_vae)")


OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "exceeds available HBM",
               "Ran out of memory")


def _oom_details(text: str) -> str:
    """The sizes an XLA/PJRT out-of-memory message states, as a short phrase ("" if none)."""
    size = r"([\d.]+\s?[KMGT]i?B?)"
    for pattern, fmt in (
        (rf"temporaries \({size}\) exceeds available HBM \({size}\)",
         "temporaries {0} exceed the available {1}"),
        (rf"[Uu]sed {size} of {size}", "needs {0} of {1}"),
        (rf"allocate {size}.*?{size} free", "allocating {0} with {1} free"),
        (rf"allocat\w* {size}", "allocating {0}"),
        (r"allocating (\d+) bytes", "allocating {0} bytes"),
    ):
        m = re.search(pattern, text, flags=re.S)
        if m:
            return fmt.format(*m.groups())
    return ""


def dry_run_command(args, devices) -> str:
    """The ``--dry_run`` command that predicts this run's per-chip HBM without a TPU."""
    import chips

    topology = chips.topology_name(devices) or "<chip>:<AxB>"
    flags = [f"--model_id {args.model_id}", f"--height {args.height}", f"--width {args.width}",
             f"--frames {args.frames}"]
    flags += [f"--{k} {getattr(args, k)}" for k in ("dp", "tp", "sp")
              if getattr(args, k, None) is not None]
    return f"python generate_flax.py {' '.join(flags)} --dry_run --topology {topology}"


@contextlib.contextmanager
def hardware_errors(stage: str, args, devices):
    """Turn a device out-of-memory error inside the block into a one-line ``GenerationError``.

    It names ``stage``, the sizes the runtime reported, and the dry-run command that
    predicts the failure. Any other error passes through unchanged.
    """
    try:
        yield
    except (UsageError, GenerationError):
        raise
    except Exception as e:
        text = str(e)
        if not any(marker in text for marker in OOM_MARKERS):
            raise
        details = _oom_details(text)
        raise GenerationError(
            f"out of device memory while {stage}" + (f" ({details})" if details else "")
            + f"; predict it without a TPU: {dry_run_command(args, devices)}") from None


def check_attention_kernel(attention: str, *, interpret: bool) -> dict | None:
    """Self-check the Splash kernel ``attention`` names on the default device (see
    ``custom_splash_attention.kernel_self_check``); None for "xla".

    Raises:
        GenerationError: the kernel's error exceeds the tested tolerance.
    """
    import jax

    import custom_splash_attention as csa

    if attention not in csa.SPLASH_KERNELS:
        return None
    result = csa.kernel_self_check(attention, interpret=interpret)
    if not result["passed"]:
        other = "--attention xla" if attention == "stock_splash" else "--attention stock_splash"
        raise GenerationError(
            f"--attention {attention}: kernel self-check failed on "
            f"{jax.devices()[0].device_kind}: max error {result['max_abs_error']:.3g} against "
            f"the float32 reference exceeds {result['tolerance']} (bf16 "
            f"{'x'.join(map(str, result['shape']))}); rerun with {other}")
    log.info("kernel self-check %s: max error %.2e in %.3f s", attention,
             result["max_abs_error"], result["seconds"])
    return result


def check_same_on_every_host(what: str, array: np.ndarray) -> None:
    """Every process computed ``array`` itself (text encoder, seeded noise); refuse to go on
    if the hosts disagree (a different checkpoint, prompt or library on one host), instead of
    silently mixing their halves of a batch.

    Raises:
        GenerationError: the hosts' arrays differ.
    """
    import zlib

    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.uint32(zlib.crc32(np.ascontiguousarray(array).view(np.uint8)))
    try:
        multihost_utils.assert_equal(digest, f"{what} differ between hosts")
    except AssertionError as e:
        raise GenerationError(f"{e}: every host must run the same command on the same "
                              "checkpoint and library versions") from None


def place_inputs(pipe, embeds_cpu, mesh, args):
    """Prompt embeddings and seeded initial latents, streamed to their shardings.

    Returns (embeds (B, T, text_dim) in the model dtype over "dp" (B = 2 with CFG:
    [cond, uncond]), latents0 (1, 16, F', H/8, W/8) float32 replicated).
    """
    import torch
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import placement

    pos, neg = embeds_cpu
    embeds = pos if not use_cfg(args) else torch.cat([pos, neg])
    embeds = embeds.to(getattr(torch, args.dtype))
    latents = prepare_latents(pipe, args)
    # Every host encoded the prompt and drew the noise itself (no broadcast needed): identical
    # inputs make the hosts' copies of one global array agree.
    check_same_on_every_host("prompt embeddings", placement.host_array(embeds))
    check_same_on_every_host("initial latents", placement.host_array(latents))
    # Placed explicitly: torchax does not shard inputs by itself, and an earlier port
    # measured 54 vs 5.9 s/step without and with this.
    embeds = placement.place_array(placement.host_array(embeds), NamedSharding(mesh, P("dp")))
    latents0 = placement.place_array(placement.host_array(latents), NamedSharding(mesh, P()))
    return embeds, latents0


def generate(args, devices=None):
    """Run the stages ``--stage`` selects; returns (frames or None, report).

    ``all`` runs everything in memory; ``encode`` / ``denoise`` / ``decode`` each load only
    their own component and read/write intermediates in ``--work_dir``. ``devices`` (default:
    all of ``jax.devices()``) lets tests build smaller meshes.

    frames: (F, H, W, 3) float32 in [0, 1] (``all`` and ``decode``). report: the JSON report's
    content without output file names.
    """
    configure_jax_platform()
    quiet_known_warnings()
    import jax
    import torchax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from custom_splash_attention import default_attention_backend, install_sdpa_override

    stage = args.stage
    cache_on = enable_compilation_cache(args.compilation_cache_dir)
    cache_before = dict(CACHE_STATS)
    devices = jax.devices() if devices is None else list(devices)
    cfg = read_transformer_config(args.model_id)
    timings: dict = {}
    fallbacks = Fallbacks()
    embeds_cpu = latents_cpu = None
    if stage == "denoise":  # intermediates are checked before any weights load
        embeds_cpu = load_embeddings(args.work_dir, cfg, args)
    if stage == "decode":
        latents_cpu = load_latents(args.work_dir, read_vae_config(args.model_id), args)
    mesh_shape = resolve_mesh_shape(args, len(devices), cfg if stage != "decode" else None)
    args.dp, args.tp, args.sp = mesh_shape.dp, mesh_shape.tp, mesh_shape.sp
    attention = default_attention_backend() if args.attention == "auto" else args.attention
    interpret = jax.default_backend() != "tpu"
    report = dict(stage=stage, settings={**vars(args), "attention": attention},
                  versions=versions())
    if stage in ("all", "denoise"):  # before minutes of weight loading, not after
        report["kernel_self_check"] = check_attention_kernel(attention, interpret=interpret)

    pipe = load_pipeline(args, STAGE_COMPONENTS[stage])
    if pipe.transformer is not None:
        cfg = dict(pipe.transformer.config)
    if stage in ("all", "encode"):
        t0 = time.perf_counter()
        embeds_cpu = encode_prompts(pipe, args)
        timings["text_encode_s"] = time.perf_counter() - t0
    if stage == "encode":
        if is_writer():
            save_embeddings(args.work_dir, *embeds_cpu, args)
        report["timings"] = timings
        return None, report

    mesh = make_mesh(mesh_shape, devices)
    replicated = NamedSharding(mesh, P())
    bench = dict(timesteps_sharding=replicated)
    weights = {}
    if stage in ("all", "denoise"):
        install_sdpa_override(torchax.default_env(), attention=attention, mesh=mesh,
                              block_sizes=block_sizes(args), interpret=interpret,
                              on_fallback=fallbacks)
        with hardware_errors("placing the transformer weights", args, devices):
            weights = shard_weights(pipe, mesh, args, fallbacks)
            embeds, latents0 = place_inputs(pipe, embeds_cpu, mesh, args)
        w = weights["transformer"]
        timings["place_transformer_s"] = w["seconds"]
        timings["place_transformer_gbps"] = w["bytes"] / max(w["seconds"], 1e-9) / 1e9
        pipe.scheduler.set_timesteps(args.num_inference_steps)
        t_example = jax.device_put(timestep_array(pipe.scheduler.timesteps[0]), replicated)
        with hardware_errors("compiling the transformer step", args, devices):
            step_compiled, timings["compile_transformer_s"] = compile_transformer_step(
                weights, mesh, args, latents0, t_example, embeds)
        bench.update(step=lambda lat, t, emb: step_compiled(w["params"], w["buffers"], lat, t,
                                                            emb),
                     scheduler_config=pipe.scheduler.config, embeds=embeds)
    else:
        import placement

        latents0 = placement.place_array(placement.host_array(latents_cpu), replicated)
    if stage in ("all", "decode"):
        with hardware_errors("placing the VAE weights", args, devices):
            placed_vae = place_vae(pipe.vae, mesh)
        timings["place_vae_s"] = placed_vae["seconds"]
        vae_decode = VaeDecoder(placed_vae, pipe.vae, mesh, tiling=args.vae_tiling,
                                fallbacks=fallbacks)
        with hardware_errors("compiling the VAE decode", args, devices):
            timings["compile_vae_s"] = vae_decode.compile(latents0)
        bench["vae_decode"] = vae_decode

    with hardware_errors("running the warmup", args, devices):
        timings.update(warmup(args, latents0=latents0, **bench))
    with hardware_errors("running the timed generations", args, devices):
        latents, video, runs = run_benchmark(args, latents0=latents0, **bench)
    if args.profile_dir is not None:
        report["profile"] = profile_step(
            args.profile_dir, latents0=latents0, num_inference_steps=args.num_inference_steps,
            **{k: bench[k] for k in ("step", "scheduler_config", "embeds", "timesteps_sharding")})
        print(f"profile of denoising step {report['profile']['traced_step']} "
              f"({report['profile']['seconds']:.3f} s traced) in {args.profile_dir}: open with "
              "TensorBoard/XProf, or perfetto_trace.json.gz in ui.perfetto.dev")

    device_kind = devices[0].device_kind
    flops = transformer_flops(cfg, args) if "step" in bench else None
    report.update(
        mesh=dataclasses.asdict(mesh_shape),
        devices=dict(kind=device_kind, count=len(devices), platform=jax.default_backend()),
        processes=[dict(index=i, devices=[d.id for d in devices if d.process_index == i])
                   for i in range(jax.process_count())],
        compilation_cache=dict(dir=args.compilation_cache_dir,
                               **{k: v - cache_before[k] for k, v in CACHE_STATS.items()})
        if cache_on else None,
        timings=summarize(runs, timings, flops, devices),
        fallbacks=fallbacks.items,
    )
    if weights:
        report.update(
            tokens=token_count(cfg, args),
            layout=dict(replicate_row_parallel=args.replicate_row_parallel, fsdp=args.fsdp,
                        sequence_parallel=mesh_shape.sp > 1),
            sharding_rule_matches=weights["transformer"]["rule_counts"],
            # Streamed from the safetensors files: what this host (process 0) read, against
            # the weights' bytes; equal when one host's devices hold a whole replica.
            weights=dict(source="safetensors slices",
                         param_bytes=weights["transformer"]["param_bytes"],
                         bytes_read_by_this_host=weights["transformer"]["bytes_read"]))
    if stage == "denoise":
        latents_cpu = torch_from_jax(latents)  # every process takes part in the gather
        if is_writer():
            save_latents(args.work_dir, latents_cpu, args, read_vae_config(args.model_id))
        return None, report
    return to_frames(pipe, video), report


def torch_from_jax(x):
    """A ``jax.Array`` gathered to this host as a CPU torch tensor."""
    import torch

    return torch.from_numpy(np.array(to_host(x)))


def main(argv=None) -> int:
    args = validate_args(parse_args(argv))  # on every host, before any host joins the others
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    if args.dry_run:
        code, report = dry_run(args)
        print_dry_run(report)
        stem = output_stem(args.output_dir)
        path = os.path.join(args.output_dir, f"{stem}_dry_run.json")
        save_report(report, path)
        print(f"wrote {path}")
        return code
    start_distributed(args)
    frames, report = generate(args)
    devices = report.get("devices", {"kind": "host CPU (text encoder)", "count": 1})
    if not is_writer():  # process 0 writes and summarises for every host
        return 0
    if frames is None:  # encode or denoise stage: intermediates are in --work_dir
        path = os.path.join(args.work_dir, f"{args.stage}_report.json")
        save_report(report, path)
        print_summary(report["timings"], devices["kind"], devices["count"])
        print(f"\nwrote {args.stage} intermediates and {path}")
        return 0
    stem = output_stem(args.output_dir)
    video_path = os.path.join(args.output_dir, stem + ".mp4")
    save_video(frames, video_path, args.fps)
    written = [video_path]
    if args.save_frames:
        written.append(os.path.join(args.output_dir, stem + ".frames.safetensors"))
        save_frames(frames, written[-1])
    report = dict(video=os.path.basename(video_path), **report)
    save_report(report, os.path.join(args.output_dir, stem + ".json"))
    print_summary(report["timings"], devices["kind"], devices["count"])
    print(f"\nwrote {', '.join(written)} and {stem}.json")
    return 0


def _in_multi_process_run() -> bool:
    if "jax" not in sys.modules:  # failed before JAX started: certainly one process
        return False
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def cli(argv=None) -> int:
    """Entry point: one-line errors, exit codes 0 / 1 (runtime) / 2 (usage).

    In a multi-process run any error is one line naming this process, and the process
    leaves at once (``os._exit`` under ``__main__``) without the shutdown barrier, so the
    others see it gone: on CPU collectives at their next collective, otherwise when JAX's
    coordination service misses its heartbeat (``DISTRIBUTED_HEARTBEAT_TIMEOUT_S``).
    """
    prefix = "generate_flax.py: error: "
    try:
        code = main(argv)
        if code == 0 and _in_multi_process_run():
            import jax

            jax.distributed.shutdown()  # every process reaches it: a clean, joint exit
        return code
    except UsageError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return EXIT_USAGE
    except GenerationError as e:
        where = f"process {_process_index()}: " if _in_multi_process_run() else ""
        print(f"{prefix}{where}{e}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("generate_flax.py: interrupted; no partial output was written", file=sys.stderr)
        return 130
    except Exception as e:
        if not _in_multi_process_run():
            raise  # a single-process bug keeps its traceback
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        print(f"{prefix}process {_process_index()}: {type(e).__name__}: {first} (a failure "
              "on another process of this run ends this one too)", file=sys.stderr)
        return EXIT_RUNTIME


def _process_index() -> int:
    import jax

    return jax.process_index()


if __name__ == "__main__":
    code = cli()
    sys.stdout.flush()
    sys.stderr.flush()
    # torchax/JAX background threads can keep the interpreter alive after main returns (reported
    # by earlier TPU ports); a hard exit after flushing guarantees the process ends.
    os._exit(code)
