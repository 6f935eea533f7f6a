"""``trellis sweep``: train a grid of hyperparameter configurations, K at a time in one batched model.

Every configuration is a complete ``trellis train`` configuration (its ``config.json`` in
``SWEEP_DIR/configs/<id>/`` repeats it solo); model batching changes how fast they train, never what they
compute. Bad input — an empty grid, an unknown hyperparameter, a value of the wrong type, a grid over model
families — is one line naming the item and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from trellis.cli.args import add_progress_flag
from trellis.cli.commands import help_of, help_text
from trellis.errors import TrellisUserError
from trellis.utils.sizes import parse_size

_EPILOG = """\
examples:
  trellis sweep STORE --model gcn --grid lr=0.01,0.005 hidden=64,128,256 dropout=0.3,0.5 --out SWEEP_DIR
  trellis sweep STORE --grid optimizer=adam,adagrad lr=0.05,0.01 --set layers=3 hidden=256 --out SWEEP_DIR
  trellis sweep STORE --grid hidden=64,256 --batch-models 1 --out SWEEP_DIR     one at a time
  trellis sweep STORE --grid hidden=64,256 --explain      the K table and the batched plan, no training
  trellis sweep STORE --grid lr=0.01,0.005 weight_decay=0,5e-4 --memory-budget 3G --out SWEEP_DIR
                                                          out of core: the batch shares every tile's reads
  trellis sweep STORE --model sign --grid lr=0.003,0.001 --set strategy=pp pp_dir=PP_DIR --out SWEEP_DIR
                                                          pre-propagation: each batch's rows read once

sweepable hyperparameters:
  lr, weight_decay, dropout, hidden, layers, optimizer, init, momentum, residual, pre_norm, norm, jk
"""


def _int(name: str) -> Any:
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer (got {text!r})") from None
    return parse


def register(sub: Any) -> None:
    """Add ``trellis sweep`` to the CLI."""
    p = sub.add_parser("sweep", help=help_of("sweep"),
                       description=help_text(__doc__), epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", metavar="STORE", help="graph store directory")
    p.add_argument("--model", default="gcn", metavar="NAME",
                   help="model family: gcn, sage, gin batch; others train one configuration at a time "
                        "(default: gcn)")
    p.add_argument("--grid", nargs="+", metavar="KEY=V1,V2", default=None,
                   help="hyperparameter values to combine, e.g. lr=0.01,0.005 hidden=64,128 dropout=0.3,0.5")
    p.add_argument("--set", dest="base", action="extend", nargs="+", metavar="KEY=VALUE", default=[],
                   help="values every configuration shares (fields of `trellis train`, e.g. layers=3 "
                        "weight_decay=0)")
    p.add_argument("--batch-models", type=_int("--batch-models"), default=None, metavar="K",
                   help="configurations per batched model (default: chosen from the cost model and memory budget)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE", help=BUDGET_HELP)
    p.add_argument("--epochs", type=_int("--epochs"), default=None, metavar="N",
                   help="maximum epochs per configuration (default: the model's, 200 for gcn)")
    p.add_argument("--patience", type=_int("--patience"), default=None, metavar="N",
                   help="early-stopping patience per configuration (default: the model's, 100)")
    p.add_argument("--seed", type=_int("--seed"), default=0, metavar="N",
                   help="seed of every configuration, as `trellis train --seed` (default: 0)")
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}", help="device (default: auto)")
    p.add_argument("--out", default=None, metavar="SWEEP_DIR",
                   help="output directory (default: sweeps/<store>-<model>-<time>)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing SWEEP_DIR")
    p.add_argument("--explain", action="store_true",
                   help="print the configurations, the choice of K and the batched plan, then exit")
    p.add_argument("--json", action="store_true", help="print the leaderboard as one JSON line at the end")
    add_progress_flag(p, "progress bar per batch on a terminal")
    p.set_defaults(func=run)


#: ``--memory-budget`` of sweep and tune: the same option as ``trellis train``'s, given to every configuration.
BUDGET_HELP = ("train every configuration within SIZE, as `trellis train --memory-budget` does (e.g. 3G): full "
               "trains out of core with K configurations sharing every tile's reads; pp plans its placement in "
               "it (default: none, in memory; K is then chosen within 60%% of the available memory)")


def with_budget(base: dict[str, str], budget: str | None) -> dict[str, str]:
    """``base`` with ``--memory-budget`` as every configuration's ``memory_budget`` (one flag, one meaning)."""
    if budget is None:
        return base
    if "memory_budget" in base:
        raise TrellisUserError("--memory-budget and --set memory_budget=... name the same option; give it once")
    parse_size(budget, flag="--memory-budget")  # one flag for every configuration: named as such, not by the first
    return {**base, "memory_budget": budget}


def _base(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise TrellisUserError(f"--set {item!r}: expected KEY=VALUE, e.g. --set layers=3")
        out[key.strip().replace("-", "_")] = value
    return out


def config_from_args(args: argparse.Namespace) -> Any:
    """The validated :class:`~trellis.train.sweep.SweepConfig` of the command line."""
    from trellis.train.sweep import SweepConfig, parse_grid

    for name in ("epochs", "patience"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise TrellisUserError(f"--{name} must be an integer >= 1 (got {value})")
    if args.seed < 0:
        raise TrellisUserError(f"--seed must be an integer >= 0 (got {args.seed})")
    return SweepConfig(store=args.store, model=args.model, grid=parse_grid(args.grid),
                       base=with_budget(_base(args.base), args.memory_budget), epochs=args.epochs,
                       patience=args.patience, seed=args.seed, device=args.device,
                       batch_models=args.batch_models, out=args.out,
                       overwrite=args.overwrite, progress=args.progress)


def run(args: argparse.Namespace) -> int:
    """Run (or with ``--explain`` only plan) the sweep and print its leaderboard; returns exit code 0."""
    from trellis.train.sweep import explain_sweep, format_leaderboard, run_sweep

    sc = config_from_args(args)
    if args.explain:
        text = explain_sweep(sc, model_factory=getattr(args, "model_factory", None))
        print(text)
        if args.json:
            print(json.dumps({"explain": text}))
        return 0
    board = run_sweep(sc, model_factory=getattr(args, "model_factory", None))
    print(format_leaderboard(board), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        sys.stdout.flush()
        print(json.dumps(board))
    return 0
