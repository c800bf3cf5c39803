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
import time

import imageio_ffmpeg

from engine.files import report as reporting
from engine.files import stream_writer
from engine.run import runtime
from engine.run.errors import GenerationError, UsageError, fail, first_line

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
    the paths written (``write_video`` without its timings; raises what it raises)."""
    return write_video(config, frames, stem, video, audio)[0]


def write_video(config, frames, stem: str, video: Video | None = None,
                audio: reporting.Audio | None = None, streamed=None) -> tuple[list[str], dict]:
    """Write one video's mp4 (and lossless frames with --save_frames), each file under a
    temporary name renamed into place; safe on ``engine.files.writer``'s thread.
    ``streamed``: the ``stream_writer.FragmentedMp4Writer`` that already holds the mp4's
    chunks (a chunked family's run, ``RunFiles.stream``): it is finished (renamed onto the
    mp4's name) in place of the encode; ``audio`` must then be None.

    ``frames``: (F, H, W, 3) float32 in [0, 1]. ``audio``: an optional
    ``reporting.Audio(waveform, sample_rate)``, waveform (channels, samples) float in
    [-1, 1], 1 or 2 channels, rate in Hz: muxed into the mp4 as an AAC track
    (``reporting.save_video``) and saved as the frames file's "audio" key. The family puts
    ``reporting.audio_fields(audio)`` (``audio_sample_rate``...) in the video's report entry.

    Returns:
        (the paths written, {"uint8_s": seconds converting to uint8, "write_s": seconds
        encoding the mp4, muxing its audio and writing the frames file, "written_at": the
        ``time.time()`` when the last file was in place}).

    Raises:
        GenerationError: one line: a bad ``audio`` (``reporting.check_audio``), before any
            file; or a file that could not be written, naming it and the cause (no partial
            file is left).
    """
    if audio is not None:
        reporting.check_audio(audio)
    files = video_files(config.run.output_dir, stem, video, config.run.save_frames)
    t0 = time.perf_counter()
    pixels = reporting.to_uint8(frames)
    t1 = time.perf_counter()
    path = files["video"]
    try:
        if streamed is not None:
            streamed.finish()
        else:
            reporting.save_video(pixels, path, config.video.fps, audio)
        if files["frames"]:
            path = files["frames"]
            reporting.save_frames(frames, path, audio)
    except GenerationError:
        raise
    except Exception as e:  # noqa: BLE001 - one line naming the file, on any thread
        raise GenerationError(f"could not write {path}: {type(e).__name__}: "
                              f"{first_line(e)}") from e
    return [p for p in files.values() if p], dict(
        uint8_s=t1 - t0, write_s=time.perf_counter() - t1, written_at=time.time())


# The report's stages of one video, in the order it goes through them (docs/features.md).
STAGES = ("text_encode_s", "denoise_s", "decode_s", "postprocess_s", "write_s", "video_wall_s")


def video_stages(runs: list, text_encode_s: float, to_frames_s: float, written: dict,
                 began: float) -> dict:
    """One video's seconds per stage (``STAGES``): ``text_encode_s`` (given), ``denoise_s``
    (its timed runs' denoise and upscale), ``decode_s`` (their VAE decodes),
    ``postprocess_s`` (``to_frames_s``, device -> host and [0, 1] frames, plus the uint8
    conversion), ``write_s`` (mp4 encode and mux, ``write_video``) and ``video_wall_s``:
    from ``began`` (``time.time()`` when its prompt's encode began) to its last file in
    place (``written["written_at"]``). The stages run one after another for one video, so
    their sum is at most ``video_wall_s``; the rest is waiting (compile, warmup, the
    videos before it in a prompts file) and Python between them."""
    return dict(
        text_encode_s=float(text_encode_s),
        denoise_s=sum(r.get("denoise_s", 0.0) + r.get("upscale_s", 0.0) for r in runs),
        decode_s=sum(r.get("vae_decode_s", 0.0) for r in runs),
        postprocess_s=to_frames_s + written["uint8_s"], write_s=written["write_s"],
        video_wall_s=written["written_at"] - began)


class RunFiles:
    """The files of one CLI run: ``save`` hands each video to ``writer`` (an
    ``engine.files.writer.VideoWriter``) and returns its file names at once; once the
    writer has waited, ``record`` puts every video's stages and the time to first video in
    the report and returns the paths written. Only the writing process (``runtime.is_writer``)
    writes; the others' ``save`` returns []."""

    def __init__(self, config, stem: str | None, writer):
        self.config, self.stem, self.writer = config, stem, writer
        self.writes: list = []  # each submitted video's future of ``write_video``
        self.streams: dict = {}  # video label (None: the single video) -> its mp4's sink

    def stream(self, video: Video | None):
        """The ``stream_writer.FragmentedMp4Writer`` of ``video``'s mp4 (None on the other
        processes): a chunked family's run hands it each chunk as it is decoded (installed
        with ``stream_writer.streaming`` around the run), ``save`` finishes it."""
        if not runtime.is_writer():
            return None
        path = video_files(self.config.run.output_dir, self.stem, video, False)["video"]
        sink = stream_writer.FragmentedMp4Writer(path, self.config.video.fps)
        self.streams[None if video is None else video.label] = sink
        return sink

    def save(self, video: Video | None, frames, audio: reporting.Audio | None = None
             ) -> list[str]:
        if not runtime.is_writer():
            return []
        sink = self.streams.pop(None if video is None else video.label, None)
        if sink is not None and not sink.handed:  # nothing streamed: the usual encode
            sink.abort()
            sink = None
        if sink is not None and audio is not None:
            sink.abort()
            raise GenerationError("a streamed mp4 cannot take the decoder's sound")
        self.writes.append(self.writer.submit(write_video, self.config, frames, self.stem,
                                              video, audio, sink))
        files = video_files(self.config.run.output_dir, self.stem, video,
                            self.config.run.save_frames)
        return [os.path.basename(p) for p in files.values() if p]

    def record(self, report: dict, run) -> list[str]:
        """``run``: the ``engine.pipeline.Generation`` (its ``video_parts``, ``timings``,
        ``began``). Sets each prompts-file entry's "stages" (or the single video's
        ``timings.stages``) and ``timings.time_to_first_video``; returns the paths."""
        writes = [w.result() for w in self.writes]
        stages = [video_stages(part["runs"], run.timings.get("text_encode_s", 0.0),
                               part["to_frames_s"], timing, run.began)
                  # an interrupt may land between a video's decode and its write
                  for part, (_, timing) in zip(run.video_parts, writes, strict=False)]
        for entry, video_stage in zip(report.get("videos", []), stages, strict=False):
            entry["stages"] = video_stage
        if not self.config.run.videos and stages:
            report["timings"]["stages"] = stages[0]
        first = {}  # the first video's file ends the time to first video
        if writes:
            timing = writes[0][1]
            first = dict(write_s=timing["uint8_s"] + timing["write_s"],
                         done_at=timing["written_at"])
        report["timings"]["time_to_first_video"] = reporting.first_video(report, **first)
        return [p for paths, _ in writes for p in paths]
