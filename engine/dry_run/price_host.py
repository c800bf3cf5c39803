"""Measurements on this host for the whole-video estimate (HOST MEASUREMENTS, not TPU figures):
its matmul rate at an encoder's own shapes (``matmul_rate``), and the post-processing and mp4
write of a video of the run's size (``write_seconds``). Each takes about a second or what one
write takes; a TPU VM's host differs from this one, so the figures say which host measured
them (``host``)."""

from __future__ import annotations

import os
import tempfile
import time
import types

import numpy as np
import torch

from engine.files import report as reporting
from engine.files import videos

# A call this long or longer sets the measured rows: the rate is that of a matmul of a few
# tenths of a second, so that a ~1 s budget holds several calls after the warm-up.
CALL_S = 0.2


def host() -> dict:
    """What measured: CPU count, torch's threads, the CPU model where Linux names it."""
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), None)
    except OSError:
        pass
    return dict(cpus=os.cpu_count(), torch_threads=torch.get_num_threads(), cpu=model)


def matmul_rate(rows: int, k: int, n: int, *, dtype=torch.bfloat16, seconds: float = 1.0) -> dict:
    """This host's matmul rate, FLOP/s, for (rows, k) @ (k, n) in ``dtype`` (torch on the CPU,
    as the pipelines run their encoders), timed over about ``seconds``.

    A first call of 8 rows warms up (oneDNN picks its kernel, pages are touched) and times a
    row; the measured calls take min(``rows``, the rows one ``CALL_S`` call holds, at least
    8) rows of the same k x n weight, and repeat until ``seconds`` have passed (at least one).

    Returns:
        dict(flops_per_s, rows_measured, shape [rows, k, n], dtype, calls, seconds, kind
        "host measurement", host).
    """
    a = torch.randn(rows, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    t0 = time.perf_counter()
    torch.matmul(a[:8], b)
    per_row = max(time.perf_counter() - t0, 1e-9) / 8
    m = int(min(rows, max(8, CALL_S / per_row)))
    x = a[:m].contiguous()
    torch.matmul(x, b)  # the measured shape's own warm-up
    calls, t0 = 0, time.perf_counter()
    while True:
        torch.matmul(x, b)
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            break
    return dict(flops_per_s=2.0 * m * k * n * calls / elapsed, rows_measured=m,
                shape=[rows, k, n], dtype=str(dtype).replace("torch.", ""), calls=calls,
                seconds=elapsed, kind="host measurement", host=host())


def synthetic_frames(frames: int, height: int, width: int) -> np.ndarray:
    """(F, H, W, 3) float32 in [0, 1]: smooth colour gradients moving frame to frame, closer
    to a video's content than noise (which H.264 encodes several times slower)."""
    y = np.linspace(0, 2 * np.pi, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0, 2 * np.pi, width, dtype=np.float32)[None, :, None]
    phase = np.array([0.0, 2.1, 4.2], np.float32)[None, None, :]
    out = np.empty((frames, height, width, 3), np.float32)
    for f in range(frames):
        out[f] = 0.5 + 0.5 * np.sin(x + 0.7 * y + phase + 0.15 * f)
    return out


def write_seconds(frames: int, height: int, width: int, fps: int,
                  sample_rate: int | None = None) -> dict:
    """The post-processing and the mp4 of one video on this host (HOST MEASUREMENT): synthetic
    frames of the run's count and size written by the run's own writer function
    (``engine.files.videos.write_video``: uint8 conversion, H.264 encode, with
    ``sample_rate`` a stereo AAC track as long as the video muxed beside) into a temporary
    folder, removed after.

    Returns:
        dict(seconds (uint8 + write), uint8_s, write_s, frames, height, width, audio, kind
        "host measurement", host).
    """
    pixels = synthetic_frames(frames, height, width)
    audio = None
    if sample_rate:
        t = np.arange(int(sample_rate * frames / fps), dtype=np.float32) / sample_rate
        audio = reporting.Audio(np.stack([0.1 * np.sin(2 * np.pi * 440 * t)] * 2), sample_rate)
    with tempfile.TemporaryDirectory(prefix="estimate_write_") as folder:
        config = types.SimpleNamespace(run=types.SimpleNamespace(output_dir=folder,
                                                                 save_frames=False),
                                       video=types.SimpleNamespace(fps=fps))
        _, timing = videos.write_video(config, pixels, "estimate", None, audio)
    return dict(seconds=timing["uint8_s"] + timing["write_s"], uint8_s=timing["uint8_s"],
                write_s=timing["write_s"], frames=frames, height=height, width=width,
                audio=sample_rate is not None, kind="host measurement", host=host())
