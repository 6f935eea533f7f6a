"""This process's memory and I/O counters, and one peak-memory sampler.

Why ``RssAnon`` next to total RSS: stores and caches are memory-mapped, so mapped file pages count in a
process's RSS although they belong to the page cache and can be dropped at any time. ``RssAnon`` is the
memory the process itself allocated and is the figure a memory budget is about. The kernel keeps a
high-water mark of total RSS (``VmHWM``) but none of ``RssAnon``; that one has to be sampled, and a
sampler on a background thread catches the peaks *inside* a training step that a sample taken between
steps misses.
"""

from __future__ import annotations

import functools
import resource
import sys
import threading
from types import TracebackType
from typing import Any

import torch

_STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
_MIB = float(2**20)


def proc_status() -> dict[str, int]:
    """Memory counters of this process in bytes: ``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ``RssShmem``.

    Read from ``/proc/self/status`` on Linux. Elsewhere psutil's RSS stands in for ``VmRSS`` and
    ``RssAnon`` (no split between anonymous and file pages is available) and the ``getrusage`` maximum
    resident set for ``VmHWM``, so callers never need a platform branch.

    Returns:
        A dict from counter name to bytes.
    """
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in _STATUS_KEYS:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:  # not Linux
        import psutil

        rss = int(psutil.Process().memory_info().rss)
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB elsewhere
        hwm = max(rss, int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale)
        out = {"VmRSS": rss, "VmHWM": hwm, "RssAnon": rss, "RssFile": 0, "RssShmem": 0}
    return out


def proc_io() -> dict[str, int]:
    """``/proc/self/io`` counters of this process (``read_bytes`` = bytes fetched from storage).

    Returns:
        A dict from counter name to its value; empty where the file is absent (not Linux, or restricted).
    """
    try:
        with open("/proc/self/io") as f:
            return {k.strip(): int(v) for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except OSError:
        return {}


class PeakMemory:
    """Peak anonymous and total RSS (and CUDA memory) of a region, sampled on a background thread.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. :meth:`sample` takes one more
    reading on demand (e.g. right after a step), so a peak is never missed for lack of a thread tick.

    Args:
        interval: Seconds between two background samples (default: 0.01; catches batch-sized allocations).
        device: A CUDA device whose peak allocation :meth:`report` includes as ``peak_cuda_mb``; its
            peak statistics are reset on :meth:`start` (default: None, no CUDA figure).

    Attributes:
        peak_anon: Peak ``RssAnon`` seen, in bytes.
        peak_rss: Peak total RSS seen (sampled ``VmRSS`` and the kernel's ``VmHWM``), in bytes.

    Example::

        with PeakMemory(device=device) as mem:
            train()
        summary.update(mem.report())
    """

    def __init__(self, interval: float = 0.01, device: torch.device | None = None) -> None:
        self.interval = interval
        self.device = device if device is not None and device.type == "cuda" else None
        self.peak_anon = 0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """Take one reading now and fold it into the peaks."""
        s = proc_status()
        self.peak_anon = max(self.peak_anon, s.get("RssAnon", s.get("VmRSS", 0)))
        self.peak_rss = max(self.peak_rss, s.get("VmRSS", 0), s.get("VmHWM", 0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> PeakMemory:
        """Reset the CUDA peak (if a device was given), take a first reading and start the thread."""
        if self.device is not None:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="trellis-peak-memory", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (if running) and take a last reading."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.sample()

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def report(self) -> dict[str, float]:
        """Peaks so far in MiB: ``peak_rss_anon_mb``, ``peak_rss_mb`` and, with a CUDA device, ``peak_cuda_mb``."""
        self.sample()
        out = {"peak_rss_anon_mb": self.peak_anon / _MIB, "peak_rss_mb": self.peak_rss / _MIB}
        if self.device is not None:
            out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(self.device) / _MIB
        return out


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes or more with ``mmap``, so freeing them unmaps them.

    Why: glibc raises its mmap threshold dynamically (up to 32 MiB) after the first large block is freed,
    after which tile-sized tensors come from the heap and stay in ``RssAnon`` after they are freed, as
    fragments. A memory budget is about live memory; with the threshold fixed, every tile's buffers go back
    to the kernel when freed. Returns False where glibc's ``mallopt`` is not available (other C libraries).
    """
    libc = _libc()
    if libc is None:
        return False
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, int(threshold)) == 1
        ok = libc.mallopt(m_trim_threshold, int(threshold)) == 1 and ok
        return ok
    except (OSError, AttributeError):
        return False


def status_of(pid: int) -> dict[str, int]:
    """``RssAnon`` and ``VmRSS`` of process ``pid`` in bytes; empty once it has exited (a zombie has neither)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "VmRSS"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


class TreeSampler(threading.Thread):
    """Peak ``RssAnon`` of a process and each of its descendants, sampled from outside every ``interval`` s.

    Why from outside: a memory claim is checked that way (a process's own sampler misses what it allocates
    before the sampler starts and after it stops); per descendant, because a launcher's ranks are separate
    processes whose peaks are claimed one by one.

    Attributes:
        peaks: ``pid -> peak RssAnon`` in bytes, for the root and every descendant seen.
        parents: ``pid -> parent pid`` of each process seen.
    """

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peaks: dict[int, int] = {}
        self.parents: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        """Sample until :meth:`stop` or until the root exits."""
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self.done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                anon = status_of(p.pid).get("RssAnon")
                if anon is None:
                    continue
                self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), anon)
                if p.pid not in self.parents:
                    try:
                        self.parents[p.pid] = p.ppid()
                    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                        self.parents[p.pid] = -1
            self.done.wait(self.interval)

    def stop(self) -> None:
        """Stop sampling and wait for the thread."""
        self.done.set()
        self.join()


def trim_heap() -> bool:
    """Give the heap's free memory back to the kernel now (glibc ``malloc_trim(0)``); False where unavailable.

    Why: freed tensors below glibc's mmap threshold stay in ``RssAnon`` as free heap; trimming between the
    phases of a step (training, evaluation) returns them without paying for an ``mmap`` and its page faults
    on every allocation, as :func:`return_freed_memory` does.
    """
    libc = _libc()
    if libc is None:
        return False
    try:
        return bool(libc.malloc_trim(0))
    except AttributeError:  # not glibc
        return False


@functools.cache
def _libc() -> Any:
    """The C library (``ctypes.CDLL``), loaded once; None where it cannot be found."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return None if name is None else ctypes.CDLL(name)
    except OSError:
        return None
