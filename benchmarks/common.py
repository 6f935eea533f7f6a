"""Shared benchmark helpers: peak-memory sampling, timing, subprocess isolation, table printing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from trellis.utils.memory import PeakMemory as _PeakMemory
from trellis.utils.memory import proc_status


class PeakMemory(_PeakMemory):
    """The package's peak-memory sampler (:class:`trellis.utils.memory.PeakMemory`) at a 2 ms period.

    Samples ``RssAnon`` (the process's own memory, not page cache of memory maps) on a background thread.
    """

    def __init__(self, interval: float = 0.002) -> None:
        super().__init__(interval)

    @property
    def peak_anon_mb(self) -> float:
        return self.peak_anon / 2**20

    @staticmethod
    def hwm_mb() -> float:
        """Kernel-tracked peak total RSS (VmHWM)."""
        return proc_status().get("VmHWM", 0) / 2**20


def time_steps(step: Callable[[], None], warmup: int = 2, repeat: int = 5) -> float:
    """Median wall time of ``step`` after ``warmup`` calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_isolated(module: str, args: dict) -> dict:
    """Run ``python -m module --child JSON`` in a fresh process so peak memory figures are separate."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    # The children import torch before trellis, so trellis's default (huge pages for torch's large allocations,
    # trellis/__init__.py) would not apply: set it here, for the competitor's child too (the same environment).
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    proc = subprocess.run([sys.executable, "-m", module, "--child", json.dumps(args)], capture_output=True,
                          text=True, env=env, cwd=root)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict], cols: list[str]) -> None:
    """A markdown table (pasteable into docs/benchmarks.md)."""
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
