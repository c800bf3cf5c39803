"""A video streamed chunk by chunk into a fragmented MP4 (``engine.files.stream_writer``).

A fake producer hands 4 chunks of 9 deterministic frames (32x48) to the writer. References:
PyAV decoding the file while it grows (after chunks 1 and 2 it sees exactly their frames),
and one continuous encode of the same frames into an ordinary MP4 by PyAV with the same
encoder settings and keyframes (``ENCODER_OPTIONS``, an I frame at each chunk start): the
decoded frames are equal, pixel for pixel, so the per-chunk muxing changes nothing but the
container. Packets (PyAV's demuxer) show a keyframe at each chunk start; the boxes show one
moof per chunk with sequence numbers 1..4.
"""

import os
import struct
import time

import av
import numpy as np
import pytest

from engine.files import report as reporting
from engine.files import stream_writer as sw
from engine.run.errors import GenerationError

FPS, CHUNKS, F, H, W = 16, 4, 9, 32, 48


def chunks() -> list[np.ndarray]:
    """4 chunks of (9, 32, 48, 3) float32 in [0, 1]: a moving colour gradient with mild
    noise (an encoder meets motion and texture), the same on every call."""
    t = np.arange(CHUNKS * F, dtype=np.float32)[:, None, None, None]
    y = np.arange(H, dtype=np.float32)[None, :, None, None]
    x = np.arange(W, dtype=np.float32)[None, None, :, None]
    c = np.array([0.0, 2.0, 4.0], dtype=np.float32)
    base = 0.5 + 0.4 * np.sin(0.2 * x + 0.15 * y + 0.3 * t + c)
    noise = np.random.default_rng(0).normal(0, 0.03, base.shape).astype(np.float32)
    video = np.clip(base + noise, 0, 1).astype(np.float32)
    return [video[k * F:(k + 1) * F] for k in range(CHUNKS)]


def decode(path) -> np.ndarray:
    with av.open(str(path)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def keyframes(path) -> list[int]:
    """Indices of the packets PyAV's demuxer marks as keyframes."""
    with av.open(str(path)) as f:
        packets = [p for p in f.demux(video=0) if p.size]
    return [i for i, p in enumerate(packets) if p.is_keyframe]


def continuous_encode(path, frames: list[np.ndarray]) -> None:
    """The reference: one PyAV encode of all frames into an ordinary MP4, with the
    writer's encoder and options and an I frame at each chunk start."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(sw.ENCODER, rate=FPS, options=dict(sw.ENCODER_OPTIONS))
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for k, chunk in enumerate(frames):
            for i, pixels in enumerate((chunk * 255).astype(np.uint8)):
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                frame.pts = k * F + i
                if i == 0:
                    frame.pict_type = av.video.frame.PictureType.I
                out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def moof_sequence_numbers(data: bytes) -> list[int]:
    """The mfhd sequence number of each top-level moof (mfhd is the moof's first child)."""
    out = []
    for kind, at, _ in sw.top_level_boxes(data):
        if kind == "moof":
            assert data[at + 12:at + 16] == b"mfhd"
            out.append(struct.unpack_from(">I", data, at + 20)[0])
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "continuous.mp4"
    continuous_encode(path, chunks())
    return decode(path)


def test_the_file_plays_while_it_grows_and_equals_a_continuous_encode(tmp_path, reference):
    path = tmp_path / "v.mp4"
    seen = []
    writer = sw.FragmentedMp4Writer(str(path), FPS, on_written=seen.append)
    t0 = time.time()
    for k, chunk in enumerate(chunks()):
        writer.on_chunk(chunk)
        if k < 2:  # a reader now: exactly the whole chunks so far, as the final file has them
            writer.flush()
            assert not path.exists()
            grown = decode(writer.partial)
            assert grown.shape == ((k + 1) * F, H, W, 3)
            np.testing.assert_array_equal(grown, reference[:(k + 1) * F])
    stats = writer.finish()
    assert not os.path.exists(writer.partial)
    frames = decode(path)
    np.testing.assert_array_equal(frames, reference)
    assert keyframes(path) == [0, 9, 18, 27]  # a keyframe at each chunk start, no other
    data = path.read_bytes()
    assert [k for k, _, _ in sw.top_level_boxes(data)] == \
        ["ftyp", "moov"] + ["moof", "mdat"] * CHUNKS
    assert moof_sequence_numbers(data) == [1, 2, 3, 4]
    assert [s["chunks_done"] for s in seen] == [1, 2, 3, 4]
    assert [s["seconds_generated"] for s in seen] == [F * (k + 1) / FPS for k in range(4)]
    assert stats == {**seen[-1], "bytes": len(data)}
    with av.open(str(path)) as f:  # the codec string a Media Source player is given
        profile, level = f.streams.video[0].codec_context.profile, f.streams.video[0].level
    assert stats["codecs"] == f"avc1.{ {'High': 100}[profile]:02x}00{level:02x}", stats
    assert t0 <= stats["first_chunk_at"] <= seen[1]["first_chunk_at"] + 1e-9
    # The encode is the frames, in order, about as close as the CLI's own mp4 writer
    # (diffusers' export_to_video settings) gets: 11.08 against 10.64 levels measured.
    video = np.concatenate(chunks()) * 255
    cli = tmp_path / "cli.mp4"
    reporting.save_video(np.concatenate(chunks()), str(cli), FPS)
    err = np.abs(frames.astype(np.float32) - video).mean()
    assert err <= np.abs(decode(cli).astype(np.float32) - video).mean() + 1.5, err
    assert np.abs(frames[1:].astype(np.float32) - video[:-1]).mean() > err + 5  # in order


def test_cancel_keeps_the_whole_chunks_and_abort_keeps_nothing(tmp_path, reference):
    path = tmp_path / "cancelled.mp4"
    writer = sw.FragmentedMp4Writer(str(path), FPS)
    for chunk in chunks()[:3]:
        writer.on_chunk(chunk)
    stats = writer.cancel()  # at once: the three chunks handed over are written whole
    assert stats["chunks_done"] == 3 and not os.path.exists(writer.partial)
    np.testing.assert_array_equal(decode(path), reference[:3 * F])
    assert keyframes(path) == [0, 9, 18]

    aborted = sw.FragmentedMp4Writer(str(tmp_path / "aborted.mp4"), FPS)
    aborted.on_chunk(chunks()[0])
    aborted.flush()
    assert os.path.exists(aborted.partial)
    aborted.abort()
    assert os.listdir(tmp_path) == ["cancelled.mp4"]
    nothing = sw.FragmentedMp4Writer(str(tmp_path / "none.mp4"), FPS)
    assert nothing.cancel()["chunks_done"] == 0
    assert os.listdir(tmp_path) == ["cancelled.mp4"]


def test_a_chunk_of_another_shape_is_one_line(tmp_path):
    writer = sw.FragmentedMp4Writer(str(tmp_path / "v.mp4"), FPS)
    with pytest.raises(GenerationError, match=r"expected \(F >= 1, H, W, 3\) with even H"):
        writer.on_chunk(np.zeros((9, 33, 48, 3), np.float32))
    writer.on_chunk(chunks()[0])
    with pytest.raises(GenerationError, match=r"every chunk must be 32x48 \(H x W\)"):
        writer.on_chunk(np.zeros((9, 64, 48, 3), np.uint8))
    writer.abort()


def test_the_sink_is_found_only_inside_streaming(tmp_path):
    writer = sw.FragmentedMp4Writer(str(tmp_path / "v.mp4"), FPS)
    assert sw.chunk_sink() is None
    with sw.streaming(writer):
        assert sw.chunk_sink() is writer
    assert sw.chunk_sink() is None
