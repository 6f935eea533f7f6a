"""User-facing errors.

Why a dedicated type: the CLI turns a :class:`TrellisUserError` into one clear line on stderr and exit
code 2 (no traceback), while any other exception is an internal error (exit 1). Every check of user
input (files, rows, flags) raises this type with a message that names the file/row/flag and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Set by ``trellis train --nproc`` in its ranks: the folder a rank writes its refusal of bad input to, so the
#: launcher raises it as its own error (one line on the CLI, a :class:`TrellisUserError` for a Python caller).
REFUSAL_DIR_ENV = "TRELLIS_REFUSAL_DIR"


class TrellisUserError(Exception):
    """Bad input from the user: a file, row, flag or value that cannot be used as given."""


class BudgetTooSmall(TrellisUserError):
    """A memory budget below the smallest that works; ``need`` is that smallest, in bytes.

    Why its own type: ranks that refuse their parts' budgets together (:meth:`trellis.distributed.comm.Comm.
    refuse_together`) let the rank that needs the most speak, so the one line printed names a budget that
    satisfies every rank.
    """

    def __init__(self, message: str, need: int) -> None:
        super().__init__(message, need)  # both in args: the error survives pickling (a worker's error)
        self.need = int(need)

    def __str__(self) -> str:
        return str(self.args[0])


class RankRefused(TrellisUserError):
    """This rank's input was refused and another rank of the job printed why: exit 2 without a second line."""


class ProcessFailure(RuntimeError):
    """A process the run depends on died or hung (a sampler worker): not bad input, but one clear line too.

    The CLI prints its message on one line and exits 1 (``TRELLIS_TRACEBACK=1`` shows the traceback).
    """


def user_check(cond: bool, message: str) -> None:
    """Raise :class:`TrellisUserError` with ``message`` unless ``cond`` holds."""
    if not cond:
        raise TrellisUserError(message)


def report_to_launcher(exc: TrellisUserError) -> bool:
    """In a rank started by the launcher, hand ``exc`` to it (``refused-<rank>.txt``); False elsewhere.

    Why: each rank printed its refusal itself, so a Python caller of a multi-rank ``trellis.train`` got a
    ``RuntimeError`` ("exit code 2") instead of the error, and the CLI a line per rank.
    """
    folder = os.environ.get(REFUSAL_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    rank = os.environ.get("RANK", "0")
    tmp = Path(folder, f".refused-{rank}.tmp")
    tmp.write_text(str(exc))
    tmp.replace(Path(folder, f"refused-{rank}.txt"))  # whole or absent when the launcher reads it
    return True


def launcher_refusal(folder: str | os.PathLike[str]) -> TrellisUserError | None:
    """The refusal the lowest refusing rank handed to the launcher (:func:`report_to_launcher`), if any."""
    found = sorted(Path(folder).glob("refused-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
    return TrellisUserError(found[0].read_text()) if found else None
