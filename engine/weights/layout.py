"""The run's default layout: Ulysses where the checkpoint's replicated weights leave room
(a two-expert model's idle expert counted parked, unless ``--park_weights off``).

``resolve_run_mesh`` is where the run (``generate_flax.resolve_mesh``, the server) and the dry
run choose (dp, tp, sp), so that a dry run predicts the run's layout. It weighs the
transformer from its config alone (meta tensors), before any weight is read.
"""

from __future__ import annotations

import torch

from engine.files.checkpoint import expert_count, read_model_index
from engine.run import chips
from engine.run.mesh import MeshShape, resolve_mesh_shape


def resident_weight_bytes(family, model_id: str, cfg: dict, dtype: str,
                          park_over: int | None = None) -> int:
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
    bfloat16 over 8 devices: 26.67 + 3.33 GiB instead of 53.3.
    """
    model = family.transformer.empty(cfg, getattr(torch, dtype))
    one = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = expert_count(read_model_index(model_id))
    if experts == 2 and park_over:
        return one + -(-one // park_over)
    return one * experts


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
    weights = resident_weight_bytes(family, config.model.model_id, cfg, config.model.dtype,
                                    park_over) if weighed else None
    return resolve_mesh_shape(
        layout.dp, layout.tp, layout.sp, n_devices, batch=video.batch,
        num_heads=family.transformer.num_heads(cfg) if cfg else None,
        tokens=(family.sizes.token_count(cfg, video.height, video.width, video.frames) if cfg
                else None),
        prefer_sp=chips.prefers_ulysses(chip, weights),
        default_sp=chip and family.transformer.default_sp.get(chip.name))
