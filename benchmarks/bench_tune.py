"""``trellis tune`` against the same candidates trained one by one with ``trellis train``.

    python -m benchmarks.bench_tune STORE [--candidates 27] [--epochs 200] [--no-grid] [--seeds 2] [--splits 1]

One benchmark run, three ways to train the same candidates, each a separate ``trellis train --config``
process per candidate, as a shell loop over a grid would:

* ``tune``: the tune itself (one process: one data load, model batching where the cost model says it pays,
  successive halving);
* ``same epochs``: every candidate for exactly the epochs it got in the tune (halving included), then the
  final runs — what the tune saves by sharing one process and batching;
* ``grid``: every candidate for its configured epochs (early stopping as configured), then the final runs —
  the hand-written grid search the tune replaces.

Each ``same epochs`` run's best validation metric is checked against the tune's record of that candidate
(the tune changes how candidates are trained, not what they compute). The tune runs with ``--playoff 1``: its
playoff (retraining the best finalists with fresh seeds before the choice) is selection, not training the same
candidates, so no side does it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print one table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--model", default="gcn")
    ap.add_argument("--candidates", type=int, default=27)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--min-epochs", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--splits", type=int, default=1)
    ap.add_argument("--no-grid", action="store_true", help="skip the full-epoch grid (the slowest side)")
    args = ap.parse_args(argv)
    trellis = [sys.executable, "-m", "trellis.cli"]
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        out = Path(tmp) / "tune"
        cmd = [*trellis, "tune", args.store, "--model", args.model, "--candidates", str(args.candidates),
               "--epochs", str(args.epochs), "--seeds", str(args.seeds), "--splits", str(args.splits),
               "--out", str(out), "--no-progress", "--playoff", "1"]  # the same work on every side: no playoff
        if args.min_epochs:
            cmd += ["--min-epochs", str(args.min_epochs)]
        tune_s = _run(cmd)
        board = json.loads((out / "leaderboard.json").read_text())
        metric = board["metric"]
        worst = 0.0
        final_jobs = [(out / "final" / "configs" / f["run"], None) for f in board["final"]]
        final_s = sum(_run([*trellis, "train", "--config", str(d / "config.json"), "--out",
                            str(Path(tmp) / "final" / d.name), "--no-progress"]) for d, _ in final_jobs)
        same_s, grid_s, grid_epochs = 0.0, 0.0, 0
        for r in board["rows"]:
            d = out / "configs" / r["config"]
            run_dir = Path(tmp) / "same" / d.name
            same_s += _run([*trellis, "train", "--config", str(d / "config.json"), "--epochs", str(r["epochs"]),
                            "--out", str(run_dir), "--no-progress"])
            got = json.loads((run_dir / "summary.json").read_text())[f"val_{metric}"][0]
            worst = max(worst, abs(got - r[f"val_{metric}"]))
            if not args.no_grid:
                grid_dir = Path(tmp) / "grid" / d.name
                grid_s += _run([*trellis, "train", "--config", str(d / "config.json"), "--out", str(grid_dir),
                                "--no-progress"])
                grid_epochs += len((grid_dir / "metrics.jsonl").read_text().splitlines())
    final_epochs = sum(f["epochs"] for f in board["final"])
    same_epochs = sum(r["epochs"] for r in board["rows"]) + final_epochs
    print(f"{Path(args.store).name}: {board['candidates']} candidates + {len(board['final'])} final runs, "
          f"model {args.model}, {board['device']}")
    print(f"{'way':<12} {'epochs':>7} {'wall s':>8} {'tune / way':>11}")
    print(f"{'tune':<12} {same_epochs:>7} {tune_s:>8.1f} {1.0:>11.2f}")
    print(f"{'same epochs':<12} {same_epochs:>7} {same_s + final_s:>8.1f} {tune_s / (same_s + final_s):>11.2f}")
    if not args.no_grid:
        print(f"{'grid':<12} {grid_epochs + final_epochs:>7} {grid_s + final_s:>8.1f} "
              f"{tune_s / (grid_s + final_s):>11.2f}")
    print(f"max |val diff| tune vs same-epochs runs: {worst:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
