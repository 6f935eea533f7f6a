"""The partitioner interface, the registry of methods by name, and the :class:`PartitionBook` result.

Every method answers one question — which part owns each node — and states where each edge lives
(its *ownership*), because exact distributed training must know whether a part pulls its in-edges'
sources (destination-owned), pushes along its out-edges (source-owned), keeps both directions (Lotan's
reverse placement) or splits nodes into a master and mirrors (vertex-cut). The result is a
:class:`PartitionBook`; the partitioned layout (:mod:`trellis.partition.layout`) is derived from it and
the store.

A new method is one file: subclass :class:`Partitioner`, implement :meth:`Partitioner.assign`, and
decorate it with :func:`register`; the CLI lists it automatically.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.partition.balance import parse_balance, rebalance
from trellis.partition.hashing import grid_edge_parts
from trellis.partition.memory import PeakMemory
from trellis.utils.atomic import MANIFEST, atomic_dir, check_output
from trellis.utils.manifest import format_of

#: Where edges live. ``dst``: with their destination's part (a part holds its nodes' in-edges; METIS,
#: GREM, LDG/Fennel, random, hash by destination). ``src``: with their source's part (hash by source,
#: GraphTheta's 1D default). ``reverse``: Lotan's scheme, each edge with its source in the forward graph
#: and a reversed copy with its destination for back-propagation. ``vertex-cut``: each edge in the part
#: its 2D grid hash picks; nodes have a master part and mirrors.
OWNERSHIPS = ("dst", "src", "reverse", "vertex-cut")
BOOK_FILE = "book.json"
NODE_PARTS_FILE = "node_parts.npy"
#: Default allowed imbalance: every part holds at most ``(1 + 0.05) * N / P`` nodes.
DEFAULT_IMBALANCE = 0.05


def part_cap(num_nodes: int, num_parts: int, imbalance: float) -> int:
    """Largest allowed part size: ``floor((1 + imbalance) * N / P)`` but never below ``ceil(N / P)``."""
    return max(-(-num_nodes // num_parts), int(math.floor((1.0 + imbalance) * num_nodes / num_parts)))


@dataclass
class PartitionBook:
    """Node → part assignment plus what a consumer needs to place edges and interpret the result.

    Attributes:
        node_parts: ``int32 [N]`` part of every node (for vertex-cut: the node's master part).
        num_parts: Number of parts ``P``.
        method: Registered name of the method that produced it.
        ownership: One of :data:`OWNERSHIPS` (where each edge is stored).
        params: Options the method ran with (seed, chunk size, ...), recorded for reproducibility.
        stats: Measurements of the run (``time_s``, ``peak_rss_mb``, ``peak_rss_anon_mb``, ...).
    """

    node_parts: np.ndarray
    num_parts: int
    method: str
    ownership: str = "dst"
    params: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.node_parts = np.ascontiguousarray(self.node_parts, dtype=np.int32)
        if self.node_parts.ndim != 1:
            raise ValueError("node_parts must be one-dimensional")
        if self.ownership not in OWNERSHIPS:
            raise ValueError(f"ownership {self.ownership!r} is not one of {OWNERSHIPS}")
        if self.node_parts.size and (self.node_parts.min() < 0 or self.node_parts.max() >= self.num_parts):
            raise ValueError("node_parts has a value outside [0, num_parts)")

    @property
    def num_nodes(self) -> int:
        """Number of nodes ``N`` (the length of ``node_parts``)."""
        return int(self.node_parts.shape[0])

    def part_sizes(self) -> np.ndarray:
        """``int64 [P]`` number of nodes in each part."""
        return np.bincount(self.node_parts, minlength=self.num_parts).astype(np.int64)

    def nodes(self, part: int) -> np.ndarray:
        """Global ids (ascending) of the nodes owned by ``part``."""
        return np.flatnonzero(self.node_parts == part).astype(np.int64)

    def edge_parts(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Part that stores each edge ``src[k] -> dst[k]`` (the forward copy under ``reverse``).

        Computed, not stored: for vertex-cut the part is a hash of the endpoints, so no ``[E]`` array is
        ever held.
        """
        if self.ownership == "dst":
            return self.node_parts[dst]
        if self.ownership in ("src", "reverse"):
            return self.node_parts[src]
        rows, cols = self.params["grid"]
        return grid_edge_parts(src, dst, rows, cols, int(self.params.get("seed", 0)))

    def metadata(self) -> dict[str, Any]:
        """JSON-serialisable description (everything but ``node_parts``)."""
        return {"num_nodes": self.num_nodes, "num_parts": self.num_parts, "method": self.method,
                "ownership": self.ownership, "params": self.params, "stats": self.stats}

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``node_parts.npy`` and ``book.json`` into directory ``path`` atomically (temp dir + rename)."""
        out = Path(path)
        with partition_dir(out, overwrite=overwrite) as tmp:
            self.write_into(tmp)
        return out

    def write_into(self, directory: Path) -> list[str]:
        """Write the book's two files into an existing directory; returns their names."""
        np.save(directory / NODE_PARTS_FILE, self.node_parts)
        (directory / BOOK_FILE).write_text(json.dumps(self.metadata(), indent=2, default=_json_default))
        return [NODE_PARTS_FILE, BOOK_FILE]

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, mmap: bool = False) -> PartitionBook:
        """Read a book from a directory written by :meth:`save` or by the layout writer."""
        d = Path(path)
        if not (d / BOOK_FILE).is_file() or not (d / NODE_PARTS_FILE).is_file():
            raise TrellisUserError(
                f"{d}: not a partition directory (needs {BOOK_FILE} and {NODE_PARTS_FILE}); create one with "
                "`trellis partition`"
            )
        meta = json.loads((d / BOOK_FILE).read_text())
        parts = np.load(d / NODE_PARTS_FILE, mmap_mode="r" if mmap else None)
        if parts.shape != (meta["num_nodes"],):
            raise TrellisUserError(f"{d / NODE_PARTS_FILE}: shape {parts.shape} does not match {BOOK_FILE}")
        return cls(parts, int(meta["num_parts"]), meta["method"], meta["ownership"],
                   dict(meta.get("params", {})), dict(meta.get("stats", {})))


_WHAT = "partitioned layout or partition directory"

#: The largest partitioning seed: METIS's seed is a C int (every method takes the same range).
MAX_PARTITION_SEED = 2**31 - 1

#: The key of a layout's manifest naming the store whose features ``--move-features`` moved into it.
FEATURES_OF = "features_moved_from"


def is_partition_output(path: Path) -> bool:
    """Whether ``path`` is a directory ``trellis partition`` may replace: a layout or a saved book.

    A store is not (its manifest's format says so): ``--out STORE --overwrite`` deleted the store, the one being
    partitioned included.
    """
    return format_of(path / MANIFEST) == "trellis-partition" or (
        (path / BOOK_FILE).is_file() and not (path / MANIFEST).exists())


def check_out_dir(out: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Refuse an existing output unless ``overwrite``, and even then only replace a partition directory.

    :func:`trellis.utils.atomic.check_output` with a directory saved by :meth:`PartitionBook.save`
    (``book.json``, no manifest) counted as replaceable too: a mistyped ``--out ~/data --overwrite`` must
    still not delete the user's files. Nor is a layout replaced that holds the only copy of a store's features
    (``--move-features``).
    """
    check_output(out, overwrite=overwrite, owned=is_partition_output, what=_WHAT)
    holder = features_held_by(Path(out))
    if holder is not None:
        raise TrellisUserError(f"{out}: holds the only copy of {holder}'s features (moved there by "
                               "`trellis partition --move-features`); replacing it would lose them. Choose another "
                               "--out, or re-import the store first")


def features_held_by(layout: Path) -> str | None:
    """The store whose features live only in ``layout`` (its manifest still says they were moved there), or None."""
    try:
        store = json.loads((layout / MANIFEST).read_text()).get(FEATURES_OF)
        moved = json.loads((Path(store) / MANIFEST).read_text())["arrays"]["x"].get("moved_to")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return str(store) if moved is not None and Path(moved).resolve() == layout.resolve() else None


def partition_dir(out: str | os.PathLike[str], *, overwrite: bool = False) -> AbstractContextManager[Path]:
    """:func:`trellis.utils.atomic.atomic_dir` under :func:`check_out_dir`'s rule (the book and layout writers)."""
    return atomic_dir(out, overwrite=overwrite, owned=is_partition_output, what=_WHAT)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj)}")


class Partitioner(ABC):
    """A partitioning method. Subclasses implement :meth:`assign` and declare ``name``/``ownership``.

    Args:
        num_parts: Number of parts ``P`` (1 ≤ P ≤ number of nodes).
        seed: Seed of every random choice; the same seed gives the same book (default: 0).
        imbalance: Allowed imbalance ε: methods with ``balanced = True`` keep every part at most
            ``part_cap(N, P, ε)`` nodes (default: 0.05).
        progress: Show a progress bar where the method streams (default: False).
    """

    name: ClassVar[str] = ""
    ownership: ClassVar[str] = "dst"
    #: Whether the method guarantees the imbalance cap (hash-based methods only balance in expectation).
    balanced: ClassVar[bool] = True

    def __init__(self, num_parts: int, *, seed: int = 0, imbalance: float = DEFAULT_IMBALANCE,
                 progress: bool = False) -> None:
        if int(num_parts) < 1:
            raise TrellisUserError(f"--parts must be at least 1 (got {num_parts})")
        if not (0.0 <= float(imbalance) < 10.0):
            raise TrellisUserError(f"--imbalance must be in [0, 10) (got {imbalance})")
        if not 0 <= int(seed) <= MAX_PARTITION_SEED:  # METIS takes a C int: larger seeds were cut or crashed it
            raise TrellisUserError(f"--seed must be in [0, {MAX_PARTITION_SEED}] for partitioning (got {seed})")
        self.num_parts = int(num_parts)
        self.seed = int(seed)
        self.imbalance = float(imbalance)
        self.progress = progress

    def options(self) -> dict[str, Any]:
        """Options recorded in the book's ``params``."""
        return {"seed": self.seed, "imbalance": self.imbalance}

    def check_store(self, store: GraphStore) -> None:
        """Reject a part count the graph cannot fill."""
        if self.num_parts > store.num_nodes:
            raise TrellisUserError(
                f"--parts {self.num_parts} exceeds the graph's {store.num_nodes} nodes; every part needs a node"
            )

    def cap(self, num_nodes: int) -> int:
        """Largest allowed part size for ``num_nodes`` nodes (see :func:`part_cap`)."""
        return part_cap(num_nodes, self.num_parts, self.imbalance)

    @abstractmethod
    def assign(self, store: GraphStore) -> tuple[np.ndarray, dict[str, Any]]:
        """Return ``(node_parts int32 [N], extra params)`` for the graph in ``store``."""

    def partition(self, store: GraphStore) -> PartitionBook:
        """Partition ``store`` and return the book (measurements are added by :func:`partition_graph`)."""
        self.check_store(store)
        parts, extra = self.assign(store)
        moved = fill_empty_parts(parts, self.num_parts)
        if moved:
            extra = {**extra, "filled_empty_parts": moved}
        return PartitionBook(parts, self.num_parts, self.name, self.ownership, {**self.options(), **extra})


def fill_empty_parts(parts: np.ndarray, num_parts: int) -> int:
    """Give every empty part one node, taken from the largest part at that moment; returns how many moved.

    Why: a part with no node is a rank with nothing to train (and, in a partition-buffer epoch, a buffer state
    with no target), so every layout has a node in each part. Structure-aware methods never leave one empty on a
    graph with more nodes than parts; hash placement does on small graphs (1,000 nodes hashed into 512 parts
    leave 80 empty). Moving the largest part's last node keeps the result a pure function of the method's.
    One step per empty part, each ``O(N)``: a part is empty only where ``N`` is a few times ``P`` at most.
    """
    counts = np.bincount(parts, minlength=num_parts)
    empty = np.flatnonzero(counts == 0)
    for part in empty:
        donor = int(np.argmax(counts))
        node = int(np.flatnonzero(parts == donor)[-1])
        parts[node] = part
        counts[donor] -= 1
        counts[part] += 1
    return int(empty.size)


_REGISTRY: dict[str, type[Partitioner]] = {}
#: Command-line spelling of options whose flag is not ``--option-name``.
_FLAGS = {"refine": "--no-refine"}
_ALIASES: dict[str, str] = {}


def register(name: str, *aliases: str) -> Any:
    """Class decorator: register a :class:`Partitioner` under ``name`` (and optional aliases)."""
    def deco(cls: type[Partitioner]) -> type[Partitioner]:
        cls.name = name
        _REGISTRY[name] = cls
        for alias in aliases:
            _ALIASES[alias] = name
        return cls
    return deco


def available_methods() -> list[str]:
    """Registered method names (aliases excluded), in registration order."""
    _load_builtin()
    return list(_REGISTRY)


def methods_of_ownership(ownership: str) -> list[str]:
    """Registered method names whose layouts have ``ownership`` (e.g. ``dst``: every in-edge at its owner)."""
    _load_builtin()
    return [name for name, cls in _REGISTRY.items() if cls.ownership == ownership]


def get_partitioner(method: str) -> type[Partitioner]:
    """Look a method up by name or alias; unknown names are a user error listing the known ones."""
    _load_builtin()
    key = _ALIASES.get(method, method)
    if key not in _REGISTRY:
        raise TrellisUserError(
            f"unknown partitioning method {method!r}; choose one of {', '.join(available_methods())}"
        )
    return _REGISTRY[key]


def create_partitioner(method: str, num_parts: int, **options: Any) -> Partitioner:
    """Instantiate a method; an option the method does not take is a user error naming it."""
    cls = get_partitioner(method)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "num_parts"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        flags = ", ".join(_FLAGS.get(k, "--" + k.replace("_", "-")) for k in unknown)
        raise TrellisUserError(f"{flags} does not apply to --method {cls.name}")
    params = inspect.signature(cls.__init__).parameters
    for name, value in options.items():
        _check_option_type(_FLAGS.get(name, "--" + name.replace("_", "-")), value, str(params[name].annotation))
    return cls(num_parts, **options)


def _check_option_type(flag: str, value: Any, annotation: str) -> None:
    """Refuse a library caller's option that is not of the annotated type (the CLI's parsers guarantee it).

    Coerced, ``refine="no"`` turned refinement on and ``passes=1.5`` ran one pass.
    """
    if value is None and "None" in annotation:
        return
    kind = annotation.split("|")[0].strip()
    ok = {"bool": lambda v: isinstance(v, bool),
          "int": lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool),
          "str": lambda v: isinstance(v, str)}.get(kind)
    if ok is not None and not ok(value):
        raise TrellisUserError(f"{flag} must be {'an' if kind == 'int' else 'a'} {kind} (got {value!r})")


def partition_graph(store: GraphStore, method: str, num_parts: int, *, measure: bool = True,
                    **options: Any) -> PartitionBook:
    """Partition a store with a registered method; records wall time and peak memory in ``book.stats``.

    Args:
        store: The graph.
        method: A name from :func:`available_methods`.
        num_parts: Number of parts.
        measure: Sample peak ``RssAnon`` in a helper process (default: True); when False only wall time
            and the kernel's peak RSS are recorded.
        **options: Method options (``seed``, ``imbalance``, ``chunk_frac``, ...), and ``balance``
            (``nodes``, or ``train``, ``edges`` or both comma-separated:
            :func:`~trellis.partition.balance.rebalance` after the method).
    """
    balance = str(options.pop("balance", "nodes"))
    constraints = parse_balance(balance)
    partitioner = create_partitioner(method, num_parts, **options)
    partitioner.check_store(store)
    if constraints and partitioner.ownership != "dst":
        raise TrellisUserError(f"--balance {balance} moves nodes between parts of a destination-owned layout; "
                               f"--method {method} is {partitioner.ownership}-owned: use grem, metis, ldg, fennel "
                               "or random")
    with PeakMemory(sample=measure) as mem:
        book = partitioner.partition(store)
        if constraints:
            book.params.update(rebalance(store, book.node_parts, num_parts, constraints, partitioner.imbalance,
                                         partitioner.seed, partitioner.cap(store.num_nodes)))
    rep = mem.report
    book.stats.update(time_s=rep.time_s, peak_rss_mb=rep.peak_rss_mb, peak_rss_anon_mb=rep.peak_rss_anon_mb,
                      base_rss_anon_mb=rep.base_rss_anon_mb)
    return book


_BUILTIN = ("hash", "vertex_cut", "reverse", "streaming", "grem", "metis")


def _load_builtin() -> None:
    """Import the built-in method modules so their ``@register`` decorators run."""
    import importlib

    for mod in _BUILTIN:
        importlib.import_module(f"trellis.partition.{mod}")
