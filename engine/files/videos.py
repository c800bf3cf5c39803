"""Many videos from one compile: ``--prompts_file`` (JSON Lines) and ``--seeds``.

One run loads, places and compiles once, runs the warmup once, then generates every video in
order. Each video is one or more timed steady-state runs of the same compiled programs with
its own prompt embeddings and initial noise (program arguments, not constants), and its files
are written as soon as it is done (``<stamp>_<name or index>.mp4``), so an interrupted run
keeps every finished video; the one JSON report, written at the end (also after an
interrupt), lists what was done.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import imageio_ffmpeg

from engine.files import report as reporting
from engine.run.errors import UsageError, fail

FIELDS = {"prompt": str, "negative_prompt": str, "seed": int, "name": str}


@dataclasses.dataclass(frozen=True)
class Video:
    """One video of a run: 0-based ``index``, its prompt, negative prompt, seed and the name
    its files carry (None: the index)."""
    index: int
    prompt: str
    negative_prompt: str
    seed: int
    name: str | None = None

    @property
    def label(self) -> str:
        return self.name if self.name is not None else str(self.index)


def parse_prompts_file(path: str, *, negative_prompt: str, seed: int) -> list[Video]:
    """The videos of a JSON Lines file: one object per line with ``prompt`` and optionally
    ``negative_prompt``, ``seed`` and ``name`` (defaults: the flags'). Blank lines are skipped.

    Raises:
        UsageError: one line naming the file's line: not JSON, not an object, no prompt, an
            unknown key, a wrong type, a bad or duplicate name, or an empty file.
    """
    flag = f"--prompts_file={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag}: cannot read it ({getattr(e, 'strerror', None) or e})") \
            from None
    videos, names = [], {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{flag}: line {number}:"
        try:
            entry = json.loads(line)
        except ValueError as e:
            raise UsageError(f"{where} not JSON ({e.msg})") from None
        if not isinstance(entry, dict):
            raise UsageError(f"{where} expected a JSON object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - set(FIELDS))
        if unknown:
            raise UsageError(f"{where} unknown key {unknown[0]!r} (keys: {', '.join(FIELDS)})")
        if "prompt" not in entry:
            raise UsageError(f"{where} no \"prompt\"")
        for key, kind in FIELDS.items():
            value = entry.get(key)
            if key in entry and (not isinstance(value, kind) or isinstance(value, bool)):
                raise UsageError(f"{where} \"{key}\" must be a {kind.__name__}, got "
                                 f"{json.dumps(value)}")
        if not entry["prompt"].strip():
            raise UsageError(f"{where} \"prompt\" is empty")
        name = entry.get("name")
        if name is not None:
            if not re.fullmatch(r"[\w.-]{1,80}", name) or name.startswith("."):
                raise UsageError(f"{where} \"name\" {name!r} must be 1-80 letters, digits, "
                                 "'_', '-' or '.' (it names the output files)")
            if name in names:
                raise UsageError(f"{where} duplicate \"name\" {name!r} (also line "
                                 f"{names[name]})")
            names[name] = number
        videos.append(Video(len(videos), entry["prompt"],
                            entry.get("negative_prompt", negative_prompt),
                            entry.get("seed", seed), name))
    if not videos:
        raise UsageError(f"{flag}: no prompts (the file is empty)")
    labels = [v.label for v in videos]
    clash = next((v for v in videos if v.name is None and labels.count(v.label) > 1), None)
    if clash is not None:
        raise UsageError(f"{flag}: a \"name\" equals the index {clash.label} of an unnamed "
                         "line; both would write the same files")
    return videos


def parse_seeds(text: str) -> list[int]:
    """``--seeds A,B,C`` as a list of distinct ints.

    Raises:
        UsageError: not a comma-separated list of integers, or a repeated seed.
    """
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        fail("--seeds", text, "must be comma-separated integers, e.g. 1,2,3")
    if len(set(seeds)) != len(seeds):
        fail("--seeds", text, "repeats a seed (the videos would be identical)")
    return seeds


def plan(args, values: dict) -> tuple[Video, ...]:
    """The run's videos from ``--prompts_file`` or ``--seeds`` (empty: one video from the
    flags). ``values``: the resolved family flags (prompt, negative_prompt). A run that
    writes mp4s checks first that it can (``check_mp4_writer``).

    Raises:
        UsageError: a bad --prompts_file / --seeds, or no ffmpeg for the mp4s.
    """
    if not args.dry_run and args.stage in ("all", "decode"):
        check_mp4_writer()
    if args.prompts_file is not None and args.seeds is not None:
        fail("--seeds", args.seeds, "cannot be combined with --prompts_file (give each line "
             "its own \"seed\")")
    if args.prompts_file is None and args.seeds is None:
        return ()
    if args.seeds is not None:
        return tuple(Video(i, values["prompt"], values["negative_prompt"], s, f"seed{s}")
                     for i, s in enumerate(parse_seeds(args.seeds)))
    return tuple(parse_prompts_file(args.prompts_file, negative_prompt=values["negative_prompt"],
                                    seed=args.seed))


def check_mp4_writer() -> str:
    """The ffmpeg executable the mp4 writer (imageio-ffmpeg, through diffusers'
    ``export_to_video``) will run, checked before any model loads, so a missing binary is one
    line rather than a traceback after the whole generation (a GPU machine once had
    imageio-ffmpeg's package without its 68 MB binary: ../shared/notes/gpu-device.md).

    Raises:
        UsageError: no ffmpeg, or ``IMAGEIO_FFMPEG_EXE`` names no executable file.
    """
    try:
        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError:
        exe = None
    found = exe and (shutil.which(exe) or (os.path.isfile(exe) and os.access(exe, os.X_OK)))
    if not found:
        raise UsageError(f"no ffmpeg to write the mp4 (imageio-ffmpeg found {exe!r}): "
                         "pip install imageio-ffmpeg (its wheel ships one), install ffmpeg, "
                         "or set IMAGEIO_FFMPEG_EXE to one")
    return exe


def video_files(output_dir: str, stem: str, video: Video | None, save_frames: bool) -> dict:
    """{"video": mp4 path, "frames": frames path or None} of one video; ``video`` None is a
    single-video run (``<stamp>.mp4``)."""
    base = os.path.join(output_dir, stem if video is None else f"{stem}_{video.label}")
    return dict(video=base + ".mp4", frames=base + ".frames.safetensors" if save_frames else None)


def save_video(config, frames, stem: str, video: Video | None = None,
               audio: reporting.Audio | None = None) -> list[str]:
    """Write one video's mp4 (and lossless frames with --save_frames), atomically; returns
    the paths written.

    ``audio``: an optional ``reporting.Audio(waveform, sample_rate)``, waveform (channels,
    samples) float in [-1, 1], 1 or 2 channels, rate in Hz: muxed into the mp4 as an AAC track
    (``reporting.save_video``) and saved as the frames file's "audio" key. The family puts
    ``reporting.audio_fields(audio)`` (``audio_sample_rate``...) in the video's report entry.

    Raises:
        GenerationError: a bad ``audio`` (``reporting.check_audio``), before any file.
    """
    if audio is not None:
        reporting.check_audio(audio)
    files = video_files(config.run.output_dir, stem, video, config.run.save_frames)
    reporting.save_video(frames, files["video"], config.video.fps, audio)
    if files["frames"]:
        reporting.save_frames(frames, files["frames"], audio)
    return [p for p in files.values() if p]
