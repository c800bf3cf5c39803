"""The resolved run configuration: built once from the flags, never mutated.

Stages take what they need from it. A staged run that reads settings recorded with its
intermediates (``--stage denoise`` / ``decode``) gets a new object via ``replace``.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every flag of ``generate_flax.py`` after validation, with family defaults filled in.

    ``family`` is the model family's key (``families.FAMILIES``); ``flow_shift_source`` says
    whether ``flow_shift`` came from the flag or the family's default. ``dp``/``tp``/``sp`` are
    the flags as given (None = chosen from the device count; the chosen ``MeshShape`` travels
    separately).
    """

    model_id: str
    family: str
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
    warmup_steps: int
    num_iterations: int
    output_dir: str
    dtype: str
    max_sequence_length: int
    attention: str
    bq: int | None
    bkv: int | None
    bkv_compute: int | None
    window_size: int | None
    k_smoothing: bool
    compilation_cache_dir: str
    stage: str
    work_dir: str
    dry_run: bool
    topology: str | None
    dry_run_layers: int | None
    dry_run_skip_vae: bool
    dry_run_exact_convs: bool
    estimate: bool
    vae_tiling: bool
    scan_layers: bool
    replicate_row_parallel: bool
    fsdp: bool
    megatron_sp: bool
    profile_dir: str | None
    verbose: bool
    save_frames: bool
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    dp: int | None
    tp: int | None
    sp: int | None
    step_cache: Any = None  # engine.step_cache.CacheSettings
    prompts_file: str | None = None
    seeds: str | None = None
    no_plots: bool = False
    videos: tuple = ()  # engine.videos.Video per video of --prompts_file / --seeds
    # ((path, scale), ...) of --lora, checked and loaded by engine.lora.validate.
    lora: tuple = ()
    # --lora_2: the same for a two-expert checkpoint's transformer_2.
    lora_2: tuple = ()
    # "unipc" or "euler" (--scheduler, resolved to the family's default).
    scheduler: str = "unipc"
    # Two-expert models (Wan 2.2 A14B): the low-noise expert's CFG scale; None otherwise.
    guidance_scale_2: float | None = None
    # {flag: where its default came from} for the flags the user left unset, when the
    # checkpoint's family records sources (Wan 2.2).
    default_sources: Any = None
    # --image: engine.image.ImageInfo (path, size, sha256) of an image-to-video run.
    image: Any = None

    @property
    def use_cfg(self) -> bool:
        """diffusers' pipelines run the unconditional pass only when guidance_scale > 1."""
        return self.guidance_scale > 1.0

    @property
    def batch(self) -> int:
        """The transformer's batch: [cond, uncond] with CFG, else [cond]."""
        return 2 if self.use_cfg else 1

    def block_sizes(self):
        """``custom_splash_attention.BlockSizes`` of --bq/--bkv/--bkv_compute, once
        ``resolve_block_sizes`` has filled the ones not given."""
        from custom_splash_attention import BlockSizes

        return BlockSizes(block_q=self.bq, block_kv=self.bkv, block_kv_compute=self.bkv_compute)

    def resolve_block_sizes(self, chip: str | None) -> RunConfig:
        """This config with --bq/--bkv/--bkv_compute not given taken from ``chip``'s
        defaults (``custom_splash_attention.DEFAULT_BLOCK_SIZES``; chip None = off TPU).

        Raises:
            UsageError: the resulting blocks break a ``BlockSizes`` rule (naming the flag).
        """
        from custom_splash_attention import BlockSizesError, default_block_sizes
        from engine.errors import fail

        default = default_block_sizes(chip)
        given = dict(bq=self.bq, bkv=self.bkv, bkv_compute=self.bkv_compute)
        values = dict(bq=default.block_q, bkv=default.block_kv,
                      bkv_compute=default.block_kv_compute)
        values.update({k: v for k, v in given.items() if v is not None})
        out = self.replace(**values)
        try:
            out.block_sizes()
        except BlockSizesError as e:
            flag = {"block_q": "bq", "block_kv": "bkv", "block_kv_compute": "bkv_compute"}[
                e.field]
            where = f"{chip or 'generic'} defaults" if None in given.values() else "flags"
            fail(f"--{flag}", values[flag], f"expected {e.expected} (blocks "
                 f"{values['bq']}/{values['bkv']}/{values['bkv_compute']} from the {where}; "
                 "give all three of --bq/--bkv/--bkv_compute)")
        return out

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict:
        """The configuration as a plain dict, for reports and intermediates."""
        return dataclasses.asdict(self)


def check_attention_options(args, family: str) -> None:
    """--window_size and --k_smoothing against the attention backend and the family, before
    any model loads (one-line ``UsageError``s).

    The window is Wan's: HunyuanVideo-1.5's joint attention appends text tokens to the
    video tokens, where a band over positions has no video meaning. JAX's stock splash kernel
    gets neither option here (our wrapper passes it segment ids only; its ``LocalMask`` is
    not wired up): a usage error rather than a silent global run.
    """
    from engine.errors import fail

    w = args.window_size
    if w is not None and w < 0:
        fail("--window_size", w, "must be an int >= 0 (omit it for global attention)")
    if w is not None and not family.startswith("wan"):
        fail("--window_size", w, f"Wan only (the {family} family's self-attention mixes in "
                                 "text tokens)")
    for flag, given in (("--window_size", w is not None), ("--k_smoothing", args.k_smoothing)):
        if given and args.attention == "stock_splash":
            fail(flag, w if flag == "--window_size" else True,
                 "needs --attention splash or xla (JAX's stock kernel is not wired for it)")


def validate_block_size_flags(args) -> None:
    """--bq/--bkv/--bkv_compute as given, each alone and the pair together, before the chip's
    defaults fill the rest (``RunConfig.resolve_block_sizes``).

    Raises:
        UsageError: "expected X" from ``custom_splash_attention.BlockSizes``.
    """
    from custom_splash_attention import BlockSizes, BlockSizesError
    from engine.errors import fail

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
