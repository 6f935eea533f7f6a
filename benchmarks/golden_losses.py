"""Golden per-epoch losses: record them before a structural change, compare after (<= 1e-6).

    python -m benchmarks.golden_losses record golden.json     # on the old commit
    python -m benchmarks.golden_losses compare golden.json    # on the new commit

Runs ``trellis train`` for GCN, SAGE, GIN, GAT and GAT-E full-batch, SAGE mini-batch, GCN cluster-batch and
SIGN pre-propagation, and a 4-configuration ``trellis sweep`` (10 epochs each, dropout on) on one seeded
generated graph, through the CLI in this process, and reads the losses back from ``metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from trellis.cli.main import main

COMMON = ["--epochs", "10", "--patience", "100", "--device", "cpu", "--no-progress", "--seed", "3"]

RUNS: dict[str, list[str]] = {
    "gcn-full": ["--model", "gcn"],
    "sage-full": ["--model", "sage"],
    "gin-full": ["--model", "gin"],
    "gat-full": ["--model", "gat"],
    "gate-full": ["--model", "gate"],
    "sage-mini": ["--model", "sage", "--strategy", "mini", "--fanouts", "5,5", "--batch-size", "256"],
    "gcn-cluster": ["--model", "gcn", "--strategy", "cluster", "--clusters", "8", "--clusters-per-batch", "2",
                    "--cluster-method", "hash"],
}


def _cli(*argv: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    if code not in (0, None):
        raise SystemExit(f"trellis {' '.join(argv)} exited {code}:\n{out.getvalue()}")


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def collect(tmp: Path) -> dict[str, list[float]]:
    """Every golden run's per-epoch losses, keyed by run name."""
    store = tmp / "store"
    _cli("data", "generate", "sbm", "--nodes", "3000", "--avg-degree", "8", "--features", "32", "--classes", "5",
         "--seed", "7", "--edge-features", "4", "--out", str(store))
    out: dict[str, list[float]] = {}
    for name, args in RUNS.items():
        _cli("train", str(store), *args, *COMMON, "--out", str(tmp / name))
        out[name] = _losses(tmp / name)
    _cli("preprocess", str(store), "--hops", "2", "--out", str(tmp / "pp"))
    _cli("train", str(store), "--strategy", "pp", "--pp-dir", str(tmp / "pp"), "--model", "sign", "--batch-size",
         "512", *COMMON, "--out", str(tmp / "sign-pp"))
    out["sign-pp"] = _losses(tmp / "sign-pp")
    _cli("sweep", str(store), "--model", "gcn", "--grid", "lr=0.01,0.005", "dropout=0.3,0.5", "--epochs", "10",
         "--patience", "100", "--device", "cpu", "--no-progress", "--seed", "3", "--out", str(tmp / "sweep"))
    for cfg_dir in sorted((tmp / "sweep" / "configs").iterdir()):
        out[f"sweep-{cfg_dir.name}"] = _losses(cfg_dir)
    return out


def main_(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        got = collect(Path(d))
    path = Path(argv[1])
    if argv[0] == "record":
        path.write_text(json.dumps(got, indent=1))
        print(f"recorded {len(got)} runs in {path}")
        return 0
    want = json.loads(path.read_text())
    worst = 0.0
    bad = []
    for name, losses in want.items():
        new = got.get(name)
        if new is None or len(new) != len(losses):
            bad.append(f"{name}: {len(losses)} epochs before, {None if new is None else len(new)} after")
            continue
        diff = max(abs(a - b) for a, b in zip(losses, new))
        worst = max(worst, diff)
        print(f"{name:28s} max |Δloss| = {diff:.3g}")
        if diff > 1e-6:
            bad.append(f"{name}: max difference {diff:.3g}")
    print(f"worst {worst:.3g}; " + ("OK" if not bad else "DIFFERENT: " + "; ".join(bad)))
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main_(sys.argv[1:]))
