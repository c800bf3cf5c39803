"""The two errors a run reports as one line, and the exit codes they map to."""

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3  # --dry_run: the run does not fit the topology's HBM


class UsageError(Exception):
    """Bad flags or inputs: reported as one line before any model loads (exit 2)."""


class GenerationError(Exception):
    """A stage failed at run time (non-finite values, unreadable weights, OOM...) (exit 1)."""


def fail(flag: str, value, rule: str):
    """Raise ``UsageError("--flag='value': rule")``."""
    raise UsageError(f"{flag}={value!r}: {rule}")


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first non-empty line of an error's text, or its type name."""
    text = str(error).strip()
    return text.splitlines()[0][:limit] if text else type(error).__name__
