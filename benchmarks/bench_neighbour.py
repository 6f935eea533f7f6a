"""What a neighbour at the lowest priority costs the trainer on this machine (the floor under `--samplers 1`).

    python -m benchmarks.bench_neighbour --store STORE [--repeats 6]

The training-only pass of ``benchmarks.bench_samplers`` (GraphSAGE 15,10, hidden 256, batch 1024; the epoch's
batches prepared beforehand, the trainer on torch's threads) is timed alone and beside one process under Linux's
``SCHED_IDLE`` that never stops: pure integer arithmetic (``alu``), a 64 MiB memory copy (``stream``), and a
random row gather the size of a batch's input rows (``gather``, what a sampler process does). Each repeat runs
the four in turn; medians are reported with their ratio to the trainer alone.

Why: a sampler process in the background only takes the cores the trainer leaves idle, yet the epoch with one
sampler process on 2 cores stays 1.13-1.30x training alone (docs/benchmarks.md). If even a neighbour that does
nothing but arithmetic slows the trainer by about as much, the cost is the machine's (preempting, waking,
sharing the physical core or its caches), not the sampler's work.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

# isort: off
import trellis  # noqa: F401  - first, as the trellis command does: its thread settings precede torch's start

# isort: on
from benchmarks.bench_samplers import _train_pass, training_only

_IDLE = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
NEIGHBOURS = {
    "alone": None,
    "alu": _IDLE + "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) & 0xffffffff\n",
    "stream": _IDLE + "import numpy as np\na = np.ones(16 << 20, np.float32)\nb = np.empty_like(a)\n"
                      "while True:\n    np.copyto(b, a)\n",
    "gather": _IDLE + "import numpy as np\nx = np.ones((1 << 20, 128), np.float32)\n"
                      "i = np.random.default_rng(0).integers(0, 1 << 20, 90000)\n"
                      "o = np.empty((90000, 128), np.float32)\nwhile True:\n    np.take(x, i, axis=0, out=o)\n",
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--fanouts", default="15,10")
    p.add_argument("--batch-size", type=int, default=1024)
    a = p.parse_args(argv)
    a.device, a.prefetch = "cpu", 2
    strategy, model, opt, kept = training_only(a)
    runs: dict[str, list[float]] = {k: [] for k in NEIGHBOURS}
    for _ in range(a.repeats):
        for name, code in NEIGHBOURS.items():
            proc = subprocess.Popen([sys.executable, "-c", code]) if code else None
            try:
                time.sleep(0.5)  # the neighbour is running (and has its memory) before the pass starts
                runs[name].append(_train_pass(strategy, model, opt, kept, "cpu"))
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    base = statistics.median(runs["alone"])
    print(f"training-only pass, {len(kept)} batches, {a.repeats} repeats (median, runs)")
    for name, v in runs.items():
        print(f"  {name:<7} {statistics.median(v):6.2f} s  {statistics.median(v) / base:5.2f}x  "
              f"{[round(x, 2) for x in v]}")


if __name__ == "__main__":
    main()
