"""The models and inputs of a run as sharded ``jax.ShapeDtypeStruct``s, with no weights:
what ``--dry_run`` compiles and ``--estimate`` traces (both build them here).

The transformer and VAE are built from the model's configs with meta weights
(``accelerate.init_empty_weights``), so even 14B needs no RAM for weights.
"""

from __future__ import annotations

import jax
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop
from torchax.ops import mappings

from engine.weights import scan_layers
from engine.weights.sharding import (
    add_sequence_parallel_hooks,
    module_sharding_specs,
    residual_token_axes,
)


def abstract_arrays(tensors: dict, mesh, specs=None, dtype=None) -> dict:
    """torch tensors (meta or real) -> ``jax.ShapeDtypeStruct``s laid out on ``mesh``."""
    return {k: jax.ShapeDtypeStruct(
        tuple(v.shape), dtype or mappings.t2j_dtype(v.dtype),
        sharding=NamedSharding(mesh, (specs or {}).get(k, P()))) for k, v in tensors.items()}


def abstract_transformer(config, family, cfg: dict, mesh) -> dict:
    """The transformer with meta weights, as ``place_module`` would place it: ``params`` and
    ``buffers`` are sharded ``ShapeDtypeStruct``s."""
    model = family.transformer
    transformer = model.empty(cfg, getattr(torch, config.model.dtype))
    if config.layout.scan_layers:
        scan_layers.scan_blocks(transformer, stack=model.block_stack)
    axes = residual_token_axes(mesh, config.layout.megatron_sp)
    if axes:
        add_sequence_parallel_hooks(transformer, mesh, stack=model.block_stack, axes=axes)
    jm = interop.JittableModule(transformer)
    specs, counts, _ = module_sharding_specs(
        transformer, {k: v.shape for k, v in jm.params.items()}, model.sharding_rules(config),
        mesh, fsdp=config.layout.fsdp)
    return dict(module=jm, specs=specs, rule_counts=counts,
                params=abstract_arrays(jm.params, mesh, specs),
                buffers=abstract_arrays(jm.buffers, mesh))


def abstract_vae(family, folder: str, mesh):
    """(VAE module with meta weights, its decode weights as sharded ``ShapeDtypeStruct``s)."""
    vae = family.vae.empty(folder)
    jv = interop.JittableModule(vae)
    keep = family.vae.is_decode_weight
    params = {k: v for k, v in jv.params.items() if keep(k)}
    buffers = {k: v for k, v in jv.buffers.items() if keep(k)}
    return vae, dict(module=jv, params=abstract_arrays(params, mesh),
                     buffers=abstract_arrays(buffers, mesh))


def abstract_inputs(config, family, cfg: dict, vae_cfg: dict, mesh):
    """(latents, timestep, model inputs) as sharded ``ShapeDtypeStruct``s."""
    rep, over_dp = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    video = config.video
    shape = family.sizes.latent_shape(vae_cfg, video.height, video.width, video.frames)
    latents = jax.ShapeDtypeStruct(shape, jax.numpy.float32, sharding=rep)
    inputs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=over_dp),
                          family.transformer.abstract_model_inputs(cfg, config))
    t = jax.ShapeDtypeStruct((1,), getattr(jax.numpy, family.transformer.timestep_dtype),
                             sharding=rep)
    return latents, t, inputs
