"""The upscale stage: a second denoising on a larger latent grid after the first
(super-resolution, ``--sr``), with its own transformer, placed and compiled with the first
stage's programs, before any timed run.

The family (``families.base.Upscale``) says what the stage is: its settings, its transformer,
a small refiner of the first stage's latents (the "upsampler") and the hand-off that turns
the first stage's final latents into the second stage's inputs. Here it is placed and
compiled:

* the second transformer on its own mesh over the same devices, from the resolver run on the
  second stage's config: the stage has its own batch (an SR stage runs guidance 1, batch 1,
  where the first stage may run CFG over dp), so its layout is its own;
* the hand-off as one compiled program (resize, upsampler, noise, condition), its weights
  replicated (small);
* the VAE decode then compiles for the second stage's latents (``stages.prepare_decode``).

The denoising loop runs it (``engine.programs.denoise.Upscale``) after the first stage's
last step, timed apart in the report (``upscale_s``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from engine.files.checkpoint import read_component_config
from engine.pipeline import text_device
from engine.programs import executables, transformer_step
from engine.programs.denoise import Programs, Upscale, set_timesteps, timestep_array
from engine.run import chips
from engine.run.errors import UsageError
from engine.run.mesh import make_mesh
from engine.weights import placement, sharding
from engine.weights.layout import resolve_run_mesh
from engine.weights.sharding import place_module

FLAGS = ("sr_model_dir", "sr_steps", "sr_flow_shift")


def add_flags(parser) -> None:
    """``--sr`` and its stage's flags, in their own help group; and
    ``--text_encoder_device`` in its own (``engine.pipeline.text_device.add_flags``)."""
    g = parser.add_argument_group("super-resolution: a second stage after the first "
                                  "(docs/features.md)")
    g.add_argument("--sr", default="none", choices=("none", "720p", "1080p", "2x"),
                   help="upscale the first stage's video with the family's super-resolution "
                        "stage to this resolution, or run a two-stage family's second stage "
                        "at twice the first's size ('2x': --height/--width give the final "
                        "size, the first stage runs at half; docs/features.md)")
    g.add_argument("--sr_model_dir", default=None, metavar="DIR",
                   help="the SR stage's weights; the family's layout is in docs/features.md "
                        "(default: none, or the family's folder in the checkpoint; needed "
                        "with --sr 720p/1080p)")
    g.add_argument("--sr_steps", type=int, default=None,
                   help="SR denoising steps (default: the SR checkpoint's)")
    g.add_argument("--sr_flow_shift", type=float, default=None,
                   help="the SR schedule's flow shift (default: the SR checkpoint's)")
    # generate_flax.py is at its line cap: the encoders' flag is declared from here.
    text_device.add_flags(parser)


def validate_flags(args, family, values: dict, serve=None):
    """The family's upscale settings for ``RunConfig.upscale``, or None with ``--sr none``;
    before any model loads. ``--overlap_compile auto`` then means off
    (``Generation.start_compile``): the decode compiles for the second stage's latents.
    ``serve``: the server's ``ServeSettings``; each of its sizes is checked with the family's
    ``for_size`` (the first stage's size sets the second's).

    Raises:
        UsageError: an SR flag without ``--sr``; ``--sr`` on a family without the stage or a
            value it lacks; with a staged run or ``--overlap_compile on`` (each runs only the
            first stage's programs today); what the family's ``validate`` and ``for_size``
            raise (a served size the stage cannot take).
    """
    if args.sr == "none":
        given = [f for f in FLAGS if getattr(args, f) is not None]
        if given:
            raise UsageError(f"--{given[0]}={getattr(args, given[0])}: needs --sr")
        return None
    if family.upscale is None or args.sr not in family.upscale.choices:
        raise UsageError(f"--sr={args.sr}: not supported for {family.name} (it has no "
                         "super-resolution stage)")
    for flag, value, ok in (("--stage", args.stage, args.stage == "all"),
                            ("--overlap_compile", args.overlap_compile,
                             args.overlap_compile != "on")):
        if not ok:
            raise UsageError(f"{flag}={value}: not with --sr (the SR stage runs in a whole "
                             "run, compiled after the first stage)")
    settings = family.upscale.validate(args, values)
    for width, height in (serve.sizes if serve is not None else ()):
        try:
            family.upscale.for_size(settings, height, width)
        except UsageError as e:
            raise UsageError(f"--serve_sizes={width}x{height}: not with --sr {args.sr} "
                             f"({e})") from None
    return settings


@dataclasses.dataclass(frozen=True)
class PlacedStage:
    """The upscale stage's weights, placed once for every shape the run compiles (the server's
    buckets): its transformer (``placement`` dict), its upsampler's, the mesh they live on,
    and ``install(kernel, mesh)`` (routes SDPA while a program traces)."""

    placed: dict
    upsampler: dict
    mesh: object
    install: Callable


def prepare_upscale(config, family, pipe, devices, embeds, lr_latents, fallbacks,
                    timings: dict, install):
    """Place and compile the upscale stage; returns (``Upscale``, its placed transformer, an
    example of its final latents for the decode's compile).

    ``devices``: the run's devices; ``install(kernel, mesh)`` routes SDPA to the attention
    backend on a mesh (``stages.install_attention``); ``lr_latents``: the first stage's
    initial latents (their shape and sharding are its final latents'). Seconds go into
    ``timings`` (``place_upscale_s``, ``compile_upscale_s``, ``compile_hand_off_s``). The
    ``Upscale``'s ``for_shape`` compiles the stage for another first-stage shape on the same
    placed weights (``compile_upscale``).
    """
    stage = family.upscale.stage(config, pipe)
    sr = stage.config
    chip = chips.chip_for_device_kind(devices[0].device_kind)
    cfg = read_component_config(sr.model.model_id, "transformer")
    mesh = make_mesh(resolve_run_mesh(sr, family, cfg, len(devices), chip), devices)
    install(sr.kernel, mesh)
    t0 = time.perf_counter()
    placed = sharding.place_expert(sr, family, stage.transformer, "transformer", mesh, fallbacks)
    up = place_module(stage.upsampler, mesh, desc="upsampler")
    timings["place_upscale_s"] = time.perf_counter() - t0
    weights = PlacedStage(placed, up, mesh, install)
    upscaled, latents0 = compile_upscale(stage, family, pipe, weights, config, embeds,
                                         lr_latents, timings)
    return upscaled, placed, latents0


def compile_upscale(stage, family, pipe, weights: PlacedStage, config, embeds, lr_latents,
                    timings: dict):
    """Compile ``stage`` (the family's stage for ``config``, the first stage's config) on
    ``weights``: its hand-off for the first stage's latents (``lr_latents``: their shape and
    sharding) and its step; returns (``Upscale``, an example of its final latents). SDPA is
    routed on the stage's mesh (``weights.install``) while they trace; the caller routes it
    back. Seconds go into ``timings`` (``compile_upscale_s``, ``compile_hand_off_s``)."""
    sr, mesh = stage.config, weights.mesh
    weights.install(sr.kernel, mesh)
    video = _with_inputs(stage, HandOff(None, weights.upsampler, mesh,
                                        latents_out=getattr(stage, "hand_off_latents", False)),
                         config, embeds)
    video, timings["compile_hand_off_s"] = compile_hand_off(stage, video, lr_latents)
    latents0, inputs = video(lr_latents)
    set_timesteps(pipe.scheduler, sr.video.num_inference_steps, stage.sigmas)
    t = jax.device_put(timestep_array(pipe.scheduler.timesteps[0]), NamedSharding(mesh, P()))
    fn = stage.step_fn(weights.placed["module"], sr)
    times: dict = {}
    step, _ = transformer_step.compile_transformer_step(
        sr, family.transformer.block_stack, pipe, weights.placed, None, mesh, fn, latents0, t,
        inputs, times)
    timings["compile_upscale_s"] = times["compile_transformer_s"]

    def for_shape(other, other_embeds, other_lr_latents, other_timings):
        return compile_upscale(family.upscale.stage(other, pipe), family, pipe, weights, other,
                               other_embeds, other_lr_latents, other_timings)

    return _upscale(stage, video, step, for_shape), latents0


def _with_inputs(stage, hand_off, config, embeds):
    """``hand_off`` with one video's initial latents, text inputs and hand-off extras, drawn
    on the host and placed (``config``: the first stage's config of this video)."""
    latents0, extras = stage.noise(config, embeds)
    text = stage.text_inputs(embeds)
    over_dp, replicated = NamedSharding(hand_off.mesh, P("dp")), NamedSharding(hand_off.mesh, P())
    return dataclasses.replace(hand_off, latents0=_put(latents0, replicated),
                               text=_put(text, over_dp), extras=_put(extras, replicated))


def _upscale(stage, hand_off, step, for_shape) -> Upscale:
    """The loop's ``Upscale`` of one video (``hand_off`` holds its inputs)."""
    programs = Programs(step=step, scheduler_config=stage.scheduler_config,
                        sigmas=stage.sigmas, timesteps_sharding=NamedSharding(hand_off.mesh, P()))
    v = stage.config.video
    return Upscale(programs=programs, num_inference_steps=v.num_inference_steps,
                   hand_off=hand_off, next_video=lambda c, e: _upscale(
                       stage, _with_inputs(stage, hand_off, c, e), step, for_shape),
                   for_shape=for_shape, size=(v.width, v.height))


def _put(tree, where):
    return jax.tree.map(lambda x: placement.place_array(placement.host_array(x), where), tree)


@dataclasses.dataclass(frozen=True)
class HandOff:
    """The first stage's final latents -> (the second stage's initial latents, its model
    inputs): ``compiled`` runs the family's ``hand_off_fn`` (weights ``placed``) on them and
    this video's placed ``extras``; ``latents0`` and ``text`` (this video's initial latents and
    text inputs) are passed through (set by ``_with_inputs``). ``latents_out``: the program
    returns (initial latents, extra inputs) instead, the latents computed from the first
    stage's (the stage's ``hand_off_latents``: a re-noised refinement, LTX-2's ``--sr 2x``)."""

    compiled: object
    placed: dict
    mesh: object
    latents0: object = None
    text: object = None
    extras: object = None
    latents_out: bool = False

    def __call__(self, lr_latents):
        replicated = NamedSharding(self.mesh, P())
        out = self.compiled(self.placed["params"], self.placed["buffers"],
                            jax.device_put(lr_latents, replicated), self.extras)
        latents0, extra_inputs = out if self.latents_out else (self.latents0, out)
        return latents0, {**self.text, **extra_inputs}


def compile_hand_off(stage, hand_off: HandOff, lr_latents) -> tuple[HandOff, float]:
    """AOT-compile the hand-off for the first stage's latents (the shape and dtype of
    ``lr_latents``) and the placed extras ``hand_off`` holds, through the executable cache;
    returns (``hand_off`` with its program, seconds)."""
    mesh, placed = hand_off.mesh, hand_off.placed
    replicated = NamedSharding(mesh, P())
    param_sh = {k: NamedSharding(mesh, s) for k, s in placed["specs"].items()}
    over_dp = NamedSharding(mesh, P("dp"))  # the extra inputs; initial latents replicated
    jitted = jax.jit(interop.jax_view(stage.hand_off_fn(placed["module"])),
                     in_shardings=(param_sh, replicated, replicated, replicated),
                     out_shardings=(replicated, over_dp) if hand_off.latents_out else over_dp)
    args = (placed["params"], placed["buffers"],
            jax.ShapeDtypeStruct(lr_latents.shape, lr_latents.dtype, sharding=replicated),
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                         hand_off.extras))
    t0 = time.perf_counter()
    compiled, _ = executables.compile_program("upscale_hand_off", lambda: jitted.lower(*args),
                                              args)
    return dataclasses.replace(hand_off, compiled=compiled), time.perf_counter() - t0
