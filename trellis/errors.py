"""User-facing errors.

Why a dedicated type: the CLI turns a :class:`TrellisUserError` into one clear line on stderr and exit
code 2 (no traceback), while any other exception is an internal error (exit 1). Every check of user
input (files, rows, flags) raises this type with a message that names the file/row/flag and the fix.
"""

from __future__ import annotations


class TrellisUserError(Exception):
    """Bad input from the user: a file, row, flag or value that cannot be used as given."""


class ProcessFailure(RuntimeError):
    """A process the run depends on died or hung (a sampler worker): not bad input, but one clear line too.

    The CLI prints its message on one line and exits 1 (``TRELLIS_TRACEBACK=1`` shows the traceback).
    """


def user_check(cond: bool, message: str) -> None:
    """Raise :class:`TrellisUserError` with ``message`` unless ``cond`` holds."""
    if not cond:
        raise TrellisUserError(message)
