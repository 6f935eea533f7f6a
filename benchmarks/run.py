"""Run every side-by-side benchmark in sequence (``make bench``).

    python -m benchmarks.run [--only fullbatch,ops,partition,minibatch,pp,sweep,ooc-sweep,user,overlap,value]

Each benchmark prints its own table with the competitor's figure and the ratio; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

BENCHES = {
    "fullbatch": ["benchmarks.bench_fullbatch", "--sizes", "100k"],
    "ops": ["benchmarks.bench_ops"],
    "partition": ["benchmarks.bench_partition"],
    "minibatch": ["benchmarks.bench_minibatch"],
    "pp": ["benchmarks.bench_pp"],
    "sweep": ["benchmarks.bench_sweep"],
    # out-of-core sweep vs budgeted solo runs (issue #24): small here; docs/benchmarks.md has the 2M-node command
    "ooc-sweep": ["benchmarks.bench_outofcore_sweep", "--nodes", "200k", "--epochs", "2", "--budget", "2G",
                  "--grid", "lr=0.01,0.005", "weight_decay=0,5e-4", "--set", "dropout=0.5"],
    "user": ["benchmarks.bench_user_layers"],
    # distributed schedules and prices (issue #22): small defaults here; docs/benchmarks.md has the full commands
    "overlap": ["benchmarks.bench_overlap", "--nodes", "200k", "--epochs", "4"],
    "value": ["benchmarks.bench_value", "--nodes", "100k", "--epochs", "4"],
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default=",".join(BENCHES), help="comma-separated subset of " + ", ".join(BENCHES))
    names = p.parse_args().only.split(",")
    failed = []
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        if subprocess.run([sys.executable, "-m", *BENCHES[name]]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
