"""The input pipeline's exception types, and the one line the CLIs print for an OSError
or for running out of memory."""

from __future__ import annotations

import errno


class DataError(Exception):
    """Bad or missing input data.

    ``str(error)`` is a single line meant for the user: what is wrong, which
    file and line, and what to do about it. The CLIs print it as
    ``error: <message>`` and exit with status 2 instead of a traceback.
    """


class MissingSplitError(DataError):
    """The corpus has no such split (training goes on without validation then)."""


def os_error_line(error: OSError, *, again: str | None = None) -> str:
    """An OSError as one line for the user: ``path: reason`` where it names a file, and
    what to do where the disk is full (then `again`, such as "training resumes", says
    in brackets what running the command again does)."""
    line = f"{error.filename}: {error.strerror}" if error.filename else str(error)
    if error.errno == errno.ENOSPC:
        line += "; make room there and run the same command again"
        line += f" ({again})" if again else ""
    return line


def out_of_memory_line(error: BaseException, advice: str) -> str | None:
    """One line for host memory (MemoryError) or accelerator memory (XLA's RESOURCE_EXHAUSTED)
    running out, ending with `advice`; None for any other error."""
    if isinstance(error, MemoryError):
        return f"out of host memory ({error}); {advice}"
    text = str(error)
    if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and text.startswith(
        "RESOURCE_EXHAUSTED"
    ):
        return f"out of memory ({text.splitlines()[0][:200]}); {advice}"
    return None
