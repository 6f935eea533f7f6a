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

from trellis.errors import TrellisUserError


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
    p.add_argument("--seed", type=int, default=0, help="seed of shuffle and samples (default: 0)")
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


# ---- dist -----------------------------------------------------------------------------------------------
def _count(text: str) -> int:
    """``"200k"`` -> 200000, ``"1.5m"`` -> 1500000 (decimal suffixes k, m, g)."""
    t = text.strip().lower()
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (e.g. 200000, 200k, 1m)") from None


def _dist_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", nargs="?", default=None,
                   help="graph store directory (default: generate one with --generator/--nodes)")
    p.add_argument("--generator", default="sbm", choices=("sbm", "rmat"), help="generated graph (default: sbm)")
    p.add_argument("--nodes", type=_count, default=200_000, help="nodes of the generated graph (default: 200k)")
    p.add_argument("--avg-degree", type=float, default=10.0, help="edges per node when generating (default: 10)")
    p.add_argument("--features", type=int, default=64, help="feature width when generating (default: 64)")
    p.add_argument("--classes", type=int, default=8, help="classes when generating (default: 8)")
    p.add_argument("--methods", default="grem,hash-dst", metavar="M1,M2",
                   help="partitioning methods (default: grem,hash-dst)")
    p.add_argument("--procs", default="1,2,4", metavar="P1,P2", help="rank counts, 1 included (default: 1,2,4)")
    p.add_argument("--epochs", type=int, default=10, help="epochs per run (default: 10)")
    p.add_argument("--model", default="gcn", help="model (default: gcn)")
    p.add_argument("--hidden", type=int, default=16, help="hidden width (default: 16)")
    p.add_argument("--layers", type=int, default=2, help="layers (default: 2)")
    p.add_argument("--predict", action="store_true",
                   help="add the cost model's prediction (trellis.dist.cost) from the P=1 step, the layouts' "
                        "per-part counts and the measured loopback bandwidth")
    p.add_argument("--bandwidth", default=None, metavar="BYTES/S",
                   help="link bandwidth for --predict, e.g. 1.25G or 1250000000 (default: measured loopback)")
    p.add_argument("--latency", type=float, default=None, metavar="S",
                   help="seconds per message for --predict (default: measured loopback)")
    p.add_argument("--cores", type=int, default=None, help="cores of this machine (default: all)")
    p.add_argument("--thread-efficiency", type=float, default=None, metavar="E",
                   help="intra-op thread efficiency in [0, 1] (default: measured, P=1 on one core)")
    p.add_argument("--workdir", default=None, help="keep stores, layouts and runs here (default: a temporary "
                                                   "directory, removed)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def _dist_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trellis.dist.scaling import ScalingConfig, format_rows, run_scaling
    from trellis.partition import available_methods
    from trellis.utils.sizes import parse_size

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in available_methods()]
    if not methods or bad:
        raise TrellisUserError(f"--methods {args.methods}: choose partitioners among {', '.join(available_methods())}")
    try:
        procs = sorted({int(v) for v in args.procs.split(",") if v.strip()})
    except ValueError:
        raise TrellisUserError(f"--procs {args.procs}: comma-separated positive integers, e.g. 1,2,4") from None
    if not procs or procs[0] < 1:
        raise TrellisUserError(f"--procs {args.procs}: comma-separated positive integers, e.g. 1,2,4")
    if args.predict and 1 not in procs:
        raise TrellisUserError("--predict needs 1 in --procs: the P=1 step is the model's reference")
    if args.nodes < 2 * max(procs) or args.epochs < 2 or args.hidden < 1 or args.layers < 1:
        raise TrellisUserError("--nodes must be at least 2 x the largest P, --epochs at least 2, --hidden and "
                               "--layers positive")
    if args.thread_efficiency is not None and not 0.0 <= args.thread_efficiency <= 1.0:
        raise TrellisUserError(f"--thread-efficiency must lie in [0, 1] (got {args.thread_efficiency})")
    if args.store is not None and not (Path(args.store) / "manifest.json").exists():
        raise TrellisUserError(f"{args.store}: not a graph store (no manifest.json); create one with "
                               "`trellis data generate` or leave STORE out")
    bandwidth = None if args.bandwidth is None else float(parse_size(args.bandwidth, flag="--bandwidth"))
    if bandwidth is not None and bandwidth <= 0:
        raise TrellisUserError("--bandwidth must be positive")
    cfg = ScalingConfig(store=None if args.store is None else Path(args.store), generator=args.generator,
                        nodes=args.nodes, avg_degree=args.avg_degree, features=args.features, classes=args.classes,
                        methods=tuple(methods), procs=tuple(procs), epochs=args.epochs, model=args.model,
                        hidden=args.hidden, layers=args.layers, predict=args.predict, bandwidth=bandwidth,
                        latency_s=args.latency, cores=args.cores, thread_efficiency=args.thread_efficiency,
                        workdir=None if args.workdir is None else Path(args.workdir))
    result = run_scaling(cfg, log=(lambda s: None) if args.json else (lambda s: print(s, flush=True)))
    print(json.dumps(result) if args.json else format_rows(result))
    return 0


#: Benchmark registry: ``trellis bench NAME`` -> :class:`Bench`. A new benchmark is one entry.
BENCHES: dict[str, Bench] = {
    "sampler": Bench("batch preparation: neighbour sampling, and sampling + feature gather", _sampler_args,
                     _sampler_run),
    "dist": Bench("partition-parallel training at P = 1, 2, 4 against the single process; --predict adds the "
                  "cost model's prediction", _dist_args, _dist_run),
}


def register(sub: Any) -> None:
    """Add ``bench`` with one sub-subcommand per :data:`BENCHES` entry."""
    p = sub.add_parser("bench", help="benchmark Trellis components on a store", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    benches = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    benches.required = True
    for name, bench in BENCHES.items():
        bp = benches.add_parser(name, help=bench.help, description=bench.help)
        bench.add_arguments(bp)
        bp.set_defaults(func=bench.run)
