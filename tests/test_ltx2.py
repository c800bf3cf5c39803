"""The LTX-2 family (families/ltx2.py) against diffusers' own eager ``LTX2Pipeline`` on CPU.

Float32 on the tiny random checkpoint (tools/make_tiny_ltx2_checkpoint.py; our weights are
random): 64 x 64 pixels, 9 frames (2 x 2 x 2 video tokens, 9 audio tokens), 2 steps, the same
prompt, negative prompt and seed on both sides; diffusers encodes the prompts with the same
tiny Gemma and connectors. Frames (F, H, W, 3) in [0, 1] and the stereo 24 kHz waveform are
compared. Guidance off (one pass), CFG only (one batch-2 pass) and the pipeline's defaults (CFG
+ STG + modality isolation: three passes in one step program). The defaults also run through
the command line on all 8 CPU devices (the default layout), which writes the mp4 with its AAC
track and the frames file with the waveform.
"""

import json
import os

import imageio_ffmpeg
import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_audio_mp4 import decoded_audio, streams

import generate_flax
from engine.pipeline import Generation
from engine.run.errors import UsageError
from families import FAMILIES, ltx2

PROMPT = "A cat walks on the grass"
NEGATIVE = "blurry"
SHAPE = dict(height=64, width=64, frames=9)
STEPS = 2
SEED = 3
OFF = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=1.0,
           audio_stg_scale=0.0, audio_modality_scale=1.0)
CFG = dict(guidance_scale=3.0, stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=7.0,
           audio_stg_scale=0.0, audio_modality_scale=1.0)
CASES = {"off": OFF, "cfg": CFG, "defaults": {}}
# Measured max |ours - diffusers| on this 2-core CPU host, over the three cases: final video
# latents 1.9e-6, audio latents 5.0e-6, frames 5.2e-6, waveform 1.0e-7.
ATOL = 2e-5


def _argv(checkpoint, scales: dict, *extra):
    flags = [f"--{k}={v}" for k, v in scales.items()]
    return ["--model_id", checkpoint, "--prompt", PROMPT, "--negative_prompt", NEGATIVE,
            "--dtype", "float32", "--seed", str(SEED), "--num_inference_steps", str(STEPS),
            "--warmup_steps", "0", "--height", str(SHAPE["height"]), "--width",
            str(SHAPE["width"]), "--frames", str(SHAPE["frames"]),
            "--compilation_cache_dir", "none", "--executable_cache_dir", "none", *flags, *extra]



def diffusers_run(pipe, scales: dict):
    """(frames, waveform, video latents, audio latents) of diffusers' eager ``pipe`` on this
    file's prompt, shape, steps and seed with the guidance ``scales``: two calls, one per
    ``output_type`` (``np`` and ``latent``), from the same generator seed."""
    runs = []
    for output_type in ("np", "latent"):
        with torch.no_grad():
            runs.append(pipe(
                prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=SHAPE["frames"],
                height=SHAPE["height"], width=SHAPE["width"], frame_rate=24.0,
                num_inference_steps=STEPS, output_type=output_type, return_dict=False,
                generator=torch.Generator("cpu").manual_seed(SEED), **scales))
    (video, audio), (video_latents, audio_latents) = runs
    return video[0], audio[0].float().numpy(), video_latents.numpy(), audio_latents.numpy()

class _Reference(dict):
    """diffusers' LTX2Pipeline.__call__, eager PyTorch float32, run when a case is first
    asked for: {case: (frames, waveform, final video latents (1, C, F', h, w), final audio
    latents (1, C, L, mel))}."""

    def __init__(self, checkpoint):
        from diffusers import LTX2Pipeline

        super().__init__()
        self.pipe = LTX2Pipeline.from_pretrained(checkpoint, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        # The tiny VAEs' statistics are 0 and 1, so the latents diffusers returns
        # (de-normalised, P:1619-1634) are the packed ones our decoder receives, unpacked.
        for vae in (self.pipe.vae, self.pipe.audio_vae):
            assert not vae.latents_mean.any() and (vae.latents_std == 1).all()

    def __missing__(self, case):
        self[case] = diffusers_run(self.pipe, CASES[case])
        return self[case]


@pytest.fixture(scope="module")
def reference(ltx2_checkpoint):
    return _Reference(ltx2_checkpoint)


def _unpacked(latents):
    """Our packed (1, size) final latents -> (video (1, 8, 2, 2, 2), audio (1, 2, 9, 16)) as
    the pipeline unpacks them (P:1611-1626)."""
    from diffusers import LTX2Pipeline

    latents = torch.from_numpy(np.array(latents))  # a writable copy
    n = 8 * 8  # 8 video tokens x 8 channels
    video = LTX2Pipeline._unpack_latents(latents[:, :n].reshape(1, 8, 8), 2, 2, 2, 1, 1)
    audio = LTX2Pipeline._unpack_audio_latents(latents[:, n:].reshape(1, 9, 32), 9,
                                               num_mel_bins=16)
    return video.numpy(), audio.numpy()


class _Recorder:
    """Stands in for the run's decoder and keeps the final latents it is given."""

    def __init__(self, decoder):
        self.decoder, self.latents = decoder, None

    def __getattr__(self, name):
        return getattr(self.__dict__["decoder"], name)

    def __call__(self, latents):
        self.latents = np.asarray(jax.device_get(latents))
        return self.decoder(latents)


_OURS: dict = {}


def run_recorded(config, devices):
    """(the finished-loading ``Generation``, its frames, the ``_Recorder`` of its decode's
    latents): one video of ``config`` on ``devices``."""
    run = Generation(config, FAMILIES[config.model.family], devices)
    run.load()
    run.encode()
    run.compile()
    recorder = _Recorder(run.programs.vae_decode.decoder)
    run.programs.vae_decode.decoder = recorder
    return run, run.time_videos(), recorder


def _ours(checkpoint, case):
    """Our run on one device (XLA attention): (frames, waveform, sample rate, report,
    (final video latents, final audio latents))."""
    if case not in _OURS:
        config = generate_flax.validate_args(generate_flax.parse_args(
            _argv(checkpoint, CASES[case], "--attention", "xla")))
        run, frames, recorder = run_recorded(config, jax.devices()[:1])
        audio = run.programs.vae_decode.audio
        _OURS[case] = (frames, audio.waveform, audio.sample_rate, run.finish(),
                       _unpacked(recorder.latents))
    return _OURS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_frames_and_waveform_match_diffusers(ltx2_checkpoint, reference, case):
    """Final latents of both modalities, frames and waveform (bound: ATOL)."""
    frames, wave, rate, report, (video_latents, audio_latents) = _ours(ltx2_checkpoint, case)
    want_frames, want_wave, want_video_latents, want_audio_latents = reference[case]
    np.testing.assert_allclose(video_latents, want_video_latents, atol=ATOL)
    np.testing.assert_allclose(audio_latents, want_audio_latents, atol=ATOL)
    assert frames.shape == want_frames.shape == (SHAPE["frames"], SHAPE["height"],
                                                 SHAPE["width"], 3)
    assert wave.shape == want_wave.shape == (2, (4 * 9 - 3) * 240) and rate == 24000
    np.testing.assert_allclose(frames, want_frames, atol=ATOL)
    np.testing.assert_allclose(wave, want_wave, atol=ATOL)
    assert report["settings"]["options"]["stg_scale"] == CASES[case].get("stg_scale", 1.0)


def test_guidance_changes_the_output(reference):
    """The passes matter: guidance gives other frames and other latents of both
    modalities, beyond 10 x ATOL (the parity is not vacuous; measured too: CFG alone ->
    the defaults moves the video latents by 7e-4 only, LTX-2.0's STG pass equals the plain
    one, docs/models.md). The tiny
    random vocoder barely follows its input (its waveforms differ by ~6e-6 between cases whose
    audio latents differ by > 1): the audio is compared at the latents, and the waveform
    shows the decode end to end."""
    for a, b in (("off", "defaults"),):
        for i in (0, 2, 3):  # frames, video latents, audio latents
            assert np.abs(reference[a][i] - reference[b][i]).max() > 10 * ATOL


@pytest.fixture(scope="module")
def cli_run(ltx2_checkpoint, tmp_path_factory):
    """The command line at the defaults on all 8 CPU devices (default layout, our Splash
    kernel in interpret mode), with --save_frames: (output dir, report)."""
    out = tmp_path_factory.mktemp("ltx2-out")
    assert generate_flax.main(_argv(ltx2_checkpoint, {}, "--output_dir", str(out),
                                    "--save_frames", "--no_plots", "--attention",
                                    "splash")) == 0
    (report,) = [f for f in os.listdir(out) if f.endswith(".json")]
    with open(out / report) as f:
        return out, json.load(f)


def test_sharded_cli_run_equals_diffusers_and_one_device(ltx2_checkpoint, reference, cli_run):
    out, report = cli_run
    # The default layout: dp1 (STG and modality passes are batch 1: ltx2.layout_batch).
    assert report["mesh"] == {"dp": 1, "tp": 2, "sp": 4} and report["audio_sample_rate"] == 24000
    (name,) = [f for f in os.listdir(out) if f.endswith(".frames.safetensors")]
    saved = load_file(str(out / name))
    want_frames, want_wave = reference["defaults"][:2]
    np.testing.assert_allclose(saved["frames"], want_frames, atol=ATOL)
    np.testing.assert_allclose(saved["audio"], want_wave, atol=ATOL)
    frames, wave = _ours(ltx2_checkpoint, "defaults")[:2]
    np.testing.assert_allclose(saved["frames"], frames, atol=2e-5)
    np.testing.assert_allclose(saved["audio"], wave, atol=2e-5)


def test_mp4_has_one_video_and_one_audio_stream(cli_run):
    """ffmpeg (imageio-ffmpeg's binary, ``test_audio_mp4``'s helpers) lists one H.264 video
    stream and one AAC stream at 24 kHz, stereo; the video has the 9 frames, and the decoded
    track holds at least the waveform's 7,920 samples (AAC pads its last 1,024-sample frame)
    and is not silent."""
    out, report = cli_run
    path = str(out / report["video"])
    lines = streams(path)
    assert len(lines) == 2, lines
    assert "Video: h264" in lines[0] and "Audio: aac" in lines[1] and "24000 Hz" in lines[1]
    assert "stereo" in lines[1]
    assert imageio_ffmpeg.count_frames_and_secs(path)[0] == SHAPE["frames"]
    track = decoded_audio(path, 2)
    assert 7920 <= track.shape[1] <= 7920 + 2 * 1024 and np.abs(track).max() > 0.05
    assert abs(report["audio_seconds"] - 7920 / 24000) < 1e-9


@pytest.mark.parametrize("argv,needle", [
    (["--flow_shift", "3"], "--flow_shift=3.0: LTX-2's scheduler shifts"),
    (["--cache", "deepcache"], "--cache='deepcache': the step caches"),
    (["--scan_layers"], "--scan_layers=True: LTX-2's blocks run unrolled"),
    (["--stage", "denoise"], "--stage='denoise': staged runs"),
    (["--fps", "25"], "--fps=25: is fixed at 24"),
    (["--overlap_compile", "on"], "--overlap_compile='on': LTX-2 compiles after the load"),
    (["--guidance_scale_2", "3"], "--guidance_scale_2=3.0"),
])
def test_ltx2_refuses_what_it_does_not_run(ltx2_checkpoint, argv, needle):
    with pytest.raises(UsageError) as e:
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", ltx2_checkpoint, *argv]))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_other_families_refuse_ltx2_flags(tiny_checkpoint):
    with pytest.raises(UsageError) as e:
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", tiny_checkpoint, "--stg_scale", "2"]))
    assert str(e.value) == ("--stg_scale=2.0: is a LTX-2 flag; --model_id is a Wan "
                            "checkpoint")


def test_defaults_and_passes(ltx2_checkpoint):
    """diffusers' defaults (P:935-953); the audio scale of 0 falls back to the video one."""
    config = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", ltx2_checkpoint, "--audio_stg_scale", "0", "--stg_scale", "2"]))
    v = config.video
    assert (v.height, v.width, v.frames, v.fps, v.num_inference_steps, v.guidance_scale) == (
        512, 768, 121, 24, 30, 3.0)
    assert not config.layout.scan_layers and v.use_cfg
    assert config.run.overlap_compile == "off"  # auto, decided by the family
    assert ltx2.scales(config)["audio_stg_scale"] == 2.0
    # CFG pair + modality: the STG pass is skipped, perturbed_attn false makes it the plain
    # pass (tests/test_ltx2_recipes.py compares with diffusers' run of it).
    assert ltx2.sample_passes(config) == 3 and not ltx2.passes(config)["stg"]
    off = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", ltx2_checkpoint, *[f"--{k}={x}" for k, x in OFF.items()]]))
    assert ltx2.sample_passes(off) == 1 and not off.video.use_cfg


def test_schedule_equals_the_pipelines(ltx2_checkpoint):
    """The static shift exp(mu) gives the dynamic (exponential) shift's timesteps and sigmas."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import retrieve_timesteps

    config = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", ltx2_checkpoint, "--num_inference_steps", "30"]))
    cfg = FlowMatchEulerDiscreteScheduler.load_config(ltx2_checkpoint, subfolder="scheduler")
    theirs = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    mu = ltx2.shift_mu(cfg, 6144)  # 768 x 512 x 121: 16 x 16 x 24 video tokens
    retrieve_timesteps(theirs, 30, "cpu", sigmas=ltx2.scheduler_sigmas(30), mu=mu)
    table = ltx2.sigma_table(config)[0]
    np.testing.assert_allclose(table[1].numpy(), theirs.sigmas[:-1].numpy(), rtol=1e-6)
    np.testing.assert_allclose(table[0].numpy(), theirs.timesteps.numpy(), rtol=1e-6)


def test_sequence_parallel_pads_the_video_tokens(ltx2_checkpoint, tmp_path):
    """96 x 64 pixels: 12 video tokens over sp=8, padded to 16 between blocks (the video RoPE
    tables by keyword, the audio-to-video attention's padded keys masked); frames and
    waveform equal the one-device run (measured max |diff| 1.5e-6 frames, 6e-8 waveform)."""
    saved = []
    for layout, attention in ((["--dp", "1", "--tp", "1", "--sp", "8"], "splash"),
                              ([], "xla")):
        out = tmp_path / attention
        argv = _argv(ltx2_checkpoint, OFF, "--height", "96", "--output_dir", str(out),
                     "--save_frames", "--no_plots", "--attention", attention, *layout)
        if not layout:  # one device
            config = generate_flax.validate_args(generate_flax.parse_args(argv))
            run = Generation(config, FAMILIES[config.model.family], jax.devices()[:1])
            run.load()
            run.encode()
            run.compile()
            frames = run.time_videos()
            saved.append((frames, run.programs.vae_decode.audio.waveform))
            continue
        assert generate_flax.main(argv) == 0
        (name,) = [f for f in os.listdir(out) if f.endswith(".frames.safetensors")]
        files = load_file(str(out / name))
        with open(out / name.replace(".frames.safetensors", ".json")) as f:
            assert json.load(f)["mesh"] == {"dp": 1, "tp": 1, "sp": 8}
        saved.append((files["frames"], files["audio"]))
    (frames, wave), (want_frames, want_wave) = saved
    assert frames.shape == want_frames.shape == (9, 96, 64, 3)
    np.testing.assert_allclose(frames, want_frames, atol=2e-5)
    np.testing.assert_allclose(wave, want_wave, atol=2e-5)
