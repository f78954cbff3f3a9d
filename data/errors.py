"""The one exception type of the input pipeline."""

from __future__ import annotations


class DataError(Exception):
    """Bad or missing input data.

    ``str(error)`` is a single line meant for the user: what is wrong, which
    file and line, and what to do about it. The CLIs print it as
    ``error: <message>`` and exit with status 2 instead of a traceback.
    """


class MissingSplitError(DataError):
    """The corpus has no such split (training goes on without validation then)."""
