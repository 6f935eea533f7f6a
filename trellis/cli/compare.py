"""``trellis compare RUN_DIR...``: one table of finished runs and their validation curves against wall time.

The work is in :mod:`trellis.train.compare`; this module parses the flags and prints. A path that is not
a finished run directory is one line naming it and exit code 2, with no PNG written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trellis.cli.commands import help_of
from trellis.errors import TrellisUserError

DESCRIPTION = """\
One table of finished runs and their validation curves against wall time. A path that is not a finished run
directory is one line naming it and exit code 2, with no PNG written."""

_EPILOG = """\
examples:
  trellis compare runs/cora-gcn runs/cora-sage-mini --target 0.78     who reaches val acc 0.78 first
  trellis compare runs/* --json --out /tmp/compare.png

columns: test metric mean ± std over runs; step ms = median training step; epoch ms = training + evaluation
per epoch; epochs; 99%pk ep = first epoch at >= 99% of the peak validation metric (PP-GNN); conv ep = first
epoch whose validation metric changed by <= 0.001 (Dorylus); reached = runs that reached the target;
epochs/time to target (means, only when every run reached it); peak anonymous memory.
"""


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None


def run_compare(args: argparse.Namespace) -> int:
    """Build the comparison, draw the PNG (unless --no-plot) and print the table or JSON."""
    from trellis.train.compare import compare_runs, format_table, plot_compare

    out = Path(args.out)
    if not args.no_plot:
        if out.suffix.lower() != ".png":
            raise TrellisUserError(f"--out {out}: must end in .png")
        if out.is_dir():
            raise TrellisUserError(f"--out {out}: is a directory; give a file name ending in .png")
    result, rds = compare_runs(args.run_dirs, args.target)
    result["plot"] = None if args.no_plot else str(plot_compare(result, rds, out))
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
        if result["plot"]:
            print(f"curves: {result['plot']}")
    return 0


def register(sub: Any) -> None:
    """Add ``trellis compare`` to the CLI."""
    p = sub.add_parser("compare", help=help_of("compare"),
                       description=DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of `trellis train` (any strategy)")
    p.add_argument("--target", type=_float, default=None, metavar="X",
                   help="validation target of the selection metric, in (0, 1] (default: each run's --target-acc)")
    p.add_argument("--out", default="compare.png", metavar="FILE.png",
                   help="where to draw the validation curves (default: compare.png)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the PNG")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    p.set_defaults(func=run_compare)
