"""Lotan's model-selection grid as one ``trellis sweep``, checked against solo ``trellis train`` runs.

    python -m benchmarks.lotan_grid [--dataset amazon-computers] [--epochs 100]

The grid of Lotan §7 — lr {0.05, 0.01} × optimizer {adam, adagrad} × dropout {0, 0.5}, a 3-layer GCN with
hidden 256 — runs as one model-batched sweep; then every configuration's saved ``config.json`` is trained
solo by ``trellis train --config`` and its per-epoch training loss is compared with the sweep's. Prints
the leaderboard, the largest per-epoch loss difference of each configuration (acceptance: ≤ 1e-4), and the
sweep's wall time beside the eight solo runs' (one process, data loaded once per run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import print_table

DATA = Path(os.environ.get("TRELLIS_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
GRID = ["lr=0.05,0.01", "optimizer=adam,adagrad", "dropout=0,0.5"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="amazon-computers", help="folder under ../shared/data")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "trellis-lotan-grid"))
    p.add_argument("--json", default=None, help="also write the report here")
    a = p.parse_args()

    from trellis.data.importers import import_graph
    from trellis.train.config import TrainConfig
    from trellis.train.runs import read_jsonl
    from trellis.train.sweep import SweepConfig, parse_grid, run_sweep
    from trellis.train.trainer import Trainer

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    store = work / f"store-{a.dataset}"
    if not (store / "manifest.json").exists():
        import_graph(DATA / a.dataset, store, progress=False)
    t0 = time.perf_counter()
    board = run_sweep(SweepConfig(store=str(store), model="gcn", grid=parse_grid(GRID),
                                  base={"hidden": "256", "layers": "3"}, epochs=a.epochs, patience=a.epochs,
                                  out=str(work / "sweep"), overwrite=True, progress=False))
    sweep_s = time.perf_counter() - t0
    rows, solo_s = [], 0.0
    for r in board["rows"]:
        cid = r["config"]
        cdir = work / "sweep" / "configs" / cid
        values = json.loads((cdir / "config.json").read_text())
        values.update(out=str(work / f"solo-{cid}"), overwrite=True, progress=False)
        t = time.perf_counter()
        Trainer(TrainConfig.from_dict(values)).fit()
        solo_s += time.perf_counter() - t
        batched = [x["loss"] for x in read_jsonl(cdir / "metrics.jsonl")]
        solo = [x["loss"] for x in read_jsonl(work / f"solo-{cid}" / "metrics.jsonl")]
        diff = max(abs(x - y) for x, y in zip(batched, solo, strict=True))
        rows.append({"config": cid, "lr": r["lr"], "optimizer": r["optimizer"], "dropout": r["dropout"],
                     "val_acc": r["val_acc"], "test_acc": r["test_acc"], "epochs": r["epochs"],
                     "max_loss_diff": f"{diff:.1e}"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"\n## Lotan's grid on {a.dataset}: 3-layer GCN hidden 256, {a.epochs} epochs, "
          f"K = {board['batch_models']}\n")
    print_table(rows, list(rows[0]))
    print(f"\nsweep wall {sweep_s:.1f} s; the 8 solo runs {solo_s:.1f} s (ratio {solo_s / sweep_s:.2f}); "
          f"max per-epoch loss difference {max(float(r['max_loss_diff']) for r in rows):.1e}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "sweep_s": sweep_s, "solo_s": solo_s,
                                            "batch_models": board["batch_models"]}, indent=2))


if __name__ == "__main__":
    main()
