"""Sparse input rows against dense rows: the same full-batch GCN, interleaved in one run.

    python -m benchmarks.bench_sparse_rows STORE [--epochs 20] [--reps 2] [--hidden 16]

Trains ``trellis train STORE --model gcn`` in this process, alternately with the store's bag-of-words
features kept sparse (the default, :mod:`trellis.ops.sparse_rows`) and forced dense, and prints the median
training step and epoch (step + evaluation) of each, their ratio, and the largest difference of the
per-epoch losses of a run without dropout (dropout masks are drawn per stored value when sparse, so with
dropout the two runs differ by their masks, not by their arithmetic).
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


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved comparison and print one table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=16)
    args = ap.parse_args(argv)
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
