"""``--image``: the conditioning image of an image-to-video run, checked before any model loads.

The image is read with PIL (through diffusers' ``load_image``, which applies the EXIF
orientation and converts to RGB as diffusers' image-to-video examples do). Resizing and
cropping are each pipeline's own preprocessing (``VideoProcessor.preprocess`` for Wan, the
aspect-ratio bucket for HunyuanVideo-1.5): the families call those, not code of ours.

Refused in one line (``UsageError``, exit 2) before anything loads:
    a missing or unreadable file, a file that is not PNG, JPEG or WebP, a truncated file,
    an image under ``MIN_SIDE`` pixels on a side, and a mode that is not 8 bits per channel
    (16-bit or float PNGs: PIL's RGB conversion would clip them silently).
A checkpoint that takes no image refuses ``--image``; one that needs an image refuses its
absence (``check_for_model``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os

from PIL import Image, UnidentifiedImageError

from engine.run.errors import fail

FORMATS = ("PNG", "JPEG", "WEBP")
# 8-bit modes PIL converts to RGB without loss of meaning (palette, grey, alpha dropped as
# diffusers' load_image drops it, CMYK and YCbCr JPEGs).
MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr")
# Smaller images carry no picture to condition on; the pipelines would upscale a few pixels
# to 720p. 16 px is the smallest side a Wan 2.1 latent can represent (8x VAE x 2x patch).
MIN_SIDE = 16


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """What the JSON report records of ``--image``: path, size in pixels, PIL format and
    mode as stored, and the file's sha256 (so a report names the exact picture)."""

    path: str
    width: int
    height: int
    format: str
    mode: str
    sha256: str


def check_image(path: str, flag: str = "--image") -> ImageInfo:
    """Open, fully decode and check ``path``; returns its ``ImageInfo``.

    Raises:
        UsageError: one line naming ``flag``, the path and the rule broken.
    """
    if not os.path.isfile(path):
        fail(flag, path, "file not found")
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        with Image.open(path) as im:
            fmt, mode, (width, height) = im.format, im.mode, im.size
            if fmt not in FORMATS:
                fail(flag, path, f"must be a PNG, JPEG or WebP image, got {fmt}")
            im.load()  # decodes every byte: a truncated file fails here, not in the pipeline
    except UnidentifiedImageError:
        fail(flag, path, "not an image PIL can read (expected PNG, JPEG or WebP)")
    except (OSError, SyntaxError, ValueError) as e:
        fail(flag, path, f"could not read the image ({str(e).splitlines()[0] if str(e) else e})")
    if mode not in MODES:
        fail(flag, path, f"expected an 8-bit image (RGB, RGBA, grey or palette), got PIL mode "
             f"{mode}")
    if min(width, height) < MIN_SIDE:
        fail(flag, path, f"expected at least {MIN_SIDE}x{MIN_SIDE} pixels, got "
             f"{width}x{height}")
    return ImageInfo(path=os.path.abspath(path), width=width, height=height, format=fmt,
                     mode=mode, sha256=digest)


def check_for_model(args, family, values: dict | None = None) -> ImageInfo | None:
    """``args.image`` against what ``args.model_id`` takes: ``family.image.mode(model_id)``
    is "none" (text-to-video only), "optional" (TI2V-5B: either), or "required" (an
    image-to-video checkpoint). ``--stage denoise`` / ``decode`` need no image (the encode
    stage stored the image conditioning with the prompt embeddings), nor does ``--dry_run``
    (it compiles with abstract inputs), nor does ``--serve`` (each job sends its own,
    ``engine.serve.uploads``).

    A family whose pipeline sizes the video from the image (``family.image.size``:
    HunyuanVideo-1.5's aspect-ratio bucket) sets ``values["height"]`` / ``["width"]`` here
    unless ``--height`` / ``--width`` were given.

    Raises:
        UsageError: an image for a text-to-video checkpoint, none for an image-to-video one,
            or a bad image (``check_image``).
    """
    path, model_id = args.image, args.model_id
    mode = family.image.mode(model_id)
    if path is None:
        if mode == "required" and args.stage in ("all", "encode") and not args.dry_run \
                and not getattr(args, "serve", False):  # --serve: each job sends its own
            fail("--image", None, f"--model_id={model_id!r} is an image-to-video checkpoint: "
                 "give the first frame with --image PATH (PNG, JPEG or WebP)")
        return None
    info = check_image(path)  # the file's own faults first: they hold for any checkpoint
    if mode == "none":
        fail("--image", path, f"--model_id={model_id!r} is a text-to-video checkpoint; "
             "--image needs an image-to-video one (see docs/models.md 'Image-to-video')")
    size = family.image.size(model_id, info) if values is not None else None
    if size is not None:
        values["height"] = values["height"] if args.height is not None else size[0]
        values["width"] = values["width"] if args.width is not None else size[1]
    return info


def read_image(info: ImageInfo):
    """The checked image as an RGB ``PIL.Image.Image``, EXIF orientation applied
    (diffusers' ``load_image``)."""
    from diffusers.utils import load_image

    return load_image(info.path)


def decode_image(data: bytes):
    """A checked image's bytes (``check_image``'s rules) as ``read_image`` gives its file:
    an RGB ``PIL.Image.Image``, EXIF orientation applied (diffusers' ``load_image``)."""
    from diffusers.utils import load_image
    return load_image(Image.open(io.BytesIO(data)))
