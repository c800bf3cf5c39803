"""The device mesh: axes ("dp", "tp", "sp") and how their sizes are chosen."""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType, Mesh

from engine.run.errors import fail

AXES = ("dp", "tp", "sp")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    dp: int
    tp: int
    sp: int


def resolve_mesh_shape(dp: int | None, tp: int | None, sp: int | None, n_devices: int, *,
                       batch: int, num_heads: int | None, tokens: int | None,
                       prefer_sp: bool = False, default_sp: int | None = None) -> MeshShape:
    """Choose (dp, tp, sp) from the flags (None = choose) and the device count.

    Default: dp = 2 when CFG doubles the batch and the device count is even (the CFG pair splits
    over dp, as earlier Wan TPU ports do), tp = the largest divisor of the rest that divides the
    head count, sp = what is left. With ``prefer_sp`` (``engine.weights.layout`` sets it by
    ``chips.prefers_ulysses``) and neither --tp nor --sp given: tp = 1 and sp = the rest
    (Ulysses: the attention's all-to-all turns tokens over sp into heads over sp), when the
    head count divides over it; else the default above. Otherwise, with ``default_sp`` (the
    family's ``default_sp`` for the chip) and neither flag given: sp = ``default_sp`` and
    tp = the rest, when that leaves tp >= 2 (the weights stay split, as in the layouts the dry
    run checked) and the heads divide over tp * sp.

    Args:
        batch: the transformer's batch (2 with CFG, else 1).
        num_heads: attention heads (None when the config is not known yet).
        tokens: video tokens per sample (None when unknown). Any count works with sp: the
            token axis is padded to a multiple of sp inside the model call
            (``sharding.add_sequence_parallel_hooks``); it is kept for callers and reports.

    Raises:
        UsageError: naming --dp/--tp/--sp and the rule they break.
    """
    if dp is None:
        dp = 2 if batch == 2 and n_devices % 2 == 0 and (tp or 1) * (sp or 1) * 2 <= n_devices \
            else 1
    if prefer_sp and tp is None and sp is None and n_devices % dp == 0 and (
            num_heads is None or num_heads % (n_devices // dp) == 0):
        tp = 1
    elif default_sp and tp is None and sp is None and n_devices % (dp * default_sp) == 0:
        rest = n_devices // (dp * default_sp)
        if rest >= 2 and (num_heads is None or num_heads % (rest * default_sp) == 0):
            tp, sp = rest, default_sp
    if tp is None:
        rest = n_devices // (dp * (sp or 1)) if n_devices % (dp * (sp or 1)) == 0 else 1
        tp = max(t for t in range(1, rest + 1)
                 if rest % t == 0 and (num_heads is None or num_heads % t == 0))
    if sp is None:
        sp = n_devices // (dp * tp) if n_devices % (dp * tp) == 0 else 1
    if dp * tp * sp != n_devices:
        fail("--dp/--tp/--sp", f"{dp}x{tp}x{sp}",
             f"the product must equal the device count {n_devices}")
    if batch % dp:
        fail("--dp", dp, f"must divide the transformer batch ({batch}: 2 with CFG, else 1)")
    if num_heads is not None and num_heads % tp:
        fail("--tp", tp, f"must divide the attention head count {num_heads}")
    return MeshShape(dp, tp, sp)


def make_mesh(shape: MeshShape, devices=None):
    """A ``jax.sharding.Mesh`` with axes ("dp", "tp", "sp") over ``devices`` (default: all).

    Axes are ``AxisType.Auto``: the torch model code carries no sharding annotations, so GSPMD
    propagates shardings from the weights and inputs we place.
    """
    from jax.experimental import mesh_utils
    sizes, types = (shape.dp, shape.tp, shape.sp), (AxisType.Auto,) * 3
    try:
        return jax.make_mesh(sizes, AXES, axis_types=types, devices=devices)
    except NotImplementedError:
        # jax.make_mesh maps each logical axis onto whole physical torus axes, which some
        # layouts cannot do (dp2 x tp4 x sp2 on a v6e 4x4 slice: after 4 and 4 nothing is left
        # for the two 2s). Splitting a physical axis keeps ring neighbours adjacent.
        grid = mesh_utils.create_device_mesh(sizes, devices or jax.devices(),
                                             allow_split_physical_axes=True)
        return Mesh(grid, AXES, axis_types=types)


def spatial_mesh(devices):
    """A mesh over ``devices`` with all of them on "sp" (dp = tp = 1), for a program that
    splits a frame's width over every device, such as a family's on-device VAE encode
    (``families.base.VaePrograms.encoder``), which runs before the transformer's mesh exists."""
    return make_mesh(MeshShape(dp=1, tp=1, sp=len(devices)), devices)
