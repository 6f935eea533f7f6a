"""``trellis preprocess`` (build a pre-propagation cache) and ``trellis train-pp`` (train from one).

``trellis preprocess STORE --operator sym --hops 3 --out PP_DIR`` computes ``[X, BX, …, B^R X]`` once,
out of core, with a progress bar over row blocks; running it again with the same store and settings
reuses the cache, an interrupted run is redone, and a ``PP_DIR`` from another store or other settings is
refused (``--overwrite`` replaces it).

``trellis train-pp STORE --pp-dir PP_DIR --model sign`` trains SGC/SIGN/HOGA from the cache; it is the
temporary home of what becomes ``trellis train --strategy pp``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from trellis.data.store import open_store
from trellis.errors import TrellisUserError
from trellis.loader.pp import LOADERS, fmt_bytes, parse_bytes
from trellis.loader.ppcache import PPSettings, ensure_pp
from trellis.ops.propagate import FEATURE_NORMS, OPERATORS, OperatorSpec

#: ``--model`` choices (``trellis.nn.pp_models.PP_MODELS``; imported lazily so ``preprocess`` needs no model code).
PP_MODEL_NAMES = ("sgc", "sign", "hoga")


def register(sub: Any) -> None:
    """Add ``preprocess`` and ``train-pp`` to the ``trellis`` subcommands."""
    p = sub.add_parser("preprocess", help="pre-propagate features for SGC/SIGN/HOGA (out of core, cached)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", metavar="STORE", help="graph store directory")
    p.add_argument("--operator", choices=OPERATORS, default="sym",
                   help="sym: D^-1/2 (A+I) D^-1/2; rw: D^-1 (A+I); ppr: personalized PageRank; heat: heat kernel "
                        "(default: sym)")
    p.add_argument("--hops", "-R", type=int, default=3, help="R: propagation steps, hops 0..R are kept (default: 3)")
    p.add_argument("--out", required=True, metavar="PP_DIR", help="cache directory to create or reuse")
    p.add_argument("--alpha", type=float, default=0.1, help="PPR teleport probability (default: 0.1)")
    p.add_argument("--t", type=float, default=3.0, help="heat-kernel diffusion time (default: 3.0)")
    p.add_argument("--iters", type=int, default=None,
                   help="PPR power iterations / heat Taylor terms (default: 10 / 20)")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--split-rows-only", dest="split_rows_only", action="store_true", default=None,
                      help="keep only rows of train/val/test nodes (PP-GNN §6.4; predicting other nodes then "
                           "needs a rebuild). Default: all rows, unless only split rows fit the free disk")
    rows.add_argument("--all-rows", dest="split_rows_only", action="store_false",
                      help="keep every node's rows even when disk is short")
    p.add_argument("--block-rows", type=int, default=None,
                   help="destination rows per block (default: ~32 MiB of output per block)")
    p.add_argument("--feature-norm", choices=FEATURE_NORMS, default="auto",
                   help="row: divide each feature row by its L1 norm before propagating (GCN's preprocessing); "
                        "auto: row when every feature is non-negative, as `trellis train` does (default: auto)")
    p.add_argument("--shuffle-seed", type=int, default=0,
                   help="seed of the one-time shuffle of training rows (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a PP_DIR built from another store/settings")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_preprocess)

    t = sub.add_parser("train-pp", help="train SGC/SIGN/HOGA from a pre-propagated cache",
                       description="Train a pre-propagation model from `trellis preprocess` output.")
    t.add_argument("store", metavar="STORE", help="graph store the cache was built from")
    t.add_argument("--pp-dir", required=True, metavar="PP_DIR", help="cache from `trellis preprocess`")
    t.add_argument("--model", choices=PP_MODEL_NAMES, default="sign", help="model (default: sign)")
    t.add_argument("--hidden", type=int, default=256, help="hidden width (default: 256)")
    t.add_argument("--layers", type=int, default=2, help="output MLP layers (default: 2)")
    t.add_argument("--heads", type=int, default=4, help="HOGA attention heads (default: 4)")
    t.add_argument("--dropout", type=float, default=0.5, help="dropout (default: 0.5)")
    t.add_argument("--input-dropout", type=float, default=0.0, help="input dropout (default: 0)")
    t.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default: 0.01)")
    t.add_argument("--weight-decay", type=float, default=0.0, help="Adam weight decay (default: 0)")
    t.add_argument("--epochs", type=int, default=200, help="maximum epochs per run (default: 200)")
    t.add_argument("--patience", type=int, default=50, help="early-stopping patience, 0 = off (default: 50)")
    t.add_argument("--batch-size", type=int, default=8192, help="training batch size (default: 8192)")
    t.add_argument("--chunk-size", type=int, default=None,
                   help="chunk reshuffling chunk in rows; 1 = exact reshuffling (default: placement's choice)")
    t.add_argument("--memory-budget", type=parse_bytes, default=None,
                   help="memory for the data, e.g. 4G or 512MiB (default: 80%% of available RAM)")
    t.add_argument("--loader", choices=LOADERS, default="auto", help="data loader (default: auto)")
    t.add_argument("--runs", type=int, default=1, help="seeds to run (default: 1)")
    t.add_argument("--seed", type=int, default=0, help="first seed (default: 0)")
    t.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    t.add_argument("--out", default=None, help="run directory for config.json, metrics.jsonl, summary.json")
    t.add_argument("--json", action="store_true", help="print the summary as JSON")
    t.set_defaults(func=run_train_pp)


def run_preprocess(args: argparse.Namespace) -> int:
    """``trellis preprocess``: build or reuse the cache."""
    if args.hops < 1:
        raise TrellisUserError(f"--hops {args.hops} must be >= 1 (R = number of propagation steps)")
    store = open_store(args.store)
    spec = OperatorSpec(name=args.operator, alpha=args.alpha, t=args.t, iters=args.iters)
    settings = PPSettings(operator=spec, hops=args.hops, split_rows_only=args.split_rows_only,
                          shuffle_seed=args.shuffle_seed, feature_norm=args.feature_norm)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout)

    cache, action = ensure_pp(store, args.out, settings, overwrite=args.overwrite, block_rows=args.block_rows,
                              progress=not args.no_progress, log=log)
    result = {
        "action": action,
        "pp_dir": str(cache.path),
        "store": str(store.path),
        "settings": cache.manifest["settings"],
        "rows": cache.num_rows,
        "split_rows_only": cache.split_rows_only,
        "features": cache.num_features,
        "bytes": cache.nbytes(),
        "seconds": cache.manifest["build"]["seconds"],
        "kernel": cache.manifest["build"]["kernel"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{action} {cache.path}: hops 0..{cache.hops} × {cache.num_rows:,} rows × {cache.num_features} "
              f"features = {fmt_bytes(result['bytes'])}; preprocessing took {result['seconds']:.2f} s "
              f"({result['kernel']} kernel)")
    return 0


def run_train_pp(args: argparse.Namespace) -> int:
    """``trellis train-pp``: train from a cache and print the summary."""
    from trellis.train.pp import PPTrainConfig, train_pp

    cfg = PPTrainConfig(model=args.model, hidden=args.hidden, layers=args.layers, heads=args.heads,
                        dropout=args.dropout, input_dropout=args.input_dropout, lr=args.lr,
                        weight_decay=args.weight_decay, epochs=args.epochs, patience=args.patience,
                        batch_size=args.batch_size, chunk_size=args.chunk_size, memory_budget=args.memory_budget,
                        loader=args.loader, runs=args.runs, seed=args.seed, device=args.device,
                        threads=args.threads, out=args.out)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout)

    summary = train_pp(args.store, args.pp_dir, cfg, log=log)
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    return 0
