from __future__ import annotations

import threading

import numpy as np
import torch

from trellis.utils.memory import PeakMemory, proc_io, proc_status


def test_status_fields_are_bytes():
    status = proc_status()
    assert {"VmRSS", "VmHWM", "RssAnon", "RssFile"} <= set(status)
    assert status["VmRSS"] > 2**20 and status["VmRSS"] % 1024 == 0
    assert isinstance(proc_io(), dict)


def test_sampler_catches_a_peak_inside_a_region_and_stops_its_thread():
    before = proc_status()["RssAnon"]
    with PeakMemory(interval=0.001) as mem:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched; freed before the region ends
        block.sum()
        mem.sample()
        del block
    assert mem.peak_anon >= before + 32 * 2**20
    assert mem.peak_rss >= mem.peak_anon
    rep = mem.report()
    assert set(rep) == {"peak_rss_anon_mb", "peak_rss_mb"}
    assert rep["peak_rss_anon_mb"] == mem.peak_anon / 2**20
    assert not any(t.name == "trellis-peak-memory" for t in threading.enumerate())


def test_start_stop_and_a_cpu_device_reports_no_cuda_figure():
    mem = PeakMemory(device=torch.device("cpu")).start()
    mem.stop()
    assert "peak_cuda_mb" not in mem.report() and mem.peak_rss > 0
