"""Sparse input rows against dense rows: the same full-batch GCN, interleaved in one run.

    python -m benchmarks.bench_sparse_rows STORE [--epochs 20] [--reps 2] [--hidden 16]

Trains ``trellis train STORE --model gcn`` in this process, alternately with the store's bag-of-words
features kept sparse (the default, :mod:`trellis.ops.sparse_rows`) and forced dense, and prints the median
training step and epoch (step + evaluation) of each, their ratio, and the largest difference of the
per-epoch losses of a run without dropout (dropout masks are drawn per stored value when sparse, so with
dropout the two runs differ by their masks, not by their arithmetic).

    python -m benchmarks.bench_sparse_rows STORE --strategy mini|cluster [--epochs 10] [--reps 2]

The batch strategies (session 58): each run is its own process (``trellis train STORE --strategy S``, GCN for
cluster, SAGE for mini), alternately with the rows taken sparse (the default: one CSR copy gathered per batch)
and as they were before (dense rows gathered per batch, normalized, dropped out at every value: what a dense
loader such as PyG's ``x[n_id]`` does), and prints each one's median epoch and peak ``RssAnon`` sampled from
outside every 10 ms, the ratios, and the largest difference of the per-epoch training losses.

    python -m benchmarks.bench_sparse_rows STORE --strategy ooc [--model gcn] [--budget 400M] [--epochs 10]

Out-of-core full-batch (session 59), the same way: ``trellis train STORE --memory-budget BUDGET`` with the rows
as sparse tiles (the default: a CSR spill written once) and as dense tiles (before: the dense rows read, dropped
out and multiplied tile by tile). The budget caps both; the table shows what each peaked at.

    python -m benchmarks.bench_sparse_rows STORE --strategy ranks --parts-dir PART_DIR [--model gcn] [--epochs 10]

Partition-parallel full-batch (session 59): one rank per part, started as ``trellis train --parts-dir`` starts
them (``python -m trellis.cli train --config``, the launcher's environment), with the rows sparse (the default
for GCN, SAGE and GIN) and dense (before); the memory column is the largest rank's peak ``RssAnon``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from trellis.train import trainer
from trellis.train.config import TrainConfig
from trellis.train.runs import read_jsonl
from trellis.train.strategies import full


def _run(store: str, out: Path, epochs: int, hidden: int, dropout: float, sparse: bool) -> tuple[float, float, list]:
    full.SPARSE_ROW_MODELS = frozenset({"gcn"}) if sparse else frozenset()
    cfg = TrainConfig(store=store, model="gcn", epochs=epochs, hidden=hidden, dropout=dropout, out=str(out),
                      progress=False, overwrite=True)
    trainer.train(cfg)
    recs = read_jsonl(out / "metrics.jsonl")
    steps = [r["step_time_s"] for r in recs[1:]]  # the first epoch compiles kernels
    epoch = [b["time_s"] - a["time_s"] for a, b in zip(recs, recs[1:])]
    return statistics.median(steps), statistics.median(epoch), [r["loss"] for r in recs]


def _rank(config: str, sparse: bool) -> int:
    """One rank of a ``--strategy ranks`` run: ``trellis train --config`` (dense rows forced unless ``sparse``)."""
    from trellis.cli.main import main as cli
    from trellis.train.strategies import partitioned

    if not sparse:
        partitioned.rank_sparse_density = lambda *a, **k: None  # type: ignore[assignment]
    return cli(["train", "--config", config])


def _launch_ranks(args: argparse.Namespace, sparse: bool) -> None:
    """The ranks of one run, started as the launcher starts them (environment, threads), waited for."""
    import json
    import os
    import subprocess

    from trellis.distributed.comm import free_port, rank_threads
    from trellis.partition.layout import PartitionedGraph

    world = PartitionedGraph(args.parts_dir).num_parts
    cfg = TrainConfig(store=args.store, model=args.model, epochs=args.epochs, out=args.out, progress=False,
                      overwrite=True, checkpoint_every=0, parts_dir=args.parts_dir, nproc=world)
    values = cfg.to_dict(session=True)
    config = Path(args.out + ".config.json")
    config.write_text(json.dumps(values))
    threads = str(rank_threads(world))
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.bench_sparse_rows", args.store, "--rank",
                               "sparse" if sparse else "dense", "--out", str(config)],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL)
             for r in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def _child(args: argparse.Namespace, sparse: bool) -> None:
    """One batch-strategy, out-of-core or ranks run in this process (the parent samples its memory)."""
    if args.strategy == "ranks":
        _launch_ranks(args, sparse)
        return
    from trellis.train.strategies.batches import BatchStrategy
    from trellis.train.strategies.outofcore import OutOfCoreFull

    if not sparse:
        BatchStrategy.sparse_input = property(lambda self: False)  # type: ignore[method-assign,assignment]
        OutOfCoreFull._sparse_density = lambda self, kind: None  # type: ignore[method-assign]
    ooc = args.strategy == "ooc"
    trainer.train(TrainConfig(store=args.store, strategy="full" if ooc else args.strategy, model=args.model,
                              epochs=args.epochs, out=args.out, progress=False, overwrite=True, checkpoint_every=0,
                              memory_budget=args.budget if ooc else None))


def _batch_run(args: argparse.Namespace, out: Path, sparse: bool) -> tuple[float, float, list[float]]:
    """Median epoch (training + evaluation), peak RssAnon (MiB, from outside) and losses of one child run."""
    import subprocess

    from trellis.utils.memory import TreeSampler

    cmd = [sys.executable, "-m", "benchmarks.bench_sparse_rows", args.store, "--strategy", args.strategy, "--epochs",
           str(args.epochs), "--model", args.model, "--budget", args.budget, "--child", "sparse" if sparse else "dense",
           "--out", str(out), *(["--parts-dir", args.parts_dir] if args.parts_dir else [])]
    proc = subprocess.Popen(cmd)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    code = proc.wait()
    sampler.stop()
    if code != 0:
        raise SystemExit(f"child run failed ({code}): {' '.join(cmd)}")
    recs = read_jsonl(out / "metrics.jsonl")
    epoch = statistics.median(b["time_s"] - a["time_s"] for a, b in zip(recs, recs[1:]))
    return epoch, max(sampler.peaks.values()) / 2**20, [r["loss"] for r in recs]


def batch_main(args: argparse.Namespace) -> int:
    """The batch strategies: sparse and dense rows, interleaved, one process per run."""
    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sparse-") as tmp:
        for rep in range(args.reps):
            for sparse in (False, True):
                epoch, peak, loss = _batch_run(args, Path(tmp) / f"{sparse}-{rep}", sparse)
                res[sparse].append((epoch, peak))
                losses[sparse] = loss
    diff = max(abs(a - b) for a, b in zip(losses[False], losses[True]))
    med = {k: (statistics.median(e for e, _ in v), statistics.median(m for _, m in v)) for k, v in res.items()}
    what = {"ooc": f"--memory-budget {args.budget}", "ranks": f"--parts-dir {args.parts_dir} (largest rank's memory)"
            }.get(args.strategy, f"--strategy {args.strategy}")
    print(f"{Path(args.store).name}: {what}, --model {args.model}, {args.epochs} epochs x {args.reps} reps each, "
          "interleaved, one process per run")
    print(f"{'rows':<8} {'epoch ms':>9} {'peak RssAnon MiB':>17}")
    for name, k in (("dense", False), ("sparse", True)):
        print(f"{name:<8} {1000 * med[k][0]:>9.1f} {med[k][1]:>17.0f}")
    print(f"dense / sparse: epoch {med[False][0] / med[True][0]:.1f}x, memory {med[False][1] / med[True][1]:.1f}x; "
          f"max |training loss diff| over the epochs: {diff:.2g}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved comparison and print one table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--epochs", type=int, default=None, help="default: 20 (full), 10 (mini, cluster)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--strategy", choices=("full", "mini", "cluster", "ooc", "ranks"), default="full",
                    help="ooc: full-batch under --budget; ranks: full-batch over --parts-dir")
    ap.add_argument("--parts-dir", help="ranks: the partitioned layout (one rank per part)")
    ap.add_argument("--model", help="mini, cluster, ooc: default sage for mini, else gcn")
    ap.add_argument("--budget", default="400M", help="ooc: the --memory-budget (default 400M)")
    ap.add_argument("--child", choices=("sparse", "dense"), help=argparse.SUPPRESS)
    ap.add_argument("--rank", choices=("sparse", "dense"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.model = args.model or ("sage" if args.strategy == "mini" else "gcn")
    if args.rank is not None:
        return _rank(args.out, args.rank == "sparse")
    if args.strategy == "ranks" and not args.parts_dir:
        ap.error("--strategy ranks needs --parts-dir")
    if args.child is not None:
        _child(args, args.child == "sparse")
        return 0
    if args.strategy != "full":
        args.epochs = args.epochs or 10
        return batch_main(args)
    args.epochs = args.epochs or 20
    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-sparse-") as tmp:
        for rep in range(args.reps):
            for sparse in (False, True):
                step, epoch, _ = _run(args.store, Path(tmp) / f"{sparse}-{rep}", args.epochs, args.hidden, 0.5, sparse)
                res[sparse].append((step, epoch))
        _, _, dense_losses = _run(args.store, Path(tmp) / "d0", 5, args.hidden, 0.0, False)
        _, _, sparse_losses = _run(args.store, Path(tmp) / "s0", 5, args.hidden, 0.0, True)
    diff = max(abs(a - b) for a, b in zip(dense_losses, sparse_losses))
    d_step = statistics.median(s for s, _ in res[False])
    s_step = statistics.median(s for s, _ in res[True])
    d_ep = statistics.median(e for _, e in res[False])
    s_ep = statistics.median(e for _, e in res[True])
    print(f"{Path(args.store).name}: GCN hidden {args.hidden}, {args.epochs} epochs x {args.reps} reps each, "
          "interleaved")
    print(f"{'rows':<8} {'step ms':>9} {'epoch ms':>9}")
    print(f"{'dense':<8} {1000 * d_step:>9.1f} {1000 * d_ep:>9.1f}")
    print(f"{'sparse':<8} {1000 * s_step:>9.1f} {1000 * s_ep:>9.1f}")
    print(f"dense / sparse: step {d_step / s_step:.1f}x, epoch {d_ep / s_ep:.1f}x; "
          f"max |loss diff| without dropout over 5 epochs: {diff:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
