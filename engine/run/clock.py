"""Wall-clock points of the process, for the report's time-to-first-video split: when the
process started (the kernel's record, so the interpreter's own start-up counts too) and when
the entry point finished its imports."""

from __future__ import annotations

import os
import time

# Epoch seconds at which ``generate_flax.py`` finished importing (``mark_imports_done``), or
# None where no entry point marked it (tests and benchmarks calling the engine directly).
_IMPORTS_DONE: list[float] = []


def process_start_time() -> float:
    """Epoch seconds at which this process started, from ``/proc/self/stat`` (field 22, in
    clock ticks since boot) and ``/proc/uptime``; 10 ms resolution. Where /proc is missing
    (not Linux), the time this module was imported, which is later than the true start."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces; the fields after its ")" do not.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_ticks = int(fields[19])  # field 22 of the whole line
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return _MODULE_IMPORTED


_MODULE_IMPORTED = time.time()


def mark_imports_done() -> float:
    """Record now as the end of the entry point's imports; returns the seconds from the
    process start (what the report calls ``imports_s``)."""
    _IMPORTS_DONE[:] = [time.time()]
    return _IMPORTS_DONE[0] - process_start_time()


def imports_done_at() -> float | None:
    """Epoch seconds of ``mark_imports_done``, or None when nothing marked it."""
    return _IMPORTS_DONE[0] if _IMPORTS_DONE else None
