"""Quality harness: PSNR and SSIM of approximate settings against the exact run, with times.

For one checkpoint (``--model_id``), a list of prompts (``--prompts``: a text file, one prompt
per line; by default five prompts of VBench's prompt suite, ``benchmarks/quality_prompts.txt``,
which names its source file and commit) and seeds (``--seeds``), it runs ``generate_flax.py``
once with the exact setting (``--flags`` only) and once per approximate setting
(``--setting NAME=FLAGS``, repeatable: any generate_flax.py flags, so a new approximation needs
no change here), each run making every video from one load and compile (``--prompts_file``,
one line per prompt x seed). Every approximate video is compared with the exact video of the
same prompt and seed:

- frames: generate_flax.py's ``--save_frames`` files (float32 (F, H, W, 3) in [0, 1],
  ``engine/files/report.py: save_frames``), not the mp4s (H.264 is lossy);
- PSNR (dB) from scikit-image (``skimage.metrics.peak_signal_noise_ratio``, ``data_range=1.0``,
  over the RGB values) and SSIM as Wang et al. 2004 define it and as the papers users compare
  against report it (Sparse VideoGen, the step-caching papers): on luma, Y = 0.299 R +
  0.587 G + 0.114 B (ITU-R BT.601, full range: ``skimage.color.rgb2yuv``'s Y), with an 11x11
  Gaussian window of sigma 1.5, the population (co)variances, K1 = 0.01, K2 = 0.03 and
  ``data_range=1.0`` (``structural_similarity(..., gaussian_weights=True, sigma=1.5,
  use_sample_covariance=False)``; scikit-image's defaults, a 7x7 uniform window with sample
  covariances, give other figures), averaged over the window positions inside the frame.
  Both are computed per frame and averaged over the video's frames. A frame equal to the
  exact one has an infinite PSNR:
  a video's PSNR is the mean over its differing frames (``identical_frames`` counts the
  others), and ``inf`` when every frame is equal. The table prints ``inf``; the JSON holds the
  string ``"inf"`` (JSON has no infinity; null would read as "not measured");
- times, from each run's JSON report: per video its denoise seconds and s/step; per run the
  steady-state s/step (``timings.steady_s_per_step``), its speed-up over the exact run, the
  cold start, the process's wall time and, with a step cache, the steps it cached.
A setting with no flags (``"again="``) reruns the exact setting: PSNR ``inf`` and SSIM 1.0 say
the runs are deterministic, and its speed-up is the timing's noise floor (on the 2-core CPU
host a first process compiling into empty caches ran its steps slower than later ones:
warm the caches with a first harness run before comparing times).

Each run is ``generate_flax.py`` in a subprocess, as a user runs it: its own process holds
the accelerator alone (a TPU belongs to one process, and this one never starts a JAX
backend), frees its memory on exit, and leaks no state (patched modules, compiled programs)
into the next setting. Every run's flags are checked first, in this process, by
generate_flax.py's own parser and ``validate_args`` (no model loads): bad input is one line
naming the flag, the value and the rule, exit 2, before any run starts.

Random weights: on a tiny checkpoint (``tools/make_tiny_checkpoint.py``), as in this project's
tests and ``benchmarks/quality_results.md``, the figures come from random weights and say
nothing about an approximation's quality; quality on real weights is measured by users with
this script on their checkpoints and machines.

Examples:
    python benchmarks/quality.py --model_id Wan-AI/Wan2.1-T2V-14B-Diffusers --seeds 42,43 \\
        --setting "magcache=--cache magcache" --setting "int8=--quantize int8" \\
        --setting "svg=--sparse svg --attention splash"
    python benchmarks/quality.py --model_id checkpoints/tiny-wan --setting "again=" \\
        --flags "--height 64 --width 96 --frames 9 --num_inference_steps 2 --dtype float32" \\
        --setting "int8=--quantize int8"

Output: a markdown table on stdout (one row per approximate video, then one per setting: mean
and min PSNR and SSIM, s/step and speed-up), and ``quality.json`` in a new folder
``<output_dir>/<YYYYMMDD_HHMMSS>/`` beside each run's files and log. Exit codes: 0; 1 a run
failed (its log's last lines and path); 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: generate_flax and engine/ live there
import generate_flax  # noqa: E402
from engine.files import videos as video_files  # noqa: E402
from engine.files.checkpoint import looks_local  # noqa: E402
from engine.files.report import save_report  # noqa: E402
from engine.run.errors import GenerationError, UsageError, fail  # noqa: E402

GENERATE = os.path.join(ROOT, "generate_flax.py")
DEFAULT_PROMPTS = os.path.join(ROOT, "benchmarks", "quality_prompts.txt")
EXACT = "exact"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")
# generate_flax.py flags the harness sets itself (or that would make no comparable video).
CONTROLLED = ("model_id", "prompt", "prompts_file", "seed", "seeds", "output_dir", "stage",
              "dry_run", "serve")
NOTE = ("PSNR and SSIM measure how far each setting moves the video from the exact run of the "
        "same checkpoint, prompt and seed. This project's own figures come from tiny "
        "checkpoints with random weights on a CPU: they prove the harness, not the quality of "
        "an approximation. Quality on real weights is measured by users, with this script.")
# The SSIM of Wang, Bovik, Sheikh and Simoncelli, "Image quality assessment: from error
# visibility to structural similarity", IEEE TIP 13(4), 2004, on luma as their ssim.m takes
# it (MATLAB's rgb2gray: BT.601 weights); the video papers report this one, not
# scikit-image's default (7x7 uniform window, sample covariance).
SSIM_VARIANT = ("SSIM of Wang et al. 2004 on luma Y = 0.299 R + 0.587 G + 0.114 B (ITU-R BT.601, "
                "full range): 11x11 Gaussian window, sigma 1.5, population covariance, "
                "K1 0.01, K2 0.03, data_range 1.0, mean over the window positions inside the "
                "frame (skimage.metrics.structural_similarity(y_exact, y_other, "
                "gaussian_weights=True, sigma=1.5, use_sample_covariance=False, "
                "data_range=1.0))")
# Wang et al.'s window: 2 * round(3.5 sigma) + 1 = 11 pixels (scipy's truncate=3.5).
SSIM_WINDOW = 11
METRIC = ("per frame, averaged over the video's frames: PSNR (dB) = "
          "skimage.metrics.peak_signal_noise_ratio(exact, other, data_range=1.0) on RGB, over "
          "the frames that differ (inf when none does); SSIM = " + SSIM_VARIANT + "; frames "
          "from --save_frames (float32 in [0, 1]); inf is written as the string \"inf\"")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One run: ``name`` and the generate_flax.py ``flags`` added to ``--flags``."""

    name: str
    flags: tuple[str, ...]
    text: str  # as the user gave it, for messages


@dataclasses.dataclass(frozen=True)
class Video:
    """One (prompt, seed) pair; ``name`` names its files (``p<index>_s<seed>``)."""

    prompt: str
    seed: int
    name: str


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (main), not argparse's usage block
        raise UsageError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_id", required=True,
                   help="the checkpoint: a diffusers-format folder or a Hub id, as for "
                        "generate_flax.py (required)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS,
                   help="text file, one prompt per line ('#' lines and blank lines skipped) "
                        "(default: benchmarks/quality_prompts.txt, five of VBench's prompts)")
    p.add_argument("--seeds", default="42",
                   help="comma-separated seeds, each with each prompt (default: 42)")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=FLAGS",
                   help="an approximate setting: generate_flax.py flags added to --flags, e.g. "
                        "'magcache=--cache magcache' or 'int8=--quantize int8'; repeatable; "
                        "empty FLAGS reruns the exact setting (a determinism check) (default: "
                        "none, the exact run alone)")
    p.add_argument("--flags", default="",
                   help="generate_flax.py flags of every run, the exact one included (size, "
                        "steps, dtype, mesh...); the harness sets --model_id, --prompts_file, "
                        "--output_dir and --save_frames itself; a single flag needs '=': "
                        "--flags=--no_plots (default: none, generate_flax.py's defaults)")
    p.add_argument("--output_dir", default=os.path.join("outputs", "quality"),
                   help="a new <YYYYMMDD_HHMMSS> folder here gets every run and quality.json "
                        "(default: outputs/quality)")
    return p.parse_args(argv)


def read_prompts(path: str) -> list[str]:
    """The prompts of ``path``, one per line; '#' lines and blank lines are skipped.

    Raises:
        UsageError: the file cannot be read or holds no prompt.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except (OSError, UnicodeDecodeError) as e:
        fail("--prompts", path, f"cannot read it ({getattr(e, 'strerror', None) or e})")
    prompts = [line for line in lines if line and not line.startswith("#")]
    if not prompts:
        fail("--prompts", path, "holds no prompt (one per line; '#' lines and blank lines are "
                                "skipped)")
    return prompts


def parse_setting(text: str) -> Setting:
    """``NAME=FLAGS`` as a ``Setting``; FLAGS split as a shell line (``shlex``).

    Raises:
        UsageError: no '=', a bad or reserved NAME, or FLAGS that do not split.
    """
    name, sep, flags = text.partition("=")
    if not sep or not NAME.fullmatch(name):
        fail("--setting", text, "must be NAME=FLAGS: NAME 1-40 letters, digits, '_', '-' or "
                                "'.'; FLAGS generate_flax.py flags (empty: rerun the exact run)")
    if name == EXACT:
        fail("--setting", text, f"NAME {EXACT!r} is the reference run (--flags alone)")
    return Setting(name, tuple(_split("--setting", text, flags)), text)


def _split(flag: str, text: str, line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as e:
        fail(flag, text, f"does not split as a shell line ({e})")


def _generate_parser(flag: str, text: str) -> argparse.ArgumentParser:
    """generate_flax.py's parser, its errors one line naming our ``flag`` and ``text``."""
    parser = generate_flax.build_parser()

    def error(message):
        raise UsageError(f"{flag}={text!r}: generate_flax.py: {message}")

    parser.error = error
    return parser


def check_flags(tokens: tuple[str, ...], flag: str, text: str) -> None:
    """``tokens`` parse as generate_flax.py flags and leave the harness's own alone.

    Raises:
        UsageError: an unknown flag or value, or one of ``CONTROLLED``.
    """
    if {"-h", "--help"} & set(tokens):
        fail(flag, text, "asks for help: see python generate_flax.py --help")
    parser = _generate_parser(flag, text)
    given, defaults = parser.parse_args(list(tokens)), parser.parse_args([])
    taken = [d for d in CONTROLLED if getattr(given, d) != getattr(defaults, d)]
    if taken:
        fail(flag, text, f"sets --{taken[0]}, which the harness sets or cannot compare (use "
                         "its --model_id, --prompts, --seeds and --output_dir)")


def generate_argv(common: tuple[str, ...], setting: Setting | None, model_id: str,
                  prompts_file: str, output_dir: str) -> list[str]:
    """generate_flax.py's argv for one run; the harness's flags last, so they win."""
    return [*common, *(setting.flags if setting else ()), "--model_id", model_id,
            "--prompts_file", prompts_file, "--output_dir", output_dir, "--save_frames"]


def write_prompts_file(videos: list[Video], path: str) -> None:
    """generate_flax.py's ``--prompts_file``: JSON Lines, one video per line."""
    with open(path, "w", encoding="utf-8") as f:
        for v in videos:
            f.write(json.dumps(dict(prompt=v.prompt, seed=v.seed, name=v.name)) + "\n")


def check_runs(args, common: tuple[str, ...], settings: list[Setting],
               videos: list[Video]) -> None:
    """Every run's argv through generate_flax.py's ``validate_args`` (no model loads) in a
    scratch folder; each setting must make videos of the exact run's size.

    Raises:
        UsageError: one line naming ``--flags`` or the ``--setting``, the value and the rule.
    """
    check_flags(common, "--flags", args.flags)
    with tempfile.TemporaryDirectory(prefix="quality-check-") as scratch:
        prompts_file = os.path.join(scratch, "prompts.jsonl")
        write_prompts_file(videos, prompts_file)
        exact = None  # (frames, height, width) of the exact run's videos
        for setting in [None, *settings]:
            flag, text = ("--setting", setting.text) if setting else ("--flags", args.flags)
            if setting:
                check_flags(setting.flags, flag, text)
            parsed = _generate_parser(flag, text).parse_args(
                generate_argv(common, setting, args.model_id, prompts_file, scratch))
            try:
                config = generate_flax.validate_args(parsed)
            except UsageError as e:
                raise UsageError(f"{flag}={text!r}: generate_flax.py: {e}") from None
            shape = (config.video.frames, config.video.height, config.video.width)
            exact = exact or shape
            if shape != exact:
                fail(flag, text, f"makes {'x'.join(map(str, shape))} videos (frames x height x "
                                 f"width), the exact run {'x'.join(map(str, exact))}: PSNR "
                                 "compares equal sizes")


def plan(args) -> tuple[tuple[str, ...], list[Setting], list[Video]]:
    """The checked inputs: common flags, settings and videos, before any run.

    Raises:
        UsageError: one line naming the flag, the value and the rule.
    """
    if looks_local(args.model_id) and not os.path.isdir(args.model_id):
        fail("--model_id", args.model_id, "no such folder (a diffusers-format checkpoint "
                                          "folder, or a Hub id org/name)")
    _metrics()  # before any run: a missing install must not cost the generations
    prompts = read_prompts(args.prompts)
    seeds = video_files.parse_seeds(args.seeds)
    settings = [parse_setting(text) for text in args.setting]
    names = [s.name for s in settings]
    for name in names:
        if names.count(name) > 1:
            fail("--setting", name, "names two settings (each NAME once)")
    common = tuple(_split("--flags", args.flags, args.flags))
    videos = [Video(p, s, f"p{i}_s{s}") for i, p in enumerate(prompts) for s in seeds]
    check_runs(args, common, settings, videos)
    return common, settings, videos


def run_generate(argv: list[str], folder: str, name: str) -> dict:
    """``generate_flax.py argv`` in a subprocess, its output in ``folder/generate.log``;
    returns {"report": its JSON report, "report_path", "log", "wall_s", "frames": {video
    name: frames path}}.

    Raises:
        GenerationError: it exited non-zero, or wrote no single report.
    """
    log = os.path.join(folder, "generate.log")
    cmd = [sys.executable, GENERATE, *argv]
    print(f"quality.py: {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if code != 0:
        with open(log, errors="replace") as f:
            sys.stderr.write("".join(f.readlines()[-20:]))
        raise GenerationError(f"setting {name!r}: generate_flax.py exited {code}; log {log}")
    reports = [p for p in os.listdir(folder) if p.endswith(".json")]
    if len(reports) != 1:
        raise GenerationError(f"setting {name!r}: expected one JSON report in {folder}, found "
                              f"{len(reports)}")
    report_path = os.path.join(folder, reports[0])
    with open(report_path) as f:
        report = json.load(f)
    frames = {v["name"]: os.path.join(folder, p) for v in report["videos"] for p in v["files"]
              if p.endswith(".frames.safetensors")}
    return dict(report=report, report_path=report_path, log=log, wall_s=wall, frames=frames)


def _metrics():
    """``(skimage.metrics, skimage.color)``, imported here so that --help works without
    scikit-image (requirements.txt pins it); ``plan`` asks for them before any run.

    Raises:
        UsageError: scikit-image is not installed (one line, exit 2).
    """
    try:
        from skimage import color, metrics
    except ImportError:
        raise UsageError("scikit-image is not installed (PSNR and SSIM come from it): pip "
                         "install -r requirements.txt, which pins it") from None
    return metrics, color


def frame_ssim(exact: np.ndarray, other: np.ndarray) -> float:
    """SSIM of two (H, W, 3) RGB frames in [0, 1] (any float dtype), as ``SSIM_VARIANT``
    says: Wang et al. 2004's on BT.601 luma, computed in float64.

    scikit-image crops (11 - 1) // 2 = 5 pixels from each side of the SSIM map before its
    mean, so the mean is over the window positions wholly inside the frame.

    Raises:
        GenerationError: a side shorter than the 11-pixel window (no family makes one).
    """
    if min(exact.shape[:2]) < SSIM_WINDOW:
        raise GenerationError(f"frames of {exact.shape[0]}x{exact.shape[1]} pixels are smaller "
                              f"than SSIM's {SSIM_WINDOW}x{SSIM_WINDOW} window")
    metrics, color = _metrics()
    # rgb2yuv's Y row is BT.601's (0.299, 0.587, 0.114); float64 in, float64 out.
    y_exact, y_other = (color.rgb2yuv(np.asarray(f, np.float64))[..., 0]
                        for f in (exact, other))
    return float(metrics.structural_similarity(
        y_exact, y_other, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
        data_range=1.0))


def video_metrics(exact: np.ndarray, other: np.ndarray) -> dict:
    """PSNR and SSIM of ``other`` against ``exact``, both (F, H, W, 3) float32 in [0, 1]:
    per frame, averaged over the frames (``METRIC``; SSIM by ``frame_ssim``).

    Returns:
        {"psnr_db", "ssim", "identical_frames", "frames", "psnr_db_frames", "ssim_frames"}.
    Raises:
        GenerationError: the shapes differ, or the frames are smaller than SSIM's window.
    """
    if exact.shape != other.shape:
        raise GenerationError(f"frame shapes differ: exact {exact.shape}, other {other.shape}")
    metrics, _ = _metrics()
    psnr, ssim = [], []
    for a, b in zip(exact, other, strict=True):
        with np.errstate(divide="ignore"):  # an equal frame: 10 log10(1 / 0) = inf, as meant
            psnr.append(float(metrics.peak_signal_noise_ratio(a, b, data_range=1.0)))
        ssim.append(frame_ssim(a, b))
    return dict(psnr_db=mean_finite(psnr), ssim=float(np.mean(ssim)),
                identical_frames=sum(math.isinf(p) for p in psnr), frames=len(psnr),
                psnr_db_frames=psnr, ssim_frames=ssim)


def mean_finite(values: list[float]) -> float:
    """The mean of the finite values; inf when there is none (every one identical)."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.inf


def compare(runs: dict, videos: list[Video]) -> list[dict]:
    """One row per (approximate setting, video): its metrics against the exact video and
    both runs' times for it."""
    rows = []
    for v in videos:
        exact = load_file(runs[EXACT]["frames"][v.name])["frames"]
        exact_run = _video_entry(runs[EXACT], v.name)["runs"][-1]
        for name, run in runs.items():
            if name == EXACT:
                continue
            timed = _video_entry(run, v.name)["runs"][-1]
            rows.append(dict(setting=name, prompt=v.prompt, seed=v.seed, video=v.name,
                             **video_metrics(exact, load_file(run["frames"][v.name])["frames"]),
                             denoise_s=timed["denoise_s"], s_per_step=timed["s_per_step"],
                             exact_denoise_s=exact_run["denoise_s"]))
    return rows


def _video_entry(run: dict, name: str) -> dict:
    return next(v for v in run["report"]["videos"] if v["name"] == name)


def summarize(runs: dict, settings: list[Setting], rows: list[dict]) -> dict:
    """Per run: its flags, files and times; per approximate setting also mean and min PSNR
    and SSIM over its videos and the speed-up of its steady-state step over the exact one."""
    exact_step = runs[EXACT]["report"]["timings"].get("steady_s_per_step")
    flags = {EXACT: [], **{s.name: list(s.flags) for s in settings}}
    out = {}
    for name, run in runs.items():
        t = run["report"]["timings"]
        step = t.get("steady_s_per_step")
        cached = (run["report"].get("cache") or {}).get("cached_steps")
        entry = dict(flags=flags[name], report=run["report_path"], log=run["log"],
                     process_wall_s=run["wall_s"], steady_s_per_step=step,
                     steps=run["report"]["settings"].get("num_inference_steps"),
                     cached_steps=len(cached) if isinstance(cached, list) else None,
                     steady_mean_s=t.get("steady_mean_s"), cold_start_s=t.get("cold_start_s"),
                     speedup_vs_exact=exact_step / step if exact_step and step else None)
        mine = [r for r in rows if r["setting"] == name]
        if mine:
            psnr, ssim = [r["psnr_db"] for r in mine], [r["ssim"] for r in mine]
            entry.update(videos=len(mine), psnr_db_mean=mean_finite(psnr),
                         psnr_db_min=float(min(psnr)), ssim_mean=float(np.mean(ssim)),
                         ssim_min=float(min(ssim)))
        out[name] = entry
    return out


def _fmt(x, spec: str = ".2f") -> str:
    if x is None:
        return "–"
    return "inf" if isinstance(x, float) and math.isinf(x) else format(x, spec)


def tables(rows: list[dict], summary: dict) -> str:
    """The markdown tables: one row per approximate video, then one per run."""
    lines = ["| setting | prompt | seed | PSNR dB | SSIM (Wang 2004, Y) | identical frames | "
             "denoise s (exact) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        prompt = r["prompt"] if len(r["prompt"]) <= 40 else r["prompt"][:39] + "…"
        lines.append(f"| {r['setting']} | {prompt} | {r['seed']} | {_fmt(r['psnr_db'])} "
                     f"| {_fmt(r['ssim'], '.4f')} | {r['identical_frames']} of {r['frames']} "
                     f"| {_fmt(r['denoise_s'], '.3f')} ({_fmt(r['exact_denoise_s'], '.3f')}) |")
    lines += ["", "| setting | flags | videos | PSNR dB mean / min | SSIM (Wang 2004, Y) "
                  "mean / min | steps cached | steady s/step | speed-up | cold start s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        metrics = ("– | – | –" if name == EXACT else
                   f"{s['videos']} | {_fmt(s['psnr_db_mean'])} / {_fmt(s['psnr_db_min'])} | "
                   f"{_fmt(s['ssim_mean'], '.4f')} / {_fmt(s['ssim_min'], '.4f')}")
        flags = (f"`{shlex.join(s['flags'])}`" if s["flags"] else
                 "(reference: --flags only)" if name == EXACT else "(none: the exact run again)")
        cached = "–" if s["cached_steps"] is None else f"{s['cached_steps']} of {s['steps']}"
        lines.append(f"| {name} | {flags} | {metrics} | {cached} | "
                     f"{_fmt(s['steady_s_per_step'], '.4f')} | "
                     f"{_fmt(s['speedup_vs_exact'], '.2f')}× | {_fmt(s['cold_start_s'], '.1f')} |")
    return "\n".join(lines)


def jsonable(value):
    """``value`` with every infinite float as the string "inf" (JSON has no infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def new_run_folder(output_dir: str) -> str:
    """A new ``<output_dir>/<YYYYMMDD_HHMMSS>[_N]`` folder."""
    stem = os.path.join(output_dir, time.strftime("%Y%m%d_%H%M%S"))
    for n in range(1000):
        path = stem if n == 0 else f"{stem}_{n}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise GenerationError(f"no free run folder under {output_dir}")


def run_all(args, common, settings, videos) -> dict:
    """Every run (the exact one first) and the comparison; writes ``quality.json`` and
    returns its content."""
    folder = new_run_folder(args.output_dir)
    prompts_file = os.path.join(folder, "prompts.jsonl")
    write_prompts_file(videos, prompts_file)
    runs = {}
    for setting in [None, *settings]:
        name = setting.name if setting else EXACT
        out = os.path.join(folder, name)
        os.makedirs(out)
        runs[name] = run_generate(generate_argv(common, setting, args.model_id, prompts_file,
                                                out), out, name)
    rows = compare(runs, videos)
    exact = runs[EXACT]["report"]
    result = dict(note=NOTE, metric=METRIC, ssim_variant=SSIM_VARIANT, model_id=args.model_id,
                  flags=list(common),
                  devices=exact.get("devices"), weights=exact.get("weights"),
                  versions=exact.get("versions"), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                  settings=summarize(runs, settings, rows), videos=rows,
                  json=os.path.join(folder, "quality.json"))
    save_report(jsonable(result), result["json"])
    return result


def main(argv=None) -> int:
    prefix = "quality.py: error: "
    try:
        args = parse_args(argv)
        common, settings, videos = plan(args)
    except UsageError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return 2
    try:
        result = run_all(args, common, settings, videos)
    except GenerationError as e:
        print(f"{prefix}{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the running generate_flax.py got the same Ctrl-C
        print("quality.py: interrupted; the finished runs' files are kept, no quality.json",
              file=sys.stderr)
        return 130
    d, w = result["devices"] or {}, result["weights"] or {}
    print(f"{NOTE}\n\n{args.model_id}: {len(videos)} videos, {d.get('count')} x {d.get('kind')} "
          f"({d.get('platform')}), weights {w.get('param_bytes', 0) / 1e6:,.3f} MB; "
          f"{METRIC}.\n")
    print(tables(result["videos"], result["settings"]))
    print(f"\nwrote {result['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
