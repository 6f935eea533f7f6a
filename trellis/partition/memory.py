"""Peak-memory measurement for partitioners: total RSS and anonymous RSS (``RssAnon``).

Why two figures: the store is memory-mapped, so pages of the edge list that a streaming partitioner reads
count in the process's RSS although they belong to the page cache and can be dropped at any time.
``RssAnon`` is the memory the process itself allocated (numpy arrays, METIS's graph copy) and is the
figure a memory budget is about. Linux reports the peak of total RSS (``VmHWM``, resettable through
``/proc/self/clear_refs``) but not the peak of ``RssAnon``; that one is sampled. The sampler is a separate
process reading ``/proc/PID/status``: a thread would not run while a numba kernel or METIS holds the GIL,
and would miss exactly the peaks that matter. (The training loop's sampler,
:class:`trellis.utils.memory.PeakMemory`, is a thread: its steps are PyTorch ops that release the GIL.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from trellis.utils.memory import proc_status

_SAMPLER = r"""
import sys, time
pid, interval = sys.argv[1], float(sys.argv[2])
peak_anon = peak_rss = 0
path = f"/proc/{pid}/status"
def sample():
    global peak_anon, peak_rss
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    peak_anon = max(peak_anon, int(line.split()[1]))
                elif line.startswith("VmRSS:"):
                    peak_rss = max(peak_rss, int(line.split()[1]))
    except OSError:
        pass
import select
while True:
    sample()
    r, _, _ = select.select([sys.stdin], [], [], interval)
    if r:
        sample()
        break
print(peak_anon, peak_rss, flush=True)
"""


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``) of this process; returns whether it worked.

    Writing ``5`` to ``/proc/self/clear_refs`` is allowed without privileges on Linux ≥ 4.0; without it
    ``VmHWM`` would include whatever the process did before partitioning (imports, loading a store).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@dataclass
class MemoryReport:
    """Peak memory over a measured region, in MiB.

    Attributes:
        peak_rss_mb: Peak total resident set (``VmHWM`` after a reset; includes mapped file pages).
        peak_rss_anon_mb: Peak anonymous resident memory (sampled ``RssAnon``; what the process allocated).
        base_rss_anon_mb: ``RssAnon`` when the region started, so a caller can report the increase.
        time_s: Wall time of the region.
    """

    peak_rss_mb: float = 0.0
    peak_rss_anon_mb: float = 0.0
    base_rss_anon_mb: float = 0.0
    time_s: float = 0.0


class PeakMemory:
    """Context manager measuring wall time, peak RSS and peak ``RssAnon`` of the enclosed code.

    Args:
        interval: Sampling interval of ``RssAnon`` in seconds (default: 0.005).
        sample: Start the sampler process (default: True). Without it only ``VmHWM`` is reported and
            ``peak_rss_anon_mb`` is ``RssAnon`` at the end of the region.

    Example::

        with PeakMemory() as mem:
            book = partitioner.partition(store)
        print(mem.report.peak_rss_anon_mb)
    """

    def __init__(self, interval: float = 0.005, sample: bool = True) -> None:
        self.interval = interval
        self.sample = sample and sys.platform.startswith("linux")
        self.report = MemoryReport()
        self._proc: subprocess.Popen[str] | None = None
        self._t0 = 0.0

    def __enter__(self) -> PeakMemory:
        reset_peak_rss()
        self.report.base_rss_anon_mb = proc_status().get("RssAnon", 0) / 2**20
        if self.sample:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SAMPLER, str(os.getpid()), str(self.interval)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            time.sleep(0.05)  # let the sampler take its first reading before the work starts
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.report.time_s = time.perf_counter() - self._t0
        status = proc_status()
        peak_anon_kb = status.get("RssAnon", 0) // 1024
        peak_rss_kb = status.get("VmHWM", status.get("VmRSS", 0)) // 1024
        if self._proc is not None:
            try:
                out, _ = self._proc.communicate(input="stop\n", timeout=10)
                anon, rss = (int(v) for v in out.split()[:2])
                peak_anon_kb = max(peak_anon_kb, anon)
                peak_rss_kb = max(peak_rss_kb, rss)
            except (subprocess.TimeoutExpired, ValueError):
                self._proc.kill()
        self.report.peak_rss_mb = peak_rss_kb / 1024
        self.report.peak_rss_anon_mb = peak_anon_kb / 1024
