"""``--dry_run --topology T --aot_export DIR``: the programs the dry run compiles for T, written
as entries of the executable cache (``engine.programs.executables``) that a run on T loads.

The round trip: compile on any host (no TPU), copy DIR to the TPU VM, run there with
``--executable_cache_dir DIR`` and the same flags. The dry run compiles the run's own
programs (the same ``compile_step`` and VAE decoder, from shapes) on the topology's devices in
the run's mesh order, and the entries are keyed as the run keys them: program, input
signature, device ids; the header's parts (source digest, library versions, platform, device
kind and count, program-shaping settings with the dry run's own options left out) are
compared on load, so a TPU VM with other versions or flags gets a named miss and compiles.
The VAE decode is compiled with the compiler's full convolution search (not the dry run's
fast one), as a run compiles it. The step-caching programs are not exported.

**Not yet verified on a TPU**: the keys are checked against a real run's, deviceless
(``tests/test_time_to_ready.py``); whether libtpu on a TPU VM accepts the payloads is not.
"""

from __future__ import annotations

import contextlib
import os
import types

from engine.pipeline.stages import program_settings
from engine.programs import executables
from engine.run import chips
from engine.run.errors import fail

# The most chips one TPU VM holds (v5e-8, v6e-8 with 8; a v5p VM has 4): a larger slice runs
# one process per host, and a multi-process run does not use the executable cache.
MAX_CHIPS_ONE_HOST = {"v5e": 8, "v6e": 8, "v5p": 4}


def check_topology(config, devices) -> None:
    """Refuse a topology whose run spans several hosts (the entries would never load).
    libtpu's topology description places v6e:2x4 on two hosts of 4 chips, while a v6e-8 VM is
    one host of 8: the chip count decides here.

    Raises:
        UsageError: naming --aot_export and the rule.
    """
    if config.dry.aot_export is None:
        return
    chip = config.dry.topology.split(":")[0]
    limit = MAX_CHIPS_ONE_HOST.get(chip, 0)
    n = chips.count_chips(devices)
    if n > limit:
        fail("--aot_export", config.dry.aot_export, f"{config.dry.topology} has {n} chips; a "
             f"{chip} VM holds at most {limit}, and a multi-host run does not use the "
             "executable cache")


@contextlib.contextmanager
def exporting(config, modules: dict, mesh):
    """Within the block, the programs compiled through ``executables.compile_program`` are
    written to ``--aot_export`` (nothing without it). ``modules``: {"transformer", and
    "transformer_2" for a two-expert model, "vae"}, the abstract modules, whose configs join
    the key as a run's pipeline's do. Yields a dict the block's end fills with the report's
    entry: the folder, the programs written, and that TPU verification is pending."""
    out: dict = {}
    if config.dry.aot_export is None:
        yield out
        return
    before = dict(executables.STATS)
    settings = program_settings(config, types.SimpleNamespace(**modules))
    with executables.caching(config.dry.aot_export, settings, mesh):
        yield out
    done = executables.stats_since(before)
    out.update(dir=os.path.abspath(config.dry.aot_export), programs_written=done["compiled"],
               verified_on_tpu=False)
