"""Wan first-and-last-frame video (FLF2V, ``--last_image PATH``): diffusers 0.42.1's
``WanImageToVideoPipeline.__call__(image=..., last_image=...)`` on an image-to-video checkpoint.

What the pipeline does with the last image (``pipeline_wan_i2v.py``):
    - it is preprocessed as the first one, stretched to (height, width) (``:711-717``);
    - the condition video is [first, zeros x (frames - 2), last], VAE-encoded whole, and the
      4-channel mask is 1 on pixel frames 0 and frames - 1 (``prepare_latents``, ``:428-484``);
    - with an image encoder (Wan 2.1), CLIP encodes both images: ``hidden_states[-2]`` of
      shape (2, 257, 1280) (``:697-705``), which the transformer's ``WanImageEmbedding`` views
      as one (1, 514, 1280) row and adds its learned ``pos_embed`` to
      (``transformer_wan.py:296-299``).
Which checkpoints take it:
    - Wan 2.1 FLF2V-14B (``Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers``): its transformer has
      ``pos_embed_seq_len`` (514 = 2 x 257); it needs both images (one image's 257 tokens
      cannot be viewed as 514: diffusers fails with a shape error), so ``--last_image`` is
      required with ``--image``.
    - Wan 2.2 I2V-A14B: no image encoder, so the last image enters through the condition only.
    - Refused in one line: Wan 2.1 I2V-480P/720P (image embedding without ``pos_embed_seq_len``:
      diffusers fails with a size mismatch), TI2V-5B (its image-to-video encodes the first
      frame alone; diffusers ignores ``last_image`` there), text-to-video checkpoints.
"""

from __future__ import annotations

from engine.files.image import ImageInfo, check_image
from engine.run.errors import fail

FLAG = "--last_image"
TAKERS = "Wan2.1-FLF2V-14B-720P or Wan 2.2 I2V-A14B"


def images_per_row(cfg: dict) -> int:
    """CLIP images per row of ``encoder_hidden_states_image``: 2 for a transformer with
    ``pos_embed_seq_len`` (``WanImageEmbedding`` views (B, tokens, D) as (B / 2, 2 x tokens,
    D): diffusers hardcodes the pair), else 1. ``cfg``: the transformer's config."""
    return 2 if cfg.get("pos_embed_seq_len") else 1


def check(path: str | None, kind: str, cfg: dict, args) -> ImageInfo | None:
    """``--last_image`` against the checkpoint, before any model loads.

    kind: the checkpoint's Wan kind ("i2v", "i2v-a14b", "ti2v", "t2v", "a14b");
    cfg: its transformer config; args: the parsed command line (None in unit calls).
    Returns the image's ``ImageInfo`` or None.

    Raises:
        UsageError: one line (an unreadable image, a checkpoint that cannot take a last
            frame, a last frame without a first, an FLF2V checkpoint without one).
    """
    image = getattr(args, "image", None)
    if cfg.get("pos_embed_seq_len") and getattr(args, "serve", False):
        fail("--serve", True, "this checkpoint's image embedding takes two images per job "
             f"(pos_embed_seq_len {cfg['pos_embed_seq_len']}); the server takes one "
             "(input_reference) and no last frame yet")
    if path is None:
        encodes = args is not None and image is not None and args.stage in ("all", "encode")
        if cfg.get("pos_embed_seq_len") and encodes:
            fail(FLAG, None, "this checkpoint's image embedding takes two images "
                 f"(pos_embed_seq_len {cfg['pos_embed_seq_len']}): give the last frame with "
                 f"{FLAG} PATH as well as --image")
        return None
    info = check_image(path, FLAG)  # the file's own faults first
    if kind in ("t2v", "a14b"):
        fail(FLAG, path, f"--model_id is a text-to-video checkpoint; first-and-last-frame "
             f"video needs an image-to-video one ({TAKERS})")
    if kind == "ti2v":
        fail(FLAG, path, "TI2V-5B's image-to-video encodes the first frame alone (diffusers "
             f"ignores last_image there); use {TAKERS}")
    if cfg.get("image_dim") and not cfg.get("pos_embed_seq_len"):
        fail(FLAG, path, "--model_id is a Wan 2.1 I2V checkpoint: its transformer has no "
             "pos_embed_seq_len, so its image embedding takes one image (diffusers fails "
             f"with a size mismatch); use {TAKERS}")
    if args is not None and image is None and args.stage in ("all", "encode") \
            and not args.dry_run and not getattr(args, "serve", False):
        fail(FLAG, path, "needs --image PATH, the first frame")
    return info
