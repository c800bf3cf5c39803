"""An mp4 with sound: a waveform muxed as an AAC track beside the H.264 video
(``engine.files.report.save_video``), and the frames file's "audio" key.

Every check reads the files back independently of the writer: ffmpeg (imageio-ffmpeg's binary;
it ships no ffprobe) lists the streams (``ffmpeg -i``) and decodes the track to raw float32 PCM,
which is compared with the synthetic waveform (its 440 Hz peak, its correlation, its start);
imageio-ffmpeg counts and decodes the video frames; safetensors reads the frames file.
"""

import os
import re
import subprocess
import types

import imageio_ffmpeg
import numpy as np
import pytest
from safetensors.numpy import load_file

from engine.files import report as reporting
from engine.files import videos
from engine.run.errors import GenerationError

RATE, FPS, FRAMES, AAC_FRAME = 24000, 16, 17, 1024


def sine_and_noise(samples: int) -> np.ndarray:
    """(2, samples) float32: channel 0 a 440 Hz sine (amplitude 0.5), channel 1 seeded noise
    (a broadband signal whose cross-correlation with its decoding peaks only at the true lag)."""
    t = np.arange(samples) / RATE
    noise = np.random.default_rng(1).uniform(-0.3, 0.3, samples)
    return np.stack([0.5 * np.sin(2 * np.pi * 440.0 * t), noise]).astype(np.float32)


def random_frames(n: int = FRAMES) -> np.ndarray:
    return np.random.default_rng(0).random((n, 64, 96, 3), dtype=np.float32)


def streams(path: str) -> list[str]:
    """The stream lines of ``ffmpeg -i path`` (it exits 1: no output file named)."""
    err = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", path],
                         capture_output=True, text=True).stderr
    return [line.strip() for line in err.splitlines() if re.match(r"\s*Stream #0:", line)]


def decoded_audio(path: str, channels: int) -> np.ndarray:
    """The mp4's audio track decoded by ffmpeg to (channels, samples) float32."""
    pcm = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", path, "-map",
                          "0:a:0", "-f", "f32le", "-acodec", "pcm_f32le", "-"],
                         capture_output=True, check=True).stdout
    return np.frombuffer(pcm, np.float32).reshape(-1, channels).T


def decoded_frames(path: str) -> np.ndarray:
    gen = imageio_ffmpeg.read_frames(path)
    meta = next(gen)
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in gen])


def lag_of(decoded: np.ndarray, original: np.ndarray, window: int = 2048) -> int:
    """The shift (samples) of ``decoded`` against ``original`` that correlates best."""
    n = min(len(decoded), len(original))
    a, b = decoded[:n] - decoded[:n].mean(), original[:n] - original[:n].mean()
    corr = np.fft.irfft(np.fft.rfft(a, 2 * n) * np.conj(np.fft.rfft(b, 2 * n)))
    lags = np.r_[np.arange(window + 1), np.arange(-window, 0)]
    return int(lags[np.argmax(corr[lags])])


def test_mp4_carries_the_waveform_as_aac_in_sync(tmp_path):
    samples = RATE * FRAMES // FPS  # the video's duration, as LTX-2 makes it
    wave_, frames = sine_and_noise(samples), random_frames()
    path = str(tmp_path / "a.mp4")
    reporting.save_video(frames, path, FPS, reporting.Audio(wave_, RATE))

    lines = streams(path)
    assert len(lines) == 2, lines
    assert "Video: h264" in lines[0]
    assert re.search(r"Audio: aac .*\b24000 Hz, stereo\b", lines[1]), lines[1]
    assert imageio_ffmpeg.count_frames_and_secs(path)[0] == FRAMES

    got = decoded_audio(path, 2)
    assert abs(got.shape[1] - samples) <= AAC_FRAME, (got.shape, samples)
    n = min(got.shape[1], samples)
    spectrum = np.abs(np.fft.rfft(got[0, :n] * np.hanning(n)))
    peak_hz = np.fft.rfftfreq(n, 1 / RATE)[np.argmax(spectrum)]
    assert abs(peak_hz - 440.0) <= 1.0, peak_hz
    assert np.corrcoef(got[0, :n], wave_[0, :n])[0, 1] > 0.99
    # In sync: the track starts at t=0 (AAC's encoder delay is undone by the mp4's edit list);
    # a missing edit list would shift it by 1024 samples.
    assert lag_of(got[1], wave_[1]) == 0
    # White noise is what AAC codes worst (0.52 measured at ffmpeg's default 128 kb/s), yet
    # far from the 0 of silence or of another signal.
    assert np.corrcoef(got[1, :n], wave_[1, :n])[0, 1] > 0.3

    # The audio leaves the video stream as an mp4 without audio carries it.
    plain = str(tmp_path / "b.mp4")
    reporting.save_video(frames, plain, FPS)
    np.testing.assert_array_equal(decoded_frames(path), decoded_frames(plain))


@pytest.mark.parametrize("seconds", [0.5, 1.6])
def test_a_shorter_or_longer_waveform_keeps_its_length(tmp_path, seconds):
    """Video 17 / 16 = 1.06 s; mono audio of 0.5 s or 1.6 s: neither stream is cut."""
    samples = int(seconds * RATE)
    mono = sine_and_noise(samples)[:1]
    path = str(tmp_path / "a.mp4")
    reporting.save_video(random_frames(), path, FPS, reporting.Audio(mono, RATE))
    lines = streams(path)
    assert len(lines) == 2 and re.search(r"24000 Hz, mono\b", lines[1]), lines
    assert imageio_ffmpeg.count_frames_and_secs(path)[0] == FRAMES
    assert abs(decoded_audio(path, 1).shape[1] - samples) <= AAC_FRAME


def config(tmp_path, save_frames=True):
    return types.SimpleNamespace(run=types.SimpleNamespace(output_dir=str(tmp_path),
                                                           save_frames=save_frames),
                                 video=types.SimpleNamespace(fps=FPS))


def test_frames_file_keeps_the_waveform_bit_exact(tmp_path):
    wave_ = sine_and_noise(RATE // 2)
    wave_[0, 7] = 1.25  # out of [-1, 1]: clipped in the mp4 only, kept in the frames file
    frames = random_frames()
    audio = reporting.Audio(wave_, RATE)
    written = videos.save_video(config(tmp_path), frames, "stem", None, audio)
    assert sorted(os.listdir(tmp_path)) == ["stem.frames.safetensors", "stem.mp4"] \
        == sorted(os.path.basename(p) for p in written)
    saved = load_file(str(tmp_path / "stem.frames.safetensors"))
    assert saved["audio"].dtype == np.float32 and saved["audio"].shape == (2, RATE // 2)
    assert saved["audio"].tobytes() == wave_.tobytes()
    assert saved["frames"].tobytes() == frames.tobytes()
    assert reporting.audio_fields(audio) == dict(audio_sample_rate=RATE, audio_channels=2,
                                                 audio_seconds=0.5)
    assert reporting.audio_fields(None) == {}


def test_without_audio_nothing_changes(tmp_path):
    videos.save_video(config(tmp_path), random_frames(), "stem")
    lines = streams(str(tmp_path / "stem.mp4"))
    assert len(lines) == 1 and "Video: h264" in lines[0], lines
    assert list(load_file(str(tmp_path / "stem.frames.safetensors"))) == ["frames"]


GOOD = sine_and_noise(2400)
BAD = {
    "one dimension": (GOOD[0], RATE, "shape=(2400,)"),
    "three channels": (np.concatenate([GOOD, GOOD[:1]]), RATE, "1 or 2 channels"),
    "no samples": (GOOD[:, :0], RATE, "at least one sample"),
    "integers": ((GOOD * 32767).astype(np.int16), RATE, "dtype='int16'"),
    "nan": (np.where(np.arange(2400) == 5, np.nan, GOOD).astype(np.float32), RATE,
            "2 value(s) not finite"),
    "inf": (np.where(np.arange(2400) == 5, np.inf, GOOD).astype(np.float32), RATE,
            "not finite"),
    "rate not for aac": (GOOD, 23000, "sample_rate=23000"),
    "rate a float": (GOOD, 24000.0, "sample_rate=24000.0"),
    "rate a bool": (GOOD, True, "sample_rate=True"),
    "rate zero": (GOOD, 0, "sample_rate=0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_audio_is_one_line_and_writes_nothing(tmp_path, case):
    waveform, rate, says = BAD[case]
    with pytest.raises(GenerationError) as e:
        videos.save_video(config(tmp_path), random_frames(), "stem", None,
                          reporting.Audio(waveform, rate))
    message = str(e.value)
    assert says in message and "\n" not in message and message.startswith("audio "), message
    assert os.listdir(tmp_path) == []


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(reporting, "write_wav", broken)
    with pytest.raises(OSError):
        reporting.save_video(random_frames(), str(tmp_path / "a.mp4"), FPS,
                             reporting.Audio(GOOD, RATE))
    assert os.listdir(tmp_path) == []
