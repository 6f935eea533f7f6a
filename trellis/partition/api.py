"""``trellis.partition(store, parts=P, out=PART_DIR)``: what ``trellis partition`` does, as a function.

Every check of the input (part count, method and its options, the store, an existing output) runs before
any work starts, so bad input raises one :class:`~trellis.errors.TrellisUserError` and writes nothing. The
layout is built under a temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from trellis.data.store import GraphStore, open_store
from trellis.errors import TrellisUserError
from trellis.partition.balance import parse_balance
from trellis.partition.base import FEATURES_OF, check_out_dir, create_partitioner, partition_graph
from trellis.partition.layout import write_layout
from trellis.partition.quality import PartitionQuality, evaluate
from trellis.utils.atomic import MANIFEST, write_json_atomic
from trellis.utils.caller import keeps_caller_state


@keeps_caller_state
def partition(store: str | os.PathLike[str] | GraphStore, parts: int, *, method: str = "grem",
              out: str | os.PathLike[str] | None = None, width: int = 256, overwrite: bool = False,
              move_features: bool = False, progress: bool = False, seed: int = 0, imbalance: float = 0.05,
              **options: Any) -> tuple[dict[str, Any], PartitionQuality]:
    """Partition ``store`` into ``parts``, evaluate the cut and write the layout to ``out`` (when given).

    Args:
        store: A store path or :class:`GraphStore`.
        parts: Number of parts P (1 <= P <= nodes).
        method: Partitioner name (``grem``, ``metis``, ``ldg``, ``fennel``, ``random``, ``hash``, ...).
        out: Layout directory to create (None: only partition and report).
        width: Feature width F of the exchange estimate in the report.
        overwrite: Replace an existing ``out``.
        move_features: After writing ``out``, delete the store's ``x.npy`` (one copy of the features on disk).
        progress: Show progress bars.
        seed: Random seed.
        imbalance: Parts hold at most ``(1 + imbalance) * N / P`` nodes.
        **options: The method's own options (grem: ``chunk_frac``, ``chunk_edges``, ``refine``,
            ``seed_method``, ``passes``).

    Returns:
        The report (``trellis partition --json``'s fields) and the quality object (``.table()`` prints it).
    """
    for flag, value, least in (("parts", parts, 1), ("width", width, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TrellisUserError(f"--{flag} must be an integer (got {value!r})")
        if value < least:
            raise TrellisUserError(f"--{flag} must be at least {least} (got {value})")
    if move_features and out is None:
        raise TrellisUserError("--move-features needs a layout to move the features into; pass --out PART_DIR")
    opts = {"seed": seed, "imbalance": imbalance, **options}
    if opts.get("balance") is not None:
        parse_balance(str(opts["balance"]))  # a bad --balance fails before anything is read
    else:
        opts.pop("balance", None)
    # rejects unknown methods and bad options now (``balance`` is applied after any method: partition_graph)
    create_partitioner(method, parts, **{k: v for k, v in opts.items() if k != "balance"})
    if out is not None:
        check_out_dir(out, overwrite=overwrite)
    graph = store if isinstance(store, GraphStore) else open_store(store)
    if out is not None and Path(out).resolve() == Path(graph.path).resolve():
        raise TrellisUserError(f"--out {out} is the store being partitioned; choose another directory for the layout")
    if parts > graph.num_nodes:
        raise TrellisUserError(f"--parts {parts} exceeds the graph's {graph.num_nodes} nodes; every part needs a node")
    book = partition_graph(graph, method, parts, progress=progress, **opts)
    quality = evaluate(graph, book, width=width)
    report: dict[str, Any] = quality.to_dict()
    if out is not None:
        t0 = time.perf_counter()
        write_layout(graph, book, out, overwrite=overwrite, quality=quality, progress=progress)
        report["layout_time_s"] = time.perf_counter() - t0
        report["out"] = str(out)
        if move_features:
            mark_features_of(out, graph.path)  # first: an interruption leaves the layout marked, the store whole
            report["moved_feature_bytes"] = graph.move_features(out)
    report["params"] = book.params
    return report, quality


def mark_features_of(layout: str | os.PathLike[str], store: str | os.PathLike[str]) -> None:
    """Record in ``layout``'s manifest that it is to hold ``store``'s only copy of the features."""
    path = Path(layout) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest[FEATURES_OF] = str(Path(store).resolve())
    write_json_atomic(path, manifest)
