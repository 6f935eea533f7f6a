"""``trellis data``: import datasets, generate synthetic graphs, describe stores.

Usage::

    trellis data import SRC --out STORE [--format planetoid|npz|ogb|edgelist] [--name NAME]
                        [--split-seed 0] [--lcc|--no-lcc] [--symmetrize|--no-symmetrize] [--overwrite] [--json]
    trellis data generate sbm|rmat --nodes N --avg-degree D --features F --classes C --seed S --out STORE
                        [--homophily 0.8] [--feature-noise 1.5] [--train-frac 0.1] [--val-frac 0.1]
                        [--edge-features D] [--edge-feature-noise S] [--node-features signal|noise]
                        [--task multiclass|binary|multilabel] [--labels C] [--json]
    trellis data info STORE [--json] [--verify]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from trellis.cli.args import add_progress_flag, int_at_least, seed_int
from trellis.cli.commands import help_of
from trellis.data.generate import DEFAULT_FEATURE_NOISE, GENERATORS, NODE_FEATURE_MODES, TASK_KINDS, generate
from trellis.data.importers import FORMATS, import_graph
from trellis.data.info import format_info, human_bytes, store_info
from trellis.data.store import open_store
from trellis.errors import TrellisUserError


def _summary(path: Any) -> dict[str, Any]:
    store = open_store(path, verify=False)
    ids = {k: store.split(k) for k in ("train", "val", "test")}
    splits = {k: None if v is None else int(v.shape[0]) for k, v in ids.items()}
    return {"store": str(store.path), "name": store.name, "num_nodes": store.num_nodes, "num_edges": store.num_edges,
            "num_features": store.num_features, "num_classes": store.num_classes, "task": store.task,
            "splits": splits, "disk_bytes": store.nbytes(), "checksum": store.checksum}


def _print_summary(s: dict[str, Any], as_json: bool, verb: str) -> None:
    if as_json:
        print(json.dumps(s))
        return
    splits = " / ".join(f"{k} {v}" for k, v in s["splits"].items() if v is not None) or "no splits"
    unit = {"multilabel": "labels", "binary": "classes (binary)"}.get(s["task"], "classes")
    classes = f"{s['num_classes']} {unit}" if s["num_classes"] is not None else "no labels"
    print(f"{verb} {s['store']}: {s['num_nodes']:,} nodes, {s['num_edges']:,} edges, {s['num_features']} features, "
          f"{classes}; {splits}; {human_bytes(s['disk_bytes'])}")


def _cmd_import(args: argparse.Namespace) -> int:
    path = import_graph(
        args.src, args.out, args.format,
        name=args.name, split=args.split, split_seed=args.split_seed, split_name=args.split_name, lcc=args.lcc,
        symmetrize=args.symmetrize, num_nodes=args.num_nodes, train_per_class=args.train_per_class,
        val_per_class=args.val_per_class, streaming=args.streaming, chunk_edges=args.chunk_edges,
        overwrite=args.overwrite or None, progress=args.progress and not args.json,
    )
    _print_summary(_summary(path), args.json, "imported")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {
        "nodes": args.nodes, "avg_degree": args.avg_degree, "features": args.features, "classes": args.classes,
        "seed": args.seed, "feature_noise": args.feature_noise, "train_frac": args.train_frac,
        "val_frac": args.val_frac, "name": args.name, "overwrite": args.overwrite,
        "node_features": args.node_features, "edge_features": args.edge_features,
        "edge_feature_noise": args.edge_feature_noise,
        "task": args.task, "labels": args.labels, "progress": args.progress and not args.json,
    }
    if args.kind == "sbm":
        for flag in ("a", "b", "c"):
            if getattr(args, flag) is not None:
                raise TrellisUserError(f"--{flag} applies to rmat only")
        if args.homophily is not None:
            options["homophily"] = args.homophily
    else:
        if args.homophily is not None:
            raise TrellisUserError("--homophily applies to sbm only (R-MAT labels follow its recursive communities)")
        options.update({k: getattr(args, k) for k in ("a", "b", "c") if getattr(args, k) is not None})
    path = generate(args.kind, args.out, **{k: v for k, v in options.items() if v is not None})
    _print_summary(_summary(path), args.json, "generated")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    info = store_info(args.store, verify=args.verify)
    print(json.dumps(info) if args.json else format_info(info))
    return 0


#: The edge-list folder format, in ``trellis data import --help``.
EDGELIST_HELP = """\
formats: planetoid (ind.<name>.* files), npz (Shchur et al.; or Platonov et al.'s node_features, node_labels,
edges and train/val/test_masks, whose fixed splits are all kept), ogb (an OGB folder), edgelist (below).

edgelist: a folder with only the edges required
  edges.npy                     int [E, 2] (src, dst), or
  edges.txt|.csv|.tsv[.gz]      "src dst" per line (comma, tab or space; # comments)
  features.npy                  float [N, F], row i = node i
  labels.npy                    int [N] (-1 = unlabelled), or 0/1 [N, C] (multilabel)
  train.npy / val.npy / test.npy  node ids or boolean masks of length N (or --split 0.5,0.25,0.25)
  edge_weights.npy              float [E], row i = edge row i
  edge_features.npy             float [E, D], row i = edge row i
The graph is symmetrized by default (--no-symmetrize keeps the edges' directions); self loops and duplicate
edges are always dropped (a duplicate's first row is kept).

example:
  trellis data import my_graph/ --out stores/my_graph --split 0.6,0.2,0.2 --split-seed 0
"""

_positive_int = int_at_least(1, "{text!r} is not an integer", "{value} must be > 0")


def register(subparsers: Any) -> None:
    """Add ``trellis data {import,generate,info}``."""
    data = subparsers.add_parser("data", help=help_of("data"),
                                 description="Create and inspect Trellis graph stores.")
    sub = data.add_subparsers(dest="data_command", metavar="ACTION")
    sub.required = True

    p = sub.add_parser("import", help="import a dataset into a store",
                       description="Import a dataset into a store (atomic: nothing is written on error).",
                       epilog=EDGELIST_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="dataset file or folder")
    p.add_argument("--out", required=True, help="store directory to create")
    p.add_argument("--format", choices=FORMATS, default=None, help="input format (default: detected)")
    p.add_argument("--name", default=None, help="dataset name (planetoid: which ind.<name>.* files)")
    p.add_argument("--split", default=None, metavar="TRAIN,VAL,TEST",
                   help="edgelist: a random split of the labelled nodes by fractions, e.g. 0.5,0.25,0.25 (instead of "
                        "train/val/test files)")
    p.add_argument("--split-seed", type=seed_int, default=None,
                   help="seed of the random split (npz: per-class; edgelist: --split) (default 0)")
    p.add_argument("--split-name", default=None, help="ogb: which split/<name> folder (default: the first)")
    p.add_argument("--train-per-class", type=int, default=None, help="npz: training nodes per class (default 20)")
    p.add_argument("--val-per-class", type=int, default=None, help="npz: validation nodes per class (default 30)")
    p.add_argument("--lcc", action=argparse.BooleanOptionalAction, default=None,
                   help="keep only the largest connected component, renumbered; the store's node_ids.npy holds "
                        "each node's id in the input (default: on for Shchur et al.'s npz files, off otherwise)")
    p.add_argument("--symmetrize", action=argparse.BooleanOptionalAction, default=None,
                   help="make the graph undirected (default: on); self loops and duplicate edges are dropped "
                        "either way")
    p.add_argument("--num-nodes", type=_positive_int, default=None, help="edgelist: node count")
    p.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=None,
                   help="ogb/edgelist: bounded-memory chunked import (default: for edge files over 512 MiB)")
    p.add_argument("--chunk-edges", type=_positive_int, default=None, help="edges per chunk when streaming")
    p.add_argument("--overwrite", action="store_true", help="replace an existing store")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    add_progress_flag(p)
    p.set_defaults(func=_cmd_import)

    g = sub.add_parser("generate", help="generate a synthetic graph",
                       description="Generate a synthetic graph with labels, features and splits.")
    g.add_argument("kind", choices=GENERATORS, help="sbm: planted partition; rmat: power law")
    g.add_argument("--nodes", type=_positive_int, required=True, help="number of nodes")
    g.add_argument("--avg-degree", type=float, default=10.0, help="directed edges per node (default 10)")
    g.add_argument("--features", type=int, default=32, help="feature width; 0 for none (default 32)")
    g.add_argument("--classes", type=_positive_int, default=4, help="number of classes (default 4)")
    g.add_argument("--seed", type=seed_int, default=0, help="random seed (default 0)")
    g.add_argument("--out", required=True, help="store directory to create")
    g.add_argument("--homophily", type=float, default=None, help="sbm: fraction of edges inside a class (0.8)")
    g.add_argument("--feature-noise", type=float, default=DEFAULT_FEATURE_NOISE,
                   help=f"per-dimension feature noise (default {DEFAULT_FEATURE_NOISE})")
    g.add_argument("--node-features", choices=NODE_FEATURE_MODES, default="signal",
                   help="signal: class means plus noise; noise: no class signal in node features (default signal)")
    g.add_argument("--edge-features", type=int, default=0,
                   help="edge feature width carrying the endpoints' classes plus noise; 0 for none (default 0)")
    g.add_argument("--edge-feature-noise", type=float, default=None,
                   help="per-dimension edge feature noise (default: --feature-noise)")
    g.add_argument("--task", choices=TASK_KINDS, default="multiclass",
                   help="labels to write: the planted classes (multiclass), their parity (binary), or a 0/1 "
                        "matrix of --labels labels derived from them (multilabel) (default multiclass)")
    g.add_argument("--labels", type=_positive_int, default=None,
                   help="multilabel: number of labels (default: --classes)")
    g.add_argument("--train-frac", type=float, default=0.1, help="training fraction (default 0.1)")
    g.add_argument("--val-frac", type=float, default=0.1, help="validation fraction (default 0.1; rest test)")
    g.add_argument("--a", type=float, default=None, help="rmat: quadrant probability a (0.57)")
    g.add_argument("--b", type=float, default=None, help="rmat: quadrant probability b (0.19)")
    g.add_argument("--c", type=float, default=None, help="rmat: quadrant probability c (0.19)")
    g.add_argument("--name", default=None, help="dataset name (default: <kind>-<nodes>)")
    g.add_argument("--overwrite", action="store_true", help="replace an existing store")
    g.add_argument("--json", action="store_true", help="print the result as one JSON line")
    add_progress_flag(g)
    g.set_defaults(func=_cmd_generate)

    i = sub.add_parser("info", help="describe a store", description="Counts, degrees and sizes of a store.")
    i.add_argument("store", help="store directory")
    i.add_argument("--json", action="store_true", help="print one JSON line")
    i.add_argument("--verify", action="store_true", help="check every array's sha256 against the manifest")
    i.set_defaults(func=_cmd_info)
