"""engine/files/video_input.py: input videos probed and read with PyAV, refusals in one line."""

from __future__ import annotations

import av
import numpy as np
import pytest
from diffusers.utils import load_video

from engine.files.video_input import frames_for, probe_video, read_video
from engine.run.errors import UsageError


def _write(path, frames, codec="ffv1", pix_fmt="bgr0", rate=12):
    """A video of uint8 RGB ``frames`` (F, H, W, 3); ffv1 in bgr0 is lossless."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = pix_fmt
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


@pytest.fixture(scope="module")
def frames():
    return np.random.default_rng(0).integers(0, 256, (7, 24, 40, 3), dtype=np.uint8)


def test_lossless_video_reads_back_exactly(tmp_path, frames):
    path = tmp_path / "v.mkv"
    _write(path, frames)
    info = probe_video(str(path))
    assert (info.frames, info.height, info.width, info.fps) == (7, 24, 40, 12.0)
    got = np.stack([np.asarray(im) for im in read_video(str(path), frames=5)])
    np.testing.assert_array_equal(got, frames[:5])


def test_h264_matches_diffusers_load_video(tmp_path):
    # A smooth picture: H.264's loss is small, and both readers convert the same YUV frames.
    y, x = np.mgrid[0:32, 0:48]
    smooth = np.stack([np.stack([(x * 5 + t * 9) % 256, y * 7, (x + y) * 3], -1)
                       for t in range(9)]).astype(np.uint8)
    path = tmp_path / "v.mp4"
    _write(path, smooth, codec="libx264", pix_fmt="yuv420p")
    ours = np.stack([np.asarray(im, dtype=np.int16) for im in read_video(str(path))])
    ref = np.stack([np.asarray(im, dtype=np.int16) for im in load_video(str(path))])
    assert ours.shape == ref.shape == (9, 32, 48, 3)
    # Two YUV->RGB conversions (PyAV's swscale, imageio's ffmpeg) round apart by a few levels.
    assert np.abs(ours - ref).max() <= 3, np.abs(ours - ref).max()


def test_refusals_are_one_line(tmp_path, frames):
    path = tmp_path / "v.mkv"
    _write(path, frames)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video at all" * 10)
    cases = [(lambda: probe_video(str(tmp_path / "missing.mp4")), "file not found"),
             (lambda: probe_video(str(junk), "--mask"), "--mask"),
             (lambda: read_video(str(path), frames=9), "expected at least 9 frames, got 7")]
    for call, text in cases:
        with pytest.raises(UsageError) as e:
            call()
        assert text in str(e.value) and "\n" not in str(e.value)


def test_frames_for_rounds_down_to_4n_plus_1():
    assert [frames_for(n, 4) for n in (0, 1, 4, 5, 8, 9, 80, 81, 84)] == [
        0, 1, 1, 5, 5, 9, 77, 81, 81]
