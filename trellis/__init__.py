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

from typing import Any

__version__ = "0.1.0"

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
