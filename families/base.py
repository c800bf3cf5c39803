"""The model-family interface: ``ModelFamily``, its groups, and the helpers family modules share.

A family module (``families/wan.py``, ...) builds one ``ModelFamily`` value; the package
``families`` registers them. The engine receives that value and reads its groups' fields
(``family.text.encode_prompts``, ``family.vae.decoder``, ...); it never imports a family.

Throughout, ``config`` is an ``engine.run.config.RunConfig`` (read by group:
``config.video.height``, ``config.model.dtype``, ``config.layout.fsdp``); ``cfg`` is the
transformer's config.json as a dict; tensors are torch CPU tensors.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine.files.checkpoint import read_component_config
from engine.run.errors import UsageError, first_line


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a family's checkpoints are and where their files live.

    pipeline_classes: ``model_index.json`` ``_class_name`` values it runs.
    shipped_configs: Hub ids whose configs ``configs/`` holds, for dry runs.
    download_hint: the command that downloads real weights.
    required_files: files a local checkpoint folder must hold.
    components: {stage: pipeline components that stage loads}.
    weight_folders: {component: checkpoint subfolders holding its safetensors}, for the
        checkpoint check before loading (``engine.files.integrity``); each folder's model class
        is its ``model_index.json`` entry, as ``from_pretrained`` reads it.
    optional_folders: weight folders a checkpoint may leave out (``model_index.json`` entry
        absent or [null, null]), e.g. Wan 2.2 A14B's ``transformer_2``.
    """

    pipeline_classes: tuple[str, ...]
    shipped_configs: tuple[str, ...]
    download_hint: str
    required_files: tuple[str, ...]
    components: Mapping[str, tuple[str, ...]]
    weight_folders: Mapping[str, tuple[str, ...]]
    optional_folders: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Flags:
    """The family's flag defaults and the checks on resolved flags.

    defaults: flag defaults (prompt, negative_prompt, height, width, frames, fps,
        num_inference_steps, guidance_scale, max_sequence_length).
    checkpoint_defaults(model_id) -> {flag: value} the checkpoint's own configs set (e.g. its
        guider's guidance_scale, its scheduler's shift as "flow_shift"); they win over
        ``defaults``. May raise ``UsageError``.
    check(values) -> (flag, rule) a resolved flag value breaks, or None; values are the
        resolved family flags and "model_id".
    options: the family's own float flags, {name: (default, help)} (``--name``; refused on
        other families); resolved values reach the run as ``config.video.options``.
    refused: ((flag dest, the only value allowed, why), ...): engine flags the family does
        not take yet; any other value is refused in one line before any model loads.
    inputs: the family's other flags (conditioning inputs such as ``--video`` or
        ``--last_image``, list-valued settings), {name: argparse keyword arguments}; every
        family's are in the parser (one definition per name: families sharing a name must
        give it the same ``type``/``action``); a family that does not declare one refuses it.
    check_inputs(inputs, values, model_id) -> (inputs, values): validates the given inputs
        ({name: value or None}, the family's names only) before any model loads and returns
        them resolved (e.g. a probed video's info) with ``values`` (the resolved family flags)
        possibly changed (e.g. ``frames`` from the video). Raises ``UsageError`` in one line.
        None: the inputs pass as given. The resolved inputs reach the run as
        ``config.video.inputs`` (None when the family declares none). A check with a
        keyword parameter ``args`` also gets the parsed command line (read-only: whether
        ``--frames`` was given, ``--stage``, ``--image``...).
    ``defaults`` may also set "scan_layers" (the --scan_layers default; True when absent) and
    "overlap_compile" (what --overlap_compile auto becomes).
    """

    defaults: Mapping[str, Any]
    checkpoint_defaults: Callable
    check: Callable
    options: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    refused: tuple = ()
    inputs: Mapping[str, dict] = dataclasses.field(default_factory=dict)
    check_inputs: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The video's and latents' geometry, read from the checkpoint's configs as diffusers'
    pipelines read them from the loaded VAE and transformer (the compression ratios, the
    patch sizes): no family keeps a ratio that a config could contradict. ``model_id`` is the
    checkpoint (a local folder, or a Hub id; a dry run reads its config files; where it has
    none, the family's shipped configs in ``configs/``: ``checkpoint_config``).

    frame_step(model_id) -> int: frames must be ``frame_step * n + 1`` (VAE temporal
        compression).
    pixel_multiple(model_id) -> int: height and width must be multiples of it (VAE spatial
        compression x transformer patch).
    latent_shape(vae_cfg, height, width, frames, model_id=None) -> (1, C, F', h, w) (or the
        family's packed layout); ``vae_cfg`` is ``model_id``'s VAE config; ``model_id`` (for
        a family whose latents also follow other components' configs, e.g. LTX-2's audio
        VAE) may be ignored.
    token_count(cfg, height, width, frames, model_id) -> video tokens per sample; ``cfg``
        is ``model_id``'s transformer config.
    """

    frame_step: Callable
    pixel_multiple: Callable
    latent_shape: Callable
    token_count: Callable


@dataclasses.dataclass(frozen=True)
class TextEncoding:
    """Loading the diffusers pipeline and encoding the prompts (CPU, before any device work).

    load_pipeline(config, components) -> diffusers pipeline, transformer with meta weights.
    encode_prompts(pipe, config) -> {name: tensor}, masks included; frees the encoders (the
        prompt and the negative together, as the diffusers pipeline runs them).
    prompt_sides(config) -> ((name prefix, text), ...): the texts one video's embeddings
        hold ("" the prompt, "negative_" the negative prompt when the run uses it).
    encode_text(pipe, config, text) -> {name: tensor} of one text, unprefixed names, equal
        bitwise to that side of ``encode_prompts`` (the prompt-embedding cache keys each
        text apart); keeps the encoders.
    embedding_names: the names ``encode_prompts`` returns (staged files hold these).
    check_embeddings(embeds, settings, cfg) -> error text or None.
    prepare_latents(pipe, config) -> float32 initial noise from ``config.video.seed``.
    encoder_modules(pipe) -> {name: torch.nn.Module}: the loaded encoder modules the encode
        functions call (text encoders, connectors, the image encoder), for
        ``--text_encoder_device mesh`` (``engine.pipeline.text_device``: each one's forward
        runs on the mesh, the encode functions unchanged); ``pipeline_modules`` builds one.
        None: the family's encoders run on the CPU only.
    """

    load_pipeline: Callable
    encode_prompts: Callable
    prompt_sides: Callable
    encode_text: Callable
    embedding_names: tuple[str, ...]
    check_embeddings: Callable
    prepare_latents: Callable
    encoder_modules: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Transformer:
    """The transformer: its model call, its layout on the mesh, what it costs and accepts.

    empty(cfg, torch dtype) -> transformer with meta weights, run dtypes.
    num_heads(cfg) -> attention heads (what tp must divide).
    flops(cfg, config) -> analytic FLOPs of one step's model call(s).
    self_attention_flops(cfg, config) -> the self-attention part of it.
    model_inputs(embeds, config) -> pytree of (batch, ...) tensors the step takes, CFG pairs
        concatenated on the batch axis (placed over "dp").
    abstract_model_inputs(cfg, config) -> same pytree as ``jax.ShapeDtypeStruct`` shapes and
        dtypes (no sharding), for the dry run.
    step_fn(jm, config) -> torch function (params, buffers, latents, timestep, inputs) ->
        noise prediction, CFG combined (to be viewed as JAX and jitted).
    timestep_dtype: dtype of the (1,) timestep the step takes ("int32" or "float32").
    sharding_rules(config) -> ((regex, spec), ...) for the transformer's state dict.
    block_stack: ``engine.weights.scan_layers.BlockStack``: the transformer's block list, what
        a block carries, where the video tokens are (scan, sequence parallelism).
    default_sp: {chip name: sp size} of the default layout on that chip when neither --tp nor
        --sp is given and the chip does not take Ulysses for this checkpoint
        (``engine.weights.layout.resolve_run_mesh``; ``chips.prefers_ulysses`` gives tp 1 and
        all of sp where the replicated weights leave room): chosen where the static estimate
        says it is faster and the dry run says every such checkpoint fits (docs/dry_run.md).
    layout_batch: ``f(config) -> int``, the batch the default layout serves: the smallest
        batch of the step's model calls (LTX-2's STG and modality passes run batch 1 beside
        the CFG pair, and a batch-1 call on dp2 runs twice, its attention off the kernel's
        dp split); None: ``config.video.batch``.
    masks: the attention mask classes (``custom_splash_attention``) its self-attention
        accepts; ``LocalMask`` among them makes ``--window_size`` apply (self-attention over
        video tokens only, in the flattened frames x height x width order).
    lora_state_dict(tensors) -> converted state dict: the transformer's LoRA key converter to
        diffusers/PEFT keys (``transformer.<module>.lora_A.weight``, ...): diffusers' own
        (a ``*LoraLoaderMixin.lora_state_dict``) where diffusers has one, else the family's
        table; None: ``--lora`` / ``--lora_2`` are not supported.
    lora_host_components(model_id, dtype) -> {component: {name: shape}}: the pipeline
        components run on the host whose converted LoRA keys (``<component>.<module>...``)
        ``--lora`` also accepts (LTX-2's text connectors); the family fuses them at load
        (``engine.weights.lora.fuse_host``). None: transformer keys only.
    quantized_linears: regex (``re.search``) over the transformer's module names (before
        ``--scan_layers`` stacks the blocks) of the ``torch.nn.Linear`` layers ``--quantize``
        runs in 8 bits (``engine.weights.quantize``); None: ``--quantize`` is refused.
    sparse_policy(model_id, values) -> ``engine.programs.sparse.SparsePolicy`` (the
        checkpoint's published Sparse VideoGen setting on the run's token grid; ``values``:
        the resolved family flags) or a one-line reason it has none; None: ``--sparse svg``
        is refused for the family.
    """

    empty: Callable
    num_heads: Callable
    flops: Callable
    self_attention_flops: Callable
    model_inputs: Callable
    abstract_model_inputs: Callable
    step_fn: Callable
    timestep_dtype: str
    sharding_rules: Callable
    block_stack: Any
    default_sp: Mapping[str, int] = dataclasses.field(default_factory=dict)
    layout_batch: Callable | None = None
    masks: tuple[type, ...] = ()
    lora_state_dict: Callable | None = None
    lora_host_components: Callable | None = None
    quantized_linears: str | None = None
    sparse_policy: Callable | None = None


@dataclasses.dataclass(frozen=True)
class VaePrograms:
    """The VAE on device: the family's programs on the engine's chunked decoder.

    empty(folder, config) -> VAE with meta weights (dry run, ahead-of-time compiles);
        ``config`` is the run's ``RunConfig``, for a decode module whose shapes follow the
        video size (LTX-2's joint video and audio decode); a family may ignore it.
    is_decode_weight(name) -> whether the decode reads this VAE weight.
    decoder(placed, vae, mesh, *, tiling, abstract, fallbacks) ->
        ``engine.programs.vae_decode.ChunkedDecoder`` or an object with its interface
        (``compile``, ``memory``, ``spatial``, call).
    encoder(placed, mesh, vae, *, abstract) -> the on-device VAE encode of the image
        conditioning (a ``ChunkedDecoder`` subclass: ``compile``, ``memory``, ``spatial``,
        call), on weights placed with ``include=is_encode_weight`` over a mesh with every
        device on "sp" (``engine.run.mesh.spatial_mesh``). Set where ``ImageConditioning.encode``
        runs it (Wan), so the dry run compiles and sizes that encode; None
        where the condition is encoded on the host (HunyuanVideo-1.5).
    is_encode_weight(name) -> whether ``encoder`` reads this VAE weight (with ``encoder``).
    """

    empty: Callable
    is_decode_weight: Callable
    decoder: Callable
    encoder: Callable | None = None
    is_encode_weight: Callable | None = None


@dataclasses.dataclass(frozen=True)
class ImageConditioning:
    """Image-to-video (``--image``, ``engine/files/image.py``); the defaults are a
    text-to-video family's.

    mode(model_id) -> "none" (text-to-video only), "optional" (either, e.g. TI2V-5B) or
        "required" (an image-to-video checkpoint).
    encode(pipe, config, image, devices, resident=None) -> {name: tensor}: the image
        conditioning (image-encoder embeddings, condition latents), computed once per run
        after the prompts and before the transformer is placed; ``image`` is an RGB PIL image,
        ``devices`` the run's devices (for an on-device VAE encode, ``VaePrograms.encoder``).
        The tensors join every video's embeddings: ``model_inputs`` gets them and the encode
        stage stores them, so a staged denoise needs no image encoder. It frees its encoders
        after the call; ``resident``, a dict the caller keeps across calls (``--serve``: one
        image per job), keeps them (the image encoder in host RAM, placed device encoders in
        the dict) for the next call.
    names: the names ``encode`` returns.
    size(model_id, engine.files.image.ImageInfo) -> (height, width) the pipeline gives a
        video of this image when no --height/--width is given, or None (the flags' size).
    finish_latents(latents, inputs) -> latents: applied to the final latents (a
        ``jax.Array``, with the placed model inputs) before the decode; the identity unless
        the pipeline edits them after its loop (TI2V-5B image-to-video).
    wanted(config) -> whether the run computes conditioning with ``encode`` (default: an
        ``--image`` was given); a family whose other inputs (``config.video.inputs``: a
        source video) need an encode says so, and ``encode`` then gets ``image`` None.
    start_latents(pipe, config, noise, embeds) -> float32 initial latents of a video from
        its seeded noise (``TextEncoding.prepare_latents``) and its embeddings (the encoded
        conditioning among them); the noise itself unless the pipeline starts elsewhere
        (video-to-video: the source video's latents noised to the first kept timestep).
    """

    mode: Callable = lambda model_id: "none"
    encode: Callable | None = None
    names: tuple[str, ...] = ()
    size: Callable = lambda model_id, info: None
    finish_latents: Callable = lambda latents, inputs: latents
    wanted: Callable = lambda config: config.video.image is not None
    start_latents: Callable = lambda pipe, config, noise, embeds: noise


@dataclasses.dataclass(frozen=True)
class Scheduling:
    """The sampler: which schedulers, their timesteps and their shift.

    default_flow_shift(height, width) -> float, with the source it documents.
    sigmas(num_inference_steps) -> sigmas for ``set_timesteps``, or None for the scheduler's
        own spacing.
    names: the ``--scheduler`` values its pipeline runs; the first is the default.
    make(scheduler_config, --scheduler, flow_shift) -> the diffusers scheduler the run
        samples with (None: not needed; a two-expert family sets it, so the step caches know
        each expert's steps before any model loads).
    named_sigmas() -> {name: sigmas}: the names ``--sigmas`` takes besides a list (LTX-2:
        "distilled"); None: the family's pipeline takes no ``sigmas`` and ``--sigmas`` is
        refused. Given sigmas replace ``sigmas(n)`` (``engine.programs.denoise.run_sigmas``).
    first_step(config) -> index into the ``num_inference_steps`` schedule of the first
        timestep sampled (the scheduler's begin index): 0, or the cut of a pipeline that
        starts part-way (diffusers' ``get_timesteps`` with ``strength``: video-to-video).
    """

    default_flow_shift: Callable
    sigmas: Callable
    names: tuple[str, ...] = ("euler",)
    make: Callable | None = None
    named_sigmas: Callable | None = None
    first_step: Callable = lambda config: 0


@dataclasses.dataclass(frozen=True)
class Upscale:
    """A second denoising stage on a larger latent grid after the first (super-resolution:
    ``--sr``), with its own transformer, on the same devices (``engine.pipeline.upscale``).

    choices: the ``--sr`` values it takes besides "none".
    validate: ``f(args, values) -> settings`` before any model loads, ``args.sr`` not "none";
        ``values``: the run's flag values with defaults filled in; a stage whose flags give
        the final size sets ``values["height"]`` / ``["width"]`` to the first stage's (LTX-2's
        ``--sr 2x``: half). The settings value goes in ``RunConfig.upscale``. Raises one-line
        ``UsageError``s.
    stage: ``f(config, pipe) -> stage`` for a run whose ``config.upscale`` is set; the
        engine reads the stage's ``config``, ``first``, ``transformer``, ``upsampler``,
        ``scheduler_config``, ``sigmas``, ``step_fn(jm, config)``, ``hand_off_fn(jm)``,
        ``noise(config, embeds)`` and ``text_inputs(embeds)`` (see
        ``families.hunyuan_sr_stage.SrStage``), and ``hand_off_latents`` when present: True
        when ``hand_off_fn`` returns (initial latents, extra inputs), the latents computed
        from the first stage's (``families.ltx2_upscale.TwoStage``).
    dry_stage: ``f(config) -> dry stage`` for ``--dry_run`` (no weights); the engine reads its
        ``config``, ``transformer_config``, ``step_fn``, ``abstract_inputs(cfg)``,
        ``estimate_config`` and ``assumed`` (see ``families.hunyuan_sr_stage.SrDryStage``).
    for_size: ``f(settings, height, width) -> settings`` for a first stage of another size
        (the server's buckets); raises a one-line ``UsageError`` for a size it cannot take.
    """

    choices: tuple[str, ...]
    validate: Callable
    stage: Callable
    dry_stage: Callable
    for_size: Callable


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """What a model family provides: its name and one frozen value per concern. What a family
    supports is a field (``transformer.masks``, ``transformer.lora_state_dict``,
    ``vae.encoder``, ``image.mode``), never a name test.

    name: human name ("Wan 2.1").
    checkpoint: ``Checkpoint``: pipeline classes, shipped configs, files and weight folders.
    flags: ``Flags``: flag defaults, the checkpoint's own defaults, flag checks.
    sizes: ``Sizes``: frame step, pixel multiple, latent shape, token count.
    text: ``TextEncoding``: the pipeline load, prompt encode and initial noise (CPU).
    transformer: ``Transformer``: model call, sharding, block stack, FLOPs, masks, LoRA.
    vae: ``VaePrograms``: the device VAE decode (and encode) programs.
    image: ``ImageConditioning``: image-to-video.
    scheduler: ``Scheduling``: schedulers, sigmas, default flow shift.
    upscale: ``Upscale`` (a super-resolution stage) or None.
    chunks: ``f(config, pipe, embeds, step, compile_for) -> loop`` for a family that makes
        a video autoregressively in chunks (Helios), or None. ``step`` is the compiled step
        (weights bound) for the initial latents' shape, ``compile_for(latents
        ShapeDtypeStruct)`` compiles and binds the same step for another latents shape (the
        same inputs), ``embeds`` the video's host embeddings. The engine then runs
        ``loop.run(programs, on_step=, on_chunk=) -> (latents, video, info)`` in place of its
        denoising loop and decode (``engine.programs.denoise.run_chunks``), ``loop.warmup
        (programs)`` as the warmup and ``loop.for_video(config, embeds)`` for another video.
    """

    name: str
    checkpoint: Checkpoint
    flags: Flags
    sizes: Sizes
    text: TextEncoding
    transformer: Transformer
    vae: VaePrograms
    scheduler: Scheduling
    image: ImageConditioning = dataclasses.field(default_factory=ImageConditioning)
    upscale: Upscale | None = None
    chunks: Callable | None = None


def pipeline_modules(*names: str) -> Callable:
    """A ``TextEncoding.encoder_modules``: ``pipe -> {name: pipe.<name>}`` for each of
    ``names`` the pipeline has loaded (not None)."""

    def modules(pipe) -> dict:
        return {n: getattr(pipe, n) for n in names if getattr(pipe, n, None) is not None}

    return modules


def checkpoint_config(model_id: str | None, subfolder: str, shipped: str,
                      filename: str = "config.json") -> dict:
    """``<subfolder>/<filename>`` of checkpoint ``model_id`` (a local folder or a Hub id whose
    configs ``configs/`` ships), else of ``shipped`` (the family's real checkpoint in
    ``configs/``): what a dry run reads where diffusers reads the loaded component.

    Raises:
        UsageError: the checkpoint's file does not parse, or neither has it (a damaged
            ``configs/``).
    """
    for source in (model_id, shipped):
        try:
            cfg = read_component_config(source, subfolder, filename=filename) if source \
                else None
        except (OSError, ValueError) as e:  # read before engine.files.integrity's check
            raise UsageError(f"--model_id={source!r}: {subfolder}/{filename}: does not parse "
                             f"({first_line(e)})") from None
        if cfg is not None:
            return cfg
    raise UsageError(f"--model_id={model_id!r}: no {subfolder}/{filename}, and none shipped "
                     f"for {shipped} in configs/")


def init_value(cls, cfg: dict, name: str):
    """``cfg[name]``, or for a key the config leaves out the default of ``cls.__init__``: the
    value ``cls.from_config(cfg)`` builds the model with."""
    if name in cfg:
        return cfg[name]
    return inspect.signature(cls.__init__).parameters[name].default


def empty_model(cls, cfg: dict, dtype):
    """A diffusers model of class ``cls`` and config ``cfg`` with meta parameters (no RAM
    for weights), in ``dtype`` except the parameters ``from_pretrained`` keeps in float32.
    Buffers (RoPE tables) are real. The weights come later, streamed from the checkpoint
    into their shards."""
    from accelerate import init_empty_weights

    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    with init_empty_weights():
        model = cls.from_config(cfg).eval()
    # torch's Module.to, not diffusers' override, which warns about the fp32-kept modules.
    torch.nn.Module.to(model, dtype)
    # from_pretrained keeps a parameter in float32 when any part of its dotted name is listed
    # (module names such as "norm1", and parameters such as "scale_shift_table").
    keep = set(model._keep_in_fp32_modules or [])
    for name, param in model.named_parameters():
        if keep.intersection(name.split(".")):
            param.data = param.data.float()
    return model
