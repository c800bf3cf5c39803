"""``--estimate``'s whole video: what a user waits for, warm, part by part.

``whole_video_seconds`` = text encode + denoising + decode + post-processing and mp4, each
part {seconds, kind} with kind one of ``KINDS``:

* text encode (``price_text``), both placements priced, the total taking the run's
  ``--text_encoder_device`` (default cpu: the design card keeps prompt embeddings on the
  CPU): on the host, FLOPs / this host's measured bf16 matmul rate ("host measurement",
  ``text_encode_host``); on the mesh, a compiled estimate of the encoder programs
  ("compiled estimate", ``text_encode_mesh``); ``whole_video_seconds_host_encoders`` and
  ``whole_video_seconds_mesh_encoders`` give the total either way. Warm: the negative prompt
  is in the per-text embedding cache;
* denoising: the step estimate x the run's schedule: dense and sparse steps (the sparse
  plan's average), full and cached steps (the step cache's schedule), a two-expert model's
  one swap per video at its estimated ICI time, and the SR stage's steps
  ("compiled estimate");
* decode: every compiled decode program priced op by op (``price_decode``; "compiled
  estimate", or "floor" where the compiled HLO cannot be read back);
* post-processing and mp4: the run's frame count at its size, from synthetic frames, written
  by the run's writer function on this host (``price_host``; "host measurement").

Where a part cannot be priced (``--dry_run_skip_vae``: no decode compiled; a checkpoint
without its encoders' configs), ``whole_video_seconds`` is None and ``whole_video_missing``
says which and why. Every figure is an estimate or a measurement on THIS host, labelled so.
"""

from __future__ import annotations

from engine.dry_run import price_decode, price_host, price_text
from engine.programs import step_cache

KINDS = ("compiled estimate", "floor", "host measurement")


def denoise_part(config, est: dict, report: dict) -> dict:
    """The denoising part (ESTIMATE) from the step estimate ``est`` and the dry run's
    ``report`` (its ``expert_parking`` and ``upscale`` entries)."""
    n = config.video.num_inference_steps
    cache = est.get("cache")
    if cache is None and config.step_cache is not None and config.step_cache.on:
        cache = step_cache.estimate_schedule(est["seconds_per_step"], config.step_cache, n,
                                             est["layers"])
    if cache is not None:
        seconds, schedule = cache["denoise_s"], f"step cache: {cache['kind']}"
    elif "average_seconds_per_step" in est:
        seconds = n * est["average_seconds_per_step"]
        schedule = f"sparse plan: {est['sparse_plan']}"
    else:
        seconds, schedule = n * est["seconds_per_step"], f"{n} dense steps"
    out = dict(steps=n, schedule=schedule, steps_s=seconds)
    swap = report.get("expert_parking") or {}
    if swap.get("parked") and swap.get("gather_s_estimate") is not None:
        out["expert_swap_s"] = swap["gather_s_estimate"]
        seconds += swap["gather_s_estimate"]
    up = report.get("upscale") or {}
    if "denoise_s" in up:
        out["sr_stage_s"] = up["denoise_s"]["sr_stage"]
        seconds += out["sr_stage_s"]
    return dict(out, seconds=seconds, kind="compiled estimate")


def price(config, family, report: dict, decoder, mesh, chip: str, *,
          rate_seconds: float = 1.0) -> dict:
    """The whole video's fields for the report's ``estimate`` (see the module docstring).

    Args:
        report: the dry run's report so far, with its ``estimate`` (the step) and per-chip
            rows (the decode's row says whether the decode compiled).
        decoder: the dry run's decoder (``program_calls()`` after its compile).
        rate_seconds: how long the host's matmul rate is measured per encoder shape.

    Returns:
        dict(whole_video_seconds, text_encoder_device, whole_video_seconds_mesh_encoders,
        whole_video_seconds_host_encoders, whole_video_parts
        {text_encode, denoise, decode, postprocess_and_mp4}, text_encode_mesh,
        text_encode_host, text_encoders, whole_video_missing).
    """
    parts, missing = {}, []
    text = price_text.price_text(config, family, mesh, chip, rate_seconds=rate_seconds)
    if text["missing"]:
        missing.append(f"text_encode: no config.json for {', '.join(text['missing'])} in "
                       f"{config.model.model_id}")
    # The run's placement where the flag exists (``--text_encoder_device``), else the host.
    placement = getattr(config.run, "text_encoder_device", "cpu")
    parts["text_encode"] = text["mesh" if placement == "mesh" else "host"]
    parts["denoise"] = denoise_part(config, report["estimate"], report)
    row = next((r for r in report["per_chip"] if r["program"].startswith("VAE decode")), None)
    if row is None or row.get("error") or not hasattr(decoder, "program_calls"):
        missing.append("decode: not compiled" + (" (--dry_run_skip_vae)"
                                                 if config.dry.dry_run_skip_vae else ""))
    else:
        parts["decode"] = price_decode.decode_estimate(decoder.program_calls(), chip)
    height, width = ((config.upscale.height, config.upscale.width) if config.upscale else
                     (config.video.height, config.video.width))
    parts["postprocess_and_mp4"] = price_host.write_seconds(
        config.video.frames, height, width, config.video.fps,
        getattr(decoder, "sample_rate", None))
    whole = None if missing else sum(p["seconds"] for p in parts.values())
    other = {k: None if whole is None else
             whole - parts["text_encode"]["seconds"] + text[k]["seconds"]
             for k in ("mesh", "host")}
    return dict(whole_video_seconds=whole, text_encoder_device=placement,
                whole_video_seconds_mesh_encoders=other["mesh"],
                whole_video_seconds_host_encoders=other["host"],
                whole_video_parts=parts, whole_video_missing=missing,
                text_encode_mesh=text["mesh"], text_encode_host=text["host"],
                text_encoders=text["encoders"])


def print_whole_video(est: dict) -> None:
    """The whole video's lines under the step estimate."""
    parts = est.get("whole_video_parts")
    if parts is None:
        return
    print("\n== Whole video, warm (ESTIMATES and measurements on this host, labelled) ==")
    for name, p in parts.items():
        print(f"{name:<26}{p['seconds']:8.3f} s   ({p['kind']})")
    mesh, host = est["text_encode_mesh"], est["text_encode_host"]
    print(f"{'text encode, mesh / host':<26}{mesh['seconds']:8.3f} / {host['seconds']:.3f} s   "
          f"(the negative prompt, first video only: {mesh['first_video_extra_s']:.3f} / "
          f"{host['first_video_extra_s']:.3f} s)")
    if est["whole_video_seconds"] is None:
        print("whole video: not priced: " + "; ".join(est["whole_video_missing"]))
        return
    print(f"{'whole video':<26}{est['whole_video_seconds']:8.3f} s   (encoders: "
          f"{est['text_encoder_device']}; mesh {est['whole_video_seconds_mesh_encoders']:.3f} "
          f"s, host CPU {est['whole_video_seconds_host_encoders']:.3f} s)")
