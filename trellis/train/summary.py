"""The one summary schema of a training run (``summary.json``), for every strategy and every sweep configuration.

Why a dataclass: three loops used to write three dialects (``runs`` an int in one and a list in another,
the median epoch time under two names, population std in one and sample std in the other), and every reader
(``trellis compare``, the sweep's leaderboard, the docs' tables) guessed. Now one writer fills
:class:`RunSummary`, :meth:`RunSummary.to_dict` gives the JSON, and :meth:`RunSummary.from_dict` reads it
back (older files included). Standard deviations are sample standard deviations (``n - 1``) everywhere.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from trellis.errors import TrellisUserError


@dataclass
class RunSummary:
    """What ``summary.json`` holds.

    Attributes:
        metric: Selection metric.
        strategy: ``full``, ``mini``, ``cluster`` or ``pp``.
        model: Model name.
        task: Task name.
        runs: Number of runs (seeds).
        seeds: Seed of each run.
        best_epoch: Best-validation epoch of each run.
        epochs_run: Epochs each run trained.
        best_run: Index of the run with the best validation metric.
        split_metrics: ``<split>_<metric>`` -> one value per run (at each run's best epoch).
        epoch_time_s_median: Median training-step time of an epoch (evaluation excluded).
        epoch_time_s_mean: Mean training-step time.
        steps_timed: Epochs timed.
        train_time_s: Wall time of all runs' epochs (training and evaluation).
        peak_rss_anon_mb: Peak anonymous RSS of the process, sampled on a thread.
        peak_rss_mb: Peak total RSS (``VmHWM``).
        peak_cuda_mb: Peak CUDA allocation (None on CPU).
        per_run: One record per run (its seed, best epoch, epochs, time and best-epoch metrics).
        time_to_accuracy: The convergence fields of :mod:`trellis.train.convergence`.
        strategy_info: What only this strategy reports (``pp``: the placement, the loader, bytes read).
        info: The rest: store, device, sizes, versions, the config.
        status: ``complete``.
    """

    metric: str
    strategy: str
    model: str
    task: str
    runs: int
    seeds: list[int]
    best_epoch: list[int]
    epochs_run: list[int]
    best_run: int
    split_metrics: dict[str, list[float]]
    epoch_time_s_median: float
    epoch_time_s_mean: float
    steps_timed: int
    train_time_s: float
    peak_rss_anon_mb: float = float("nan")
    peak_rss_mb: float = float("nan")
    peak_cuda_mb: float | None = None
    per_run: list[dict[str, Any]] = field(default_factory=list)
    time_to_accuracy: dict[str, Any] = field(default_factory=dict)
    strategy_info: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    status: str = "complete"

    def mean(self, key: str) -> float:
        """Mean over runs of ``<split>_<metric>``."""
        return _mean(self.split_metrics[key])

    def std(self, key: str) -> float:
        """Sample standard deviation over runs of ``<split>_<metric>`` (0 for one run)."""
        return _std(self.split_metrics[key])

    def stat(self, key: str, which: str = "mean") -> float | None:
        """``mean`` or ``std`` of ``<split>_<metric>``, None when the summary has neither.

        From the per-run values, else as an older file recorded it (``<key>_mean``/``<key>_std`` only).
        """
        if key in self.split_metrics:
            return self.mean(key) if which == "mean" else self.std(key)
        value = self.info.get(f"{key}_{which}")
        return float(value) if isinstance(value, (int, float)) else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: core fields, ``<split>_<metric>[_mean|_std]``, then the flattened extras."""
        out: dict[str, Any] = {"status": self.status, "metric": self.metric}
        for key, values in self.split_metrics.items():
            out[key] = list(values)
            out[f"{key}_mean"] = self.mean(key)
            out[f"{key}_std"] = self.std(key)
        core = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in _NESTED and f.name not in ("status", "metric")}
        if self.peak_cuda_mb is None:
            core.pop("peak_cuda_mb")
        out.update(core)
        out.update(self.info)
        out.update(self.strategy_info)
        out.update(self.time_to_accuracy)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "summary.json") -> RunSummary:
        """Read a summary written by :meth:`to_dict` (or by an older trellis: pp's ``runs`` list etc.).

        Raises:
            TrellisUserError: A required field is missing.
        """
        try:
            per_run = d.get("per_run")
            runs = d["runs"]
            if isinstance(runs, list):  # pre-propagation summaries before the one schema
                per_run = per_run or runs
                runs = len(runs)
            per_run = list(per_run or [])
            metric = str(d.get("metric") or "acc")
            split_metrics = {k: [float(v) for v in val] for k, val in d.items()
                             if isinstance(val, list) and _is_split_metric(k)}
            median = d.get("epoch_time_s_median", d.get("epoch_time_median_s", float("nan")))
            peak_anon = d.get("peak_rss_anon_mb")
            if peak_anon is None and d.get("peak_rss_anon_bytes") is not None:
                peak_anon = float(d["peak_rss_anon_bytes"]) / 2**20
            peak = d.get("peak_rss_mb")
            if peak is None and d.get("peak_rss_bytes") is not None:
                peak = float(d["peak_rss_bytes"]) / 2**20
            core = {f.name for f in fields(cls)}
            known = core | set(split_metrics) | {f"{k}_mean" for k in split_metrics} | {
                f"{k}_std" for k in split_metrics}
            rest = {k: v for k, v in d.items() if k not in known}
            return cls(
                metric=metric, strategy=str(d.get("strategy", "full")), model=str(d.get("model", "?")),
                task=str(d.get("task", "multiclass")), runs=int(runs),
                seeds=[int(s) for s in d.get("seeds", [r.get("seed", 0) for r in per_run])],
                best_epoch=list(d.get("best_epoch", [r.get("best_epoch", -1) for r in per_run])),
                epochs_run=list(d.get("epochs_run", [r.get("epochs", r.get("epochs_run", 0)) for r in per_run])),
                best_run=int(d.get("best_run", 0)), split_metrics=split_metrics,
                epoch_time_s_median=float(median), epoch_time_s_mean=float(d.get("epoch_time_s_mean", median)),
                steps_timed=int(d.get("steps_timed", 0)), train_time_s=float(d.get("train_time_s", float("nan"))),
                peak_rss_anon_mb=float(peak_anon) if peak_anon is not None else float("nan"),
                peak_rss_mb=float(peak) if peak is not None else float("nan"),
                peak_cuda_mb=float(d["peak_cuda_mb"]) if d.get("peak_cuda_mb") is not None else None,
                per_run=per_run, info=rest, status=str(d.get("status", "complete")))
        except (KeyError, TypeError, ValueError) as exc:
            raise TrellisUserError(f"{where}: not a trellis run summary ({exc!r}); rerun `trellis train`") from None


_NESTED = ("split_metrics", "time_to_accuracy", "strategy_info", "info")
_SPLIT_PREFIXES = ("train_", "val_", "test_")


def _is_split_metric(key: str) -> bool:
    return key.startswith(_SPLIT_PREFIXES) and not key.endswith(("_mean", "_std")) and key != "val_loss"


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _std(values: Sequence[float]) -> float:
    if any(math.isnan(v) for v in values):  # an undefined metric (AUC of one class); stdev cannot take NaN
        return float("nan")
    return statistics.stdev(values) if len(values) > 1 else 0.0


def split_metrics_of(results: Sequence[dict[str, Any]], metric_names: Sequence[str],
                     splits: Sequence[str]) -> dict[str, list[float]]:
    """``<split>_<metric>`` -> per-run values, for the splits and metrics every result carries."""
    out: dict[str, list[float]] = {}
    for name in metric_names:
        for split in splits:
            key = f"{split}_{name}"
            if results and all(key in r for r in results):
                out[key] = [float(r[key]) for r in results]
    return out

