"""The models and inputs of a run as sharded ``jax.ShapeDtypeStruct``s, with no weights, laid
out exactly as placement lays out the real ones: what ``--dry_run`` compiles, ``--estimate``
traces, ``--overlap_compile`` compiles while the real weights load, and ``--aot_export``
writes. Exactness matters: the executable cache keys a program by its input signature
(shardings spelt as placement spells them), so a program built from these shapes is found by
the run that places the real arrays.

The transformer and VAE are built from the model's configs with meta weights
(``accelerate.init_empty_weights``), so even 14B needs no RAM for weights. Meta construction
patches torch process-wide: call these on the main thread.
"""

from __future__ import annotations

import jax
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop
from torchax.ops import mappings

from engine.weights import quantize, scan_layers
from engine.weights.sharding import (
    add_sequence_parallel_hooks,
    module_sharding_specs,
    residual_token_axes,
)


def abstract_arrays(tensors: dict, mesh, specs=None, dtype=None) -> dict:
    """{name: torch tensor (meta or real)} -> {name: ``jax.ShapeDtypeStruct``} on ``mesh``
    with ``specs[name]`` (default replicated) and ``dtype`` (default the tensor's)."""
    return {k: jax.ShapeDtypeStruct(
        tuple(v.shape), dtype or mappings.t2j_dtype(v.dtype),
        sharding=NamedSharding(mesh, (specs or {}).get(k, P()))) for k, v in tensors.items()}


def abstract_transformer(config, family, cfg: dict, mesh) -> dict:
    """The transformer with meta weights laid out as ``sharding.place_expert`` places the
    real one (blocks scanned first with --scan_layers, the family's rules, FSDP, then the
    sequence-parallel hooks): ``place_module``'s dict with ``ShapeDtypeStruct`` params and
    buffers, and ``rule_counts`` (matches per sharding rule)."""
    model = family.transformer
    module = model.empty(cfg, getattr(torch, config.model.dtype))
    quantize.apply(module, family, config.model.quantize)
    if config.layout.scan_layers:
        scan_layers.scan_blocks(module, stack=model.block_stack)
    jm = quantize.jittable(module)
    specs, counts, _ = module_sharding_specs(
        module, {k: v.shape for k, v in jm.params.items()}, model.sharding_rules(config),
        mesh, fsdp=config.layout.fsdp)
    axes = residual_token_axes(mesh, config.layout.megatron_sp)
    if axes:
        add_sequence_parallel_hooks(module, mesh, stack=model.block_stack, axes=axes)
    return dict(module=jm, specs=specs, rule_counts=counts,
                params=abstract_arrays(jm.params, mesh, specs),
                buffers=abstract_arrays(jm.buffers, mesh))


def abstract_vae(family, folder: str, mesh, config):
    """(VAE module with meta weights from ``folder``'s config and the run's ``config``, its
    decode weights as replicated ``ShapeDtypeStruct``s, as ``stages.prepare_decode`` places
    them)."""
    vae = family.vae.empty(folder, config)
    jv = interop.JittableModule(vae)
    keep = family.vae.is_decode_weight
    params = {k: v for k, v in jv.params.items() if keep(k)}
    # No rule: every weight replicated, spelt as place_module spells it (P(None, ...)).
    specs, _, _ = module_sharding_specs(vae, {k: v.shape for k, v in params.items()}, (), mesh)
    return vae, dict(module=jv, params=abstract_arrays(params, mesh, specs),
                     buffers=abstract_arrays({k: v for k, v in jv.buffers.items() if keep(k)},
                                             mesh))


def abstract_inputs(config, family, cfg: dict, vae_cfg: dict, mesh):
    """(latents (1, C, F', h, w) float32 replicated, timestep (1,) replicated, model inputs
    over "dp") as ``ShapeDtypeStruct``s, as ``stages.place_model_inputs`` places them."""
    rep, over_dp = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    video = config.video
    shape = family.sizes.latent_shape(vae_cfg, video.height, video.width, video.frames,
                                      model_id=config.model.model_id)
    latents = jax.ShapeDtypeStruct(shape, jax.numpy.float32, sharding=rep)
    inputs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=over_dp),
                          family.transformer.abstract_model_inputs(cfg, config))
    t = jax.ShapeDtypeStruct((1,), getattr(jax.numpy, family.transformer.timestep_dtype),
                             sharding=rep)
    return latents, t, inputs
