"""``trellis demo``: generate a planted-partition graph, train GCN on it full-batch, report accuracy and time.

Why this graph: a stochastic block model with class-correlated but noisy features is learnable only by
combining a node's features with its neighbours' (a feature-only model stays far below a GCN), so the
demo shows the graph engine doing the work. It is sized (~50k nodes, ~500k edges) to finish in well under
two minutes on two CPU cores; ``--nodes`` scales it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from trellis.cli.args import add_progress_flag, int_at_least, seed_int
from trellis.cli.commands import help_of
from trellis.errors import TrellisUserError
from trellis.utils.tempdirs import OwnedTempDir

_positive_int = int_at_least(1, "expected an integer, got {text!r}", "expected an integer >= 1, got {value}")


def run_demo(args: argparse.Namespace) -> int:
    """Generate the planted-partition store, train GCN on it and print accuracy and timing; returns exit code 0."""
    from trellis.data.generate import generate_sbm
    from trellis.train.config import TrainConfig
    from trellis.train.trainer import train

    log = sys.stderr if args.json else sys.stdout
    t0 = time.perf_counter()
    with OwnedTempDir("trellis-demo-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        if args.keep and root.exists() and any(root.iterdir()):
            raise TrellisUserError(f"--keep {root}: directory exists and is not empty; choose a new one")
        store_dir, run_dir = root / "store", root / "run"
        print(f"generating a planted-partition graph: {args.nodes:,} nodes, average degree {args.avg_degree:g}, "
              f"{args.classes} classes, {args.features} noisy features", file=log, flush=True)
        generate_sbm(store_dir, nodes=args.nodes, avg_degree=args.avg_degree, features=args.features,
                     classes=args.classes, seed=args.seed, progress=args.progress and not args.json)
        t_gen = time.perf_counter() - t0
        cfg = TrainConfig(store=str(store_dir), model="gcn", epochs=args.epochs, seed=args.seed, device=args.device,
                          out=str(run_dir), checkpoint_every=0,
                          progress=args.progress and not args.json)
        print(f"generated in {t_gen:.1f} s; training a 2-layer GCN (hidden {cfg.hidden}) full-batch for up to "
              f"{cfg.epochs} epochs", file=log, flush=True)
        s = train(cfg)
        total = time.perf_counter() - t0
        result: dict[str, Any] = {
            "nodes": s["num_nodes"], "edges": s["num_edges"], "test_acc": s["test_acc_mean"],
            "val_acc": s["val_acc_mean"], "best_epoch": s["best_epoch"][0], "epochs": s["epochs_run"][0],
            "train_time_s": s["train_time_s"], "epoch_time_s_median": s["epoch_time_s_median"],
            "generate_time_s": t_gen, "total_time_s": total, "peak_rss_mb": s["peak_rss_mb"],
            "peak_rss_anon_mb": s["peak_rss_anon_mb"], "device": s["device"],
            "kept": str(root) if args.keep else None,
        }
        print(f"test accuracy {s['test_acc_mean']:.3f} (validation {s['val_acc_mean']:.3f}, chance "
              f"{1 / args.classes:.3f}) on {s['num_nodes']:,} nodes / {s['num_edges']:,} edges", file=log)
        print(f"trained {s['epochs_run'][0]} epochs in {s['train_time_s']:.1f} s (training step "
              f"{s['epoch_time_s_median'] * 1000:.1f} ms median) on {s['device']}; total {total:.1f} s; "
              f"peak RSS {s['peak_rss_mb']:.0f} MiB", file=log)
        if args.keep:
            print(f"kept the store in {store_dir} and the run in {run_dir}", file=log)
    if args.json:
        print(json.dumps(result))
    return 0


def register(subparsers: Any) -> None:
    """Add ``demo`` to the ``trellis`` command."""
    p = subparsers.add_parser(
        "demo", help=help_of("demo"),
        description="Generate a planted-partition graph with noisy class-correlated features into a temporary "
                    "directory, train a 2-layer GCN full-batch with the GCN paper's hyperparameters, and print "
                    "test accuracy and timing.")
    p.add_argument("--nodes", type=_positive_int, default=50_000, help="number of nodes (default: 50000)")
    p.add_argument("--avg-degree", type=float, default=10.0, help="average degree (default: 10)")
    p.add_argument("--features", type=_positive_int, default=64, help="feature width (default: 64)")
    p.add_argument("--classes", type=_positive_int, default=8, help="number of classes (default: 8)")
    p.add_argument("--epochs", type=_positive_int, default=200, help="maximum epochs (default: 200)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the graph and the run (default: 0)")
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}", help="(default: auto)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep the store and the run directory in DIR (default: a temporary directory, removed)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    add_progress_flag(p)
    p.set_defaults(func=run_demo)
