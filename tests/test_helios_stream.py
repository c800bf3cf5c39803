"""Helios's chunks streamed into the CLI's mp4 (issue 68 item 3): the chunk loop hands each
decoded chunk to the ``engine.files.stream_writer.FragmentedMp4Writer`` of the run's mp4
(``engine.programs.denoise.run_chunks`` forwards to the sink ``engine.pipeline.
run_videos`` installs; ``engine.files.videos.RunFiles`` finishes it in place of the encode).

References: the same run's ``--save_frames`` (the lossless frames the run returned) encoded
once, continuously, by PyAV with the writer's encoder settings and an I frame at each chunk
start, as tests/test_stream_writer.py does: the streamed file's decoded frames are equal to
that encode's, pixel for pixel, so the file is those frames within H.264's loss and nothing
else; PyAV's demuxer sees a keyframe at each chunk start (frames 0 and 33), and the file's
top-level boxes are one init segment and one moof + mdat per chunk.
"""

from __future__ import annotations

import glob
import os

import av
import jax
import numpy as np
from safetensors.numpy import load_file

import generate_flax
from engine.files import report as reporting
from engine.files import stream_writer as sw
from engine.pipeline.generation import Generation

FPS, WINDOW = 16, 33


def _decode(path) -> np.ndarray:
    with av.open(str(path)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def _keyframes(path) -> list[int]:
    with av.open(str(path)) as f:
        packets = [p for p in f.demux(video=0) if p.size]
    return [i for i, p in enumerate(packets) if p.is_keyframe]


def _continuous_encode(path, pixels: np.ndarray) -> None:
    """One PyAV encode of ``pixels`` (F, H, W, 3) uint8 into an ordinary MP4, with the
    writer's encoder and options and an I frame at each chunk start."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(sw.ENCODER, rate=FPS, options=dict(sw.ENCODER_OPTIONS))
        stream.height, stream.width, stream.pix_fmt = *pixels.shape[1:3], "yuv420p"
        for i, image in enumerate(pixels):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            if i % WINDOW == 0:
                frame.pict_type = av.video.frame.PictureType.I
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


def test_cli_streams_each_chunk_into_a_fragmented_mp4(helios_checkpoint, tmp_path,
                                                     monkeypatch):
    """2 chunks (66 frames asked, 65 made: 33 + 32), 64 x 64, 2 steps, no CFG, timed twice,
    on one CPU device (the CLI's run on the first device only: 8 interpreted ones cost
    minutes here, and sharding is test_helios' case)."""
    monkeypatch.setattr(generate_flax, "Generation",
                        lambda config, family: Generation(config, family, jax.devices()[:1]))
    out = tmp_path / "out"
    out.mkdir()
    code = generate_flax.main([
        "--model_id", helios_checkpoint, "--dtype", "float32", "--seed", "0",
        "--prompt", "A cat walks on the grass.", "--max_sequence_length", "16",
        "--height", "64", "--width", "64", "--frames", "66", "--num_inference_steps", "2",
        "--guidance_scale", "1.0", "--fps", str(FPS), "--num_iterations", "2",
        "--save_frames", "--no_plots", "--output_dir", str(out)])
    assert code == 0
    (mp4,) = glob.glob(str(out / "*.mp4"))
    (saved,) = glob.glob(str(out / "*.frames.safetensors"))
    assert not glob.glob(str(out / ".*partial*")), os.listdir(out)
    frames = load_file(saved)["frames"]
    assert frames.shape == (65, 64, 64, 3)
    data = open(mp4, "rb").read()
    boxes = [k for k, _, _ in sw.top_level_boxes(data)]
    # an init segment, then fragments (moof + mdat); the random tiny model's frames make
    # x264 cut scenes inside chunks too, so there are more keyframes than chunk starts
    assert boxes[:2] == ["ftyp", "moov"] and boxes[2:] == ["moof", "mdat"] * (
        len(boxes[2:]) // 2) and len(boxes) >= 6, boxes
    keys = _keyframes(mp4)
    assert 0 in keys and WINDOW in keys, keys
    reference = tmp_path / "continuous.mp4"
    _continuous_encode(reference, reporting.to_uint8(frames))
    assert _keyframes(reference) == keys
    streamed = _decode(mp4)
    np.testing.assert_array_equal(streamed, _decode(reference))
    err = np.abs(streamed.astype(np.float32) - frames * 255).mean()
    print(f"mean |streamed - saved frames| {err:.2f} levels of 255")
    assert err < 20, err
