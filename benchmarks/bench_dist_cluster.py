"""Cluster-batch across ranks (GraphTheta's hybrid-parallel batches) against one process: result, epoch, memory.

    python -m benchmarks.bench_dist_cluster --store STORE --layout PART_DIR [--ranks 2] [--epochs 3]
        [--clusters 64] [--clusters-per-batch 8] [--cluster-method metis] [--model gcn] [--hidden 128]

One run after another (never two at once): ``trellis train STORE --strategy cluster`` in one process, then the
same batches with ``--parts-dir PART_DIR --nproc R`` for each R in ``--ranks``. Reports the largest difference
of any per-epoch loss or metric from one process's (the ranks compute one process's batches), test accuracy,
the median epoch time of epochs >= 1, the halo bytes per epoch, and each process's peak ``RssAnon`` sampled from
outside every 10 ms (as ``benchmarks.scaling`` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.scaling import _run_sampled

KEYS = ("loss", "val_loss", "train_acc", "val_acc", "test_acc")


def _train(a: argparse.Namespace, out: Path, ranks: int) -> dict:
    cmd = [sys.executable, "-m", "trellis.cli", "train", a.store, "--strategy", "cluster", "--model", a.model,
           "--hidden", str(a.hidden), "--clusters", str(a.clusters), "--clusters-per-batch",
           str(a.clusters_per_batch), "--cluster-method", a.cluster_method, "--epochs", str(a.epochs), "--device",
           "cpu", "--checkpoint-every", "0", "--no-progress", "--out", str(out)]
    if ranks > 1:
        cmd += ["--parts-dir", a.layout, "--nproc", str(ranks)]
    _, peaks = _run_sampled(cmd, 7200.0, launcher=ranks > 1)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epoch = statistics.median(r["step_time_s"] for r in records[1:]) if len(records) > 1 else records[0]["step_time_s"]
    return {"test": float(summary["test_acc_mean"]) * 100, "epoch_s": epoch, "peaks": peaks, "records": records,
            "exchange": statistics.median(r.get("exchange_bytes", 0) for r in records)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--layout", required=True, help="a destination-owned layout of the store (trellis partition)")
    p.add_argument("--ranks", default="2", help="rank counts, comma-separated")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--model", default="gcn")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--clusters", type=int, default=64)
    p.add_argument("--clusters-per-batch", type=int, default=8)
    p.add_argument("--cluster-method", default="metis")
    a = p.parse_args(argv)
    counts = [1] + [int(r) for r in a.ranks.split(",")]
    rows: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="trellis-bench-dist-cluster-") as tmp:
        for r in counts:
            rows[r] = _train(a, Path(tmp) / f"r{r}", r)
            print(f"{r} rank(s): {rows[r]['epoch_s']:.2f} s/epoch", flush=True)
    one = rows[1]
    print(f"\n{a.store} over {a.layout}: {a.model} hidden {a.hidden}, {a.clusters_per_batch} of {a.clusters} "
          f"{a.cluster_method} clusters per batch, {a.epochs} epochs\n")
    print("| run | test accuracy | max diff from one process | epoch s | epoch vs one process | halo MiB per epoch "
          "| peak RssAnon MiB per process |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    for r, run in rows.items():
        diff = max(abs(x[k] - y[k]) for x, y in zip(run["records"], one["records"]) for k in KEYS)
        peaks = ", ".join(f"{v:,.0f}" for v in run["peaks"])
        name = "one process" if r == 1 else f"{r} ranks"
        ratio = run["epoch_s"] / one["epoch_s"]
        print(f"| {name} | {run['test']:.2f} | {diff:.1e} | {run['epoch_s']:.2f} | {ratio:.2f}× "
              f"| {run['exchange'] / 2**20:,.1f} | {peaks} |")
        out[name] = {"test": run["test"], "max_diff": diff, "epoch_s": run["epoch_s"],
                     "exchange_bytes": run["exchange"], "peak_rss_anon_mb": run["peaks"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
