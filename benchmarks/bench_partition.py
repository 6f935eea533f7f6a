"""Partitioning: GREM vs METIS vs LDG/Fennel vs hash, side by side in one run; and GREM's memory flatness.

    python -m benchmarks.bench_partition [--graphs sbm,rmat,computers,cs,physics,cora] [--parts 2,4,8,16]
                                         [--nodes 1000000] [--degree 10] [--flatness] [--quick]

Graphs: a generated planted-partition graph (SBM, 16 classes, homophily 0.8, ``--nodes`` nodes, ``--degree``
edges per node, so 1M nodes / 10M edges by default), a generated R-MAT power-law graph of the same size,
and the real graphs in ``../shared/data`` (imported once into the temp dir). Methods: GREM with chunks of
10% and 1% of the edges (METIS seed), GREM at 1% without refinement (Armada Fig. 6's fixed greedy) and with
a second refining pass over the stream, METIS
(pymetis; its default mode, k-way above 8 parts, is the reference of the ratios; ``metis-rb`` is recursive
bisection, much better on R-MAT), LDG, Fennel and hash.

Every run is its own process (``benchmarks.common.run_isolated``), which first partitions a tiny graph
with the same method so numba's kernels are loaded before the measured region. Figures are the
partitioning step only: wall time, peak ``RssAnon`` (sampled every 5 ms from a helper process) and peak
RSS (``VmHWM`` reset at the start; includes mapped store pages).

``--flatness``: GREM with a fixed ``--chunk-edges`` on two graphs with the same node count and 5x the
edges; the issue's goal is that the larger graph raises GREM's peak memory by at most 20%.

Ratios are printed against METIS on the same graph and part count: cut difference in percentage points,
time ratio and peak-``RssAnon`` ratio. The machine this runs on is stated beside the figures in
docs/partitioning.md; METIS and all methods here are single-threaded.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import print_table, run_isolated

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CACHE = Path(tempfile.gettempdir()) / "trellis-bench-graphs"
REAL = {"cora": "cora", "citeseer": "citeseer", "computers": "amazon-computers", "cs": "coauthor-cs",
        "physics": "coauthor-physics"}

#: label -> (method, options)
METHODS = {
    "grem-10%": ("grem", {"chunk_frac": 0.1}),
    "grem-1%": ("grem", {"chunk_frac": 0.01}),
    "grem-1%-norefine": ("grem", {"chunk_frac": 0.01, "refine": False}),
    "grem-1%-2pass": ("grem", {"chunk_frac": 0.01, "passes": 2}),
    "metis": ("metis", {}),
    "metis-rb": ("metis", {"recursive": True}),
    "ldg": ("ldg", {}),
    "fennel": ("fennel", {}),
    "hash": ("hash", {}),
}


def graph_store(name: str, nodes: int, degree: float) -> str:
    """Create (once) and return the store of a benchmark graph."""
    if name in REAL:
        out = CACHE / f"ds-{name}"
        if not (out / "manifest.json").exists():
            from trellis.data.importers import import_graph

            import_graph(DATA / REAL[name], out, progress=False)
        return str(out)
    from trellis.data.generate import generate_rmat, generate_sbm

    out = CACHE / f"part-{name}-{nodes}-{degree:g}"
    if not (out / "manifest.json").exists():
        if name == "sbm":
            generate_sbm(out, nodes=nodes, avg_degree=degree, classes=16, homophily=0.8, features=0, seed=0,
                         progress=False)
        elif name == "rmat":
            generate_rmat(out, nodes=nodes, avg_degree=degree, features=0, seed=0, progress=False)
        else:
            raise SystemExit(f"unknown graph {name!r}")
    return str(out)


def _warm(method: str, options: dict) -> None:
    """Load numba's kernels for ``method`` on a tiny graph, outside the measured region."""
    import numpy as np

    from trellis.data.store import open_store, write_store
    from trellis.partition import partition_graph

    with tempfile.TemporaryDirectory() as tmp:
        n = 64  # a ring: node v's one in-edge comes from v - 1
        write_store(Path(tmp) / "s", indptr=np.arange(n + 1, dtype=np.int64), indices=(np.arange(n) - 1) % n)
        opts = {k: v for k, v in options.items() if k != "chunk_edges"}
        partition_graph(open_store(Path(tmp) / "s"), method, 2, measure=False, **opts)


def _child(args: dict) -> dict:
    from trellis.data.store import open_store
    from trellis.partition import evaluate, partition_graph

    _warm(args["method"], args["options"])
    store = open_store(args["store"], verify=False)
    book = partition_graph(store, args["method"], args["parts"], **args["options"])
    q = evaluate(store, book)
    return {"edge_cut_frac": q.edge_cut_frac, "balance": q.balance, "time_s": q.time_s,
            "peak_rss_anon_mb": q.peak_rss_anon_mb, "peak_rss_mb": q.peak_rss_mb,
            "base_rss_anon_mb": book.stats.get("base_rss_anon_mb"), "replication_factor": q.replication_factor,
            "nodes": store.num_nodes, "edges": store.num_edges}


def run_one(store: str, label: str, parts: int, extra: dict | None = None) -> dict:
    method, options = METHODS[label] if label in METHODS else (label, {})
    res = run_isolated("benchmarks.bench_partition", {"store": store, "method": method, "parts": parts,
                                                       "options": {**options, **(extra or {})}})
    res.update(method=label, parts=parts)
    return res


def comparison(graphs: list[str], parts_list: list[int], methods: list[str], nodes: int, degree: float) -> list[dict]:
    rows = []
    for g in graphs:
        store = graph_store(g, nodes, degree)
        for parts in parts_list:
            res = {m: run_one(store, m, parts) for m in methods}
            ref = res.get("metis", {})
            for m in methods:
                r = res[m]
                row = {"graph": g, "P": parts, "method": m}
                if "error" in r:
                    row["cut %"] = r["error"]
                    rows.append(row)
                    continue
                row.update({"nodes": r["nodes"], "edges": r["edges"], "cut %": 100 * r["edge_cut_frac"],
                            "balance": r["balance"], "time s": r["time_s"], "RssAnon MB": r["peak_rss_anon_mb"],
                            "RSS MB": r["peak_rss_mb"]})
                if "edge_cut_frac" in ref:
                    row["Δcut vs METIS (pts)"] = 100 * (r["edge_cut_frac"] - ref["edge_cut_frac"])
                    row["time / METIS"] = r["time_s"] / ref["time_s"]
                    row["RssAnon / METIS"] = r["peak_rss_anon_mb"] / ref["peak_rss_anon_mb"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def flatness(nodes: int, degree: float, chunk_edges: int, parts: int) -> list[dict]:
    rows = []
    for deg in (degree, 5 * degree):
        store = graph_store("sbm", nodes, deg)
        r = run_one(store, "grem", parts, {"chunk_edges": chunk_edges})
        r.update(graph=f"sbm deg {deg:g}")
        rows.append(r)
        print(json.dumps(r), flush=True)
    if all("error" not in r for r in rows):
        for key in ("peak_rss_anon_mb", "peak_rss_mb"):
            rows[1][f"{key} ratio"] = rows[1][key] / rows[0][key]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--graphs", default="sbm,rmat,computers,cs,physics,cora")
    ap.add_argument("--parts", default="2,4,8,16")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--degree", type=float, default=10.0)
    ap.add_argument("--flatness", action="store_true", help="run only the memory-flatness check")
    ap.add_argument("--chunk-edges", type=int, default=1_000_000, help="GREM chunk of the flatness check")
    ap.add_argument("--quick", action="store_true", help="100k nodes, P=4 and 16, no real graphs")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return
    if args.quick:
        args.nodes, args.parts, args.graphs = 100_000, "4,16", "sbm,rmat"
        args.chunk_edges = min(args.chunk_edges, 100_000)
    if not args.flatness:
        rows = comparison(args.graphs.split(","), [int(p) for p in args.parts.split(",")],
                          args.methods.split(","), args.nodes, args.degree)
        print()
        print_table(rows, ["graph", "P", "method", "cut %", "Δcut vs METIS (pts)", "balance", "time s",
                           "time / METIS", "RssAnon MB", "RssAnon / METIS", "RSS MB"])
    rows = flatness(args.nodes, args.degree, args.chunk_edges, 16)
    print()
    print_table(rows, ["graph", "edges", "edge_cut_frac", "time_s", "peak_rss_anon_mb", "peak_rss_anon_mb ratio",
                       "peak_rss_mb", "peak_rss_mb ratio"])


if __name__ == "__main__":
    main()
