"""``input_reference``: a job's first frame for an image-to-video model.

OpenAI's Videos API takes it as a multipart file, or as a reference object
``{"image_url": ..., "file_id": ...}`` (``ImageInputReferenceParam`` of the ``openai``
client, which itself sends only files: 3.57.0 refuses a dict in its multipart body). This
server takes the file, and in a JSON body a reference whose ``image_url`` is a base64
``data:`` URL; it fetches nothing from the network (a URL would make the server a proxy to
wherever it points) and has no Files API, so an ``http(s)`` URL, a ``file_id`` or a bare
string is a 400 in one line.

The bytes are checked as ``--image`` is (``engine.files.image.check_image``: PNG, JPEG or
WebP, fully decodable, 8 bits per channel, at least 16 px a side), then stored beside the
job (``<id>.input.<ext>``, atomically) before the job is committed, so a restart re-runs a
queued image-to-video job with its own image.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import tempfile

from engine.files import report as reporting
from engine.files.image import check_image
from engine.run.errors import UsageError
from engine.serve.requests import MAX_UPLOAD_BYTES, refuse

FIELD = "input_reference"
_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)
_SHAPE = "send a multipart file, or {\"image_url\": \"data:image/png;base64,...\"}"
EXTENSIONS = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp"}


def from_reference(value) -> bytes:
    """The image bytes of a JSON body's reference object.

    Raises:
        ApiError: 400 for anything but {"image_url": a base64 data URL}; 413 when the
            decoded image is over ``MAX_UPLOAD_BYTES``.
    """
    if not isinstance(value, dict):
        refuse(FIELD, _short(value), f"expected a reference object; {_SHAPE}")
    extra = sorted(set(value) - {"image_url", "file_id"})
    if extra:
        refuse(f"{FIELD}.{extra[0]}", _short(value[extra[0]]), "unknown field; a reference "
               "takes image_url")
    if value.get("file_id") is not None:
        refuse(f"{FIELD}.file_id", value["file_id"], f"this server has no Files API; "
               f"{_SHAPE}")
    url = value.get("image_url")
    if not isinstance(url, str):
        refuse(f"{FIELD}.image_url", _short(url), f"required, a string; {_SHAPE}")
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        refuse(f"{FIELD}.image_url", _short(url), "only base64 data:image/... URLs are taken "
               "(the server fetches nothing from the network)")
    if len(m[1]) > MAX_UPLOAD_BYTES * 4 // 3 + 4:
        refuse(f"{FIELD}.image_url", f"{len(m[1])} base64 characters", f"the image must be "
               f"at most {MAX_UPLOAD_BYTES} bytes", 413, "too_large")
    try:
        return base64.b64decode(m[1], validate=True)
    except (binascii.Error, ValueError):
        refuse(f"{FIELD}.image_url", _short(url), "not valid base64")


def check(data: bytes, name) -> dict:
    """What the job records of its image: {"format", "width", "height", "sha256", "bytes"}.

    Raises:
        ApiError: 400 unless PIL reads ``data`` whole as an 8-bit PNG, JPEG or WebP of at
            least 16 px a side (``check_image``'s rules); ``name`` is the upload's file name.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "upload")
        with open(path, "wb") as f:
            f.write(data)
        try:
            info = check_image(path, FIELD)
        except UsageError as e:
            refuse(FIELD, name, str(e).split(": ", 1)[-1])
    return dict(format=info.format, width=info.width, height=info.height,
                sha256=info.sha256, bytes=len(data))


def save(folder: str, job_id: str, data: bytes, info: dict) -> str:
    """Write the image beside the job store, atomically; returns its file name."""
    name = f"{job_id}.input{EXTENSIONS[info['format']]}"
    path = os.path.join(folder, name)

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    reporting.atomic_write(path, write)
    return name


def load(folder: str, settings) -> bytes | None:
    """The stored image of a job's ``settings`` (an ``engine.serve.requests.VideoJob``),
    None for a text-to-video job.

    Raises:
        OSError: the file is gone (the worker fails the job with one line).
    """
    ref = settings.input_reference
    if ref is None:
        return None
    with open(os.path.join(folder, ref.file), "rb") as f:
        return f.read()


def _short(value, n: int = 40):
    text = repr(value)
    return value if len(text) <= n else text[:n] + "..."


def remove(folder: str, settings) -> None:
    """Remove the stored image of a job's ``settings`` (a ``VideoJob``), if it has one."""
    ref = settings.input_reference
    if ref is not None and os.path.exists(os.path.join(folder, ref.file)):
        os.remove(os.path.join(folder, ref.file))
