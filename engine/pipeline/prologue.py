"""The start of every run, the CLI's and the server's alike: the runtime, the persistent
compilation cache, the devices, the chip and its block sizes, the mesh, the attention
backend, the kernel's self-check, and the load of the diffusers pipeline."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from engine.files.checkpoint import read_component_config
from engine.pipeline import text_device
from engine.run import chips, runtime
from engine.run.config import RunConfig, resolve_attention_backend
from engine.weights import quantize
from engine.weights.layout import resolve_run_mesh


@dataclasses.dataclass(frozen=True)
class Prologue:
    """What a run knows once it sees its devices, before any weight is read.

    config: the run's ``RunConfig`` with the chip's block sizes resolved.
    family: the ``families.ModelFamily`` value that runs it.
    devices: the ``jax.Device`` list the mesh is built on.
    chip: ``chips.Chip`` of ``devices[0]``, None off TPU.
    mesh_shape: the (dp, tp, sp) ``MeshShape`` (``resolve_mesh``).
    attention: the SDPA backend ("splash", "stock_splash", "xla" or "cudnn"; "auto"
        resolved).
    self_check: the kernel self-check's entry (``runtime.check_attention_kernel``; None for
        a backend with no kernel, and where the run's stage calls no attention).
    cache_before: the persistent compilation cache's counters at the start, or None when
        the cache is off.
    """

    config: RunConfig
    family: Any
    devices: list
    chip: Any
    mesh_shape: Any
    attention: str
    self_check: dict | None
    cache_before: dict | None

    def load(self, skip: tuple = ()) -> tuple[Any, float]:
        """(the diffusers pipeline with the components this stage reads, less ``skip``
        (e.g. the text encoders when every prompt's embeddings are cached), seconds); the
        transformer's weights stay on the meta device until they are placed."""
        t0 = time.perf_counter()
        components = tuple(c for c in self.family.checkpoint.components[self.config.run.stage]
                           if c not in skip)
        pipe = self.family.text.load_pipeline(self.config, components)
        return pipe, time.perf_counter() - t0


def resolve_mesh(config: RunConfig, family, n_devices: int, chip=None):
    """The (dp, tp, sp) ``MeshShape`` for this run on ``chip`` (a ``chips.Chip``, None off TPU).

    Raises:
        UsageError: the flags' mesh does not divide the devices or the model (names the flag).
    """
    cfg = None if config.run.stage == "decode" else read_component_config(config.model.model_id,
                                                                      "transformer")
    return resolve_run_mesh(config, family, cfg, n_devices, chip)


def start(config: RunConfig, family, devices=None) -> Prologue:
    """Configure the runtime and resolve everything the devices decide.

    ``devices`` (default: all of ``jax.devices()``) lets tests build smaller meshes. The
    kernel self-check runs here, before minutes of weight loading, for the stages that call
    attention (all, denoise).

    Raises:
        UsageError: a mesh flag that does not fit (``resolve_mesh``); an ``--attention``
            backend this platform lacks (``resolve_attention_backend``); a ``--quantize``
            scheme the devices do not run at an 8-bit rate (``quantize.check_scheme``);
            ``--text_encoder_device mesh`` where the encoders do not fit
            (``text_device.plan``).
        GenerationError: the attention kernel failed its self-check.
    """
    runtime.configure_jax_platform()
    runtime.quiet_known_warnings()
    cache_on = runtime.enable_compilation_cache(config.run.compilation_cache_dir)
    cache_before = dict(runtime.CACHE_STATS) if cache_on else None
    devices = list(jax.devices() if devices is None else devices)
    attention = resolve_attention_backend(config.kernel.attention, jax.default_backend())
    chip = chips.chip_for_device_kind(devices[0].device_kind)
    quantize.check_scheme(config.model.quantize, family, devices[0].device_kind,
                          quantize.eight_bit_for(chip and chip.name, devices[0]))
    config = config.resolve_block_sizes(chip.name if chip else None)
    mesh_shape = resolve_mesh(config, family, len(devices), chip)
    text_device.plan(config, family, devices, chip)  # --text_encoder_device mesh: fits?
    self_check = None
    if config.run.stage in ("all", "denoise"):
        self_check = runtime.check_attention_kernel(
            attention, interpret=jax.default_backend() != "tpu")
    return Prologue(config=config, family=family, devices=devices, chip=chip,
                    mesh_shape=mesh_shape, attention=attention, self_check=self_check,
                    cache_before=cache_before)
