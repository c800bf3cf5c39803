"""Pictures of a run, from its JSON report, with matplotlib (Agg, no display).

- ``timeline``: every timed phase of a run on one time axis: text encode, placement, each
  compile, the warmup, each denoising step (cached steps in their own colour) and each VAE
  decode; one row for the cold start and one per timed run (per video with --prompts_file);
  above them, the time to first video from the process start, phase by phase
  (``engine.files.report.time_to_first_video``), on its own clock.
  The phases are laid end to end in the order the run does them; untimed work between them
  (loading the pipeline, placing the model inputs) is not drawn. A video with sound (the
  report's ``audio_sample_rate``: LTX-2) names its audio phases: the decode is one program
  of the video VAE, the audio VAE and the vocoder ("video + audio decode", its compile and
  warmup alike), and the write muxes the AAC track ("write mp4 + AAC"); their audio parts
  are not timed apart (one compiled program; one ffmpeg process). The title gives the
  track's rate, channels and length.
- ``dry_run_hbm``: per-chip HBM bars for each program of a dry run (arguments, outputs,
  temporaries, kept) against the chip's capacity, and with ``--estimate`` a bar of the
  estimated step time's breakdown.

A plotting failure is a warning, never a failed run (``engine.files.report.save_run``).
"""

from __future__ import annotations

COLD_PHASES = (("text encode", "text_encode_s"), ("place transformer", "place_transformer_s"),
               ("compile step", "compile_transformer_s"),
               ("compile cached step", "compile_transformer_cached_s"),
               ("place VAE", "place_vae_s"), ("compile VAE decode", "compile_vae_s"),
               ("warmup denoise", "warmup_denoise_s"), ("warmup VAE decode",
                                                        "warmup_vae_decode_s"))
COLOURS = {"text encode": "#8c564b", "place transformer": "#7f7f7f", "place VAE": "#bcbd22",
           "compile step": "#d62728", "compile cached step": "#ff9896",
           "compile VAE decode": "#e377c2", "warmup denoise": "#9467bd",
           "warmup VAE decode": "#c5b0d5", "step": "#1f77b4", "cached step": "#aec7e8",
           "VAE decode": "#2ca02c"}


# The time-to-first-video row's phases (keys of the report's split) and their colours.
FIRST_VIDEO_COLOURS = {"imports_s": "#393b79", "checkpoint_check_s": "#5254a3",
                       "prologue_s": "#6b6ecf", "read_s": "#9c9ede", "text_encode_s": "#8c564b",
                       "place_s": "#7f7f7f", "trace_lower_s": "#e7969c",
                       "compile_s": "#d62728", "executable_load_s": "#17becf",
                       "warmup_s": "#9467bd", "denoise_s": "#1f77b4", "decode_s": "#2ca02c",
                       "write_s": "#bcbd22", "other_s": "#dddddd"}
FIRST_VIDEO_ROW = "time to first video"
# The names of the phases that carry the audio of a video with sound (see the docstring);
# each keeps its colour.
AUDIO_PHASES = {"compile VAE decode": "compile video + audio decode",
                "warmup VAE decode": "warmup video + audio decode",
                "VAE decode": "video + audio decode",
                "decode_s": "decode video + audio", "write_s": "write mp4 + AAC"}


def first_video_phases(report: dict) -> list[tuple[str, str, float, float]]:
    """The time-to-first-video row: (row, phase key, start s, seconds), end to end from
    the process start; [] when the report has no split."""
    split, out, clock = report["timings"].get("time_to_first_video") or {}, [], 0.0
    for key in FIRST_VIDEO_COLOURS:
        if split.get(key):
            out.append((FIRST_VIDEO_ROW, key, clock, split[key]))
            clock += split[key]
    return out


def timeline_phases(report: dict) -> list[tuple[str, str, float, float]]:
    """(row, phase, start s, seconds) for every bar of the timeline, from ``report``."""
    t, out, clock = report["timings"], first_video_phases(report), 0.0
    for label, key in COLD_PHASES:
        if key in t:
            out.append(("cold start", label, clock, t[key]))
            clock += t[key]
    runs = [(f"video {v.get('name') or v['index']} run {i + 1}", r)
            for v in report.get("videos", []) for i, r in enumerate(v["runs"])] \
        or [(f"run {i + 1}", r) for i, r in enumerate(t.get("runs", []))]
    for row, run in runs:
        kinds = run.get("step_kinds") or ["full"] * len(run.get("step_seconds", []))
        for kind, seconds in zip(kinds, run.get("step_seconds", []), strict=True):
            out.append((row, "cached step" if kind == "cached" else "step", clock, seconds))
            clock += seconds
        if "vae_decode_s" in run:
            out.append((row, "VAE decode", clock, run["vae_decode_s"]))
            clock += run["vae_decode_s"]
    return out


def _title(report: dict) -> str:
    s, mesh, dev = report["settings"], report.get("mesh", {}), report.get("devices", {})
    model = s["model_id"].rstrip("/").rsplit("/", 1)[-1]
    return (f"{model}  {s['width']}x{s['height']}x{s['frames']}, {s['num_inference_steps']} "
            f"steps  mesh dp{mesh.get('dp')} tp{mesh.get('tp')} sp{mesh.get('sp')}  "
            f"{dev.get('count')} x {dev.get('kind')}")


LEGEND_COLUMNS = 6


def _legend_name(row: str, label: str, audio: bool = False) -> str:
    """A phase's legend entry: the time-to-first-video row's split keys without "_s"; with
    ``audio`` (a video with sound), ``AUDIO_PHASES``' names."""
    if audio and label in AUDIO_PHASES:
        return AUDIO_PHASES[label]
    return label.removesuffix("_s").replace("_", " ") if row == FIRST_VIDEO_ROW else label


def _audio_title(report: dict) -> str:
    """The track of a video with sound, for the title ("" without one)."""
    if "audio_sample_rate" not in report:
        return ""
    return (f"  audio {report['audio_sample_rate']} Hz x {report.get('audio_channels')}, "
            f"{report.get('audio_seconds', 0):.2f} s")


def draw_timeline(report: dict):
    """The timeline figure of ``report`` and its phases: (matplotlib Figure, phases).

    The legend sits below the x-axis label in a band of its own height: matplotlib's
    constrained layout places a figure legend "outside lower center" (an axes legend anchored
    at a fixed fraction of the axes' height overlapped the label on short figures and left a
    blank band below on tall ones). The height: 1.2 in + 0.45 in a row + 0.2 in a legend line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases, audio = timeline_phases(report), "audio_sample_rate" in report
    rows = list(dict.fromkeys(r for r, *_ in phases))
    names = list(dict.fromkeys(_legend_name(row, label, audio) for row, label, *_ in phases))
    legend_lines = -(-len(names) // LEGEND_COLUMNS)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * len(rows) + 0.2 * legend_lines), dpi=100,
                           layout="constrained")
    seen = set()
    for row, label, start, seconds in phases:
        colour = FIRST_VIDEO_COLOURS.get(label) if row == FIRST_VIDEO_ROW else COLOURS[label]
        name = _legend_name(row, label, audio)
        ax.barh(rows.index(row), seconds, left=start, height=0.6, color=colour,
                edgecolor="white", linewidth=0.3, label=None if name in seen else name)
        seen.add(name)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (phases end to end; untimed work between them not drawn)")
    ax.set_title(_title(report) + _audio_title(report), fontsize=9)
    fig.legend(loc="outside lower center", ncol=LEGEND_COLUMNS, fontsize=7, frameon=False)
    return fig, phases


def timeline(report: dict, path: str) -> list[tuple[str, str, float, float]]:
    """Write the timeline PNG of ``report`` to ``path`` (``draw_timeline``); returns the
    phases drawn."""
    import matplotlib.pyplot as plt

    fig, phases = draw_timeline(report)
    fig.savefig(path)
    plt.close(fig)
    return phases


def dry_run_hbm(report: dict, path: str) -> list[str]:
    """Write the dry run's per-chip HBM bars (and the estimate's breakdown) to ``path``;
    returns the programs drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["per_chip"]
    parts = (("argument_bytes", "arguments", "#1f77b4"), ("output_bytes", "outputs", "#ff7f0e"),
             ("temp_bytes", "temporaries", "#d62728"), ("resident_bytes", "kept", "#7f7f7f"))
    est = report.get("estimate")
    fig, axes = plt.subplots(1, 2 if est else 1, figsize=(13 if est else 8, 4.5), dpi=100,
                             squeeze=False)
    ax = axes[0][0]
    names = [r["program"] for r in rows]
    capacity = rows[0]["capacity_bytes"]
    largest = max(sum(r.get(k) or 0 for k, *_ in parts) for r in rows)
    # A small model's bars would vanish against the chip's capacity: MiB, capacity as text.
    unit, scale = ("GiB", 2**30) if largest > 0.02 * capacity else ("MiB", 2**20)
    for i, r in enumerate(rows):
        bottom = 0.0
        for key, label, colour in parts:
            size = (r.get(key) or 0) / scale
            ax.bar(i, size, bottom=bottom, color=colour, label=label if i == 0 else None)
            bottom += size
    if unit == "GiB":
        ax.axhline(capacity / scale, color="black", linestyle="--",
                   label=f"HBM {capacity / scale:.1f} GiB per chip")
    ax.set_xticks(range(len(names)), names, rotation=15, fontsize=7, ha="right")
    ax.set_ylabel(f"{unit} per chip (compiler's figures)")
    ax.set_title(f"dry run {report['topology']}: mesh dp{report['mesh']['dp']} "
                 f"tp{report['mesh']['tp']} sp{report['mesh']['sp']}"
                 + ("" if unit == "GiB" else f"; HBM {capacity / 2**30:.1f} GiB per chip "
                    "(off scale)"), fontsize=9)
    ax.legend(fontsize=7)
    if est:
        ax = axes[0][1]
        bottom = 0.0
        for name, seconds in est["parts"].items():
            ax.bar(0, seconds, bottom=bottom, label=name.replace("_s", "").replace("_", " "))
            bottom += seconds
        ax.set_xticks([0], ["one denoising step"])
        ax.set_ylabel("seconds per step: ESTIMATE, not a measurement")
        ax.set_title(f"estimated {est['seconds_per_step']:.2f} s/step ({est['label']})",
                     fontsize=7, wrap=True)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return names
