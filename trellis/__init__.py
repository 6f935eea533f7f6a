"""Trellis: GNN training on graphs from thousands to billions of edges.

The library's front door (``docs/api.md``)::

    import trellis
    run = trellis.train("stores/cora", model="gcn", epochs=50)   # -> trellis.Run
    run.model, run.history, run.summary, run.predict()
    trellis.train("stores/cora", model="sage", strategy=trellis.MiniOptions(fanouts=[10, 5]))
    trellis.load_run("runs/cora-gcn")                            # a run directory as a Run
    trellis.predict(run_dir, store, out)                         # what `trellis predict` writes
    trellis.partition(store, parts=8, out="parts")               # what `trellis partition` writes
    trellis.sweep(store, {"lr": [0.01, 0.005]}), trellis.tune(store, budget="5m"), trellis.preprocess(store, out)

``trellis.train`` is both this function and the package of strategies and the trainer (the module is
callable). Everything is imported on first use, so ``import trellis`` stays cheap.
"""

import os
import sys
from typing import Any

__version__ = "0.1.0"

#: Cores up to which Trellis asks torch's OpenMP threads to sleep, not spin, between parallel regions.
PASSIVE_WAIT_CORES = 4

if "torch" not in sys.modules and (os.cpu_count() or 1) <= PASSIVE_WAIT_CORES:
    # Why: torch's OpenMP threads spin for a while after every op, and Trellis runs numba kernels (SpMM,
    # sampling, gathers) and sampler processes beside them, which the spinning threads then take cores from.
    # Measured on 2 cores (docs/benchmarks.md): a full-batch GCN step on Amazon Computers 0.92x (3 pairs,
    # benchmarks/bench_omp_wait.py), the 1M mini-batch epoch with one sampler process 5.86 -> 5.51 s; Cora the same. Set
    # OMP_WAIT_POLICY yourself (before torch is imported) to choose otherwise; results do not change either way.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _huge_pages_possible() -> bool:
    """Whether the kernel can back madvised memory with transparent huge pages (Linux, THP not ``never``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


if "torch" not in sys.modules and _huge_pages_possible():
    # Why: torch's CPU allocator asks for transparent huge pages (``madvise(MADV_HUGEPAGE)`` on allocations of
    # 2 MiB or more) only when THP_MEM_ALLOC_ENABLE is set. Trellis's hot paths gather and scatter rows across
    # tensors of hundreds of MB (features, aggregations, their gradients), where 4 KiB pages spend the time in
    # TLB misses. Measured on 2 cores (docs/benchmarks.md, "Transparent huge pages"), same losses, same peak
    # RssAnon: a full-batch GCN step on Amazon Computers 37.6 -> 25.4 ms, on the 1M planted graph 4.46 -> 3.16 s,
    # out of core under 1G 6.93 -> 5.44 s, the 1M mini-batch epoch 3.53 -> 2.88 s. Set THP_MEM_ALLOC_ENABLE=0
    # (before torch is imported) to opt out. The setting is read at torch's first allocation, so it applies
    # only where trellis is imported before torch (the trellis command, its ranks and sampler processes).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_EXPORTS = {
    "Run": ("trellis.train.api", "Run"),
    "load_run": ("trellis.train.api", "load_run"),
    "resume": ("trellis.train.api", "resume"),
    "explain": ("trellis.train.api", "explain"),
    "predict": ("trellis.train.predict", "predict"),
    "sweep": ("trellis.train.api", "sweep"),
    "tune": ("trellis.train.api", "tune"),
    "preprocess": ("trellis.loader.ppcache", "preprocess"),
    "TrellisUserError": ("trellis.errors", "TrellisUserError"),
    "TrainConfig": ("trellis.train.config", "TrainConfig"),
    "FullOptions": ("trellis.train.options", "FullOptions"),
    "MiniOptions": ("trellis.train.options", "MiniOptions"),
    "ClusterOptions": ("trellis.train.options", "ClusterOptions"),
    "PPOptions": ("trellis.train.options", "PPOptions"),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("train", "partition", "data", "nn"):
        return importlib.import_module(f"trellis.{name}")
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'trellis' has no attribute {name!r}")


__all__ = ["ClusterOptions", "FullOptions", "MiniOptions", "PPOptions", "Run", "TrainConfig",
           "TrellisUserError", "explain", "load_run", "partition", "predict", "preprocess",
           "resume", "sweep", "train", "tune", "__version__"]
