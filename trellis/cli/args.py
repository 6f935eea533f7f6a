"""Argument parsing shared by the subcommands.

Why: ``data``, ``demo`` and ``train`` each wrote the same ``type=`` function for a bounded integer
option, differing only in the bound and the wording of the two errors; the wording is kept per command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(minimum: int, not_int: str, too_small: str) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer ``>= minimum``.

    Args:
        minimum: The smallest accepted value.
        not_int: Error for text that is not an integer, formatted with ``text`` (``"{text!r} is not an integer"``).
        too_small: Error for a value below ``minimum``, formatted with ``value`` (``"{value} must be > 0"``).
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(not_int.format(text=text)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(too_small.format(value=value))
        return value

    return parse


#: ``--seed`` / ``--split-seed``: numpy's generators take no negative seed, torch's none beyond 64 bits (signed).
_seed = int_at_least(0, "{text!r} is not an integer", "{value} must be >= 0 (a seed is a non-negative integer)")


def seed_int(text: str) -> int:
    """A seed: an integer in ``[0, 2**63 - 1]``."""
    value = _seed(text)
    if value > 2**63 - 1:
        raise argparse.ArgumentTypeError(f"{value} must be at most 2**63 - 1 = {2**63 - 1}")
    return value


def add_progress_flag(parser: argparse.ArgumentParser, what: str = "progress bars on a terminal") -> None:
    """``--progress/--no-progress`` (default on), as ``train``, ``sweep`` and ``tune`` take it.

    Why everywhere: a script that passes ``--no-progress`` to every command was refused by the ones without it
    (``data generate``, ``data import``, ``partition``).
    """
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help=f"{what} (default: on)")
