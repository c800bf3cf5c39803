"""Compile while loading (``--overlap_compile``): the transformer step and the VAE decode
lowered and compiled from shapes on a background thread while the main thread reads the
checkpoint, encodes the prompts and places the weights.

The programs need only shapes, dtypes and shardings, all known before any weight is read:
the transformer and the VAE are built again from their configs with meta weights (a module
of their own, so the thread never touches the pipeline's modules, which placement changes),
their weights laid out by the same sharding rules placement applies, the model inputs from
``family.transformer.abstract_model_inputs``. The thread goes through
``executables.compile_program``, so the executable cache applies as in a sequential run (a
hit loads instead of compiling).

Thread safety, why it holds: torchax's interception is torch's function and dispatch mode
stacks, which are thread-local, so the main thread's torch CPU work (the text encoder,
``from_pretrained``) never enters torchax while the thread traces; torchax's own runtime
properties are thread-local too. What is process-wide is set before the thread starts and
not changed while it runs: the SDPA override and our lowerings (``install_attention``), and
the meta-device module construction (``accelerate.init_empty_weights`` patches
``nn.Module`` for the whole process, so the meta modules are built on the main thread before
``from_pretrained`` runs there). JAX's tracing state is thread-local.

Nothing compiled ahead is used unless its input signature (pytree, shapes, dtypes,
shardings) equals the placed arguments' exactly; a mismatch or an error in the thread is a
warning naming it, then the sequential compile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types

import jax
import torch

from engine.files.checkpoint import model_config_dir, read_component_config
from engine.programs import executables
from engine.programs.step import compile_step
from engine.run.errors import first_line
from engine.weights.abstract import abstract_inputs, abstract_transformer, abstract_vae

log = logging.getLogger("generate_flax")

# Host cores from which ``auto`` overlaps on a CPU backend. Measured on this project's 2-core
# host (benchmarks/time_to_ready_results.md): the thread's XLA compile and the main thread's
# torch CPU work contend for the two cores, so the overlap gains nothing there.
MIN_CPU_CORES = 4


def wanted(setting: str, stage: str, devices) -> bool:
    """Whether a run compiles while loading: ``setting`` is ``--overlap_compile`` ("auto",
    "on", "off"); only the stages that load and compile the step (all, denoise) do. ``auto``
    is on with accelerators, or on a CPU backend with at least ``MIN_CPU_CORES`` cores, and
    off in a multi-process run."""
    if stage not in ("all", "denoise") or setting == "off":
        return False
    if setting == "on":
        return True
    if jax.process_count() > 1:
        return False
    return devices[0].platform != "cpu" or (os.cpu_count() or 1) >= MIN_CPU_CORES


class Ahead:
    """The background compile of one run's programs; ``start`` builds and starts it.

    Attributes once ``join`` returned: ``step`` ((compiled, seconds) or None),
    ``step_args`` (the abstract arguments it was compiled for), ``decoder`` (an abstract
    ``ChunkedDecoder`` with every program compiled, or None), ``vae_s`` (its seconds),
    ``error`` (the thread's exception or None), ``stats`` (``executables.STATS`` spent in
    the thread), ``started``/``ended`` (``time.perf_counter()`` at the thread's start and
    end), ``wait_s`` (seconds the main thread waited in ``join``), ``joined`` (its
    ``perf_counter()`` when ``join`` was called).
    """

    def __init__(self, work, settings: dict, cache_dir: str | None, mesh):
        self.settings = settings
        self.step = self.step_args = self.decoder = self.latents = self.error = None
        self.vae_s, self.stats, self.wait_s, self.joined = 0.0, {}, 0.0, None
        self.started = self.ended = None
        self._work, self._cache_dir, self._mesh = work, cache_dir, mesh
        self._thread = threading.Thread(target=self._run, name="overlap-compile", daemon=True)

    def _run(self) -> None:
        self.started = time.perf_counter()
        before = executables.stats_snapshot()
        try:
            with executables.caching(self._cache_dir, self.settings, self._mesh):
                self._work(self)
        except Exception as e:  # noqa: BLE001 - reported at join, then a sequential compile
            self.error = e
        self.stats = executables.stats_since(before)
        self.ended = time.perf_counter()

    def join(self) -> Ahead:
        """Wait for the thread; logs its error (the caller then compiles sequentially)."""
        self.joined = time.perf_counter()
        self._thread.join()
        self.wait_s = time.perf_counter() - self.joined
        if self.error is not None:
            log.warning("overlap compile: the background compile failed (%s: %s); compiling "
                        "after placement instead", type(self.error).__name__,
                        first_line(self.error))
        return self

    def timings(self, began: float) -> dict:
        """The overlap's figures, seconds from ``began`` (``time.perf_counter()`` before the
        main thread built the shapes): ``overlap_build_s`` (that build, main thread),
        ``overlap_compile_chain_s`` (the build and the thread: the compile chain),
        ``overlap_load_chain_s`` (the main thread from the thread's start to the join:
        read, encode, place), ``overlap_wall_s`` (``began`` to the later end of the two),
        ``overlap_wait_s`` (the main thread's wait in ``join``), ``overlap_thread_start_s``
        and ``overlap_load_end_s`` (when the thread started and the load chain ended), and
        the thread's lower / compile / load seconds (``overlap_lower_s``,
        ``overlap_xla_compile_s``, ``overlap_load_s``)."""
        return dict(overlap_build_s=self.started - began,
                    overlap_compile_chain_s=self.ended - began,
                    overlap_load_chain_s=self.joined - self.started,
                    overlap_wall_s=max(self.ended, self.joined) - began,
                    overlap_wait_s=self.wait_s,
                    overlap_thread_start_s=self.started - began,
                    overlap_load_end_s=self.joined - began,
                    overlap_lower_s=self.stats.get("lower_s", 0.0),
                    overlap_xla_compile_s=self.stats.get("compile_s", 0.0),
                    overlap_load_s=self.stats.get("load_s", 0.0))

    def step_for(self, args: tuple):
        """(compiled, seconds) of the step when it was compiled for exactly ``args``' input
        signature (params, buffers, latents, timestep, inputs), else None (warned)."""
        if self.step is None:
            return None
        why = difference(self.step_args, args)
        if why is not None:
            log.warning("overlap compile: the placed step's input signature differs from "
                        "the one compiled from shapes (%s); compiling it again", why)
            return None
        return self.step

    def decoder_for(self, decoder, latents) -> bool:
        """Give ``decoder`` (the placed ``ChunkedDecoder``) the programs compiled ahead when
        its weights and ``latents`` have their signatures; True when it took them."""
        ahead = self.decoder
        if ahead is None or self.error is not None:
            return False
        mine = (ahead.placed["params"], ahead.placed["buffers"], ahead.mean, ahead.inv_std,
                self.latents)
        theirs = (decoder.placed["params"], decoder.placed["buffers"], decoder.mean,
                  decoder.inv_std, latents)
        why = difference(mine, theirs)
        if why is not None:
            log.warning("overlap compile: the placed VAE decode's signature differs from the "
                        "one compiled from shapes (%s); compiling it again", why)
            return False
        decoder.adopt(ahead)
        return True


def difference(ahead: tuple, placed: tuple) -> str | None:
    """None when ``placed`` (arguments) has ``ahead``'s input signature
    (``executables.signature``: pytree, shapes, dtypes, shardings), else the first
    difference named: "pytree", or the leaf's index with both [shape, dtype, sharding]."""
    a, b = executables.signature(ahead), executables.signature(placed)
    if a["tree"] != b["tree"]:
        return "pytree"
    for i, (x, y) in enumerate(zip(a["leaves"], b["leaves"], strict=True)):
        if x != y:
            return f"leaf {i}: {x} from shapes, {y} placed"
    return None


def start(config, family, mesh, settings_of, fallbacks, *, decode: bool) -> Ahead | None:
    """Build the run's programs from shapes on the main thread's share (meta modules, their
    abstract weights and inputs), then start compiling them on a thread; None when the
    checkpoint's configs are not local (nothing to build from before the read).

    Args:
        config: the run's (first video's) ``RunConfig``.
        family: its ``families.ModelFamily``.
        mesh: the run's mesh; the attention must already be installed on it.
        settings_of: ``(pipe-like) -> dict``: the executable cache's settings of a pipeline
            (``stages.program_settings`` bound to ``config``); given a namespace of the meta
            modules, it gives what the loaded pipeline will.
        fallbacks: the run's ``sharding.Fallbacks``.
        decode: compile the VAE decode too (stage all).
    """
    model_id, folder = config.model.model_id, model_config_dir(config.model.model_id)
    cfg = read_component_config(model_id, "transformer")
    vae_cfg = read_component_config(model_id, "vae")
    if cfg is None or vae_cfg is None or folder is None:
        return None
    step_on = config.step_cache is None or not config.step_cache.on
    placed = abstract_transformer(config, family, cfg, mesh)
    vae, vae_placed = abstract_vae(family, folder, mesh, config)
    cfg2 = read_component_config(model_id, "transformer_2")
    parts = types.SimpleNamespace(
        transformer=placed["module"]._model, vae=vae,
        transformer_2=None if cfg2 is None else family.transformer.empty(
            cfg2, getattr(torch, config.model.dtype)))
    latents, t, inputs = abstract_inputs(config, family, cfg, vae_cfg, mesh)
    decoder = family.vae.decoder(vae_placed, vae, mesh, tiling=config.run.vae_tiling,
                                 abstract=True, fallbacks=fallbacks) if decode else None
    fn = family.transformer.step_fn(placed["module"], config) if step_on else None

    def work(ahead: Ahead) -> None:
        if fn is not None:
            ahead.step_args = (placed["params"], placed["buffers"], latents, t, inputs)
            ahead.step = compile_step(placed, mesh, fn, latents, t, inputs)
        if decoder is not None:
            ahead.vae_s = decoder.compile(latents)
            ahead.decoder, ahead.latents = decoder, latents

    ahead = Ahead(work, settings_of(parts), config.run.executable_cache_dir, mesh)
    ahead._thread.start()
    return ahead
