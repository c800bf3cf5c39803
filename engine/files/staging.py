"""Staged intermediates (``--stage encode | denoise | decode``) in ``--work_dir``.

``encode`` writes the prompt embeddings (safetensors, bf16 round-trips exactly) and the
settings they were made with; ``denoise`` reads them and writes the final latents with the
settings that made them and a digest of the VAE config they are meant for; ``decode`` reads
those. Every reader refuses, in one line naming the file, a file that is missing, damaged,
or made for another model or size.
"""

from __future__ import annotations

import hashlib
import json
import os

from engine.files.checkpoint import read_component_config
from engine.files.report import atomic_write, save_report
from engine.run import runtime
from engine.run.errors import UsageError, first_line

EMBEDDINGS_FILE = "embeddings.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
LATENTS_FILE = "latents.safetensors"
# The settings that, with the embeddings, determine the final latents; decode reports them.
LATENT_SETTINGS = ("seed", "num_inference_steps", "height", "width", "frames", "flow_shift",
                   "guidance_scale", "prompt", "negative_prompt", "model_id")


def config_digest(config) -> str:
    """sha256 of a diffusers config's architecture values (keys starting with "_" such as the
    diffusers version are left out), so intermediates can name the model they came from."""
    clean = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def save_tensors(tensors: dict, path: str, metadata: dict) -> None:
    """Write CPU torch tensors as safetensors (bf16 round-trips exactly), atomically."""
    from safetensors.torch import save_file

    meta = {k: json.dumps(v) for k, v in metadata.items()}
    atomic_write(path, lambda tmp: save_file(
        {k: v.detach().clone() for k, v in tensors.items()}, tmp, metadata=meta))


def load_tensors(path: str, keys, produced_by: str, optional=()):
    """Read ``keys`` (and those of ``optional`` the file holds) and the JSON metadata from a
    safetensors file.

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
            return {k: f.get_tensor(k) for k in (*keys, *optional) if k in f.keys()}, meta
    except UsageError:
        raise
    except Exception as e:  # safetensors raises several types for damaged files
        raise UsageError(f"{path}: unreadable, truncated or corrupt safetensors file "
                         f"({first_line(e)})") from None


def save_embeddings(work_dir: str, embeds: dict, settings: dict) -> None:
    """Write ``embeds`` ({name: CPU tensor}) and the ``settings`` that made them (prompt,
    negative_prompt, model_id, max_sequence_length, dtype) to ``work_dir``."""
    os.makedirs(work_dir, exist_ok=True)
    save_tensors(embeds, os.path.join(work_dir, EMBEDDINGS_FILE), settings)
    save_report(settings, os.path.join(work_dir, GENERATION_CONFIG_FILE))


def load_embeddings(work_dir: str, names, check=None, optional=()):
    """Embeddings written by ``--stage encode``: ({name: CPU tensor}, recorded settings).

    ``check(embeds, settings)`` returns an error text for embeddings the transformer cannot
    take (shape, text width), or None; the text is reported after the file's path.

    Raises:
        UsageError: the file is missing or damaged, or ``check`` refuses it.
    """
    path = os.path.join(work_dir, EMBEDDINGS_FILE)
    embeds, settings = load_tensors(path, tuple(names), "encode", optional)
    problem = check(embeds, settings) if check is not None else None
    if problem:
        raise UsageError(f"{path}: {problem}")
    return embeds, settings


def save_latents(work_dir: str, latents, settings: dict, vae_config) -> None:
    """Write final latents with the ``LATENT_SETTINGS`` that made them and the VAE's digest."""
    os.makedirs(work_dir, exist_ok=True)
    meta = {k: settings[k] for k in LATENT_SETTINGS}
    meta["vae_config_sha256"] = config_digest(vae_config)
    save_tensors(dict(latents=latents), os.path.join(work_dir, LATENTS_FILE), meta)


def load_latents(work_dir: str, vae_config, model_id: str, expected_shape):
    """Final latents written by ``--stage denoise``: (float32 CPU tensor, recorded settings).

    ``expected_shape(settings)`` gives the latent shape the recorded size implies.

    Raises:
        UsageError: latents made for another VAE, recorded settings missing, or a shape that
            disagrees with the recorded size.
    """
    path = os.path.join(work_dir, LATENTS_FILE)
    t, meta = load_tensors(path, ("latents",), "denoise")
    if meta.get("vae_config_sha256") != config_digest(vae_config):
        raise UsageError(f"{path}: made for a different VAE config than --model_id="
                         f"{model_id!r} (recorded model: {meta.get('model_id')!r})")
    missing = [k for k in LATENT_SETTINGS if k not in meta]
    if missing:
        raise UsageError(f"{path}: metadata lacks {', '.join(missing)}")
    settings = {k: meta[k] for k in LATENT_SETTINGS}
    expected, lat = tuple(expected_shape(settings)), t["latents"]
    if tuple(lat.shape) != expected:
        raise UsageError(f"{path}: expected latents of shape {expected} for "
                         f"{settings['frames']} frames at {settings['height']}x"
                         f"{settings['width']}, got {tuple(lat.shape)}")
    return lat.float(), settings


def video_dir(work_dir: str, video=None) -> str:
    """Where one video's intermediates live: ``work_dir`` itself for a single video, else
    ``work_dir/videos/<name or index>/`` (``--prompts_file`` / ``--seeds``: one embeddings
    and one latents file per video, so each stage can run, fail or be repeated per entry,
    and an interrupted stage keeps the videos it finished)."""
    return work_dir if video is None else os.path.join(work_dir, "videos", video.label)


def _check_video(path: str, settings: dict, video, keys) -> None:
    """Refuse intermediates recorded for another entry of the prompts file."""
    if video is None:
        return
    for key in keys:
        if settings.get(key) != getattr(video, key):
            raise UsageError(f"{path}: made for {key} {settings.get(key)!r}, but video "
                             f"{video.label!r} has {getattr(video, key)!r}; run the earlier "
                             "stage with the same --prompts_file / --seeds first")


def read_intermediates(config, family):
    """(config with the recorded settings, [embeddings or latents per video]) for
    ``--stage denoise`` / ``decode``; (config, [None per video]) otherwise. One entry per
    video of ``config.run.videos`` (one for a single video). Checked before any weights load.

    Raises:
        UsageError: a file missing, damaged, made for another model or size, or (many
            videos) for another prompt or seed than its entry's.
    """
    videos = config.run.videos or (None,)
    if config.run.stage == "denoise":
        cfg = read_component_config(config.model.model_id, "transformer")
        out = []
        for video in videos:
            folder = video_dir(config.run.work_dir, video)
            embeds, settings = load_embeddings(
                folder, family.text.embedding_names,
                check=lambda e, s: family.text.check_embeddings(
                    e, {**s, "model_id": config.model.model_id}, cfg),
                optional=family.image.names)  # image-to-video: the image conditioning
            _check_video(os.path.join(folder, EMBEDDINGS_FILE), settings, video,
                         ("prompt", "negative_prompt"))
            out.append(embeds)
        return config.replace(prompt=settings.get("prompt"),
                              negative_prompt=settings.get("negative_prompt"),
                              max_sequence_length=settings.get("max_sequence_length")), out
    if config.run.stage == "decode":
        vae_cfg = read_component_config(config.model.model_id, "vae", download=True)
        out = []
        for video in videos:
            folder = video_dir(config.run.work_dir, video)
            latents, settings = load_latents(
                folder, vae_cfg, config.model.model_id,
                lambda s: family.sizes.latent_shape(vae_cfg, s["height"], s["width"], s["frames"],
                                                    model_id=config.model.model_id))
            _check_video(os.path.join(folder, LATENTS_FILE), settings, video,
                         ("prompt", "negative_prompt", "seed"))
            out.append(latents)
        return config.replace(**settings), out
    return config, [None] * len(videos)


def save_run_embeddings(config, embeds: dict, video=None) -> None:
    """``--stage encode``: the embeddings and the settings the later stages need, in
    ``video_dir`` (process 0 writes)."""
    if runtime.is_writer():
        save_embeddings(video_dir(config.run.work_dir, video), embeds, dict(
            prompt=config.video.prompt, negative_prompt=config.video.negative_prompt,
            model_id=config.model.model_id, max_sequence_length=config.video.max_sequence_length,
            dtype=config.model.dtype))


def save_run_latents(config, latents, video=None) -> None:
    """``--stage denoise``: the final latents, in ``video_dir`` (every process takes part in
    the gather; process 0 writes)."""
    latents_cpu = runtime.torch_from_jax(latents)  # every process takes part in the gather
    if runtime.is_writer():
        save_latents(video_dir(config.run.work_dir, video), latents_cpu, config.settings(),
                     read_component_config(config.model.model_id, "vae", download=True))
