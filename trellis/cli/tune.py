"""``trellis tune``: search a model's hyperparameters on validation, then report test accuracy over seeds.

Candidates are drawn from a search space (the model's documented default, a JSON file, or ``--grid``),
trained model-batched, and cut by successive halving on validation; the chosen configuration is retrained
over several splits and seeds. Bad input — an unknown key or an empty range in a space file, a bad budget,
a TUNE_DIR that is not a tune — is one line naming it and exit code 2, with nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from trellis.cli.args import add_progress_flag
from trellis.cli.commands import help_of, help_text
from trellis.cli.sweep import BUDGET_HELP, _base, _int, with_budget
from trellis.errors import TrellisUserError

_EPILOG = """\
examples:
  trellis tune STORE --model gcn --budget 20m --out TUNE_DIR
  trellis tune STORE --model gat --space space.json --candidates 9 --epochs 300 --out TUNE_DIR
  trellis tune STORE --grid lr=0.01,0.005 hidden=64,256 dropout=0.3,0.6 --out TUNE_DIR
  trellis tune --resume TUNE_DIR                    continue an interrupted tune
  trellis train STORE --config TUNE_DIR/best/config.json      replay the chosen configuration

a space file is JSON: {"lr": {"log_uniform": [0.001, 0.05]}, "hidden": [64, 128], "dropout": {"uniform": [0.2, 0.8]}}
tunable:
  lr, weight_decay, dropout, hidden, layers, optimizer, init, momentum, residual, pre_norm, norm, jk
"""


def register(sub: Any) -> None:
    """Add ``trellis tune`` to the CLI."""
    p = sub.add_parser("tune", help=help_of("tune"), description=help_text(__doc__), epilog=_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", metavar="STORE", nargs="?", default=None, help="graph store directory")
    p.add_argument("--model", default="gcn", metavar="NAME", help="model family (default: gcn)")
    p.add_argument("--space", default="default", metavar="default|FILE",
                   help="search space: the model's default or a JSON file (default: default)")
    p.add_argument("--grid", nargs="+", metavar="KEY=V1,V2", default=None,
                   help="a finite space on the command line instead of --space, e.g. lr=0.01,0.005 hidden=64,128")
    p.add_argument("--search", default="auto", choices=("auto", "grid", "random"),
                   help="auto: the whole grid when it has at most --candidates points, else random draws "
                        "(default: auto)")
    p.add_argument("--candidates", type=_int("--candidates"), default=27, metavar="N",
                   help="candidates drawn at random (the first rung; default: 27)")
    p.add_argument("--budget", default=None, metavar="DURATION",
                   help="wall-time budget for the whole tune, e.g. 20m, 90s, 1h (a bare number is minutes) "
                        "(default: none: the full halving schedule)")
    p.add_argument("--eta", type=_int("--eta"), default=3, metavar="N",
                   help="halving rate: keep the best 1/eta per rung, train them eta times longer (default: 3)")
    p.add_argument("--min-epochs", type=_int("--min-epochs"), default=None, metavar="N",
                   help="epochs of the first rung (default: --epochs / eta^s, at least 20)")
    p.add_argument("--epochs", type=_int("--epochs"), default=None, metavar="N",
                   help="epochs of the last rung (default: the model's, 200 for gcn)")
    p.add_argument("--patience", type=_int("--patience"), default=None, metavar="N",
                   help="early-stopping patience of every candidate (default: the model's)")
    p.add_argument("--seed", type=_int("--seed"), default=0, metavar="N",
                   help="seed of the draws and the candidates (default: 0)")
    p.add_argument("--seeds", type=_int("--seeds"), default=3, metavar="N",
                   help="seeds per split for the chosen configuration's final runs (default: 3)")
    p.add_argument("--playoff", type=_int("--playoff"), default=15, metavar="N",
                   help="the N best finalists are retrained with fresh seeds and the best mean validation is "
                        "chosen (1: the search's best single run; default: 15)")
    p.add_argument("--playoff-seeds", type=_int("--playoff-seeds"), default=3, metavar="N",
                   help="fresh seeds per playoff finalist and round; with --budget, time left races the "
                        "finalists within noise of the leader over further rounds (default: 3)")
    p.add_argument("--splits", type=_int("--splits"), default=None, metavar="N",
                   help="splits for the final runs: per-class splits drawn again (Shchur et al.'s npz imports) or "
                        "the store's fixed splits (Platonov et al.'s) (default: 3 where a store has them; else 1)")
    p.add_argument("--set", dest="base", action="extend", nargs="+", metavar="KEY=VALUE", default=[],
                   help="values every candidate shares (fields of `trellis train`, e.g. feature_norm=l2)")
    p.add_argument("--batch-models", type=_int("--batch-models"), default=None, metavar="K",
                   help="candidates per batched model (default: the cost model's choice)")
    p.add_argument("--memory-budget", default=None, metavar="SIZE", help=BUDGET_HELP)
    p.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}", help="device (default: auto)")
    p.add_argument("--out", default=None, metavar="TUNE_DIR", help="output directory (default: tunes/<store>-<model>)")
    p.add_argument("--resume", default=None, metavar="TUNE_DIR", help="continue the interrupted tune in TUNE_DIR")
    p.add_argument("--overwrite", action="store_true", help="replace an existing TUNE_DIR")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line at the end")
    add_progress_flag(p)
    p.set_defaults(func=run, _defaults={a.dest: a.default for a in p._actions if a.dest != "help"})


#: What ``--resume`` may be given with: the rest is the tune's saved settings.
RESUME_ALLOWED = frozenset({"resume", "json", "progress", "func", "model_factory"})


def config_from_args(args: argparse.Namespace) -> Any:
    """The validated :class:`~trellis.train.tune.TuneConfig` of the command line."""
    from pathlib import Path

    from trellis.train.tune import TuneConfig, parse_duration

    if args.store is None:
        raise TrellisUserError("trellis tune: give a STORE (or --resume TUNE_DIR)")
    if args.seed < 0:
        raise TrellisUserError(f"--seed must be an integer >= 0 (got {args.seed})")
    out = args.out or str(Path("tunes") / f"{Path(args.store).name}-{args.model}")
    return TuneConfig(store=args.store, model=args.model, space=args.space, grid=args.grid, search=args.search,
                      candidates=args.candidates,
                      budget_s=parse_duration(args.budget) if args.budget is not None else None, eta=args.eta,
                      min_epochs=args.min_epochs, epochs=args.epochs, patience=args.patience, seed=args.seed,
                      seeds=args.seeds, splits=args.splits, playoff=args.playoff,
                      playoff_seeds=args.playoff_seeds, base=with_budget(_base(args.base), args.memory_budget),
                      device=args.device, batch_models=args.batch_models, out=out,
                      overwrite=args.overwrite, progress=args.progress)


def run(args: argparse.Namespace) -> int:
    """Run (or resume) the tune and print its leaderboard and report; returns exit code 0."""
    from trellis.train.tune import format_tune, load_resume, run_tune

    if args.resume is not None:
        given = sorted(d for d, default in args._defaults.items()
                       if d not in RESUME_ALLOWED and getattr(args, d) != default)
        if given:
            name = "STORE" if given[0] == "store" else "--" + given[0].replace("_", "-")
            raise TrellisUserError(f"{name} cannot be given with --resume: a resumed tune continues with the settings "
                                   f"saved in {args.resume}/tune.json (start a new tune with --out to change them)")
        tc = load_resume(args.resume)
        tc.out = args.resume
        board = run_tune(tc, model_factory=getattr(args, "model_factory", None), resume=True)
    else:
        board = run_tune(config_from_args(args), model_factory=getattr(args, "model_factory", None))
    print(format_tune(board), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        sys.stdout.flush()
        print(json.dumps({k: v for k, v in board.items() if k != "rows"} | {"top": board["rows"][:5]}))
    return 0
