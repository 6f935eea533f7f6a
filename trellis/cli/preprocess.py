"""``trellis preprocess``: build a pre-propagation cache for ``trellis train --strategy pp``.

``trellis preprocess STORE --operator sym --hops 3 --out PP_DIR`` computes ``[X, BX, …, B^R X]`` once,
out of core, with a progress bar over row blocks; running it again with the same store and settings
reuses the cache, an interrupted run is redone, and a ``PP_DIR`` from another store or other settings is
refused (``--overwrite`` replaces it).

``trellis train STORE --strategy pp --pp-dir PP_DIR --model sign`` then trains SGC/SIGN/HOGA from the
cache as many times as wanted.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from trellis.cli.args import add_progress_flag
from trellis.cli.commands import help_of, help_text
from trellis.loader.ppcache import preprocess
from trellis.ops.propagate import FEATURE_NORMS, OPERATORS
from trellis.utils.sizes import format_size

#: ``--model`` choices (``trellis.nn.pp_models.PP_MODELS``; imported lazily so ``preprocess`` needs no model code).
PP_MODEL_NAMES = ("sgc", "sign", "hoga")


def register(sub: Any) -> None:
    """Add ``preprocess`` to the ``trellis`` subcommands."""
    p = sub.add_parser("preprocess", help=help_of("preprocess"),
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
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
                        "l2: by its L2 norm; auto: chosen from the features as `trellis train` chooses (row for "
                        "bag-of-words rows, l2 for rows with many active words, none for dense or signed "
                        "features) (default: auto)")
    p.add_argument("--shuffle-seed", type=int, default=0,
                   help="seed of the one-time shuffle of training rows (default: 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a PP_DIR built from another store/settings")
    add_progress_flag(p, "a progress bar on a terminal")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run_preprocess)



def run_preprocess(args: argparse.Namespace) -> int:
    """``trellis preprocess``: build or reuse the cache."""

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout)

    result = preprocess(args.store, args.out, operator=args.operator, hops=args.hops, alpha=args.alpha, t=args.t,
                        iters=args.iters, split_rows_only=args.split_rows_only, block_rows=args.block_rows,
                        feature_norm=args.feature_norm, shuffle_seed=args.shuffle_seed, overwrite=args.overwrite,
                        progress=args.progress, log=log)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['action']} {result['pp_dir']}: hops 0..{args.hops} × {result['rows']:,} rows × "
              f"{result['features']} "
              f"features = {format_size(result['bytes'])}; preprocessing took {result['seconds']:.2f} s "
              f"({result['kernel']} kernel)")
    return 0
