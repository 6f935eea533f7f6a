"""Training-node and in-edge balance of partitions with and without ``--balance``, on the real graphs.

    python -m benchmarks.bench_balance [--datasets amazon-computers,coauthor-cs] [--parts 4,8] [--methods metis,grem]

Imports each data set from ``TRELLIS_DATA_DIR``, partitions it per method and part count with each ``--balance``
(nodes only, the default; training nodes too; in-edges too; both), and prints the edge cut, the training
nodes per part, and the node and in-edge balance (max over mean).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    from trellis.data.importers import import_graph
    from trellis.data.store import GraphStore
    from trellis.partition import evaluate, partition_graph

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="amazon-computers,coauthor-cs")
    p.add_argument("--parts", default="4,8")
    p.add_argument("--methods", default="metis,grem")
    data = Path(os.environ.get("TRELLIS_DATA_DIR", ROOT.parent / "shared" / "data"))
    p.add_argument("--balances", default="nodes,train,edges,train+edges", help="'+' joins constraints")
    a = p.parse_args(argv)
    print("| graph | method | P | balance | edge cut | training nodes per part | node max/mean | in-edge max/mean |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="trellis-bench-balance-") as tmp:
        for name in a.datasets.split(","):
            if not (data / name).exists():
                raise SystemExit(f"{data / name}: not found; set TRELLIS_DATA_DIR")
            store = GraphStore(import_graph(data / name, Path(tmp) / name, progress=False))
            train = np.asarray(store.split("train"))
            deg = np.diff(np.asarray(store.indptr))
            for method in a.methods.split(","):
                for parts in (int(v) for v in a.parts.split(",")):
                    for balance in (b.replace("+", ",") for b in a.balances.split(",")):
                        book = partition_graph(store, method, parts, measure=False, balance=balance)
                        cut = evaluate(store, book, width=16).edge_cut_frac
                        t = np.bincount(book.node_parts[train], minlength=parts)
                        n = np.bincount(book.node_parts, minlength=parts)
                        e = np.bincount(book.node_parts, weights=deg, minlength=parts)
                        print(f"| {name} | {method} | {parts} | {balance} | {cut:.1%} | {t.min()}–{t.max()} "
                              f"(max/mean {t.max() / t.mean():.2f}) | {n.max() / n.mean():.3f} | "
                              f"{e.max() / e.mean():.3f} |", flush=True)


if __name__ == "__main__":
    main()
