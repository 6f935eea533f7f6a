"""``trellis tune`` against the same candidates trained one by one with ``trellis train``.

    python -m benchmarks.bench_tune STORE [--candidates 9] [--epochs 60] [--seeds 2] [--splits 1]

One benchmark run: first the tune (one process), then every candidate it trained, each as its own
``trellis train --config configs/<id>/config.json --epochs <the epochs it got in the tune>`` process, then
the final runs the same way — the same candidates for the same epochs, trained the way a hand-written grid
search with a shell loop would. Wall time of each side and the ratio are printed; each solo run's validation
metric is checked against the tune's record of that candidate (batching changes speed, not results).
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
    ap.add_argument("--candidates", type=int, default=9)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--min-epochs", type=int, default=None)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--splits", type=int, default=1)
    args = ap.parse_args(argv)
    trellis = [sys.executable, "-m", "trellis.cli"]
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        out = Path(tmp) / "tune"
        cmd = [*trellis, "tune", args.store, "--model", args.model, "--candidates", str(args.candidates),
               "--epochs", str(args.epochs), "--seeds", str(args.seeds), "--splits", str(args.splits),
               "--out", str(out), "--no-progress"]
        if args.min_epochs:
            cmd += ["--min-epochs", str(args.min_epochs)]
        tune_s = _run(cmd)
        board = json.loads((out / "leaderboard.json").read_text())
        metric = board["metric"]
        solo_s, worst = 0.0, 0.0
        jobs = [(out / "configs" / r["config"], r["epochs"], r[f"val_{metric}"]) for r in board["rows"]]
        jobs += [(out / "final" / "configs" / f["run"], f["epochs"], f[f"val_{metric}"]) for f in board["final"]]
        for d, epochs, val in jobs:
            run_dir = Path(tmp) / "solo" / d.name
            solo_s += _run([*trellis, "train", "--config", str(d / "config.json"), "--epochs", str(epochs),
                            "--out", str(run_dir), "--no-progress"])
            got = json.loads((run_dir / "summary.json").read_text())[f"val_{metric}"][0]
            worst = max(worst, abs(got - val))
    epochs_total = sum(e for _, e, _ in jobs)
    print(f"{'store':<28} {'candidates':>10} {'runs':>5} {'epochs':>7} {'tune s':>8} {'one by one s':>13} "
          f"{'ratio':>6} {'max |val diff|':>15}")
    print(f"{Path(args.store).name:<28} {board['candidates']:>10} {len(jobs):>5} {epochs_total:>7} {tune_s:>8.1f} "
          f"{solo_s:>13.1f} {tune_s / solo_s:>6.2f} {worst:>15.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
