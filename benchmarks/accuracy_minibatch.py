"""Accuracy of mini-batch and cluster-batch training against full-batch, through ``trellis train``'s trainer.

    python -m benchmarks.accuracy_minibatch [--datasets cora,computers] [--runs 10] [--configs ...]

Each configuration trains ``--runs`` seeds (``seed .. seed+runs-1``) with the trainer's defaults for the
model (GraphSAGE: hidden 64, dropout 0.5, lr 0.01, weight decay 5e-4, 200 epochs, patience 100; GCN:
hidden 16), early stopping on validation accuracy, and reports test accuracy at the best validation
epoch (mean ± std). Mini- and cluster-batch runs are evaluated exactly (layer-wise full-neighbourhood
inference), so the difference to full-batch is the training strategy alone. Datasets are imported
from ``../shared/data`` once into the temp dir (public splits for Cora; 20/30 per class on the rest).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_table

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CACHE = Path(tempfile.gettempdir()) / "trellis-bench-graphs"
SOURCES = {"cora": "cora", "citeseer": "citeseer", "computers": "amazon-computers", "cs": "coauthor-cs"}

#: name -> TrainConfig overrides.
CONFIGS = {
    "sage-full": {"model": "sage", "strategy": "full"},
    "sage-mini": {"model": "sage", "strategy": "mini", "fanouts": "15,10", "batch_size": 1024},
    "sage-mini-b64": {"model": "sage", "strategy": "mini", "fanouts": "15,10", "batch_size": 64},
    "sage-mini-labor": {"model": "sage", "strategy": "mini", "fanouts": "15,10", "batch_size": 64, "labor": True},
    "gcn-full": {"model": "gcn", "strategy": "full"},
    "gcn-cluster": {"model": "gcn", "strategy": "cluster", "clusters": 32, "clusters_per_batch": 4},
    "gcn-cluster-b1": {"model": "gcn", "strategy": "cluster", "clusters": 32, "clusters_per_batch": 4,
                       "boundary_hops": 1},
}


def store_for(name: str) -> str:
    out = CACHE / f"ds-{name}"
    if not (out / "manifest.json").exists():
        from trellis.data.importers import import_graph

        import_graph(DATA / SOURCES[name], out, progress=False)
    return str(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="cora,computers")
    ap.add_argument("--configs", default="sage-full,sage-mini,sage-mini-b64,gcn-full,gcn-cluster")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=None, help="override the epoch budget")
    a = ap.parse_args()
    from trellis.train.config import TrainConfig
    from trellis.train.trainer import Trainer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ds in a.datasets.split(","):
            store = store_for(ds)
            for name in a.configs.split(","):
                extra = {"epochs": a.epochs} if a.epochs else {}
                cfg = TrainConfig(store=store, out=f"{tmp}/{ds}-{name}", runs=a.runs, progress=False,
                                  checkpoint_every=0, **CONFIGS[name], **extra)
                t0 = time.perf_counter()
                s = Trainer(cfg).fit()
                row = {"dataset": ds, "config": name, "test acc": f"{100 * s['test_acc_mean']:.2f} ± "
                       f"{100 * s['test_acc_std']:.2f}", "val acc": f"{100 * s['val_acc_mean']:.2f}",
                       "runs": a.runs, "epoch s (median)": s["epoch_time_s_median"],
                       "wall s": time.perf_counter() - t0}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print_table(rows, list(rows[0]))


if __name__ == "__main__":
    main()
