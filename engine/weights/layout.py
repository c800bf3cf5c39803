"""The run's default layout: Ulysses where the checkpoint's replicated weights leave room
(a two-expert model's idle expert counted parked, unless ``--park_weights off``: in HBM, or
none of it where ``idle_expert_memory`` parks it in host memory).

``resolve_run_mesh`` is where the run (``generate_flax.resolve_mesh``, the server) and the dry
run choose (dp, tp, sp), so that a dry run predicts the run's layout. It weighs the
transformer from its config alone (meta tensors), before any weight is read.
"""

from __future__ import annotations

import re

import torch

from engine.files.checkpoint import expert_count, read_model_index
from engine.run import chips
from engine.run.errors import fail
from engine.run.mesh import MeshShape, resolve_mesh_shape
from engine.weights import quantize as quantize_mod

PARK_MEMORY = ("auto", "device", "pinned_host")


def idle_expert_memory(mode: str, chip, whole_bytes: int, parked_bytes: int) -> str:
    """Where a two-expert model's parked idle expert lives: "device" (1/devices of every
    weight in each device's HBM) or "pinned_host" (the same slices in host memory: no HBM,
    and each swap also moves them over the host link).

    Args:
        mode: ``--park_memory`` ("auto", "device" or "pinned_host").
        chip: the run's ``chips.Chip`` (None off TPU: "auto" keeps "device").
        whole_bytes / parked_bytes: one expert's weights per device, replicated and parked.

    "auto" takes host memory only where it changes the layout: on a chip that weighs the
    replicated weights for Ulysses (``chips.ULYSSES_WEIGHT_FRACTION``), when one expert
    whole fits that share but one whole beside the other parked in HBM does not (Wan 2.2
    A14B on v6e-8: 26.67 GiB fits, 26.67 + 3.33 does not; dry runs in
    benchmarks/dry_run_results.md).
    """
    if mode != "auto":
        return mode
    if chip is None or chip.name not in chips.ULYSSES_WEIGHT_FRACTION:
        return "device"
    changes = (chips.prefers_ulysses(chip, whole_bytes)
               and not chips.prefers_ulysses(chip, whole_bytes + parked_bytes))
    return "pinned_host" if changes else "device"


def resident_weight_bytes(family, model_id: str, cfg: dict, dtype: str,
                          park_over: int | None = None, park_memory: str = "device",
                          chip=None, sp_over: int | None = None, rules=(),
                          quantize: str = "none") -> int:
    """Bytes of transformer weights one device holds when they are replicated.

    Every parameter of ``family.transformer.empty(cfg, dtype)`` (meta tensors: no RAM, about
    0.3 s for a 14B config) at the dtype a run loads it in (``dtype``, float32 where
    ``from_pretrained`` keeps it), times the experts that stay resident
    (``checkpoint.expert_count``: 2 for Wan 2.2 A14B). Wan 2.1 T2V 14B in bfloat16:
    26.67 GiB; its I2V: 30.59; HunyuanVideo-1.5: 15.51.

    ``park_over``: the device count a two-expert model's idle expert is parked over
    (``engine.programs.experts.ExpertParking``), or None (both whole). Then the second
    expert counts 1/``park_over`` of its bytes (rounded up; a weight no dimension of which
    divides stays whole, a few MiB at most: the dry run counts them exactly). A14B in
    bfloat16 over 8 devices: 26.67 + 3.33 GiB instead of 53.3; nothing for the idle expert
    where ``idle_expert_memory(park_memory, chip, ...)`` parks it in host memory.

    ``sp_over`` with ``rules`` (the family's sharding rules): weights whose rule splits them
    over "sp" even when tp is 1 (Wan 2.1 I2V's image cross-attention, 3.9 GiB at 14B) count
    1/``sp_over`` of their bytes, as a Ulysses layout with that sp holds them.

    ``quantize`` ("int8" / "fp8"): the family's 8-bit layers count one byte per weight plus
    their float32 scales (``engine.weights.quantize``).
    """
    model = family.transformer.empty(cfg, getattr(torch, dtype))
    quantize_mod.apply(model, family, quantize)  # 8-bit weights and their float32 scales
    one = sum(_held_bytes(name, p, rules, sp_over) for name, p in model.named_parameters())
    experts = expert_count(read_model_index(model_id))
    if experts == 2 and park_over:
        parked = -(-one // park_over)
        if idle_expert_memory(park_memory, chip, one, parked) == "pinned_host":
            return one
        return one + parked
    return one * experts


def _held_bytes(name: str, param, rules, sp_over: int | None) -> int:
    """Bytes of one weight a device holds under Ulysses: 1/``sp_over`` where its first
    matching rule names "sp", else all of it."""
    nbytes = param.numel() * param.element_size()
    rule = next((axes for rx, axes in rules if re.search(rx, name)), ())
    names = {x for a in rule if a is not None for x in (a if isinstance(a, tuple) else (a,))}
    return -(-nbytes // sp_over) if sp_over and "sp" in names else nbytes


def resolve_run_mesh(config, family, cfg: dict | None, n_devices: int, chip) -> MeshShape:
    """The (dp, tp, sp) of a run of ``config`` (a ``RunConfig``) on ``n_devices`` devices of
    ``chip`` (a ``chips.Chip``, None off TPU): the --dp/--tp/--sp flags, and for those left
    unset the defaults of ``resolve_mesh_shape``, with Ulysses where ``chips.prefers_ulysses``
    says so for this checkpoint's replicated weights. ``cfg``: the transformer config (None
    when the stage loads no transformer; then only the chip decides). The run and the dry run
    both resolve their mesh here, so a dry run predicts the run's layout.

    Raises:
        UsageError: naming --dp/--tp/--sp and the rule they break.
    """
    layout, video = config.layout, config.video
    weighed = cfg is not None and chip is not None and chip.name in chips.ULYSSES_WEIGHT_FRACTION
    # --park_weights (not off) keeps a two-expert model's idle expert parked over every
    # device wherever both whole would not fit (experts.park_idle_expert), so only then do
    # they count as one whole and one parked.
    park_over = n_devices if config.run.park_weights != "off" else None
    # The Ulysses candidate's sp (tp 1; dp as resolve_mesh_shape picks it), for the weights
    # the family's rules split over sp even then.
    # The batch the default dp serves (the family's smallest pass); a given --dp is checked
    # against the step's whole batch.
    batch = (family.transformer.layout_batch(config)
             if family.transformer.layout_batch and not layout.dp else video.batch)
    dp = layout.dp or (2 if batch == 2 and n_devices % 2 == 0 else 1)
    weights = resident_weight_bytes(
        family, config.model.model_id, cfg, config.model.dtype, park_over,
        config.run.park_memory, chip, sp_over=max(n_devices // dp, 1),
        rules=family.transformer.sharding_rules(config),
        quantize=config.model.quantize) if weighed else None
    no_sp = not family.transformer.block_stack.sequence_parallel
    shape = resolve_mesh_shape(
        layout.dp, layout.tp, layout.sp, n_devices, batch=batch,
        num_heads=family.transformer.num_heads(cfg) if cfg else None,
        tokens=(family.sizes.token_count(cfg, video.height, video.width, video.frames,
                                         config.model.model_id) if cfg else None),
        prefer_sp=chips.prefers_ulysses(chip, weights) and not no_sp,
        default_sp=chip and family.transformer.default_sp.get(chip.name))
    if no_sp and shape.sp > 1:
        fail("--sp", shape.sp, f"{family.name} takes no sequence parallelism: give --dp and "
             f"--tp whose product is the device count ({n_devices}; tp divides the heads)")
    return shape
