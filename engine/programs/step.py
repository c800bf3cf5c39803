"""The denoising step as one sharded, ahead-of-time compiled program."""

from __future__ import annotations

import time

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from engine.programs import executables


def compile_step(placed: dict, mesh, fn, latents, timestep, inputs, extra=None):
    """JIT and AOT-compile one model call; returns (compiled, seconds).

    Args:
        placed: the transformer as ``sharding.place_module`` returns it (``params`` and
            ``buffers`` may be ``ShapeDtypeStruct``s: a deviceless compile).
        mesh: the ("dp", "tp", "sp") mesh.
        fn: the family's torch step function (``ModelFamily.transformer.step_fn``).
        latents: (1, C, F', h, w) float32, replicated.
        timestep: (1,) int32 or float32, replicated.
        inputs: the family's model-inputs pytree, batch over "dp".
        extra: JSON-able static parts the arguments do not show (a sparse program's
            ``splash.svg.SparseScope``), for the executable cache's key.

    The compiled call takes (params, buffers, latents, timestep, inputs) and returns the
    replicated noise prediction. Weights keep the shardings they were placed with; GSPMD
    propagates the rest.
    """
    in_shardings, out_shardings = step_shardings(placed, mesh)
    jitted = jax.jit(interop.jax_view(fn), in_shardings=in_shardings,
                     out_shardings=out_shardings)
    args = (placed["params"], placed["buffers"], latents, timestep, inputs)
    t0 = time.perf_counter()
    # Loaded from the executable cache when one is open and matches (no tracing then).
    compiled, _ = executables.compile_program("transformer_step", lambda: jitted.lower(*args),
                                              args, extra=extra)
    return compiled, time.perf_counter() - t0


def step_shardings(placed: dict, mesh):
    """(in_shardings, out_sharding) of a step program: weights as placed, buffers, latents
    and timestep replicated, model inputs over "dp"; the noise prediction replicated."""
    replicated = NamedSharding(mesh, P())
    param_sh = {k: NamedSharding(mesh, s) for k, s in placed["specs"].items()}
    return (param_sh, replicated, replicated, replicated, NamedSharding(mesh, P("dp"))), \
        replicated
