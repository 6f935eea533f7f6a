"""Out-of-core sweep of K configurations vs K budgeted solo runs on a large graph (Lotan's batching, out of core).

    python -m benchmarks.bench_outofcore_sweep [--nodes 2m] [--features 128] [--avg-degree 10] [--budget 3G]
                                               [--epochs 3]
                                               [--grid lr=0.01,0.005 dropout=0.3,0.5] [--set dropout=0.5]
                                               [--data-dir DIR]

One ``trellis sweep STORE --set memory_budget=BUDGET`` process trains the grid's configurations together (every
tile's CSR reads and aggregations shared, :mod:`trellis.nn.tiled_batch`), then each configuration's saved
``config.json`` is replayed by its own ``trellis train --config`` process under the same budget, one after
another: what a user without model batching runs. Both sides train a fixed number of epochs (patience =
epochs). Reported: each side's wall time (process start to exit, loading included) and training time (the
summaries' ``train_time_s``), peak ``RssAnon`` sampled every 10 ms from outside, and the largest per-epoch loss
difference between each configuration's sweep and solo curves.

The store is an SBM graph (``--avg-degree``, 10 classes) generated once under ``--data-dir`` (reused after).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_outofcore import StoreSpec, child_env, failure, parse_count, run_watched, store_for
from benchmarks.common import print_table

ROOT = Path(__file__).resolve().parents[1]


def losses(run_dir: Path) -> list[float]:
    """Per-epoch losses of a run directory's ``metrics.jsonl``."""
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="2m")
    ap.add_argument("--features", type=int, default=128)
    ap.add_argument("--avg-degree", type=float, default=10.0,
                    help="the generated graph's average degree (graph work grows with it, dense work does not)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--model", default="gcn")
    ap.add_argument("--budget", default="3G")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--grid", nargs="+", default=["lr=0.01,0.005", "dropout=0.3,0.5"])
    ap.add_argument("--set", dest="base", nargs="+", default=[], metavar="KEY=VALUE",
                    help="values every configuration shares (e.g. dropout=0.5)")
    ap.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "trellis-bench-ooc"))
    ap.add_argument("--work", default=None, help="where runs and spills go (default: a temporary directory)")
    args = ap.parse_args(argv)

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    store, _ = store_for(data_dir, StoreSpec(parse_count(args.nodes), args.avg_degree, args.features))
    work = Path(args.work or tempfile.mkdtemp(prefix="trellis-ooc-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    spill = work / "spill"
    env = child_env()
    sweep_dir = work / "sweep"
    cmd = [sys.executable, "-m", "trellis.cli", "sweep", str(store), "--model", args.model, "--grid", *args.grid,
           "--set", f"memory_budget={args.budget}", f"spill_dir={spill}", f"hidden={args.hidden}", *args.base,
           "--epochs", str(args.epochs), "--patience", str(args.epochs), "--device", "cpu", "--out", str(sweep_dir),
           "--overwrite", "--no-progress", "--json"]
    print("sweep:", " ".join(cmd[2:]), flush=True)
    sw = run_watched(cmd, env=env, spill_dir=spill)
    if sw.rc != 0:
        print(failure(sw), file=sys.stderr)
        return 1
    board = json.loads(sw.stdout.strip().splitlines()[-1])
    print(f"  {board['configs']} configurations in batches of {board['batch_models']}: {sw.wall_s:.1f} s, "
          f"peak RssAnon {sw.peak_anon / 2**20:.0f} MiB", flush=True)
    rows = []
    solo_wall = solo_train = 0.0
    solo_peak = 0
    worst = 0.0
    for r in sorted(board["rows"], key=lambda r: r["config"]):
        cid = r["config"]
        run_dir = work / f"solo-{cid}"
        config = sweep_dir / "configs" / cid / "config.json"
        cmd = [sys.executable, "-m", "trellis.cli", "train", "--config", str(config),
               "--out", str(run_dir), "--overwrite", "--no-progress", "--checkpoint-every", "0"]
        w = run_watched(cmd, env=env, spill_dir=spill)
        if w.rc != 0:
            print(failure(w), file=sys.stderr)
            return 1
        summary = json.loads((run_dir / "summary.json").read_text())
        a, b = losses(sweep_dir / "configs" / cid), losses(run_dir)
        diff = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")
        worst = max(worst, diff)
        solo_wall += w.wall_s
        solo_train += summary["train_time_s"]
        solo_peak = max(solo_peak, w.peak_anon)
        sweep_summary = json.loads((sweep_dir / "configs" / cid / "summary.json").read_text())
        rows.append({"config": cid, **{k: r[k] for k in board["grid"]}, "solo wall s": w.wall_s,
                     "solo train s": summary["train_time_s"], "sweep share train s": sweep_summary["train_time_s"],
                     "max |Δloss|": f"{diff:.2g}"})
        print(f"  solo {cid}: {w.wall_s:.1f} s, peak RssAnon {w.peak_anon / 2**20:.0f} MiB, max |Δloss| {diff:.2g}",
              flush=True)
    print()
    print_table(rows, list(rows[0]))
    print()
    sweep_train = board["sweep_time_s"]
    print_table([{"": "wall time (s)", "sweep": sw.wall_s, f"{len(rows)} solo runs": solo_wall,
                  "speedup": solo_wall / sw.wall_s},
                 {"": "training time (s)", "sweep": sweep_train, f"{len(rows)} solo runs": solo_train,
                  "speedup": solo_train / sweep_train},
                 {"": "peak RssAnon (MiB)", "sweep": sw.peak_anon / 2**20, f"{len(rows)} solo runs": solo_peak / 2**20,
                  "speedup": ""}],
                ["", "sweep", f"{len(rows)} solo runs", "speedup"])
    print(f"\nstore {store}; budget {args.budget}; {args.epochs} epochs; worst per-epoch |Δloss| {worst:.2g}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
