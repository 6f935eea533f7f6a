"""Out-of-core ranks: per-rank peak memory under ``--memory-budget`` against in-memory ranks, and the losses.

    python -m benchmarks.bench_outofcore_ranks [--nodes 2m] [--features 256] [--hidden 256] [--ranks 4]
                                               [--epochs 3] [--fraction 0.333] [--workdir DIR]

On a generated SBM graph (GREM, ``--ranks`` parts), GCN hidden ``--hidden``, dropout on. It runs four things,
each its own process tree, with peak ``RssAnon`` sampled from outside, per rank:

1. one in-memory process (the reference losses);
2. in-memory ranks (``--parts-dir``): what a rank needs;
3. out-of-core ranks with ``--memory-budget`` set to ``--fraction`` of the largest in-memory rank's peak.

It prints each rank's peak against the budget, and the largest loss difference from the single process.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import print_table
from benchmarks.scaling import _cli, _count, _run, _run_sampled


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=_count, default=2_000_000, help="(default: 2m)")
    p.add_argument("--features", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--hidden", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--ranks", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--epochs", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--fraction", type=float, default=1 / 3, help="budget / in-memory rank peak (default: 1/3)")
    p.add_argument("--skip-single", action="store_true", help="compare the ranks with each other only")
    p.add_argument("--workdir", type=Path, default=None, help="(default: a temporary directory)")
    args = p.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="trellis-oocranks-"))
    root.mkdir(parents=True, exist_ok=True)
    store = root / f"sbm-{args.nodes}-{args.features}"
    if not (store / "manifest.json").exists():
        _run(_cli("data", "generate", "sbm", "--nodes", str(args.nodes), "--features", str(args.features),
                  "--classes", "8", "--out", str(store)), timeout=7200)
    parts = root / f"{store.name}-grem-{args.ranks}"
    if not (parts / "manifest.json").exists():
        _run(_cli("partition", str(store), "--method", "grem", "--parts", str(args.ranks), "--out", str(parts)),
             timeout=7200)
    common = ["--model", "gcn", "--hidden", str(args.hidden), "--epochs", str(args.epochs), "--checkpoint-every", "0",
              "--no-progress", "--overwrite"]
    rows = []
    single: list[float] | None = None
    if not args.skip_single:
        _, peaks = _run_sampled(_cli("train", str(store), *common, "--out", str(root / "single")), 7200)
        single = _losses(root / "single")
        rows.append({"run": "one process, in memory", "peak RssAnon MiB per rank": f"{peaks[0]:.0f}",
                     "budget MiB": "-", "max |Δloss| vs one process": "0"})
    _, mem_peaks = _run_sampled(_cli("train", str(store), *common, "--parts-dir", str(parts), "--out",
                                     str(root / "ranks")), 7200, launcher=True)
    ref = single or _losses(root / "ranks")
    rows.append({"run": f"{args.ranks} ranks, in memory", "peak RssAnon MiB per rank":
                 ", ".join(f"{v:.0f}" for v in mem_peaks), "budget MiB": "-",
                 "max |Δloss| vs one process": f"{max(abs(a - b) for a, b in zip(_losses(root / 'ranks'), ref)):.2g}"})
    budget_mib = int(max(mem_peaks) * args.fraction)
    _, ooc_peaks = _run_sampled(_cli("train", str(store), *common, "--parts-dir", str(parts), "--memory-budget",
                                     f"{budget_mib}MiB", "--out", str(root / "ooc")), 7200, launcher=True)
    ooc = _losses(root / "ooc")
    rows.append({"run": f"{args.ranks} ranks, --memory-budget {budget_mib}MiB", "peak RssAnon MiB per rank":
                 ", ".join(f"{v:.0f}" for v in ooc_peaks), "budget MiB": str(budget_mib),
                 "max |Δloss| vs one process": f"{max(abs(a - b) for a, b in zip(ooc, ref)):.2g}"})
    print(f"SBM {args.nodes:,} nodes x {args.features} features, GCN hidden {args.hidden}, {args.ranks} ranks (GREM), "
          f"{args.epochs} epochs; budget = {args.fraction:.3f} x the largest in-memory rank's peak")
    print_table(rows, list(rows[0]))
    within = all(v <= budget_mib for v in ooc_peaks)
    print(f"every out-of-core rank within its budget: {within}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
