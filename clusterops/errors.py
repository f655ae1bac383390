"""Exception types shared by the library and mapped to exit codes by the CLI.

Exit codes (the contract in DESIGN.md):
  0  ok
  1  the thing checked is unhealthy / the job failed for good / not found
  2  usage or input error (bad spec, bad flag, bad file)
Other codes are documented by the commands that use them.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2


class ClusteropsError(Exception):
    """Base error: carries the exit code the CLI should end with."""

    exit_code = EXIT_FAIL

    def __init__(self, message: str, *, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else self.__class__.__name__


class InputError(ClusteropsError):
    """Bad user input: a spec, a profile, a flag value. Exit code 2.

    The message names the file, line and field where they are known.
    """

    exit_code = EXIT_USAGE


class NotFoundError(ClusteropsError):
    """An unknown job, node or path. Exit code 1 (a query that found nothing)."""

    exit_code = EXIT_FAIL


def where(path: object = None, line: int | None = None, field: str | None = None) -> str:
    """Format a location as ``file:line: field`` for one-line error messages."""
    parts = []
    if path is not None:
        parts.append(str(path) + (f":{line}" if line is not None else ""))
    if field:
        parts.append(field)
    return ": ".join(parts)
