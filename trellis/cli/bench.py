"""``trellis bench``: micro-benchmarks of Trellis's own components on a store.

Each benchmark is one entry of :data:`BENCHES`: a name, a one-line help, a function adding its flags and
a function running it (returning an exit code). Adding a benchmark is adding an entry; the parser is
built from the registry. Every benchmark prints a human-readable report, or one JSON object with
``--json``. (Comparisons against other systems live in ``benchmarks/``, not here: the CLI has no
competitor dependencies.)
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trellis.cli.args import seed_int
from trellis.cli.commands import help_of
from trellis.errors import TrellisUserError

DESCRIPTION = """\
Micro-benchmarks of Trellis's own components on a store. Each prints a report, or one JSON object with --json.
Comparisons against other systems are in the repository's benchmarks/ (make bench), not here."""


@dataclass(frozen=True)
class Bench:
    """One ``trellis bench NAME`` subcommand."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- sampler --------------------------------------------------------------------------------------------
def _sampler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", help="graph store directory")
    p.add_argument("--fanouts", default="15,10", metavar="F1,F2,...",
                   help="neighbours per node per layer, target layer first, -1 = all (default: 15,10)")
    p.add_argument("--batch-size", type=int, default=1024, help="target nodes per batch (default: 1024)")
    p.add_argument("--labor", action="store_true", help="LABOR sampling instead of uniform")
    p.add_argument("--batches", type=int, default=50, help="batches timed per figure (default: 50)")
    p.add_argument("--workers", type=int, default=1, help="threads preparing batches concurrently (default: 1)")
    p.add_argument("--threads", type=int, default=None,
                   help="numba threads per worker (default: all cores)")
    p.add_argument("--split", default="train", choices=("train", "all"),
                   help="targets: the training split or every node (default: train)")
    p.add_argument("--mmap", action="store_true",
                   help="gather features from the store's memory map instead of a copy in RAM")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of shuffle and samples (default: 0)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _sampler_run(args: argparse.Namespace) -> int:
    import numpy as np

    from trellis.data.store import open_store
    from trellis.loader.blocks import parse_fanouts
    from trellis.loader.throughput import format_throughput, sampler_throughput

    fanouts = parse_fanouts(args.fanouts)
    if args.batch_size <= 0:
        raise TrellisUserError(f"--batch-size must be a positive integer (got {args.batch_size})")
    if args.batches <= 0 or args.workers <= 0 or (args.threads is not None and args.threads <= 0):
        raise TrellisUserError("--batches, --workers and --threads must be positive integers")
    if args.threads is not None:
        from trellis.utils.numba import max_threads

        if args.threads > max_threads():
            raise TrellisUserError(f"--threads {args.threads}: numba runs at most {max_threads()} threads here "
                                   "(NUMBA_NUM_THREADS, the cores it saw); give at most that")
    store = open_store(args.store, verify=False)
    ids = store.split("train") if args.split == "train" else None
    if ids is None or len(ids) == 0:
        ids = np.arange(store.num_nodes, dtype=np.int64)
    x = store.x
    if x is not None and not args.mmap:
        x = np.array(x)
    result = sampler_throughput(store.indptr, store.indices, np.asarray(ids), fanouts, args.batch_size, x=x,
                                labor=args.labor, batches=args.batches, workers=args.workers, threads=args.threads,
                                seed=args.seed)
    result.update(store=str(store.path), num_nodes=store.num_nodes, num_edges=store.num_edges,
                  num_features=store.num_features, features_in="mmap" if args.mmap else "ram")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{store.name}: {store.num_nodes} nodes, {store.num_edges} edges, {store.num_features} features")
        print(format_throughput(result))
    return 0


#: Benchmark registry: ``trellis bench NAME`` -> :class:`Bench`. A new benchmark is one entry.
BENCHES: dict[str, Bench] = {
    "sampler": Bench("batch preparation: neighbour sampling, and sampling + feature gather", _sampler_args,
                     _sampler_run),
}


def register(sub: Any) -> None:
    """Add ``bench`` with one sub-subcommand per :data:`BENCHES` entry."""
    p = sub.add_parser("bench", help=help_of("bench"), description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    benches.required = True
    for name, bench in BENCHES.items():
        bp = benches.add_parser(name, help=bench.help, description=bench.help)
        bench.add_arguments(bp)
        bp.set_defaults(func=bench.run)
