"""Data-parallel mini-batch on ranks against one process's mini-batch: accuracy over seeds, epoch time, traffic.

    python -m benchmarks.bench_dist_mini --store STORE --layout PART_DIR [--ranks 2] [--seeds 5] [--epochs 5]
    python -m benchmarks.bench_dist_mini --store STORE --layout PART_DIR --ranks 1,2,4,8 --seeds 1  # scaling
    python -m benchmarks.bench_dist_mini ... --ranks 2 --also "--buffer-parts 2 --buffer-cache 64M"  # rank buffers

Per seed, one after another (never two at once): ``trellis train STORE --strategy mini`` in one process, then
``trellis train STORE --strategy mini --parts-dir PART_DIR --nproc R`` for each R in ``--ranks``, all GraphSAGE
with the same fanouts, batch size (the step's: each rank takes its share) and seed, exact layer-wise
evaluation. Reports test accuracy at the best validation epoch (mean ± std over seeds and the difference), the
median epoch time of epochs >= 1 and the training targets per second it gives (training steps only: evaluation
is not part of an epoch's time), the rows and bytes the ranks fetched from each other per epoch, and each
rank's peak ``RssAnon`` (sampled from outside every 10 ms, as ``benchmarks.scaling`` does) beside the single
process's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.scaling import _run_sampled
from trellis.data.store import GraphStore


def _train(store: str, out: Path, seed: int, a: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "trellis.cli", "train", store, "--strategy", "mini", "--model", "sage",
           "--hidden", str(a.hidden), "--fanouts", a.fanouts, "--batch-size", str(a.batch_size), "--epochs",
           str(a.epochs), "--seed", str(seed), "--device", "cpu", "--checkpoint-every", "0", "--no-progress",
           "--out", str(out), *extra]
    launched = bool(extra) and extra[-1] != "1"  # --nproc 1 trains in the launched process itself
    _, peaks = _run_sampled(cmd, 3600.0, launcher=launched)  # each training process's peak, from outside
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epoch = statistics.median(r["step_time_s"] for r in records[1:]) if len(records) > 1 else records[0]["step_time_s"]
    return {"test": float(summary["test_acc_mean"]) * 100, "epoch_s": epoch, "records": records, "summary": summary,
            "peaks": peaks}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--layout", required=True, help="the store's partitioned layout (`trellis partition`)")
    p.add_argument("--ranks", default="2", help="rank counts, comma-separated (1,2,4,8: a scaling table)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--fanouts", default="15,10")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--also", default="", help="flags of a second run at each rank count (e.g. a partition buffer "
                                              "per rank: \"--buffer-parts 2 --buffer-cache 64M\")")
    a = p.parse_args(argv)
    counts = [int(r) for r in str(a.ranks).split(",")]
    also = a.also.split()
    runs_of = [(r, f"{r} rank{'s' * (r > 1)}", []) for r in counts]
    if also:
        runs_of += [(r, f"{r} rank{'s' * (r > 1)} {a.also}", also) for r in counts]
    rows: dict[str, list[dict]] = {"one process": [], **{name: [] for _, name, _ in runs_of}}
    with tempfile.TemporaryDirectory(prefix="trellis-bench-dist-mini-") as tmp:
        for seed in range(a.seeds):
            one = _train(a.store, Path(tmp) / f"one-{seed}", seed, a, [])
            rows["one process"].append(one)
            line = f"seed {seed}: one process {one['test']:.2f} ({one['epoch_s']:.2f} s/epoch)"
            for i, (r, name, extra) in enumerate(runs_of):
                run = _train(a.store, Path(tmp) / f"run{i}-{seed}", seed, a,
                             [*extra, "--parts-dir", a.layout, "--nproc", str(r)])
                rows[name].append(run)
                line += f", {name} {run['test']:.2f} ({run['epoch_s']:.2f} s/epoch)"
            print(line, flush=True)
    train_nodes = int(GraphStore(a.store).split("train").shape[0])  # every one is a target once per epoch
    base = statistics.mean(r["test"] for r in rows["one process"])
    base_epoch = statistics.median(r["epoch_s"] for r in rows["one process"])
    print(f"\n{a.store}: SAGE hidden {a.hidden}, fanouts {a.fanouts}, batch {a.batch_size} per step, "
          f"{a.epochs} epochs, {a.seeds} seeds\n")
    print("| run | test accuracy | vs one process | epoch s | targets/s | speed-up | remote rows / epoch | "
          "fetched MiB / epoch | peak RssAnon MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = {}
    for name, runs in rows.items():
        tests = [r["test"] for r in runs]
        mean, sd = statistics.mean(tests), statistics.stdev(tests) if len(tests) > 1 else 0.0
        epoch = statistics.median(r["epoch_s"] for r in runs)
        last = runs[0]["records"][-1]
        remote = last.get("fetch_remote_rows", 0)
        mib = last.get("fetch_recv_bytes", 0) / 2**20
        peak = runs[0]["peaks"]
        peaks = ", ".join(f"{v:,.0f}" for v in peak)
        rate = train_nodes / epoch
        print(f"| {name} | {mean:.2f} ± {sd:.2f} | {mean - base:+.2f} | {epoch:.2f} | {rate:,.0f} | "
              f"{base_epoch / epoch:.2f}× | "
              f"{remote:,} | {mib:,.1f} | {peaks} |")
        out[name] = {"test_mean": mean, "test_std": sd, "epoch_s": epoch, "targets_per_s": rate, "remote_rows": remote,
                     "fetched_mib": mib,
                     "peak_rss_anon_mb": peak}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
