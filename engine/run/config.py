"""The resolved run configuration: built once from the flags, never mutated.

Stages take what they need from it. A staged run that reads settings recorded with its
intermediates (``--stage denoise`` / ``decode``) gets a new object via ``replace``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from typing import Any

from custom_splash_attention import (
    AttentionOptions,
    BlockSizes,
    BlockSizesError,
    LocalMask,
    default_attention_backend,
    default_block_sizes,
    default_sparse_block_sizes,
)
from engine.run.chips import ESTIMATE_CHIPS
from engine.run.errors import fail


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """What is loaded: ``--model_id`` and its family's key (``families.FAMILIES``), the run
    dtype, the LoRA sets (``engine.weights.lora.LoraSet``; None only in a configuration
    built by hand without LoRAs) fused into ``transformer`` and ``transformer_2``, and
    ``--quantize`` ("none", "int8" or "fp8": ``engine.weights.quantize``)."""

    model_id: str
    family: str
    dtype: str
    lora: Any = None
    lora_2: Any = None
    quantize: str = "none"


@dataclasses.dataclass(frozen=True)
class VideoSettings:
    """What is generated, as the pipeline's ``__call__`` takes it: prompts, size, steps, CFG,
    the scheduler and its ``flow_shift`` (``flow_shift_source``: "flag", "checkpoint" or
    "resolution"), the seed, and the conditioning image (``engine.files.image.ImageInfo``).
    ``guidance_scale_2`` is a two-expert model's low-noise CFG scale, else None;
    ``default_sources`` is {flag: where its default came from} for the flags left unset,
    when the family records sources (Wan 2.2). ``options`` holds the family's own flags
    ({name: value}, ``families.base.Flags.options``), else None. ``sigmas``: the schedule
    before the scheduler's shift, diffusers' ``sigmas`` (``--sigmas`` or the checkpoint's
    recipe; as many as ``num_inference_steps``), else None (the family's spacing).
    ``recipe``: {"name", "source"} of the defaults a family's checkpoint implies (LTX-2:
    "distilled" or "pipeline defaults"; "flag" when ``--sigmas`` is given), else None.
    ``inputs``: the family's other flags as its ``Flags.check_inputs`` resolved them
    ({name: value}; conditioning videos, masks, last images), else None."""

    prompt: str
    negative_prompt: str
    height: int
    width: int
    frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    flow_shift: float
    flow_shift_source: str
    seed: int
    max_sequence_length: int
    scheduler: str = "unipc"
    guidance_scale_2: float | None = None
    image: Any = None
    default_sources: Any = None
    options: Any = None
    sigmas: tuple[float, ...] | None = None
    recipe: Any = None
    inputs: Any = None

    @property
    def use_cfg(self) -> bool:
        """diffusers' pipelines run the unconditional pass only when guidance_scale > 1 (or,
        for a family with more guidance scales, any option named *guidance_scale > 1: the
        audio CFG scale of a video-with-sound model)."""
        return self.guidance_scale > 1.0 or any(
            v > 1.0 for k, v in (self.options or {}).items() if k.endswith("guidance_scale"))

    @property
    def batch(self) -> int:
        """The transformer's batch: [cond, uncond] with CFG, else [cond]."""
        return 2 if self.use_cfg else 1


@dataclasses.dataclass(frozen=True)
class LayoutSettings:
    """How the weights and activations lie on the mesh: ``dp``/``tp``/``sp`` as given (None =
    chosen from the device count; the chosen ``MeshShape`` travels separately), the scanned
    block stack, and the sharding options."""

    dp: int | None
    tp: int | None
    sp: int | None
    scan_layers: bool
    replicate_row_parallel: bool
    fsdp: bool
    megatron_sp: bool


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """The attention backend (``attention``: auto, splash, stock_splash, xla or cudnn) and our
    kernel's flags; ``options()`` is the one value the kernel takes."""

    attention: str
    bq: int | None
    bkv: int | None
    bkv_compute: int | None
    window_size: int | None
    k_smoothing: bool

    def block_sizes(self) -> BlockSizes:
        """``custom_splash_attention.BlockSizes`` of --bq/--bkv/--bkv_compute, once
        ``RunConfig.resolve_block_sizes`` has filled the ones not given."""
        return BlockSizes(block_q=self.bq, block_kv=self.bkv, block_kv_compute=self.bkv_compute)

    def options(self) -> AttentionOptions:
        """The model attention's one value (``custom_splash_attention.AttentionOptions``):
        the resolved blocks, --k_smoothing, and --window_size as a ``LocalMask``."""
        w = self.window_size
        return AttentionOptions(block_sizes=self.block_sizes(), k_smoothing=self.k_smoothing,
                                mask=None if w is None else LocalMask(w))


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The process's work and its outputs: the stage and its folders, the benchmark protocol
    (warmup, timed iterations, profile), the persistent compile cache, the videos of
    --prompts_file / --seeds (``engine.files.videos.Video``s), what is written, and the VAE
    decode's tiling, ``--park_weights`` (``engine.programs.parking``), ``--park_memory``
    (``engine.weights.layout.idle_expert_memory``) and ``--text_encoder_device``
    (``engine.pipeline.text_device``)."""

    stage: str
    work_dir: str
    output_dir: str
    warmup_steps: int
    num_iterations: int
    compilation_cache_dir: str
    profile_dir: str | None
    verbose: bool
    save_frames: bool
    vae_tiling: bool
    no_plots: bool = False
    park_weights: str = "auto"
    park_memory: str = "auto"
    prompts_file: str | None = None
    seeds: str | None = None
    videos: tuple = ()
    executable_cache_dir: str = "none"
    embeddings_cache: str = "none"
    overlap_compile: str = "off"
    text_encoder_device: str = "cpu"


@dataclasses.dataclass(frozen=True)
class DryRunSettings:
    """``--dry_run`` and its options: the topology compiled for, how much of it, and
    ``--estimate``."""

    dry_run: bool
    topology: str | None
    dry_run_layers: int | None
    dry_run_skip_vae: bool
    dry_run_exact_convs: bool
    estimate: bool
    aot_export: str | None = None


@dataclasses.dataclass(frozen=True)
class HostSettings:
    """The multi-host flags for ``jax.distributed.initialize`` (None: found by JAX)."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


# RunConfig's groups, in the order reports list their settings.
GROUPS = (("model", ModelSettings), ("video", VideoSettings), ("layout", LayoutSettings),
          ("kernel", KernelSettings), ("run", RunSettings), ("dry", DryRunSettings),
          ("hosts", HostSettings))
_GROUP_OF = {f.name: group for group, cls in GROUPS for f in dataclasses.fields(cls)}
# Settings kept as one value, not a flag group.
_WHOLE = ("step_cache", "serve", "upscale", "sparse", "process_env")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every flag of ``generate_flax.py`` after validation, with family defaults filled in,
    in the groups that stages read: a stage's signature names the group it needs.

    model: ``ModelSettings``; video: ``VideoSettings``; layout: ``LayoutSettings``; kernel:
    ``KernelSettings``; run: ``RunSettings``; dry: ``DryRunSettings``; hosts:
    ``HostSettings``; step_cache: ``engine.programs.step_cache_settings.CacheSettings`` (None: off);
    serve: ``engine.serve.flags.ServeSettings`` (None: no --serve); upscale: the family's
    super-resolution settings (``families.base.Upscale.validate``; None: no --sr); sparse:
    ``engine.programs.sparse.SparseSettings`` (None: --sparse none); process_env: the
    ``engine.run.runtime.ProcessEnv`` the flags ask for (XLA and libtpu flags; None:
    nothing), computed by validation without writing the environment and applied where the
    runtime starts (``runtime.start_distributed``, the dry run's deviceless setup).
    Build one from flat flag values with ``from_flags``; ``replace`` takes flat names too.
    """

    model: ModelSettings
    video: VideoSettings
    layout: LayoutSettings
    kernel: KernelSettings
    run: RunSettings
    dry: DryRunSettings
    hosts: HostSettings
    step_cache: Any = None
    serve: Any = None
    upscale: Any = None
    sparse: Any = None
    process_env: Any = None

    @classmethod
    def from_flags(cls, **values) -> RunConfig:
        """A configuration from flat values (flag names, as ``settings`` lists them).

        Raises:
            TypeError: a name no group has, or a required one missing.
        """
        unknown = sorted(set(values) - set(_GROUP_OF) - set(_WHOLE))
        if unknown:
            raise TypeError(f"RunConfig: expected flag names, got {unknown}")
        groups = {g: c(**{k: v for k, v in values.items() if _GROUP_OF.get(k) == g})
                  for g, c in GROUPS}
        return cls(**groups, **{k: values.get(k) for k in _WHOLE})

    def resolve_block_sizes(self, chip: str | None) -> RunConfig:
        """This config with --bq/--bkv/--bkv_compute not given taken from ``chip``'s
        defaults (``custom_splash_attention.DEFAULT_BLOCK_SIZES``; chip None = off TPU),
        and with --sparse, the band calls' blocks (``SparseSettings.block_sizes``): the
        chip's ``SPARSE_BLOCK_SIZES`` when none of the three flags is given, else the flags'.

        Raises:
            UsageError: the resulting blocks break a ``BlockSizes`` rule (naming the flag).
        """
        default = default_block_sizes(chip)
        k = self.kernel
        given = dict(bq=k.bq, bkv=k.bkv, bkv_compute=k.bkv_compute)
        values = dict(bq=default.block_q, bkv=default.block_kv,
                      bkv_compute=default.block_kv_compute)
        values.update({name: v for name, v in given.items() if v is not None})
        out = self.replace(**values)
        if self.sparse is not None:
            # The band calls' own blocks, unless the user chose blocks (then those).
            sb = (default_sparse_block_sizes(chip) if all(v is None for v in given.values())
                  else None)
            out = out.replace(sparse=dataclasses.replace(self.sparse, block_sizes=None if sb
                              is None else (sb.block_q, sb.block_kv, sb.block_kv_compute)))
        try:
            out.kernel.block_sizes()
        except BlockSizesError as e:
            flag = {"block_q": "bq", "block_kv": "bkv", "block_kv_compute": "bkv_compute"}[
                e.field]
            where = f"{chip or 'generic'} defaults" if None in given.values() else "flags"
            fail(f"--{flag}", values[flag], f"expected {e.expected} (blocks "
                 f"{values['bq']}/{values['bkv']}/{values['bkv_compute']} from the {where}; "
                 "give all three of --bq/--bkv/--bkv_compute)")
        return out

    def replace(self, **changes) -> RunConfig:
        """A copy with ``changes``: flat flag names (``seed=3``) or whole groups
        (``video=...``)."""
        groups = {k: v for k, v in changes.items()
                  if k in dict(GROUPS) or k in _WHOLE}
        for group, _ in GROUPS:
            flat = {k: v for k, v in changes.items() if _GROUP_OF.get(k) == group}
            if flat:
                groups[group] = dataclasses.replace(groups.get(group, getattr(self, group)),
                                                    **flat)
        unknown = set(changes) - set(groups) - set(_GROUP_OF)
        if unknown:
            raise TypeError(f"RunConfig.replace: expected flag or group names, got "
                            f"{sorted(unknown)}")
        return dataclasses.replace(self, **groups)

    def settings(self) -> dict:
        """The configuration as one flat dict of flag names, for reports and intermediates: a
        LoRA set as its [[path, scale], ...] (its tensors are not settings)."""
        out = {}
        for group, _ in GROUPS:
            out.update(dataclasses.asdict(getattr(self, group)) if group != "model" else
                       dataclasses.asdict(dataclasses.replace(self.model, lora=None,
                                                              lora_2=None)))
        out["step_cache"] = (None if self.step_cache is None
                             else dataclasses.asdict(self.step_cache))
        out.update(lora=self.model.lora.specs() if self.model.lora else [],
                   lora_2=self.model.lora_2.specs() if self.model.lora_2 else [])
        if self.serve is not None:  # a CLI run's settings stay as they were
            out["serve"] = self.serve.settings()
        if self.upscale is not None:
            out["upscale"] = dataclasses.asdict(self.upscale)
        if self.sparse is not None:
            out["sparse"] = dataclasses.asdict(self.sparse)
        return out


def check_attention_options(args, family) -> None:
    """--window_size and --k_smoothing against the attention backend and the family (a
    ``families.ModelFamily``), before any model loads (one-line ``UsageError``s).

    The window needs a family whose self-attention runs over video tokens only (``LocalMask``
    in ``family.transformer.masks``): a joint attention that appends text tokens to the video
    tokens gives a band over positions no video meaning. JAX's stock splash kernel gets neither
    option here (our wrapper passes it segment ids only; its ``LocalMask`` is not wired up): a
    usage error rather than a silent global run.
    """
    w = args.window_size
    if w is not None and w < 0:
        fail("--window_size", w, "must be an int >= 0 (omit it for global attention)")
    if w is not None and LocalMask not in family.transformer.masks:
        fail("--window_size", w, f"not supported for {family.name} (its transformer "
                                 "takes no local attention mask)")
    for flag, given in (("--window_size", w is not None), ("--k_smoothing", args.k_smoothing)):
        if given and args.attention == "stock_splash":
            fail(flag, w if flag == "--window_size" else True,
                 "needs --attention splash or xla (JAX's stock kernel is not wired for it)")


def resolve_attention_backend(attention: str, platform: str) -> str:
    """``--attention`` against the platform the run sees (``jax.default_backend()``):
    "auto" resolved (``default_attention_backend``), a backend that cannot run there
    refused. "xla" runs everywhere; "cudnn" needs a CUDA GPU; the Splash kernels are Pallas
    TPU kernels, refused on a GPU (elsewhere off TPU they run in interpret mode, as CPU
    tests do).

    Raises:
        UsageError: "cudnn" off GPU, "splash"/"stock_splash" on a GPU (one line).
    """
    if attention == "auto":
        return default_attention_backend(platform)
    if attention == "cudnn" and platform != "gpu":
        fail("--attention", attention, f"needs an NVIDIA GPU (JAX's default backend here is "
                                       f"{platform}); use --attention xla")
    if attention in ("splash", "stock_splash") and platform == "gpu":
        fail("--attention", attention, "a Pallas TPU kernel, not supported on a GPU; use "
                                       "--attention cudnn or xla")
    return attention


def resolve_scheduler(value: str | None, family) -> str:
    """``--scheduler`` resolved against ``family.scheduler.names`` (the first is its default).

    Raises:
        UsageError: a scheduler the family's pipeline does not run.
    """
    if value is not None and value not in family.scheduler.names:
        fail("--scheduler", value, f"{family.name} runs {' or '.join(family.scheduler.names)} "
             "only")
    return value or family.scheduler.names[0]


def validate_block_size_flags(args) -> None:
    """--bq/--bkv/--bkv_compute as given, each alone and the pair together, before the chip's
    defaults fill the rest (``RunConfig.resolve_block_sizes``).

    Raises:
        UsageError: "expected X" from ``custom_splash_attention.BlockSizes``.
    """
    # Each given value alone (128 stands in for the others); the three together once the
    # chip's defaults fill the rest (RunConfig.resolve_block_sizes).
    for flag, field in (("bq", "block_q"), ("bkv", "block_kv"),
                        ("bkv_compute", "block_kv_compute")):
        value = getattr(args, flag)
        if value is None:
            continue
        try:
            BlockSizes(**{"block_q": 128, "block_kv": 128, "block_kv_compute": 128,
                          field: value})
        except BlockSizesError as e:
            if e.field == field:
                fail(f"--{flag}", value, f"expected {e.expected}")
    if args.bkv is not None and args.bkv_compute is not None:
        try:
            BlockSizes(block_q=128, block_kv=args.bkv, block_kv_compute=args.bkv_compute)
        except BlockSizesError as e:
            fail("--bkv", args.bkv, f"expected {e.expected}")


def resolve_sigmas(args, family, defaults: dict) -> tuple[float, ...] | None:
    """The run's sigmas (diffusers' ``sigmas``): ``--sigmas`` (comma-separated floats, or a
    name the family's ``scheduler.named_sigmas`` gives), else the checkpoint's default
    (``defaults["sigmas"]``) unless ``--num_inference_steps`` asks for another count, else
    None. Given sigmas set the step count, as the pipeline's ``retrieve_timesteps`` does.

    Raises:
        UsageError: one line naming ``--sigmas`` (not floats, empty, outside (0, 1], not
            decreasing, or a family without ``sigmas``) or a conflicting
            ``--num_inference_steps``.
    """
    text, steps = args.sigmas, args.num_inference_steps
    if text is None:
        default = defaults.get("sigmas")
        return tuple(default) if default and steps in (None, len(default)) else None
    if family.scheduler.named_sigmas is None:
        fail("--sigmas", text, f"{family.name}'s pipeline takes no sigmas")
    names = family.scheduler.named_sigmas()
    if text.strip() in names:
        values = tuple(names[text.strip()])
    else:
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            fail("--sigmas", text, "must be comma-separated floats (e.g. 0.9,0.5,0.2) or "
                 f"one of: {', '.join(names)}")
    if not all(0 < v <= 1 for v in values):
        fail("--sigmas", text, "every sigma must be in (0, 1] (the scheduler appends the "
             "final 0)")
    if any(b >= a for a, b in zip(values, values[1:], strict=False)):
        fail("--sigmas", text, "must be strictly decreasing (the noise level falls each step)")
    if steps is not None and steps != len(values):
        fail("--num_inference_steps", steps, f"conflicts with --sigmas' {len(values)} values "
             "(the step count comes from the list; leave it out)")
    return values


def resolve_recipe(args, family, defaults: dict, values: dict) -> dict:
    """``values`` (the family flags, resolved) with "sigmas" (``resolve_sigmas``), the step
    count they set, and "recipe": the checkpoint's (``defaults["recipe"]``, a family's
    ``Flags.checkpoint_defaults``) or, with ``--sigmas``, the same named "sigmas" from
    "flag".

    Raises:
        UsageError: as ``resolve_sigmas``.
    """
    sigmas = resolve_sigmas(args, family, defaults)
    recipe = defaults.get("recipe")
    if args.sigmas is not None:  # the schedule is the user's; the rest of the recipe stays
        recipe = dict(recipe or {}, name="sigmas", source="flag")
    steps = values["num_inference_steps"] if sigmas is None else len(sigmas)
    return dict(values, sigmas=sigmas, num_inference_steps=steps, recipe=recipe)


def check_numbers(args) -> None:
    """The numeric flags' ranges and the dry-run flags' combinations, before anything else.

    Raises:
        UsageError: one line naming the flag, the value and the rule.
    """
    rules = (("num_inference_steps", 1, ">= 1"), ("num_iterations", 1, ">= 1"),
             ("warmup_steps", 0, ">= 0 (0 skips the warmup)"), ("fps", 1, ">= 1"),
             ("max_sequence_length", 1, ">= 1"), ("dp", 1, ">= 1"), ("tp", 1, ">= 1"),
             ("sp", 1, ">= 1"), ("dry_run_layers", 1, ">= 1"))
    for name, low, rule in rules:
        value = getattr(args, name)
        if value is not None and value < low:
            fail(f"--{name}", value, f"must be {rule}")
    for flag in ("guidance_scale", "guidance_scale_2"):
        g = getattr(args, flag)
        if g is not None and (not math.isfinite(g) or g < 0):
            fail(f"--{flag}", g, "must be a finite number >= 0")
    shift = args.flow_shift
    if shift is not None and (not math.isfinite(shift) or shift <= 0):
        fail("--flow_shift", shift, "must be a finite number > 0")
    if args.estimate and not args.dry_run:
        fail("--estimate", True, "needs --dry_run (it estimates the compiled step's time)")
    if args.estimate and args.attention == "stock_splash":
        fail("--attention", args.attention, "--estimate profiles our kernel (splash) or xla")
    if args.dry_run and args.attention == "cudnn":
        fail("--attention", args.attention, "--dry_run compiles for a TPU topology; use "
                                            "splash, stock_splash or xla")
    if args.estimate and args.topology and args.topology.split(":")[0] not in ESTIMATE_CHIPS:
        fail("--topology", args.topology,
             f"--estimate knows the clock of {', '.join(ESTIMATE_CHIPS)} only")
    if args.dry_run and (not args.topology or not re.fullmatch(
            r"(v\d+[a-z]*|tpu\d+[a-z]*):\d+x\d+(x\d+)?", args.topology)):
        fail("--topology", args.topology, "--dry_run needs a TPU topology such as v6e:2x4 or "
             "tpu7x:2x2x1")


def check_size(family, values: dict, model_id: str) -> None:
    """--frames against the checkpoint's ``family.sizes.frame_step`` and --height/--width
    against its ``pixel_multiple`` (VAE compression times patch size), with the family's name
    in the rule.

    Raises:
        UsageError: one line naming the flag, the value and the rule.
    """
    step, multiple = family.sizes.frame_step(model_id), family.sizes.pixel_multiple(model_id)
    if values["frames"] < 1 or (values["frames"] - 1) % step:
        fail("--frames", values["frames"], f"must be of the form {step}n+1 (1, {step + 1}, "
             f"{2 * step + 1}, ...) for {family.name}")
    for flag in ("height", "width"):
        v = values[flag]
        if v < multiple or v % multiple:
            fail(f"--{flag}", v, f"must be a positive multiple of {multiple} for {family.name} "
                 "(VAE compression times patch size)")


def check_writable_dir(path: str, flag: str = "--output_dir") -> None:
    """Create ``path`` if needed and write a temporary file in it.

    Raises:
        UsageError: not a writable directory.
    """
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        fail(flag, path, f"must be a writable directory ({e.strerror or e})")


def add_cache_flags(g, home: str) -> None:
    """--compilation_cache_dir (default ``home``/jax-compilation-cache),
    --executable_cache_dir and --embeddings_cache on the argparse group ``g``; "auto"
    folders are resolved by ``resolve_cache_dirs``."""
    g.add_argument("--compilation_cache_dir",
                   default=os.path.join(home, "jax-compilation-cache"),
                   help="JAX persistent compilation cache; 'none' disables it")
    g.add_argument("--executable_cache_dir", default="auto",
                   help="compiled programs by program, input signature, sources, library "
                        "versions, devices and settings: a warm run neither traces nor "
                        "compiles them; auto = 'executables' beside --compilation_cache_dir "
                        "(off when that is 'none'); 'none' disables it (docs/features.md)")
    g.add_argument("--embeddings_cache", default="auto", metavar="DIR",
                   help="prompt embeddings by text encoder, prompts, length and dtype: when "
                        "every video hits, the text encoder is neither read nor run; auto = "
                        "'embeddings' beside --compilation_cache_dir (off when that is "
                        "'none'); 'none' disables it (docs/features.md)")
    g.add_argument("--overlap_compile", choices=("auto", "on", "off"), default="auto",
                   help="compile the step and the VAE decode from shapes on a thread while "
                        "the checkpoint is read, the prompts encoded and the weights placed; "
                        "auto = on with accelerators or 4+ CPU cores (docs/features.md)")


def resolve_cache_dirs(args) -> dict:
    """{flag name: folder or "none"} of the three cache flags, "auto" resolved beside
    --compilation_cache_dir.

    Raises:
        UsageError: a folder given explicitly that is not a writable directory.
    """
    compilation = args.compilation_cache_dir
    out = dict(compilation_cache_dir=compilation)
    for flag, leaf in (("executable_cache_dir", "executables"),
                       ("embeddings_cache", "embeddings")):
        value = getattr(args, flag)
        if value == "auto":
            value = "none" if compilation.lower() == "none" else os.path.join(
                os.path.dirname(os.path.abspath(compilation)), leaf)
        elif value.lower() != "none":
            check_writable_dir(value, flag=f"--{flag}")
        out[flag] = value
    return out
