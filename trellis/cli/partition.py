"""``trellis partition STORE --parts P --method M --out PART_DIR``: partition a store, report, write the layout.

Every check of the user's input (part count, method, chunk size, the store's manifest, an existing output)
runs before any work starts, so a bad invocation exits 2 with one line and writes nothing. The layout is
built under a temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from trellis.cli.args import add_progress_flag, seed_int
from trellis.cli.commands import help_of
from trellis.errors import TrellisUserError

DESCRIPTION = """\
Split a graph store into P balanced parts with few cut edges, print the quality report and write the
partitioned layout (local CSR + halo per part, edge buckets, per-part features) to PART_DIR.

methods: grem (streaming with refinement, Armada), metis (pymetis), ldg, fennel (streaming greedy),
random, hash (1D by source; hash-dst by destination), vertex-cut (2D grid), reverse (Lotan).
"""


def register(subparsers: Any) -> None:
    """Add the ``partition`` subcommand."""
    p = subparsers.add_parser("partition", help=help_of("partition"),
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store", metavar="STORE", help="graph store directory")
    p.add_argument("--parts", "-p", type=int, required=True, help="number of parts P (1 <= P <= nodes)")
    p.add_argument("--method", "-m", default="grem", help="partitioning method (default: grem)")
    p.add_argument("--out", "-o", metavar="PART_DIR", help="layout directory to create (required unless --no-layout)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    chunk = p.add_mutually_exclusive_group()
    chunk.add_argument("--chunk-frac", type=float, help="grem: chunk size as a fraction of the edges, in (0, 1] "
                       "(default: the whole graph up to 16M edges, METIS then seeds every edge; 0.1 above)")
    chunk.add_argument("--chunk-edges", type=int, help="grem: chunk size in edges (memory stays fixed)")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed (default: 0)")
    p.add_argument("--no-refine", action="store_true", help="grem: fixed assignments (no re-assignment)")
    p.add_argument("--seed-method", help="grem: seed partitioner on the first chunk: metis, ldg or fennel "
                   "(default: metis)")
    p.add_argument("--passes", type=int, help="grem: passes over the edge stream per level (default: 1)")
    p.add_argument("--imbalance", type=float, default=0.05,
                   help="allowed imbalance: parts hold at most (1 + x) * N / P nodes (default: 0.05)")
    p.add_argument("--width", type=int, default=256,
                   help="feature width F for the exchange estimate (default: 256)")
    p.add_argument("--balance", metavar="WHAT",
                   help="what every part gets an equal share of besides nodes, comma-separated: train = training "
                        "nodes (equal targets and batch counts for the ranks that train the parts), edges = "
                        "in-edges (equal aggregation work); e.g. train,edges. Destination-owned methods "
                        "(default: nodes)")
    p.add_argument("--no-layout", action="store_true", help="only partition and report; write no layout")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PART_DIR")
    p.add_argument("--move-features", action="store_true",
                   help="after writing PART_DIR, delete the store's x.npy: the features then live only in the "
                        "layout (one copy on disk); mini-batch training reads them there with --parts-dir")
    add_progress_flag(p)
    p.set_defaults(func=run)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Method options the user actually gave (so a flag that does not apply can be reported)."""
    opts: dict[str, Any] = {"seed": args.seed, "imbalance": args.imbalance}
    for name in ("chunk_frac", "chunk_edges", "seed_method", "passes", "balance"):
        if getattr(args, name) is not None:
            opts[name] = getattr(args, name)
    if args.no_refine:
        opts["refine"] = False
    return opts


def run(args: argparse.Namespace) -> int:
    """Validate, partition, evaluate, write; print a table or one JSON line."""
    from trellis.partition.api import partition

    if args.no_layout and args.move_features:
        raise TrellisUserError("--move-features needs a layout to move the features into; drop --no-layout")
    out = None if args.no_layout else args.out
    if out is None and not args.no_layout:
        raise TrellisUserError("--out PART_DIR is required (or pass --no-layout to only report)")
    opts = _options(args)
    report, quality = partition(args.store, args.parts, method=args.method, out=out, width=args.width,
                                overwrite=args.overwrite, move_features=args.move_features,
                                progress=args.progress and not args.json, **opts)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        print(quality.table())
        if out is not None:
            print(f"\nlayout written to {out} in {report['layout_time_s']:.2f} s")
        sys.stdout.flush()
    return 0
