"""One parser and one formatter of byte sizes (``--memory-budget 4G``, ``512MiB``, messages).

Why one: ``trellis train --memory-budget`` read a SIZE string while ``trellis sweep --memory-budget``
read a float of MiB, and four formatters printed sizes with different units and digits. ``K``/``M``/``G``/
``T`` (and ``KB``...) are decimal, ``KiB``/``MiB``/``GiB``/``TiB`` binary, as in ``df -H`` / ``df -h``.
"""

from __future__ import annotations

import os
import re

from trellis.errors import TrellisUserError

__all__ = ["UNITS", "format_budget", "format_size", "machine_memory", "parse_size"]

#: Multiplier of every accepted unit (lower-case; matching is case-insensitive).
UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
_BINARY = ("B", "KiB", "MiB", "GiB", "TiB")


def parse_size(text: str | int | float, *, bare_unit: str = "B", flag: str | None = None) -> int:
    """Bytes of a size: ``"2G"`` (decimal), ``"512MiB"`` (binary), ``"1.5gb"``, ``1000``.

    Args:
        text: The size; an int or float is already a count of ``bare_unit``.
        bare_unit: Unit of a number without one (default: ``B``; ``sweep --memory-budget`` keeps ``MiB``
            for compatibility with its old float-of-MiB flag).
        flag: Flag named in the error message (default: none).

    Returns:
        The size in bytes (rounded down).

    Raises:
        TrellisUserError: ``text`` is not a non-negative number with a known unit.
    """
    scale = UNITS[bare_unit.lower()]
    if isinstance(text, int | float) and not isinstance(text, bool):
        return int(text * scale)
    m = _SIZE.fullmatch(str(text))
    if not m or m.group(2).lower() not in UNITS:
        where = f"{flag}: " if flag else ""
        raise TrellisUserError(f"{where}cannot read the size {text!r}; write e.g. 2G, 512MiB or 1000000")
    unit = m.group(2).lower()
    value = float(m.group(1)) * (UNITS[unit] if unit else scale)
    if not unit and scale == 1 and value != int(value):  # "1.5" was read as 1 byte: a unit was surely meant
        where = f"{flag}: " if flag else ""
        raise TrellisUserError(f"{where}{text!r} is a fraction of a byte; give a unit, e.g. {m.group(1)}G or "
                               f"{m.group(1)}GiB")
    return int(value)


def format_size(n: float, *, digits: int = 2, unit: str | None = None) -> str:
    """A byte count for people: ``1536`` -> ``"1.50 KiB"`` (binary units; bytes without decimals).

    Args:
        n: Bytes.
        digits: Decimals above bytes (default: 2).
        unit: Force one of ``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB`` (default: the largest that keeps the
            value below 1024).
    """
    if unit is not None:
        value = n / 1024 ** _BINARY.index(unit)
        return f"{value:.0f} {unit}" if unit == "B" else f"{value:.{digits}f} {unit}"
    value = float(n)
    for name in _BINARY:
        if abs(value) < 1024 or name == "TiB":
            return f"{value:.0f} {name}" if name == "B" else f"{value:.{digits}f} {name}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_budget(n: int) -> str:
    """A parsed size as it was most likely written: ``100M`` -> ``"100M (95.37 MiB)"``, ``512MiB`` -> ``"512.00 MiB"``.

    A refusal that named ``--memory-budget 100M`` as "95.37 MiB" read as if another value had been given.
    """
    if n % 2**20 == 0:
        return format_size(n)
    for unit in ("T", "G", "M", "K"):
        scale = UNITS[unit.lower()]
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit} ({format_size(n)})"
    return format_size(n)


def machine_memory() -> int:
    """Bytes of memory this process can have at most: the machine's RAM, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(limit).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return int(total)
