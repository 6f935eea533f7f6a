"""Blocking, overlapped and stale schedules of partition-parallel training under an emulated link.

    python -m benchmarks.bench_overlap [--nodes 1m] [--features 128] [--hidden 256] [--ranks 2] [--epochs 6]
                                       [--link RATE[,LATENCY]] [--workdir DIR]

On a generated SBM graph partitioned by GREM into ``--ranks`` parts, trains GCN (2 layers, ``--hidden``) with
``trellis train --parts-dir`` three ways under the same emulated link: blocking (``--staleness 0``, the
exact engine), ``--overlap`` and ``--staleness 1`` (PipeGCN). Without ``--link`` the link's rate is chosen so
that a blocking epoch's ``comm_s`` is about 1.2x its ``compute_s``: first one blocking run without a link
measures the compute and the bytes a rank sends per step. Figures are medians over epochs >= 1 from
``metrics.jsonl`` (``step_time_s``, ``compute_s``, ``comm_s``, each a maximum over ranks), every run its own
process, one after another. The issue's goal: stale epoch <= 1.15 x max(compute, comm), blocking about
their sum, overlap between.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from benchmarks.scaling import _cli, _count, _run

SCHEDULES = {"blocking": [], "overlap": ["--overlap"], "staleness 1": ["--staleness", "1"]}


def _medians(run: Path) -> dict[str, float]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    out = {k: statistics.median(r[k] for r in recs) for k in ("step_time_s", "compute_s", "comm_s")}
    out["sent_per_rank"] = statistics.median(max(r["exchange_bytes_per_rank"]) for r in recs)
    out["loss"] = recs[-1]["loss"]
    return out


def _train(store: Path, parts: Path, out: Path, args: argparse.Namespace, *extra: str) -> dict[str, float]:
    _run(_cli("train", str(store), "--parts-dir", str(parts), "--model", "gcn", "--hidden", str(args.hidden),
              "--epochs", str(args.epochs), "--checkpoint-every", "0", "--no-progress", "--out", str(out),
              "--overwrite", *extra), timeout=3600)
    return _medians(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=_count, default=1_000_000, help="(default: 1m)")
    p.add_argument("--avg-degree", type=float, default=10.0, help="(default: %(default)s)")
    p.add_argument("--features", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--ranks", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--epochs", type=int, default=6, help="(default: %(default)s)")
    p.add_argument("--method", default="grem", help="partitioner (default: %(default)s)")
    p.add_argument("--link", default=None, help="RATE[,LATENCY] (default: chosen so comm ~ 1.2 x compute)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the store and layout here (default: temp)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON object")
    args = p.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="trellis-overlap-"))
    root.mkdir(parents=True, exist_ok=True)
    store = root / f"sbm-{args.nodes}-{args.features}"
    if not (store / "manifest.json").exists():
        _run(_cli("data", "generate", "sbm", "--nodes", str(args.nodes), "--avg-degree", str(args.avg_degree),
                  "--features", str(args.features), "--classes", "8", "--out", str(store)),
             timeout=3600)
    parts = root / f"{store.name}-{args.method}-{args.ranks}"
    if not (parts / "manifest.json").exists():
        _run(_cli("partition", str(store), "--method", args.method, "--parts", str(args.ranks), "--out", str(parts)),
             timeout=3600)
    link = args.link
    calibration = None
    if link is None:
        calibration = _train(store, parts, root / "calibrate", args)
        rate = calibration["sent_per_rank"] / (1.2 * calibration["compute_s"])
        link = f"{rate / 1e6:.1f}MB/s,1ms"
    rows: list[dict[str, Any]] = []
    for name, extra in SCHEDULES.items():
        m = _train(store, parts, root / name.replace(" ", "-"), args, "--emulate-link", link, *extra)
        bound = max(m["compute_s"], m["comm_s"])
        rows.append({"schedule": name, "epoch s": f"{m['step_time_s']:.3f}", "compute_s": f"{m['compute_s']:.3f}",
                     "comm_s": f"{m['comm_s']:.3f}", "compute + comm": f"{m['compute_s'] + m['comm_s']:.3f}",
                     "epoch / max(compute, comm)": f"{m['step_time_s'] / bound:.2f}",
                     "vs blocking": f"{m['step_time_s'] / float(rows[0]['epoch s']) if rows else 1.0:.2f}x",
                     "last loss": f"{m['loss']:.4f}", "_raw": m})
    print(f"{args.ranks} ranks, SBM {args.nodes:,} nodes x {args.features} features, GCN hidden {args.hidden}, "
          f"{args.method}, emulated link {link}, medians of epochs 1..{args.epochs - 1}")
    print_table(rows, [c for c in rows[0] if not c.startswith("_")])
    if args.json:
        print(json.dumps({"link": link, "calibration": calibration,
                          "rows": {r["schedule"]: r["_raw"] for r in rows}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
