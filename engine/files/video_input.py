"""Input videos (``--video``, a mask video, a video condition): probed and read with PyAV.

Frames are taken in order, at the file's own rate: diffusers' pipelines take a list of frames
and never resample fps (``WanVideoToVideoPipeline``, ``WanVACEPipeline``,
``LTX2ConditionPipeline``), so neither do we; the output runs at ``--fps``. Resizing and
cropping stay each pipeline's own ``VideoProcessor``: what this module returns is the list of
RGB ``PIL.Image`` frames a diffusers example would build with ``diffusers.utils.load_video``.

Refused in one line (``UsageError``, exit 2) before anything loads: a missing or unreadable
file, a file with no video stream, and a video with fewer frames than asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import av
from PIL import Image

from engine.run.errors import fail


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """A probed input video: ``path``; ``frames`` (decoded frames, counted by decoding, since
    a container's frame count may be missing or wrong); ``height`` and ``width`` in pixels;
    ``fps`` (the stream's average rate, frames per second; 0.0 when the file gives none);
    ``sha256`` of the file (so a report names the exact input)."""

    path: str
    frames: int
    height: int
    width: int
    fps: float
    sha256: str

    def report(self) -> dict:
        """The JSON report's record of this input."""
        return dataclasses.asdict(self)


def _open(path: str, flag: str):
    """The PyAV container and its first video stream.

    Raises:
        UsageError: missing or unreadable file, or no video stream.
    """
    if not os.path.isfile(path):
        fail(flag, path, "file not found")
    try:
        container = av.open(path)
    except (av.FFmpegError, OSError, ValueError) as e:
        fail(flag, path, f"not a video PyAV can open ({type(e).__name__})")
    if not container.streams.video:
        container.close()
        fail(flag, path, "has no video stream")
    return container, container.streams.video[0]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def probe_video(path: str, flag: str = "--video") -> VideoInfo:
    """Size, frame count and rate of the video at ``path`` (every frame is decoded once, to
    count them and to find a corrupt stream before any model loads).

    Raises:
        UsageError: missing, unreadable or corrupt file, no video stream, or no frames.
    """
    container, stream = _open(path, flag)
    count, size = 0, None
    try:
        for frame in container.decode(stream):
            size = size or (frame.height, frame.width)
            count += 1
    except (av.FFmpegError, OSError, ValueError) as e:
        fail(flag, path, f"cannot be decoded past frame {count} ({type(e).__name__})")
    finally:
        container.close()
    if count == 0:
        fail(flag, path, "has no frames")
    fps = float(stream.average_rate) if stream.average_rate else 0.0
    return VideoInfo(path, count, size[0], size[1], fps, _sha256(path))


def read_video(path: str, flag: str = "--video", frames: int | None = None) -> list[Image.Image]:
    """The first ``frames`` frames (all when None) of the video at ``path``, in order, as RGB
    ``PIL.Image`` (8 bits per channel; PyAV converts from the stream's pixel format).

    Raises:
        UsageError: the file cannot be read, or has fewer than ``frames`` frames.
    """
    container, stream = _open(path, flag)
    out: list[Image.Image] = []
    try:
        for frame in container.decode(stream):
            if frames is not None and len(out) == frames:
                break
            out.append(frame.to_image().convert("RGB"))
    except (av.FFmpegError, OSError, ValueError) as e:
        fail(flag, path, f"cannot be decoded past frame {len(out)} ({type(e).__name__})")
    finally:
        container.close()
    if frames is not None and len(out) < frames:
        fail(flag, path, f"expected at least {frames} frames, got {len(out)}")
    return out


def frames_for(count: int, frame_step: int) -> int:
    """The largest ``frame_step * n + 1`` not above ``count`` (a video's length as a run's
    ``--frames``; ``frame_step`` is the VAE's temporal compression), or 0 when none is."""
    return (count - 1) // frame_step * frame_step + 1 if count >= 1 else 0
