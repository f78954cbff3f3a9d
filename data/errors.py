"""The input pipeline's exception types, and the one line the CLIs print for an OSError."""

from __future__ import annotations


class DataError(Exception):
    """Bad or missing input data.

    ``str(error)`` is a single line meant for the user: what is wrong, which
    file and line, and what to do about it. The CLIs print it as
    ``error: <message>`` and exit with status 2 instead of a traceback.
    """


class MissingSplitError(DataError):
    """The corpus has no such split (training goes on without validation then)."""


def os_error_line(error: OSError) -> str:
    """An OSError as one line for the user: ``path: reason`` where it names a file."""
    return f"{error.filename}: {error.strerror}" if error.filename else str(error)
