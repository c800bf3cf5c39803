"""Text-to-video on JAX (TPU first): diffusers' PyTorch models through torchax, with our
Splash attention kernel. The one script users run.

It reads as one generation, top to bottom (``generate``), each stage a call to the engine:
    1. flags and validation      parse_args -> validate_args (a frozen RunConfig), before any
                                 model loads; the family from model_index.json's _class_name
    2. check the checkpoint      engine.files.integrity (headers and sizes, no weights read)
    3. prologue                  Generation(...): runtime, devices, chip, blocks, mesh, kernel
                                 self-check (engine.pipeline.prologue)
    4. load                      run.load(): transformer weights stay on the meta device
    5. encode on CPU             run.encode(): text (and image) encoders, then freed
    6. place, route, compile     run.compile(): weights and inputs onto the mesh, torch SDPA
                                 to the kernel, the step and the VAE decode compiled AOT
    7. warmup                    run.warm_up(): every program once
    8. timed runs                run.time_videos(): steady state, each video written when done
    9. report and summary        run.finish(), engine.files.report

Family-specific code (pipeline, encoders, transformer call, sharding rules, VAE decode) is in
``families/``; the engine (mesh, placement, kernel routing, compile, benchmark protocol,
staged intermediates, dry run, report) is in ``engine/``. torchax runs the torch modules on
JAX: ``torchax.interop.jax_view`` turns a torch function into a JAX function, which we
``jax.jit`` ourselves (what ``torchax.compile`` does inside) so that shardings are explicit and
the same function can be lowered ahead of time.

Example (TPU VM, real weights):
    python generate_flax.py --model_id Wan-AI/Wan2.1-T2V-14B-Diffusers --prompt "A cat ..."

Example (CPU, tiny checkpoint):
    python generate_flax.py --model_id checkpoints/tiny-wan --height 64 --width 64 --frames 9 \
        --num_inference_steps 4
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import families
from engine.dry_run import flags as dry_flags
from engine.dry_run.fit import run_dry
from engine.files import integrity, videos
from engine.files import report as reporting
from engine.files.checkpoint import looks_local, model_config_dir
from engine.files.image import check_for_model
from engine.files.writer import VideoWriter
from engine.pipeline import Generation, upscale
from engine.programs import experts, parking, sparse, step_cache_flags
from engine.run import clock, runtime
from engine.run.config import (
    RunConfig,
    add_cache_flags,
    check_attention_options,
    check_numbers,
    check_size,
    check_writable_dir,
    resolve_cache_dirs,
    resolve_recipe,
    resolve_scheduler,
    validate_block_size_flags,
)
from engine.run.errors import (
    EXIT_RUNTIME,
    EXIT_USAGE,
    GenerationError,
    UsageError,
    fail,
    first_line,
)
from engine.serve import flags as serving
from engine.serve.app import serve
from engine.weights import layout, lora, quantize
from families import FAMILIES, OPTION_NAMES, add_option_flags, detect_family, resolve_options

# Engine defaults in one place; the model-specific ones (prompt, size, frames, steps, guidance,
# text length, fps) come from the detected family (``families/<name>.py``).
DEFAULTS = dict(
    model_id="Wan-AI/Wan2.1-T2V-14B-Diffusers",
    flow_shift=None,  # the family's default for the resolution
    seed=42, warmup_steps=2, num_iterations=1,
    output_dir="outputs", dtype="bfloat16", attention="auto", stage="all",
    # JAX's compilation cache, and beside it the executable and prompt-embedding caches.
    cache_home=os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"), "wan-flax"),
    work_dir="work",
    scan_layers=None,  # the family's default (on; LTX-2: off)
    bq=None, bkv=None, bkv_compute=None,  # Splash blocks: None = the chip's (default_block_sizes)
    park_weights="auto",
    park_memory="auto",
)
FAMILY_FLAGS = ("prompt", "negative_prompt", "height", "width", "frames", "fps",
                "num_inference_steps", "guidance_scale", "max_sequence_length")


# ---------------------------------------------------------------------------------------------
# 1. Flags and validation
# ---------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (the family's default or "chosen for you")."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """Every flag, grouped as ``--help`` shows them, with its default (a None default is
    described in the flag's help: the family's value, or chosen for you)."""
    p = argparse.ArgumentParser(
        prog="generate_flax.py", formatter_class=_HelpFormatter,
        description="Text-to-video (Wan 2.1, HunyuanVideo-1.5; LTX-2 with sound) on JAX/TPU "
                    "through torchax. Flags marked 'family default' take the detected model "
                    "family's value (or its checkpoint's) when omitted.")
    _add_generation_flags(p.add_argument_group("generation"))
    add_option_flags(p.add_argument_group("model-family flags (docs/flags.md)"))
    _add_run_flags(p.add_argument_group("run and benchmark"))
    _add_parallel_flags(p.add_argument_group("parallelism and kernel"))
    step_cache_flags.add_cache_flags(p.add_argument_group("step caching (docs/features.md)"))
    sparse.add_sparse_flags(p.add_argument_group("sparse attention (docs/features.md)"))
    dry_flags.add_dry_run_flags(p.add_argument_group("dry run (no TPU needed)"))
    serving.add_serve_flags(p.add_argument_group("serving (docs/serving.md)"))
    upscale.add_flags(p)
    runtime.add_host_flags(p.add_argument_group("multi-host (one process per host; Cloud TPU "
                                                "finds these itself)"))
    return p


def _add_generation_flags(g) -> None:
    d, fam = DEFAULTS, "family default"
    g.add_argument("--model_id", default=d["model_id"],
                   help="diffusers-format folder, or a Hub id (needs network access); its "
                        "model_index.json picks the model family")
    g.add_argument("--prompt", default=None, help=f"text prompt ({fam})")
    g.add_argument("--negative_prompt", default=None, help=f"negative prompt for CFG ({fam})")
    g.add_argument("--height", type=int, default=None, help=f"pixels ({fam}: 720)")
    g.add_argument("--width", type=int, default=None, help=f"pixels ({fam}: 1280)")
    g.add_argument("--frames", type=int, default=None,
                   help=f"video frames, of the form 4n+1 ({fam}: Wan 81, HunyuanVideo 121)")
    g.add_argument("--fps", type=int, default=None, help=f"frames per second of the mp4 ({fam})")
    g.add_argument("--num_inference_steps", type=int, default=None,
                   help=f"denoising steps ({fam}: Wan 50)")
    g.add_argument("--guidance_scale", type=float, default=None,
                   help=f"CFG scale; > 1 runs cond and uncond as one batch-2 call ({fam}; "
                        "HunyuanVideo: the checkpoint's guider)")
    g.add_argument("--guidance_scale_2", type=float, default=None,
                   help="two-expert models only (Wan 2.2 A14B): CFG scale of the low-noise "
                        "expert transformer_2 (family default: 3.0)")
    g.add_argument("--flow_shift", type=float, default=d["flow_shift"],
                   help="scheduler flow shift; Wan 2.1 default by resolution as its model "
                        "card says: 5.0 when the shorter side is >= 720 px, else 3.0; "
                        "HunyuanVideo: the checkpoint scheduler's shift")
    g.add_argument("--image", default=None, metavar="PATH",
                   help="first frame for an image-to-video checkpoint, Wan 2.2 TI2V-5B or LTX-2 "
                        "(PNG, JPEG or WebP; default: none, text-to-video); see docs/models.md")
    g.add_argument("--lora", action="append", default=None, metavar="PATH[:SCALE]",
                   help="a LoRA .safetensors (Wan: diffusers/PEFT or original/lightx2v "
                        "keys; HunyuanVideo-1.5: official Tencent or diffusers/PEFT keys), "
                        "fused into the weights as they are placed; repeatable; SCALE 1.0 "
                        "when omitted (default: none; see docs/models.md 'LoRA')")
    g.add_argument("--lora_2", action="append", default=None, metavar="PATH[:SCALE]",
                   help="as --lora, fused into a two-expert checkpoint's transformer_2 "
                        "(Wan 2.2 A14B's low-noise expert; default: none)")
    g.add_argument("--scheduler", choices=("unipc", "euler"), default=None,
                   help="sampler: diffusers' UniPCMultistepScheduler or "
                        "FlowMatchEulerDiscreteScheduler, from the checkpoint's scheduler "
                        "config with --flow_shift (family default: Wan unipc, HunyuanVideo "
                        "euler)")
    g.add_argument("--seed", type=int, default=d["seed"],
                   help="seed of the CPU torch.Generator that draws the initial latents")
    g.add_argument("--max_sequence_length", type=int, default=None,
                   help=f"text tokens the prompt embeddings are padded to ({fam})")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), default=d["dtype"],
                   help="transformer and text-encoder weights; the VAE always runs in float32")
    quantize.add_flag(g)


def _add_run_flags(g) -> None:
    d = DEFAULTS
    g.add_argument("--warmup_steps", type=int, default=d["warmup_steps"],
                   help="warmup: this many denoising steps plus one VAE decode run every "
                        "compiled program once before timing; 0 skips the warmup")
    g.add_argument("--num_iterations", type=int, default=d["num_iterations"],
                   help="timed full generations after the warmup (steady state)")
    g.add_argument("--output_dir", default=d["output_dir"],
                   help="where YYYYMMDD_HHMMSS.mp4 and .json are written")
    g.add_argument("--prompts_file", default=None,
                   help="JSON Lines, one video per line: {\"prompt\": ..., and optionally "
                        "\"negative_prompt\", \"seed\", \"name\"}; one load and compile for "
                        "all (default: one video of --prompt; docs/features.md)")
    g.add_argument("--seeds", default=None,
                   help="comma-separated seeds: one video per seed of --prompt, one compile "
                        "(default: --seed only)")
    g.add_argument("--no_plots", action="store_true",
                   help="write no PNG pictures (timeline, dry-run HBM bars)")
    g.add_argument("--save_frames", action="store_true",
                   help="also write the float32 frames in [0, 1] as <stamp>.frames.safetensors "
                        "(lossless, for quality comparisons; the mp4 is H.264)")
    g.add_argument("--stage", choices=("all", "encode", "denoise", "decode"),
                   default=d["stage"],
                   help="all = one shot; encode / denoise / decode run one stage each, with "
                        "intermediates in --work_dir")
    g.add_argument("--work_dir", default=d["work_dir"],
                   help="folder for embeddings.safetensors, generation_config.json and "
                        "latents.safetensors")
    add_cache_flags(g, d["cache_home"])  # compilation, executable, embeddings caches
    g.add_argument("--profile_dir", default=None,
                   help="capture a jax.profiler trace of one steady-state denoising step (model "
                        "call + scheduler step) into this folder, for TensorBoard/XProf or "
                        "Perfetto (default: no trace)")
    g.add_argument("--vae_tiling", action="store_true",
                   help="decode with diffusers' spatial tiling in one program instead of the "
                        "default frame-chunked decode")
    g.add_argument("--park_weights", choices=parking.MODES, default=d["park_weights"],
                   help="shard the transformer's replicated weights over every device while "
                        "the VAE decodes, and a two-expert model's idle expert until its "
                        "boundary step (auto: each where it would not fit otherwise)")
    g.add_argument("--park_memory", choices=layout.PARK_MEMORY, default=d["park_memory"],
                   help="where parked weights live: device (HBM) or pinned_host (host "
                        "memory: no HBM; moving them crosses the host link). auto: a "
                        "two-expert model's idle expert goes to pinned_host only where that "
                        "lets the layout be Ulysses; the decode's parking, where sharding over "
                        "the devices would not make it fit (one chip)")
    g.add_argument("--verbose", action="store_true", help="debug logging (e.g. unsharded weights)")


def _add_parallel_flags(g) -> None:
    d = DEFAULTS
    g.add_argument("--dp", type=int, default=None,
                   help="mesh axis for the CFG/data batch (default: chosen from the devices)")
    g.add_argument("--tp", type=int, default=None,
                   help="mesh axis for tensor (head) parallelism (default: chosen)")
    g.add_argument("--sp", type=int, default=None,
                   help="mesh axis for sequence parallelism (default: chosen)")
    g.add_argument("--scan_layers", action="store_true", default=d["scan_layers"],
                   help="run the transformer blocks as one jax.lax.scan (one compiled block "
                        "instead of 40: 4.9x faster 14B TPU compile, 30%% fewer temporaries; "
                        "default: on, LTX-2 off)")
    g.add_argument("--no_scan_layers", dest="scan_layers", action="store_false",
                   default=argparse.SUPPRESS,
                   help="unroll the blocks (diffusers' own loop), for comparison")
    g.add_argument("--replicate_row_parallel", action="store_true",
                   help="replicate attention-out and FFN-down weights (drops their all-reduce)")
    g.add_argument("--fsdp", action="store_true",
                   help="also shard weights over the mesh axes tensor parallelism leaves free")
    g.add_argument("--megatron_sp", action="store_true",
                   help="Megatron sequence parallelism: shard the residual stream's tokens "
                        "over tp (and sp) between blocks, so tp's all-reduces become "
                        "reduce-scatter + all-gather and norms and modulation run on 1/tp of "
                        "the tokens")
    g.add_argument("--attention", choices=("auto", "splash", "stock_splash", "xla", "cudnn"),
                   default=d["attention"],
                   help="SDPA backend: splash = our TPU kernel, stock_splash = JAX's (TPU), xla ="
                        " plain XLA (~228 GB per chip for 14B 720p), cudnn = cuDNN on an NVIDIA "
                        "GPU; auto = splash on TPU, cudnn on GPU, else xla (docs/attention.md)")
    g.add_argument("--window_size", type=int, default=None,
                   help="local self-attention: token i attends token j iff |i - j| <= W, "
                        "positions in the flattened frames x height x width order (Wan; "
                        "splash, xla or cudnn; default: global)")
    g.add_argument("--k_smoothing", action="store_true",
                   help="subtract K's mean before attention (SageAttention's K smoothing; "
                        "exact for softmax; splash, xla or cudnn)")
    g.add_argument("--bq", type=int, default=d["bq"],
                   help="Splash block_q: queries per kernel grid step (multiple of 128; "
                        "default: the chip's, see docs/attention.md)")
    g.add_argument("--bkv", type=int, default=d["bkv"],
                   help="Splash block_kv: keys per grid step (multiple of --bkv_compute; "
                        "default: the chip's)")
    g.add_argument("--bkv_compute", type=int, default=d["bkv_compute"],
                   help="Splash block_kv_compute: keys per score tile (multiple of 128; "
                        "default: the chip's)")


def validate_args(args: argparse.Namespace) -> RunConfig:
    """Check every flag without loading a model and resolve the run configuration.

    Detects the model family from ``--model_id`` (``model_index.json``), fills the flags left
    unset from its defaults, and returns the frozen ``RunConfig``.

    Raises:
        UsageError: one line naming the flag, the value and the rule.
    """
    check_numbers(args)
    if args.park_memory == "pinned_host" and args.park_weights == "off":
        fail("--park_memory", args.park_memory, "says where parked weights live: needs "
             "--park_weights auto or on")
    dry_flags.check_dry_run_flags(args)
    validate_block_size_flags(args)
    runtime.validate_distributed_flags(args)
    family_key = _validate_model(args)
    family, options = FAMILIES[family_key], resolve_options(args, family_key)
    check_attention_options(args, family)
    env = quantize.check_flag(args.quantize, family, args.topology if args.dry_run else None)
    defaults = {**family.flags.defaults, **family.flags.checkpoint_defaults(args.model_id)}
    values = resolve_recipe(args, family, defaults, {  # sigmas, their step count, recipe
        k: defaults[k] if getattr(args, k) is None else getattr(args, k) for k in FAMILY_FLAGS})
    values["guidance_scale_2"] = experts.resolve_guidance_scale_2(args.guidance_scale_2,
                                                                  defaults)
    sources = {k: v for k, v in defaults.get("sources", {}).items()
               if getattr(args, k, None) is None and values.get(k, 0) is not None} or None
    serve = serving.validate_serve_flags(args, family, values, defaults)  # sizes: 1st bucket
    image_info = check_for_model(args, family, values)  # may size the video from the image
    inputs, values = families.resolve_inputs(args, family_key, values)  # frames from a video?
    check_size(family, values, args.model_id)
    broken = family.flags.check({**values, "model_id": args.model_id})
    if broken is not None:
        fail(broken[0], values[broken[0].lstrip("-")], broken[1])
    if args.megatron_sp and not family.transformer.block_stack.sublayers:
        fail("--megatron_sp", True, f"not supported for {family.name} (its blocks declare no "
             "sublayers to gather and scatter)")
    flow_shift, source = args.flow_shift, "flag"
    if flow_shift is None and "flow_shift" in defaults:
        flow_shift, source = defaults["flow_shift"], "checkpoint"
    elif flow_shift is None:
        flow_shift = family.scheduler.default_flow_shift(values["height"], values["width"])
        source = "resolution"
    if args.profile_dir is not None:
        if args.dry_run or args.stage in ("encode", "decode"):
            fail("--profile_dir", args.profile_dir, "needs a denoising run: --stage all or "
                 "denoise, without --dry_run")
        check_writable_dir(args.profile_dir, flag="--profile_dir")
    check_writable_dir(args.output_dir)
    extras = dict(videos=videos.plan(args, values), **resolve_cache_dirs(args),
                  image=image_info, serve=serve,
                  lora=lora.validate(args.lora, family, args.model_id, args.dtype),
                  lora_2=lora.validate(args.lora_2, family, args.model_id, args.dtype,
                                       "--lora_2"),
                  scheduler=(scheduler := resolve_scheduler(args.scheduler, family)),
                  upscale=upscale.validate_flags(args, family, values, serve),
                  step_cache=step_cache_flags.validate_cache_flags(
                      args, values["num_inference_steps"], make_scheduler=family.scheduler.make,
                      scheduler=scheduler, flow_shift=flow_shift, sigmas=family.scheduler.sigmas),
                  sparse=sparse.validate_sparse_flags(args, family, values))
    flags = {k: v for k, v in vars(args).items() if k not in step_cache_flags.FLAGS + serving.FLAGS
             + upscale.FLAGS + OPTION_NAMES + sparse.FLAGS + ("cache", "sr")}
    config = RunConfig.from_flags(**{**flags, **values, **extras, "family": family_key,
                          "options": options, "inputs": inputs, "process_env": env,
                          "flow_shift": flow_shift, "flow_shift_source": source,
                          "default_sources": sources})
    # A dry run knows its chip now; a real run resolves the blocks once it sees its devices.
    return config.resolve_block_sizes(args.topology.split(":")[0]) if args.dry_run else config


def _validate_model(args) -> str:
    """Check --model_id's folder (or shipped config for --dry_run) and detect its family."""
    model_id = args.model_id
    if args.dry_run and model_config_dir(model_id) is None:
        shipped = [c for family in FAMILIES.values() for c in family.checkpoint.shipped_configs]
        fail("--model_id", model_id, "no local folder or shipped config under configs/ "
             f"(shipped: {', '.join(shipped)})")
    hint = FAMILIES["wan"].checkpoint.download_hint
    if looks_local(model_id) and not os.path.isdir(model_id):
        fail("--model_id", model_id, "local folder not found; build the tiny test checkpoint "
             "with 'python tools/make_tiny_checkpoint.py --output PATH' or download real "
             f"weights with '{hint}'")
    if looks_local(model_id) and not os.path.isfile(os.path.join(model_id, "model_index.json")):
        fail("--model_id", model_id, "not a diffusers folder, missing model_index.json; "
             f"download the weights with '{hint}'")
    key = detect_family(model_id)
    if looks_local(model_id):
        family = FAMILIES[key]
        missing = [f for f in family.checkpoint.required_files
                   if not os.path.isfile(os.path.join(model_id, f))]
        if missing:
            fail("--model_id", model_id, f"not a diffusers {family.name} folder, missing "
                 f"{', '.join(missing)}; download the weights with "
                 f"'{family.checkpoint.download_hint}'")
    return key


# ---------------------------------------------------------------------------------------------
# 2-11. One run: load, encode on the CPU, route SDPA to the kernel, compile, warm up, time, write
# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    clock.mark_imports_done()  # the report's time to first video starts at the process start
    config = validate_args(parse_args(argv))  # on every host, before any host joins the others
    logging.basicConfig(level=logging.DEBUG if config.run.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    family = FAMILIES[config.model.family]
    # Before any model loads: headers and sizes of the files this stage reads (configs only
    # for --dry_run) against the models their configs build (engine/files/integrity.py).
    checked = integrity.check_checkpoint(config, family)
    if config.dry.dry_run:
        return run_dry(config, family, checked)
    runtime.start_distributed(config.hosts.coordinator_address, config.hosts.num_processes,
                              config.hosts.process_id, process_env=config.process_env)
    if config.serve is not None:  # the same stages, one load and compile, many jobs
        return serve(config, family)
    return generate(config, family, checked)


def generate(config: RunConfig, family, checked: dict) -> int:
    """One run, stage by stage (``engine.pipeline.Generation``); process 0 hands each
    video to the writer thread as soon as it is done (``engine.files.writer``: uint8, mp4
    encode and audio mux beside the next video's work), waits for every file, then writes
    the JSON report and the summary. Returns the exit code (130: interrupted between videos,
    the finished ones kept); a video that could not be written raises its one line."""
    stem = reporting.output_stem(config.run.output_dir) if runtime.is_writer() else None
    with VideoWriter() as writer:
        files = videos.RunFiles(config, stem, writer)

        def save(video, frames):  # a decoder with sound (LTX-2) holds its last waveform
            return files.save(video, frames, getattr(run.programs.vae_decode, "audio", None))

        run = Generation(config, family)  # runtime, devices, chip, blocks, mesh, self-check
        run.load()  # the diffusers pipeline; the transformer's weights stay on the meta device
        run.encode()  # text (and image) encoders on the CPU, freed before anything is placed
        if config.run.stage == "encode":
            return write_stage_report(config, dict(run.save_encoded(), checkpoint_check=checked))
        run.compile()  # place the weights, route torch SDPA to the kernel, compile ahead of time
        run.warm_up()  # every compiled program once: what follows is steady state
        frames = run.time_videos(on_video=save, stream=files.stream)  # each video written when done
        report = dict(run.finish(), checkpoint_check=checked)
        if not runtime.is_writer():  # process 0 writes and summarises for every host
            return 0
        if config.run.stage == "denoise":
            return write_stage_report(config, report)
        if not config.run.videos:
            report = dict(video=save(None, frames)[0], **report)
        writer.wait()  # every file in place (or the first failure's line) before the report
    report.update(reporting.audio_fields(getattr(run.programs.vae_decode, "audio", None)))
    written = files.record(report, run)  # each video's stages, the time to first video
    written += reporting.save_run(report, config.run.output_dir, stem,
                                  plots=not config.run.no_plots)
    devices = report["devices"]
    reporting.print_summary(report["timings"], devices["kind"], devices["count"],
                            quantize.summary_line(report.get("quantize")))
    print(f"\nwrote {', '.join(written)}")
    if report.get("interrupted"):
        print("generate_flax.py: interrupted; the videos above are complete, the JSON lists "
              "them", file=sys.stderr)
        return 130
    return 0


def write_stage_report(config: RunConfig, report: dict) -> int:
    """``--stage encode`` / ``denoise``: the report goes in ``--work_dir`` beside the
    intermediates (written by process 0 only)."""
    if not runtime.is_writer():
        return 0
    devices = report.get("devices", {"kind": "host CPU (text encoder)", "count": 1})
    path = os.path.join(config.run.work_dir, f"{config.run.stage}_report.json")
    reporting.save_report(report, path)
    reporting.print_summary(report["timings"], devices["kind"], devices["count"])
    print(f"\nwrote {config.run.stage} intermediates and {path}")
    return 0


def cli(argv=None) -> int:
    """Entry point: one-line errors, exit codes 0 / 1 (runtime) / 2 (usage) / 3 (dry run:
    does not fit).

    In a multi-process run any error is one line naming this process, and the process
    leaves at once (``os._exit`` under ``__main__``) without the shutdown barrier, so the
    others see it gone: on CPU collectives at their next collective, otherwise when JAX's
    coordination service misses its heartbeat (``DISTRIBUTED_HEARTBEAT_TIMEOUT_S``).
    """
    prefix = "generate_flax.py: error: "
    try:
        code = main(argv)
        if code == 0 and runtime.in_multi_process_run():
            import jax

            jax.distributed.shutdown()  # every process reaches it: a clean, joint exit
        return code
    except UsageError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return EXIT_USAGE
    except GenerationError as e:
        where = f"process {runtime.process_index()}: " if runtime.in_multi_process_run() else ""
        print(f"{prefix}{where}{e}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("generate_flax.py: interrupted; no partial output was written", file=sys.stderr)
        return 130
    except Exception as e:
        if not runtime.in_multi_process_run():
            raise  # a single-process bug keeps its traceback
        print(f"{prefix}process {runtime.process_index()}: {type(e).__name__}: "
              f"{first_line(e) if str(e).strip() else ''} (a failure on another process of "
              "this run ends this one too)", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    code = cli()
    sys.stdout.flush()
    sys.stderr.flush()
    # torchax/JAX background threads can keep the interpreter alive after main returns (reported
    # by earlier TPU ports); a hard exit after flushing guarantees the process ends.
    os._exit(code)
