"""A video streamed as it is made: chunks of frames appended to a fragmented MP4.

A model that generates a video chunk by chunk (each chunk conditioned on the ones before)
hands each chunk's frames to a ``ChunkSink`` as soon as they are decoded; a reader (a
player, ``GET /v1/videos/{id}/content`` of a running job) can play the file while the rest
is made. ``FragmentedMp4Writer`` is the sink that writes the file.

The contract for a chunked producer (a family's chunk loop):

- ``sink = chunk_sink()`` once, before the loop: the sink of this run, or None when nobody
  streams (then the run goes on as without streaming). The run's owner (the server's worker,
  a CLI run) installs it with ``with streaming(sink):`` around the generation.
- After each chunk: ``sink.on_chunk(frames)``, frames (F, H, W, 3), float32 in [0, 1] or
  uint8, the chunk's frames as they will be in the video (the last chunk already trimmed):
  the chunks handed over, in order, are the video's frames, and the frames the run returns
  equal their concatenation. Every chunk has the first chunk's H and W (even numbers).
  ``on_chunk`` returns at once (the encode runs on a writer thread) and may raise the
  writer's error (``GenerationError``, one line); let it propagate.
- The producer calls nothing else; a cancel is the run's ``on_step`` raising, as for any
  run (the server's worker raises it at the first step after the chunk being made is
  handed over, so that chunk is kept: ``handed`` counts them). The owner calls
  ``finish()`` once the run returned, or ``cancel()`` when it stopped early (the whole
  chunks handed over are kept), or ``abort()`` on a failure (no file is left).

The file (``FragmentedMp4Writer``): H.264 (libx264, ``ENCODER_OPTIONS``) in an MP4 with
``movflags=frag_keyframe+empty_moov+default_base_moof``: first the init segment (ftyp,
moov), then one fragment (moof + mdat) per chunk, each starting with a forced IDR frame.
FFmpeg's mov muxer closes a fragment only when the next packet arrives (or on an
``av_write_frame(ctx, NULL)`` flush, which PyAV 18.1 does not expose), so one muxer for the
whole video would hold each chunk back until the next one is made. Instead each chunk is
muxed by its own muxer into memory, with ``fragment_index`` (the moof's sequence number)
and ``frag_discont`` (its tfdt: the chunk's first frame time), and only its moof + mdat are
appended: after ``on_chunk``'s write, the file holds every chunk handed over as whole
fragments, a playable fragmented MP4 with no trailer needed. One encoder runs across the
chunks with x264's ``zerolatency`` tuning (no lookahead, no B-frames: a frame's packet
comes out as the frame goes in), so the packets are those of one continuous encode of the
same frames with the same keyframes (tests/test_stream_writer.py decodes both).

The file grows under a hidden ``.<name>.partial.mp4`` name in the target folder
(``partial_path``) and is renamed onto its name by ``finish`` and ``cancel``; a server that
restarts removes such leftovers (``engine.serve.jobs.JobStore.recover``).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import struct
import time
from fractions import Fraction
from typing import Protocol

import av
import numpy as np

from engine.files import report as reporting
from engine.files.writer import VideoWriter
from engine.run.errors import GenerationError, first_line

# x264 with no frame delay: each frame's packet leaves the encoder with the frame, so a
# chunk's fragment can be written as soon as its last frame is in (x264 --tune zerolatency:
# no lookahead, no B-frames, sliced threads). Preset veryfast, live streaming's usual one:
# the encode must keep up with a model that makes video faster than it plays (measured at
# 384x640 on a loaded 2-core host: 23 fps with x264's default medium, 74 with veryfast,
# for a 15 % larger file). The rest are x264's defaults (CRF 23). Keyframes come from the
# chunk starts (forced IDR frames) and x264's own GOP (keyint 250), not from scene cuts
# (sc_threshold 0): with frag_keyframe every keyframe starts a fragment, and a scene cut
# inside a chunk would split it (seen: 58 keyframes, 5 fragments for 2 tiny random chunks).
ENCODER = "libx264"
ENCODER_OPTIONS = {"tune": "zerolatency", "preset": "veryfast", "sc_threshold": "0"}
MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof"

_SINK: contextvars.ContextVar = contextvars.ContextVar("chunk_sink", default=None)


class ChunkSink(Protocol):
    """Where a chunked producer hands its frames (see the module's contract)."""

    def on_chunk(self, frames) -> None:
        """One chunk's frames, (F, H, W, 3) float32 in [0, 1] or uint8, in video order."""

    def finish(self) -> dict:
        """The run ended: write what is pending, close; returns the stream's ``stats``."""

    def cancel(self) -> dict:
        """The run stopped early: keep the whole chunks handed over; returns ``stats``."""


def chunk_sink() -> ChunkSink | None:
    """The sink installed by ``streaming`` around this run (this thread), or None."""
    return _SINK.get()


@contextlib.contextmanager
def streaming(sink: ChunkSink | None):
    """Install ``sink`` for the producer's ``chunk_sink()`` inside the block (None: none)."""
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def partial_path(path: str) -> str:
    """The hidden name ``path`` grows under: ``<folder>/.<stem>.partial<ext>`` (the name
    ``engine.files.report.atomic_write`` uses, so the same clean-ups find it)."""
    root, ext = os.path.splitext(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(root)}.partial{ext}")


def top_level_boxes(data: bytes) -> list[tuple[str, int, int]]:
    """The top-level ISO BMFF boxes of ``data``: (type, offset, size) each (size 1: the
    64-bit size that follows; size 0: to the end).

    Raises:
        GenerationError: a box runs past the end (not a whole MP4).
    """
    boxes, at = [], 0
    while at < len(data):
        size, kind = struct.unpack_from(">I4s", data, at)
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, at + 8)
        elif size == 0:
            size = len(data) - at
        if size < 8 or at + size > len(data):
            raise GenerationError(f"the MP4 muxer wrote a cut box {kind!r} at byte {at}")
        boxes.append((kind.decode("latin-1"), at, size))
        at += size
    return boxes


class FragmentedMp4Writer:
    """A ``ChunkSink`` writing a fragmented MP4 at ``path`` (see the module docstring), at
    ``fps`` frames per second, one chunk at a time on a writer thread (at most ``depth``
    chunks wait; ``on_chunk`` blocks beyond that).

    ``on_written(stats)``: called on the writer thread after each chunk's fragment is in
    the file, with ``stats`` then; it must not raise (a server records it in its store).

    ``stats``: {"chunks_done", "frames_done", "seconds_generated" (frames_done / fps),
    "first_chunk_at" (``time.time()`` when the first fragment was in the file, or None),
    "bytes" (the file's size), "codecs" (the RFC 6381 codec string a Media Source player
    needs, e.g. "avc1.64000a", from the moov's avcC; None before the first chunk)}.

    ``partial``: the name the file grows under (default ``partial_path(path)``; a server
    gives each run its own, so a run that lost its job cannot touch the next run's file).
    ``handed``: the chunks ``on_chunk`` has taken so far (written or still queued).
    """

    def __init__(self, path: str, fps: int, *, on_written=None, depth: int = 2,
                 partial: str | None = None):
        if fps <= 0:
            raise ValueError(f"fps={fps!r}: must be > 0")
        self.path, self.fps, self.on_written = path, int(fps), on_written
        self.partial = partial or partial_path(path)
        self.handed = 0
        self.stats = dict(chunks_done=0, frames_done=0, seconds_generated=0.0,
                          first_chunk_at=None, bytes=0, codecs=None)
        self._thread = VideoWriter(depth)
        self._file = None
        self._encoder = None
        self._shape = None  # (H, W) of the first chunk

    def on_chunk(self, frames) -> None:
        """Queue one chunk (F, H, W, 3), float32 in [0, 1] (``report.to_uint8``) or uint8;
        the array is kept until written.

        Raises:
            GenerationError: one line: a chunk of another shape than (F >= 1, H, W, 3) with
                even H and W equal to the first chunk's, or an earlier chunk's write failed.
        """
        pixels = reporting.to_uint8(frames)
        shape = tuple(pixels.shape)
        if len(shape) != 4 or shape[0] < 1 or shape[3] != 3 or shape[1] % 2 or shape[2] % 2:
            raise GenerationError(f"a streamed chunk's frames {shape}: expected (F >= 1, H, W,"
                                  " 3) with even H and W (H.264 in 4:2:0)")
        if self._shape is None:
            self._shape = shape[1:3]
        elif shape[1:3] != self._shape:
            raise GenerationError(f"a streamed chunk's frames {shape}: every chunk must be "
                                  f"{self._shape[0]}x{self._shape[1]} (H x W) as the first")
        self._thread.submit(self._write_chunk, pixels)
        self.handed += 1

    def flush(self) -> dict:
        """Block until every chunk handed over is in the file; returns ``stats``.

        Raises:
            GenerationError: a chunk's write failed (one line naming the file).
        """
        self._thread.wait()
        return dict(self.stats)

    def finish(self) -> dict:
        """Write the pending chunks, close the file and rename it onto ``path``; returns
        ``stats``. No chunk at all: nothing is written (``stats["chunks_done"]`` 0).

        Raises:
            GenerationError: a chunk's write or the rename failed (the partial file is
                removed).
        """
        try:
            self.flush()
        except BaseException:
            self.abort()
            raise
        return self._close(keep=True)

    def cancel(self) -> dict:
        """The run stopped early: the chunks already handed over are written (whole), the
        file is closed and renamed onto ``path`` (none: no file); returns ``stats``."""
        return self.finish()

    def abort(self) -> None:
        """A failure: drop the chunks not yet written, close and remove the file."""
        self._thread.close()
        self._close(keep=False)

    def _close(self, keep: bool) -> dict:
        self._thread.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._encoder = None  # PyAV frees the codec context with the object
        if os.path.exists(self.partial):
            if keep and self.stats["chunks_done"]:
                os.replace(self.partial, self.path)
            else:
                os.remove(self.partial)
        return dict(self.stats)

    def _write_chunk(self, pixels: np.ndarray) -> None:
        """The writer thread: encode one chunk, mux it, append its fragment and flush."""
        try:
            data = self._fragment(pixels)
            if self._file is None:
                self._file = open(self.partial, "wb")  # noqa: SIM115 - open across chunks
            self._file.write(data)
            self._file.flush()
        except GenerationError:
            raise
        except Exception as e:  # noqa: BLE001 - one line naming the file, on any thread
            raise GenerationError(f"could not write {self.path}: {type(e).__name__}: "
                                  f"{first_line(e)}") from e
        s = self.stats
        s["chunks_done"] += 1
        s["frames_done"] += len(pixels)
        s["seconds_generated"] = s["frames_done"] / self.fps
        s["bytes"] += len(data)
        if s["first_chunk_at"] is None:
            s["first_chunk_at"], s["codecs"] = time.time(), avc_codecs(data)
        if self.on_written is not None:
            self.on_written(dict(s))

    def _fragment(self, pixels: np.ndarray) -> bytes:
        """One chunk's bytes: its frames through the one encoder, the first forced to an
        IDR frame, muxed alone; the init segment (ftyp, moov) too for the first chunk."""
        index, first = self.stats["chunks_done"], self.stats["frames_done"]
        if self._encoder is None:
            self._encoder = _encoder(pixels.shape[2], pixels.shape[1], self.fps)
        packets = []
        for i, pixel in enumerate(pixels):
            frame = av.VideoFrame.from_ndarray(pixel, format="rgb24")
            frame.pts = first + i
            if i == 0:
                frame.pict_type = av.video.frame.PictureType.I
            packets.extend(self._encoder.encode(frame))
        if len(packets) != len(pixels):  # zerolatency holds no frame back
            raise GenerationError(f"could not write {self.path}: the encoder returned "
                                  f"{len(packets)} packets for a chunk of {len(pixels)} "
                                  "frames (it must hold none back)")
        return _mux_alone(packets, index, self.fps, pixels.shape[2], pixels.shape[1])


def avc_codecs(data: bytes) -> str | None:
    """The RFC 6381 codec string of the H.264 track in an init segment ``data``:
    "avc1." + the avcC's profile, profile compatibility and level bytes, in hex (ISO/IEC
    14496-15: they follow its version byte); None without an avcC."""
    at = data.find(b"avcC")
    if at < 0 or at + 8 > len(data):
        return None
    return "avc1." + data[at + 5:at + 8].hex()


def _encoder(width: int, height: int, fps: int):
    """An open libx264 encoder for rgb24 frames of ``width`` x ``height`` at ``fps``, with
    ``ENCODER_OPTIONS``, SPS and PPS in-band at each keyframe (no global header: each
    chunk's muxer finds them in its first packet)."""
    encoder = av.CodecContext.create(ENCODER, "w")
    encoder.width, encoder.height, encoder.pix_fmt = width, height, "yuv420p"
    encoder.time_base, encoder.framerate = Fraction(1, fps), Fraction(fps)
    encoder.options = dict(ENCODER_OPTIONS)
    encoder.open()
    return encoder


def _mux_alone(packets: list, index: int, fps: int, width: int, height: int) -> bytes:
    """One chunk's packets muxed by their own fragmented-MP4 muxer: its moof (sequence
    number ``index + 1``, tfdt at the first packet's time: ``frag_discont`` with no
    timestamp shift or edit list) and mdat; for chunk 0 the ftyp and moov before them. The
    trailer's mfra (an optional index) is dropped."""
    buffer = io.BytesIO()
    options = {"movflags": MOVFLAGS + "+frag_discont", "fragment_index": str(index + 1),
               "avoid_negative_ts": "disabled", "use_editlist": "0"}
    with av.open(buffer, "w", format="mp4", container_options=options) as out:
        stream = out.add_mux_stream("h264", rate=fps, width=width, height=height)
        stream.time_base = Fraction(1, fps)
        for packet in packets:
            packet.stream = stream
            out.mux(packet)
    data = buffer.getvalue()
    keep = ("ftyp", "moov", "moof", "mdat") if index == 0 else ("moof", "mdat")
    return b"".join(data[at:at + size] for kind, at, size in top_level_boxes(data)
                    if kind in keep)
