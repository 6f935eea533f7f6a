"""Shared benchmark helpers: peak-memory sampling, timing, subprocess isolation, table printing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Samples ``RssAnon`` (the process's own memory, not page cache of memory maps) every few ms."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.peak_anon_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_anon_kb = max(self.peak_anon_kb, _status_kb("RssAnon"))
            time.sleep(self.interval)

    def __enter__(self) -> PeakMemory:
        self.peak_anon_kb = _status_kb("RssAnon")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_anon_kb = max(self.peak_anon_kb, _status_kb("RssAnon"))

    @property
    def peak_anon_mb(self) -> float:
        return self.peak_anon_kb / 1024

    @staticmethod
    def hwm_mb() -> float:
        """Kernel-tracked peak total RSS (VmHWM)."""
        return _status_kb("VmHWM") / 1024


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
