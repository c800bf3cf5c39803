"""``--dry_run``: compile the denoising step and the VAE decode for a TPU topology on a host
with no TPU, and report per-chip HBM.

The transformer and VAE are built from the model's configs with meta weights
(``accelerate.init_empty_weights``), so even 14B needs no RAM for weights; the weights enter
``jit(...).lower`` as ``ShapeDtypeStruct``s carrying the real shardings, and libtpu's compiler
(``jax.experimental.topologies``) compiles for the topology's chips.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time

import jax
import torchax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from custom_splash_attention import install_sdpa_override
from engine.dry_run import estimate, export, whole_video
from engine.dry_run.abstract import (
    abstract_arrays,
    abstract_inputs,
    abstract_transformer,
    abstract_vae,
)
from engine.dry_run.estimate import print_estimate
from engine.files import report as reporting
from engine.files.checkpoint import (
    expert_count,
    model_config_dir,
    read_component_config,
    read_model_index,
)
from engine.files.plots import dry_run_hbm
from engine.files.report import versions
from engine.programs import experts, parking, sparse, step_cache, step_plan
from engine.programs.denoise import run_sigmas
from engine.programs.step import compile_step
from engine.programs.step_cache import estimate_schedule
from engine.run import chips, lowering, runtime
from engine.run.errors import EXIT_DOES_NOT_FIT, GenerationError, UsageError, fail, first_line
from engine.run.mesh import make_mesh, spatial_mesh
from engine.weights import layout, lora, placement
from engine.weights.layout import resolve_run_mesh


class _Skipped(Exception):
    """--dry_run_skip_vae: the VAE row is left out of the table."""


def _per_chip_bytes(structs) -> int:
    """Bytes one chip holds of these sharded ``ShapeDtypeStruct``s."""
    return sum(placement.shard_bytes(s) for s in structs)


def _memory_row(name: str, compiled, seconds: float, capacity: int) -> dict:
    m = compiled.memory_analysis()
    total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
             - m.alias_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return dict(program=name, argument_bytes=m.argument_size_in_bytes,
                output_bytes=m.output_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                total_bytes=total, capacity_bytes=capacity, fits=total <= capacity,
                flops=float((cost or {}).get("flops", 0.0)), compile_s=seconds)


def _oom_row(name: str, error: Exception, seconds: float, capacity: int,
             argument_bytes: int | None = None) -> dict:
    """A compile that failed for memory, as a table row with the compiler's own figure.

    libtpu words it either "... the total memory required for HLO temporaries (34.00G)
    exceeds available HBM (31.25G)" or "Used 40.1G of 31.25G hbm". Both figures are the
    program's whole need, arguments included (a deviceless v6e compile with 30 GiB of
    arguments and 4 GiB of sort buffers reports "temporaries (34.00G)":
    ``tests/test_tpu_compile.py::test_oom_figure_includes_the_arguments``); with
    ``argument_bytes`` known from the shardings, the temporaries are the difference.
    Without a figure the total is NaN.
    """
    text = str(error)
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    temp = re.search(r"temporaries \(([\d.]+)([KMGT])\)", text)
    used = re.search(r"[Uu]sed ([\d.]+)([KMGT])", text)
    temp_bytes = None
    if temp:
        need = float(temp.group(1)) * scale[temp.group(2)]
        temp_bytes = None if argument_bytes is None else max(need - argument_bytes, 0.0)
    elif used:
        need = float(used.group(1)) * scale[used.group(2)]
    else:
        need = float("nan")
    return dict(program=name, argument_bytes=argument_bytes if temp else None,
                output_bytes=None, temp_bytes=temp_bytes, total_bytes=need,
                capacity_bytes=capacity, fits=False, flops=None, compile_s=seconds,
                error=text.strip().splitlines()[0][:300])




def _topology(topology: str):
    """(devices, chip) of a described TPU slice; raises ``UsageError`` for unknown names."""
    try:
        topo = runtime.topology_desc(topology)
    except Exception as e:  # libtpu missing or an unknown name
        raise UsageError(f"--topology={topology!r}: {first_line(e)}") from None
    chip = chips.chip_for_topology(topology)
    if chip is None:
        fail("--topology", topology, f"unknown chip; known: {', '.join(chips.CHIPS)}")
    return list(topo.devices), chip


def _step_row(config, family, placed, mesh, abstract_inputs, capacity: int,
              layers: int) -> dict:
    latents, t, inputs = abstract_inputs
    print(f"compiling the transformer step ({layers} blocks) for {config.dry.topology}...",
          flush=True)
    t0 = time.perf_counter()
    try:
        fn = family.transformer.step_fn(placed["module"], config)
        compiled, seconds = compile_step(placed, mesh, fn, latents, t, inputs)
        return _memory_row("transformer step", compiled, seconds, capacity)
    except Exception as e:  # the compiler reports real OOMs as errors
        weights = _per_chip_bytes([*placed["params"].values(), *placed["buffers"].values()])
        return _oom_row("transformer step", e, time.perf_counter() - t0, capacity,
                        weights + _per_chip_bytes([latents, *_leaves(inputs)]))


def _sparse_rows(config, family, placed, mesh, abstract_inputs, capacity: int,
                 layers: int) -> list:
    """``--sparse``: the sparse step programs compiled as a run compiles them
    (``sparse.compile_sparse_programs``), one row each. With fewer blocks compiled than the
    run's (``--dry_run_layers``), the sparse layer range is moved into the compiled ones
    (at least one sparse block: layer 0 of a 1-block dry run) so each program holds a
    sparse block; the row names the range."""
    latents, t, inputs = abstract_inputs
    lo, hi = config.sparse.layers
    lo = min(lo, layers - 1)
    hi = max(min(hi, layers), lo + 1)
    cfg = config.replace(sparse=dataclasses.replace(config.sparse, layers=(lo, hi)))
    print(f"compiling the sparse step programs ({layers} blocks, blocks [{lo}, {hi}) sparse) "
          f"for {config.dry.topology}...", flush=True)
    t0, seconds, timings = time.perf_counter(), {}, {}
    try:
        compiled = sparse.compile_sparse_programs(
            cfg, placed, mesh, family.transformer.step_fn(placed["module"], cfg), latents, t,
            inputs, timings, seconds)
    except Exception as e:  # the compiler reports real OOMs as errors
        return [_oom_row("transformer step (sparse)", e, time.perf_counter() - t0, capacity)]
    return [_memory_row(f"transformer step ({key}, blocks [{lo}, {hi}))", c, seconds[key],
                        capacity) for key, c in compiled.items()]


def run_plan(config, family) -> step_plan.StepPlan:
    """The run's ``step_plan.StepPlan`` before any model loads (the dry run's estimate): per
    step its expert (0, or 1 for a two-expert model's low-noise one, from the checkpoint's
    scheduler as a run decides it, ``experts.expert_steps``), dense or sparse
    (``config.sparse``) and full or cached (``config.step_cache``)."""
    n, model_id = config.video.num_inference_steps, config.model.model_id
    split = experts.expert_steps(
        read_model_index(model_id), read_component_config(
            model_id, "scheduler", filename="scheduler_config.json"), family.scheduler.make,
        config.video.scheduler, config.video.flow_shift, n, run_sigmas(config, family))
    expert_of_step = [0] * n if split is None else [0] * split[0] + [1] * split[1]
    return step_plan.StepPlan.build(expert_of_step, config.sparse, config.step_cache)


def sparse_estimate(est: dict, plan) -> dict:
    """``est`` (``estimate.estimate`` of a ``--sparse`` run, with its ``sparse`` entry) with
    ``sparse_seconds_per_step`` (seconds; {program key: seconds} with several sparse
    programs, one per expert density), ``average_seconds_per_step`` over ``plan``'s
    (``step_plan.StepPlan``) dense and sparse steps, ``sparse_plan`` (its counts in words) and
    ``step_plan``. ``seconds_per_step`` stays the dense step's. ESTIMATES."""
    by_key = {k: v["seconds_per_step"] for k, v in est["sparse"].items()}
    k = sum(p != step_plan.DENSE for p in plan.programs)
    return dict(est, sparse_seconds_per_step=next(iter(by_key.values())) if len(by_key) == 1
                else by_key,
                average_seconds_per_step=plan.average_seconds(est["seconds_per_step"], by_key),
                sparse_plan=f"{len(plan.programs) - k} dense + {k} sparse steps",
                step_plan=plan.report())


def _cache_rows(config, family, placed, mesh, abstract_inputs, capacity: int):
    """Step caching: the full and the cached step programs compiled for the topology (they
    replace the plain step, which a cached run never runs), and what the cache keeps."""
    latents, t, inputs = abstract_inputs
    settings = config.step_cache
    print(f"compiling the {settings.kind} full and cached step programs for "
          f"{config.dry.topology}...", flush=True)
    t0 = time.perf_counter()
    try:
        lowered = step_cache.compile_cache_programs(
            placed, mesh, family.transformer.step_fn(placed["module"], config),
            family.transformer.block_stack, settings, latents, t, inputs, lower_only=True)
    except Exception as e:
        weights = _per_chip_bytes([*placed["params"].values(), *placed["buffers"].values()])
        return [_oom_row("transformer step (full)", e, time.perf_counter() - t0, capacity,
                         weights)], None
    rows = []
    for name, program in (("full", lowered.full), ("cached", lowered.cached)):
        t1 = time.perf_counter()
        label = f"transformer step ({name})"
        try:
            compiled = program.compile()
            rows.append(_memory_row(label, compiled, lowered.compile_s[name]
                                    + time.perf_counter() - t1, capacity))
        except Exception as e:  # the compiler reports real OOMs as errors
            rows.append(_oom_row(label, e, time.perf_counter() - t1, capacity))
    cache = dict(step_cache.cache_report(lowered, [], config.video.num_inference_steps),
                 kept_specs=[str(s) for s in step_cache.kept_specs(lowered.kept_shapes, mesh)])
    return rows, cache


def _peak_row(name: str, mem: dict, capacity: int, seconds: float) -> dict:
    """The per-chip row of a chunked VAE program set (``ChunkedDecoder``/``ChunkedEncoder``
    ``memory()``): its peak program against the chip's usable HBM."""
    return dict(program=f"{name} ({mem['programs']} programs, peak)",
                argument_bytes=mem["argument_bytes"], output_bytes=mem["output_bytes"],
                temp_bytes=mem["temp_bytes"], total_bytes=mem["peak_bytes"],
                capacity_bytes=capacity, fits=mem["peak_bytes"] <= capacity,
                flops=None, compile_s=seconds)


def _vae_rows(config, decoder, latents, capacity: int) -> list:
    t0 = time.perf_counter()
    try:
        if config.dry.dry_run_skip_vae:
            raise _Skipped
        print(f"compiling the VAE decode for {config.dry.topology}"
              + (" (slow: 5-70 s per 3D conv)" if config.dry.dry_run_exact_convs else "") + "...",
              flush=True)
        seconds = decoder.compile(latents)
        mem = decoder.memory()
        return [_peak_row("VAE decode", mem, capacity, seconds)]
    except _Skipped:
        return []
    except Exception as e:
        return [_oom_row("VAE decode", e, time.perf_counter() - t0, capacity)]


def _encode_rows(config, family, vae, devices, capacity: int) -> list:
    """Image-to-video, or a run whose other inputs are encoded (``family.image.wanted``:
    Wan VACE's control video, a video-to-video source): the family's chunked VAE encode of
    the conditioning video (``family.vae.encoder``), on its own all-device mesh as a run
    builds it (``spatial_mesh``). It runs before the transformer is placed, so nothing else
    is resident. None for a family that encodes on the host (no ``vae.encoder``)."""
    mode = family.image.mode(config.model.model_id)
    wanted = mode == "required" or family.image.wanted(config)  # a dry run takes no --image
    if config.dry.dry_run_skip_vae or family.vae.encoder is None or not wanted:
        return []
    print(f"compiling the VAE encode for {config.dry.topology}...", flush=True)
    t0 = time.perf_counter()
    try:
        mesh = spatial_mesh(devices)
        jv = interop.JittableModule(vae)
        parts = {kind: abstract_arrays({k: v for k, v in getattr(jv, kind).items()
                                        if family.vae.is_encode_weight(k)}, mesh)
                 for kind in ("params", "buffers")}
        encoder = family.vae.encoder(dict(module=jv, **parts), mesh, vae, abstract=True)
        # An "optional" checkpoint (TI2V-5B) encodes the image alone, one frame.
        frames = 1 if mode == "optional" else config.video.frames
        shape = (1, 3, frames, config.video.height, config.video.width)
        video = jax.ShapeDtypeStruct(shape, jax.numpy.float32, sharding=encoder.spatial(
            shape) or NamedSharding(mesh, P()))
        seconds = encoder.compile(video)
        mem = encoder.memory()
        return [_peak_row("VAE encode", mem, capacity, seconds)]
    except Exception as e:
        return [_oom_row("VAE encode", e, time.perf_counter() - t0, capacity)]


def _leaves(tree) -> list:
    return jax.tree.leaves(tree)


def _expert_parking(placed, inputs, vae_placed, latents, mode: str, chip,
                    memory_mode: str = "device") -> dict:
    """A two-expert model's idle expert parked (``engine.programs.experts``, the rule a run
    applies): one expert whole beside the other parked, and at the boundary step one swap
    (the done expert parked, then the next gathered, one weight at a time). ``memory_mode``:
    ``--park_memory``; in host memory (``layout.idle_expert_memory``) the idle expert holds
    no HBM.

    Returns dict(parked, memory ("device" or "pinned_host"), whole_bytes_per_device,
    parked_bytes_per_device (one expert's parked slices), idle_hbm_bytes_per_device (what
    the idle expert holds in HBM), host_bytes_per_device (what a swap moves over the host
    link each way: the parked slices, in host memory only),
    swap_peak_bytes: what a device holds at the swap's worst moment: VAE weights, inputs and
    latents, one expert whole, the other parked in HBM, plus the largest weight's parked
    slice (a weight's old and new copies are both live while it moves),
    gather_bytes_per_device: what each device receives in the swap's all-gathers,
    gather_s_estimate: those bytes at the chip's assumed ICI egress (a static estimate, as
    ``--estimate``'s collectives; None for a chip without one)).
    """
    arrays = [*placed["params"].values(), *placed["buffers"].values()]
    whole, parked_bytes = experts.expert_bytes(arrays)
    park = experts.park_idle_expert(mode, whole, parked_bytes, chip.usable_hbm_bytes)
    memory = layout.idle_expert_memory(memory_mode, chip, whole, parked_bytes)
    idle = 0 if memory == "pinned_host" else parked_bytes
    largest = max((placement.shard_bytes(jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=placement.parked_sharding(a))) for a in arrays), default=0)
    others = _per_chip_bytes([*vae_placed["params"].values(), *vae_placed["buffers"].values(),
                              latents, *_leaves(inputs)])
    gather = whole - parked_bytes
    ici = (estimate.device_ici_bytes_per_s(chip.name)
           if chip.name in estimate.ICI_EGRESS_GBPS else None)
    return dict(parked=park, mode=mode, memory=memory, whole_bytes_per_device=whole,
                parked_bytes_per_device=parked_bytes, idle_hbm_bytes_per_device=idle,
                host_bytes_per_device=parked_bytes - idle,
                swap_peak_bytes=others + whole + idle + largest,
                gather_bytes_per_device=gather,
                gather_s_estimate=None if ici is None else gather / ici)


def _add_resident(rows: list, placed, vae_placed, inputs, video_bytes: int,
                  experts: int = 1, park_weights: str = "off",
                  expert_parking: dict | None = None, park_memory: str = "auto") -> dict:
    """In one process the transformer weights stay in HBM while the VAE decodes, and the VAE
    weights while the transformer runs; the decoded chunks and their concatenation are held
    too. With two experts (Wan 2.2 A14B) both stay resident: the step program's arguments
    are one expert's weights, the other's are kept, whole, or parked where
    ``expert_parking`` (``_expert_parking``) says so; then a row for the expert swap's
    transient is added. The compiler sees one program at a time, so add what the others
    keep. With ``park_weights`` (``engine.programs.parking``, the same rule a run applies)
    the decode keeps the transformer weights parked: sharded over every device, or in host
    memory where ``park_memory`` (``parking.decode_memory``) puts them there. Returns the
    parking decision, dict(parked, memory, mode, weights_bytes_per_device,
    parked_bytes_per_device: what stays in HBM)."""
    step_weights = _per_chip_bytes([*placed["params"].values(), *placed["buffers"].values()])
    now, parked = parking.weights_bytes([placed] * experts)
    other = step_weights
    if expert_parking and expert_parking["parked"]:
        other = expert_parking["idle_hbm_bytes_per_device"]  # the idle expert, parked
        now = step_weights + other
        parked = expert_parking["parked_bytes_per_device"] + other
        rows.append(dict(program="expert swap (transient)", argument_bytes=None,
                         output_bytes=None, temp_bytes=None, total_bytes=0,
                         capacity_bytes=rows[0]["capacity_bytes"], fits=True, flops=None,
                         compile_s=0.0))
    resident = {"transformer step": _per_chip_bytes([*vae_placed["params"].values(),
                                                     *vae_placed["buffers"].values()])
                + (experts - 1) * other,
                "VAE decode": now + _per_chip_bytes(_leaves(inputs))
                + 2 * video_bytes,
                "VAE encode": 0,  # image-to-video: before anything else is placed
                "expert swap": expert_parking and expert_parking["swap_peak_bytes"]}
    decision = dict(parked=False, memory=None, mode=park_weights,
                    weights_bytes_per_device=now, parked_bytes_per_device=parked)
    for r in rows:
        r["resident_bytes"] = next(v for k, v in resident.items() if r["program"].startswith(k))
        if r["total_bytes"] == r["total_bytes"]:  # not NaN (an OOM without a figure)
            r["total_bytes"] += r["resident_bytes"]
            where = r["program"].startswith("VAE decode") and parking.decode_memory(
                park_weights, park_memory, r["total_bytes"], now, parked, r["capacity_bytes"])
            if where:
                freed = now - parking.kept_bytes(where, parked)
                r["resident_bytes"] -= freed
                r["total_bytes"] -= freed
                r["weights_parked"] = decision["parked"] = True
                decision.update(memory=where, parked_bytes_per_device=now - freed)
            r["fits"] = r["fits"] and r["total_bytes"] <= r["capacity_bytes"]
    return decision


def _hosts(placed, vae_placed, n_experts: int = 1) -> dict:
    """What each host reads from the checkpoint for its own devices (weights stream slice by
    slice, so a host never holds more than the largest slice beyond what is placed); every
    expert of a two-expert model is read alike."""
    per_host, largest = placement.per_host_bytes(
        [*placed["params"].values(), *placed["buffers"].values()] * n_experts
        + [*vae_placed["params"].values(), *vae_placed["buffers"].values()])
    return dict(count=len(per_host), weight_bytes=[per_host[p] for p in sorted(per_host)],
                largest_slice_bytes=largest)


def _deviceless(config):
    """Start the dry run's runtime: libtpu set up to compile for ``--topology`` with no TPU,
    after the flags' own settings (``config.process_env``: --quantize's libtpu flag), all
    applied here, before libtpu loads (``runtime.apply_process_env``); (devices, chip)."""
    settings = config.process_env or runtime.ProcessEnv()
    if config.dry.estimate and config.dry.topology.split(":")[0] in runtime.PROFILE_LIBTPU_CHIPS:
        settings += estimate.block_hlo_env()  # the newer libtpu's HLO is read from its dump
    # An exported VAE decode must be the program a run compiles: the full convolution search.
    settings += runtime.deviceless_tpu_env(config.dry.topology, profile_libtpu=True,
                                           fast_convs=not (config.dry.dry_run_exact_convs
                                                           or config.dry.aot_export))
    runtime.apply_process_env(settings)
    runtime.configure_jax_platform()
    runtime.quiet_known_warnings()
    devices, chip = _topology(config.dry.topology)
    export.check_topology(config, devices)
    return devices, chip


def _compiled_rows(config, family, models, mesh, inputs_abstract, capacity: int, layers: int,
                   n_experts: int, decode_latents=None):
    """The step (or the step cache's programs) and the VAE decode compiled for the topology,
    written to ``--aot_export`` when given. ``models``: (placed transformer, VAE, placed
    VAE); ``decode_latents``: what the decode takes when not the step's latents (``--sr``).
    Returns (rows, the step cache's entry or None, the decoder, the export's entry)."""
    placed, vae, vae_placed = models
    modules = dict(transformer=placed["module"], vae=vae,
                   **({"transformer_2": placed["module"]} if n_experts > 1 else {}))
    cache = None
    with export.exporting(config, modules, mesh) as exported:
        if config.step_cache is not None and config.step_cache.on:
            rows, cache = _cache_rows(config, family, placed, mesh, inputs_abstract, capacity)
        else:
            rows = [_step_row(config, family, placed, mesh, inputs_abstract, capacity, layers)]
        if config.sparse is not None:
            rows += _sparse_rows(config, family, placed, mesh, inputs_abstract, capacity,
                                 layers)
        decoder = family.vae.decoder(vae_placed, vae, mesh, tiling=config.run.vae_tiling,
                                     abstract=True)
        rows += _vae_rows(config, decoder, inputs_abstract[0] if decode_latents is None
                          else decode_latents, capacity)
    return rows, cache, decoder, exported


def _route_sdpa(config, mesh, attention: str) -> None:
    """Torch SDPA to ``attention`` on ``mesh`` for what traces next (a stage's programs and
    its estimate trace on that stage's own mesh)."""
    install_sdpa_override(torchax.default_env(), attention=attention, mesh=mesh,
                          options=config.kernel.options(), interpret=False)


def _upscale_latents(config, family, vae_cfg: dict, mesh):
    """The upscale stage's latents (replicated ``ShapeDtypeStruct``), or None without --sr."""
    if config.upscale is None:
        return None
    s = config.upscale
    shape = family.sizes.latent_shape(vae_cfg, s.height, s.width, config.video.frames,
                                      model_id=config.model.model_id)
    return jax.ShapeDtypeStruct(shape, jax.numpy.float32, sharding=NamedSharding(mesh, P()))


def _upscale_step(config, family, devices, chip, attention: str, latents, capacity: int):
    """``--sr``: the second stage's step compiled on its own mesh (the resolver's layout for
    its config, as a run builds it). Returns dict(row, placed, mesh, shape, dry) where
    ``dry`` is the family's dry stage (``families.base.Upscale.dry_stage``)."""
    dry = family.upscale.dry_stage(config)
    sr, cfg = dry.config, dict(dry.transformer_config)
    shape = resolve_run_mesh(sr, family, cfg, len(devices), chip)
    if config.dry.dry_run_layers:
        cfg["num_layers"] = min(config.dry.dry_run_layers, cfg["num_layers"])
    mesh = make_mesh(shape, devices)
    _route_sdpa(sr, mesh, attention)
    placed = abstract_transformer(sr, family, cfg, mesh)
    rep, over_dp = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=over_dp),
                          dry.abstract_inputs(cfg))
    t = jax.ShapeDtypeStruct((1,), getattr(jax.numpy, family.transformer.timestep_dtype),
                             sharding=rep)
    latents = jax.ShapeDtypeStruct(latents.shape, latents.dtype, sharding=rep)
    print(f"compiling the SR transformer step ({cfg['num_layers']} blocks) for "
          f"{config.dry.topology}...", flush=True)
    t0 = time.perf_counter()
    try:
        compiled, seconds = compile_step(placed, mesh, dry.step_fn(placed["module"], sr),
                                         latents, t, inputs)
        row = _memory_row("transformer step (SR)", compiled, seconds, capacity)
    except Exception as e:  # the compiler reports real OOMs as errors
        row = _oom_row("transformer step (SR)", e, time.perf_counter() - t0, capacity,
                       _per_chip_bytes([*placed["params"].values(), latents, *_leaves(inputs)]))
    return dict(row=row, placed=placed, mesh=mesh, shape=shape, dry=dry)


def _upscale_report(config, family, up: dict, first_estimate: dict | None, chip: str,
                    attention: str) -> dict:
    """The report's ``upscale`` entry: the SR stage's settings, mesh, whether its transformer
    config was assumed, and with ``--estimate`` its step estimate and the two stages'
    denoising seconds (the decode is not estimated)."""
    s, dry = config.upscale, up["dry"]
    out = dict(dataclasses.asdict(s), mesh=dataclasses.asdict(up["shape"]),
               transformer_config_assumed=dry.assumed)
    if first_estimate is not None:
        cfg = {**dry.transformer_config,
               "in_channels": read_component_config(config.model.model_id,
                                                    "transformer")["in_channels"]}
        print("estimating the SR step...", flush=True)
        _route_sdpa(dry.config, up["mesh"], attention)
        try:
            est = estimate.estimate(dry.estimate_config, family, cfg, up["mesh"], up["shape"],
                                    chip, attention)
        except (ValueError, RuntimeError) as e:
            raise GenerationError(f"--estimate (SR stage): {first_line(e)}") from None
        out["estimate"] = est
        out["denoise_s"] = dict(
            first_stage=first_estimate["seconds_per_step"] * config.video.num_inference_steps,
            sr_stage=est["seconds_per_step"] * s.steps)
    return out


def dry_run(config, family) -> tuple[int, dict]:
    """Compile the denoising step and the VAE decode for ``config.dry.topology`` without a TPU.

    Returns:
        (exit code: 0 fits / 3 does not fit, report dict with a per-chip table).

    Raises:
        UsageError: unknown topology, or a mesh the topology cannot hold.
    """
    devices, chip = _deviceless(config)
    capacity = chip.usable_hbm_bytes  # per JAX device (a v7x chip is 2 devices)
    folder = model_config_dir(config.model.model_id)
    cfg = read_component_config(config.model.model_id, "transformer")
    vae_cfg = read_component_config(config.model.model_id, "vae")
    shape = resolve_run_mesh(config, family, cfg, len(devices), chip)  # all layers' weights
    if config.dry.dry_run_layers:
        cfg["num_layers"] = min(config.dry.dry_run_layers, cfg["num_layers"])
    tokens = family.sizes.token_count(cfg, config.video.height, config.video.width,
                                      config.video.frames, config.model.model_id)
    mesh = make_mesh(shape, devices)
    attention = "splash" if config.kernel.attention == "auto" else config.kernel.attention
    lowering.install(torchax.default_env())
    _route_sdpa(config, mesh, attention)
    placed = abstract_transformer(config, family, cfg, mesh)
    vae, vae_placed = abstract_vae(family, folder, mesh, config)
    inputs_abstract = abstract_inputs(config, family, cfg, vae_cfg, mesh)
    latents, inputs = inputs_abstract[0], inputs_abstract[2]
    n_experts = expert_count(read_model_index(config.model.model_id))
    hr = _upscale_latents(config, family, vae_cfg, mesh)
    rows, cache, decoder, exported = _compiled_rows(
        config, family, (placed, vae, vae_placed), mesh, inputs_abstract, capacity,
        cfg["num_layers"], n_experts, hr)
    up = hr is not None and _upscale_step(config, family, devices, chip, attention, hr,
                                          capacity)
    resident = n_experts
    if up:  # both transformers resident, as a two-expert model's (the same class and size)
        _route_sdpa(config, mesh, attention)  # back on the first stage's mesh (its estimate)
        rows.insert(1, up["row"])
        resident, latents = 2, hr
    rows += _encode_rows(config, family, vae, devices, capacity)
    height, width = ((config.upscale.height, config.upscale.width) if up else
                     (config.video.height, config.video.width))
    video = 3 * config.video.frames * height * width * 4 // (
        len(devices) if decoder.spatial(latents.shape) is not None else 1)
    swap = n_experts > 1 and _expert_parking(placed, inputs, vae_placed, latents,
                                             config.run.park_weights, chip,
                                             config.run.park_memory) or None
    parked = _add_resident(rows, placed, vae_placed, inputs, video, resident,
                           config.run.park_weights, swap, config.run.park_memory)
    fits = all(r["fits"] for r in rows)
    report = dict(
        dry_run=True, topology=config.dry.topology, devices=len(devices),
        chips=chips.count_chips(devices), fits=fits,
        libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS", ""),
        vae_checked=not config.dry.dry_run_skip_vae,
        settings={**config.settings(), "attention": attention, **dataclasses.asdict(shape)},
        mesh=dataclasses.asdict(shape), layers_compiled=cfg["num_layers"], tokens=tokens,
        experts_resident=n_experts, park_weights=parked, expert_parking=swap,
        per_chip=rows, analytic_transformer_flops_per_step=family.transformer.flops(cfg, config),
        analytic_self_attention_flops_per_step=family.transformer.self_attention_flops(cfg, config),
        sharding_rule_matches=placed["rule_counts"], versions=versions(),
        hosts=_hosts(placed, vae_placed, resident))
    if cache is not None:
        report["cache"] = cache
    if exported:
        report["aot_export"] = exported
    if config.model.lora or config.model.lora_2:
        report["loras"] = _lora_report(config, family, placed)
    _add_estimates(report, config, family, (mesh, shape, chip.name, attention), decoder, up,
                   cache)
    return (0 if fits else EXIT_DOES_NOT_FIT), report


def _add_estimates(report: dict, config, family, where: tuple, decoder, up, cache) -> None:
    """With ``--estimate``: the step, the decode floor, the SR stage's step (``up``: the
    SR stage's compile, or False) and the whole video, into ``report``; ``where``: (mesh,
    mesh shape, chip name, attention)."""
    mesh, shape, chip, attention = where
    if config.dry.estimate:
        report["estimate"] = _estimate(config, family, mesh, shape, chip, attention)
        report["decode_estimate"] = _decode_estimate(report["per_chip"], decoder, chip)
    if up:
        report["upscale"] = _upscale_report(config, family, up, report.get("estimate"),
                                            chip, attention)
        if cache is not None:
            report["estimate"]["cache"] = estimate_schedule(
                report["estimate"]["seconds_per_step"], config.step_cache,
                config.video.num_inference_steps, read_component_config(
                    config.model.model_id, "transformer")["num_layers"])
    if config.dry.estimate:
        report["estimate"].update(_whole_video(config, family, report, decoder, mesh, chip))


def _whole_video(config, family, report: dict, decoder, mesh, chip: str) -> dict:
    """``whole_video.price``; a failure is one line (``GenerationError``)."""
    print("estimating the whole video (text encoders on the mesh and the host, the decode, "
          "the mp4 on this host)...", flush=True)
    try:
        return whole_video.price(config, family, report, decoder, mesh, chip)
    except (ValueError, RuntimeError, AttributeError, KeyError, TypeError, OSError) as e:
        raise GenerationError(f"--estimate (whole video): {type(e).__name__}: "
                              f"{first_line(e)}") from None


def _decode_estimate(rows: list, decoder, chip: str) -> dict | None:
    """``estimate.decode_floor`` of the compiled decode, or None (not compiled, did not
    compile, or a decoder that does not list its programs)."""
    row = next((r for r in rows if r["program"].startswith("VAE decode")), None)
    if row is None or row.get("error") or not hasattr(decoder, "program_calls"):
        return None
    try:
        return estimate.decode_floor(decoder.program_calls(), chip)
    except ValueError:
        return None


def _lora_report(config, family, placed) -> list:
    """Each fused LoRA file's entry, with the replicated weights it touches; transformer_2
    has the first expert's tree and specs (one program serves both)."""
    return [dict(x.report(), expert=loras.component,
                 replicated_weights=lora.touched_replicated(x, placed["specs"],
                                                            family.transformer.block_stack))
            for loras in (config.model.lora, config.model.lora_2) if loras for x in loras]


def _estimate(config, family, mesh, shape, chip: str, attention: str) -> dict:
    """``--estimate``: the step time from libtpu's static model (``engine.dry_run.estimate``), for
    the real block count whatever ``--dry_run_layers`` compiled."""
    print(f"estimating the step time for {config.dry.topology} (one block, and the kernel on a "
          "tiny grid with libtpu's static profile)...", flush=True)
    try:
        est = estimate.estimate(config, family, read_component_config(
            config.model.model_id, "transformer"), mesh, shape, chip, attention)
        if config.sparse is None:
            return est
        return sparse_estimate(est, run_plan(config, family))
    except ValueError as e:
        raise UsageError(f"--estimate: {e}") from None
    except RuntimeError as e:
        raise GenerationError(str(e)) from None


def print_dry_run(report: dict) -> None:
    gib = lambda b: "-" if b is None else f"{b / 2**30:7.2f}"  # noqa: E731
    chips = f"{report['chips']} chips" + (f", {report['devices']} devices"
                                          if report["devices"] != report["chips"] else "")
    print(f"\n== Dry run: {report['topology']} ({chips}), mesh "
          f"dp{report['mesh']['dp']} tp{report['mesh']['tp']} sp{report['mesh']['sp']}, "
          f"{report['layers_compiled']} blocks, {report['tokens']} tokens ==")
    print(f"{'program':<34}{'args GiB':>9}{'out GiB':>9}{'temp GiB':>9}{'kept GiB':>9}"
          f"{'total':>9}{'HBM':>9}  {'fits':<5}{'compile s':>10}")
    for r in report["per_chip"]:
        print(f"{r['program']:<34}{gib(r['argument_bytes']):>9}{gib(r['output_bytes']):>9}"
              f"{gib(r['temp_bytes']):>9}{gib(r['resident_bytes']):>9}{gib(r['total_bytes']):>9}"
              f"{gib(r['capacity_bytes']):>9}  {'yes' if r['fits'] else 'NO':<5}"
              f"{r['compile_s']:>10.1f}")
    if "cache" in report:
        c = report["cache"]
        print(f"{c['kind']}: {len(c['cached_steps'])} of {c['full_steps'] + len(c['cached_steps'])}"
              f" steps cached; the cache keeps {c['kept_shapes']} "
              f"({c['kept_bytes_per_chip'] / 2**30:.3f} GiB per chip, {c['kept_specs']})")
    step = report["per_chip"][0]
    if step.get("flops"):
        print(f"XLA FLOPs per step per chip (Pallas kernels count 0): {step['flops']:.3e}")
    print(f"analytic FLOPs per step (all chips): "
          f"{report['analytic_transformer_flops_per_step']:.3e} "
          f"(self-attention {report['analytic_self_attention_flops_per_step']:.3e})")
    for r in report["per_chip"]:
        if not r["fits"]:
            print(f"{r['program']}: does not fit: {r['total_bytes'] / 2**30:.1f} GiB needed, "
                  f"{r['capacity_bytes'] / 2**30:.2f} GiB available"
                  + (f" ({r['error']})" if r.get("error") else ""))
    hosts = report["hosts"]
    print(f"host RAM for weights: each of {hosts['count']} host(s) reads "
          f"{max(hosts['weight_bytes']) / 2**30:.2f} GiB of slices for its own devices, "
          f"streamed (largest slice {hosts['largest_slice_bytes'] / 2**30:.2f} GiB)")
    for x in report.get("loras", []):
        rep = x["replicated_weights"]
        print(f"LoRA {x['path']} ({x['expert']}, scale {x['scale']}): "
              f"{x['matched_weights']} weights fused "
              f"into their slices at placement, no step-time cost; replicated weights it "
              f"touches: {', '.join(rep) if rep else 'none'}")
    park = report.get("park_weights") or {}
    if park.get("parked"):
        print(f"--park_weights {park['mode']}: while the VAE decodes, the transformer weights "
              + ("are in host memory (--park_memory pinned_host) "
                 if park.get("memory") == "pinned_host" else "are sharded over every device ")
              + f"({park['weights_bytes_per_device'] / 2**30:.2f} "
              f"-> {park['parked_bytes_per_device'] / 2**30:.2f} GiB per device)")
    swap = report.get("expert_parking") or {}
    if swap.get("parked"):
        est = swap["gather_s_estimate"]
        where = ("in host memory (--park_memory pinned_host: no HBM)"
                 if swap["memory"] == "pinned_host" else "in HBM")
        print(f"--park_weights {swap['mode']}: the idle expert stays parked {where} "
              f"({swap['whole_bytes_per_device'] / 2**30:.2f} GiB whole -> "
              f"{swap['parked_bytes_per_device'] / 2**30:.2f} parked per device); one swap per "
              f"video at the boundary step: {swap['gather_bytes_per_device'] / 2**30:.2f} GiB "
              "all-gathered per device"
              + (f", {swap['host_bytes_per_device'] / 2**30:.2f} GiB each way over the host "
                 "link" if swap["host_bytes_per_device"] else "")
              + ("" if est is None else f", {est:.3f} s at the assumed ICI egress (estimate)"))
    print("kept = HBM other stages hold meanwhile (the other model's weights, decoded frames)"
          + (f"; {report['experts_resident']} experts resident"
             if report.get("experts_resident", 1) > 1 else ""))
    print("verdict:", "fits" if report["fits"] else "does not fit",
          "" if report["vae_checked"] else "(transformer only: --dry_run_skip_vae)")
    if "estimate" in report:
        print_estimate(report["estimate"])
    decode = report.get("decode_estimate")
    if decode:
        print(f"VAE decode (ESTIMATE, a floor): >= {decode['seconds']:.2f} s per video "
              f"({decode['calls']} program calls; {decode['method']})")
    if "upscale" in report:
        _print_upscale(report["upscale"], decode)
    if "estimate" in report:
        whole_video.print_whole_video(report["estimate"])


def _print_upscale(up: dict, decode: dict | None) -> None:
    m = up["mesh"]
    print(f"SR stage ({up['version']}, {up['height']} x {up['width']}, {up['steps']} steps): "
          f"its own mesh dp{m['dp']} tp{m['tp']} sp{m['sp']}"
          + ("; its transformer config is the first stage's with 98 input channels (no "
             "--sr_model_dir)" if up["transformer_config_assumed"] else ""))
    if "estimate" in up:
        print_estimate(up["estimate"])
        d = up["denoise_s"]
        total = d["first_stage"] + d["sr_stage"]
        print(f"whole video (ESTIMATE): first stage {d['first_stage']:.1f} s + SR stage "
              f"{d['sr_stage']:.1f} s = {total:.1f} s of denoising"
              + (f", + the VAE decode >= {decode['seconds']:.1f} s = >= "
                 f"{total + decode['seconds']:.1f} s" if decode else
                 "; the VAE decode is not estimated"))


def run_dry(config, family, checked: dict) -> int:
    """``--dry_run`` as the script runs it: compile deviceless, print the per-chip table,
    write ``<stamp>_dry_run.json`` (with ``checked``, the checkpoint check) and, unless
    ``--no_plots``, ``<stamp>_dry_run_hbm.png`` in ``--output_dir``. Returns the exit code
    (0, or ``EXIT_DOES_NOT_FIT``)."""
    code, report = dry_run(config, family)
    report["checkpoint_check"] = checked
    print_dry_run(report)
    stem = reporting.output_stem(config.run.output_dir)
    written = [] if config.run.no_plots else reporting.save_picture(
        dry_run_hbm, report, os.path.join(config.run.output_dir, f"{stem}_dry_run_hbm.png"))
    path = os.path.join(config.run.output_dir, f"{stem}_dry_run.json")
    reporting.save_report(report, path)
    print(f"wrote {', '.join([*written, path])}")
    if "aot_export" in report:
        e = report["aot_export"]
        print(f"exported {e['programs_written']} programs to {e['dir']} for "
              f"{config.dry.topology} (not yet verified on a TPU: copy the folder to the VM "
              "and pass it as --executable_cache_dir)")
    return code
