"""Pre-propagation training data-parallel over rows against one process: accuracy over seeds, epoch, memory.

    python -m benchmarks.bench_dist_pp --store STORE --pp-dir PP_DIR [--ranks 2] [--seeds 3] [--epochs 10]

Per seed, one after another (never two at once): ``trellis train STORE --strategy pp --pp-dir PP_DIR`` in one
process, then the same with ``--nproc R`` for each R in ``--ranks`` (SIGN, the same batch size, which is the
step's: each rank takes its share). Reports test accuracy at the best validation epoch (mean ± std over seeds),
the median epoch time of epochs >= 1 (training only), and each process's peak ``RssAnon`` sampled from outside
every 10 ms (as ``benchmarks.scaling`` does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.scaling import _run_sampled


def _train(a: argparse.Namespace, out: Path, seed: int, ranks: int) -> dict:
    cmd = [sys.executable, "-m", "trellis.cli", "train", a.store, "--strategy", "pp", "--pp-dir", a.pp_dir,
           "--model", "sign", "--hidden", str(a.hidden), "--batch-size", str(a.batch_size), "--epochs",
           str(a.epochs), "--seed", str(seed), "--device", "cpu", "--checkpoint-every", "0", "--no-progress",
           "--out", str(out)] + (["--nproc", str(ranks)] if ranks > 1 else [])
    _, peaks = _run_sampled(cmd, 3600.0, launcher=ranks > 1)
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epoch = statistics.median(r["step_time_s"] for r in records[1:]) if len(records) > 1 else records[0]["step_time_s"]
    return {"test": float(summary["test_acc_mean"]) * 100, "epoch_s": epoch, "peaks": peaks}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--pp-dir", required=True)
    p.add_argument("--ranks", default="2", help="rank counts, comma-separated")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    a = p.parse_args(argv)
    counts = [1] + [int(r) for r in a.ranks.split(",")]
    rows: dict[int, list[dict]] = {r: [] for r in counts}
    with tempfile.TemporaryDirectory(prefix="trellis-bench-dist-pp-") as tmp:
        for seed in range(a.seeds):
            for r in counts:
                rows[r].append(_train(a, Path(tmp) / f"r{r}-s{seed}", seed, r))
            print(f"seed {seed}: " + ", ".join(f"{r} rank(s) {rows[r][-1]['test']:.2f} ({rows[r][-1]['epoch_s']:.2f} "
                                              "s/epoch)" for r in counts), flush=True)
    base = statistics.mean(x["test"] for x in rows[1])
    base_epoch = statistics.median(x["epoch_s"] for x in rows[1])
    print(f"\n{a.store} over {a.pp_dir}: SIGN hidden {a.hidden}, batch {a.batch_size} per step, {a.epochs} epochs, "
          f"{a.seeds} seeds\n")
    print("| run | test accuracy | vs one process | epoch s | epoch vs one process | peak RssAnon MiB per process |")
    print("|---|---|---|---|---|---|")
    out = {}
    for r, runs in rows.items():
        tests = [x["test"] for x in runs]
        mean, sd = statistics.mean(tests), statistics.stdev(tests) if len(tests) > 1 else 0.0
        epoch = statistics.median(x["epoch_s"] for x in runs)
        peaks = ", ".join(f"{v:,.0f}" for v in runs[0]["peaks"])
        name = "one process" if r == 1 else f"{r} ranks"
        print(f"| {name} | {mean:.2f} ± {sd:.2f} | {mean - base:+.2f} | {epoch:.3f} | {epoch / base_epoch:.2f}× | "
              f"{peaks} |")
        out[name] = {"test_mean": mean, "test_std": sd, "epoch_s": epoch, "peak_rss_anon_mb": runs[0]["peaks"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
