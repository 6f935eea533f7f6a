"""Importers: read a dataset in a known format and write a Trellis store.

Registry by name (``planetoid``, ``npz``, ``ogb``, ``edgelist``): :func:`import_graph` dispatches, and a
new format is one module plus one line in :data:`IMPORTERS`. Every importer validates its input (a bad
file names the file, row and fix) and writes atomically: on any error nothing is left at ``out``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trellis.data.importers.common import GraphInput, largest_component, restrict, write_graph
from trellis.data.importers.edgelist import EDGE_FILES, import_edgelist
from trellis.data.importers.npz import import_npz, load_npz
from trellis.data.importers.ogb import import_ogb
from trellis.data.importers.planetoid import import_planetoid, load_planetoid
from trellis.errors import TrellisUserError

#: Format name -> importer ``f(src, out, **options) -> Path``.
IMPORTERS: dict[str, Callable[..., Path]] = {
    "planetoid": import_planetoid,
    "npz": import_npz,
    "ogb": import_ogb,
    "edgelist": import_edgelist,
}
FORMATS = tuple(IMPORTERS)


def detect_format(src: str | os.PathLike[str]) -> str:
    """Guess the format of ``src`` from its files (raises :class:`TrellisUserError` if unsure)."""
    p = Path(src)
    if not p.exists():
        raise TrellisUserError(f"{p}: not found; check the path")
    if p.is_file():
        if p.suffix == ".npz":
            return "npz"
        if p.name.startswith("ind."):
            return "planetoid"
        return "edgelist"
    if any(p.glob("ind.*.x")):
        return "planetoid"
    if (p / "raw").is_dir() and any((p / "raw").glob("edge.csv*")):
        return "ogb"
    if any((p / f).is_file() for f in EDGE_FILES):
        return "edgelist"
    if len(list(p.glob("*.npz"))) == 1:
        return "npz"
    raise TrellisUserError(f"{p}: cannot tell the format; pass --format ({'|'.join(FORMATS)})")


def import_graph(src: str | os.PathLike[str], out: str | os.PathLike[str], format: str | None = None,
                 **options: Any) -> Path:
    """Import ``src`` in ``format`` (default: detected) to the store ``out``.

    Args:
        src: Input file or folder.
        out: Store directory to create.
        format: One of :data:`FORMATS`, or None to detect it.
        **options: Importer options (``name``, ``split_seed``, ``lcc``, ``symmetrize``, ``overwrite``, ...);
            an option the format does not take is refused. Options set to None are dropped (format default).

    Returns:
        The store path.
    """
    fmt = format or detect_format(src)
    if fmt not in IMPORTERS:
        raise TrellisUserError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    fn = IMPORTERS[fmt]
    accepted = inspect.signature(fn).parameters
    kwargs = {}
    for key, value in options.items():
        if value is None:
            continue
        if key not in accepted:
            flag = "--" + key.replace("_", "-")
            raise TrellisUserError(f"{flag} does not apply to --format {fmt}")
        kwargs[key] = value
    return fn(src, out, **kwargs)


__all__ = [
    "FORMATS",
    "IMPORTERS",
    "GraphInput",
    "detect_format",
    "import_edgelist",
    "import_graph",
    "import_npz",
    "import_ogb",
    "import_planetoid",
    "largest_component",
    "load_npz",
    "load_planetoid",
    "restrict",
    "write_graph",
]
