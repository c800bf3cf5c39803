"""One generation, stage by stage: the wing every entry point runs.

``generate_flax.py`` tells the story of one run in calls to this wing, the server
(``engine.serve``) keeps a warm model built from the same stages, and tests and benchmarks
call ``generate``. Nothing here parses flags: a run arrives as a frozen
``engine.run.config.RunConfig`` and its ``families.ModelFamily`` value.

    prologue   the run's start, shared by the CLI and the server: runtime, compile cache,
               devices, chip, block sizes, mesh, attention backend, kernel self-check, load
    stages     encode on the CPU, place, route SDPA to the kernel, compile, decode programs
    generation ``Generation``: load, encode, compile, warm up, time, report; ``generate``
"""

from engine.pipeline.generation import Generation, generate
from engine.pipeline.prologue import Prologue, start

__all__ = ["Generation", "Prologue", "generate", "start"]
