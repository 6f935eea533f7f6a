"""Time to accuracy: when a run reached a target, its convergence point, and when it stopped changing.

Why these and not only "final accuracy": two systems (or strategies) that end at the same accuracy can
differ by an order of magnitude in how long they took to get there, and a faster epoch is worth nothing
if it needs more epochs. The papers measure this three ways and the summary reports all three, computed
from the per-epoch records of ``metrics.jsonl`` (the file survives ``--resume``, so the numbers of a
resumed run equal those of an uninterrupted one):

* **time / epochs to target** (Dorylus §7.3, Table 5): the first epoch whose validation metric reaches
  ``--target-acc``; its cumulative wall time ``time_s`` and the number of epochs trained until then.
* **convergence point** (PP-GNN §3.3): the first epoch whose validation metric is at least 99% of the
  run's peak — comparable across models that peak at different accuracies.
* **converged epoch** (Dorylus §7.3: "the difference of the model accuracy between consecutive epochs is
  within 0.001"): the first epoch ``e`` such that ``|val[t] - val[t-1]| <= 0.001`` for the
  ``W =`` :data:`CONVERGENCE_WINDOW` ``= 3`` consecutive transitions ``t = e-W+1 .. e`` (the metric held
  within 0.001 from epoch to epoch over four epochs in a row; why three, see the constant). Transitions
  that happen while the metric still equals its epoch-0 value are not counted: a model that has not
  started learning (a majority-class plateau right after initialization) has not converged. A run whose
  metric never leaves its epoch-0 value, or never holds still, has no converged epoch (``None``).

Epoch numbers (``epoch_at_99pct_peak_val``, ``converged_epoch``) are 0-based epoch indices, as in
``metrics.jsonl`` and ``best_epoch``; ``epochs_to_target`` is a count (index + 1), i.e. how many epochs
were trained to reach the target. Means over runs are given only when every run has a value (otherwise
``None``): averaging only the runs that happened to reach a target would flatter a configuration.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, TypeGuard

#: Largest change of the validation metric between consecutive epochs that counts as "not changing"
#: (Dorylus §7.3).
CONVERGENCE_TOL = 0.001

#: How many consecutive small changes make a run converged. Dorylus states the rule for one pair of
#: consecutive epochs, but on a rising curve one pair within 0.001 is a coincidence: on Cora (GCN, 5 seeds)
#: a window of 1 fired at epochs 13-50, mid-rise, 20-40 points of accuracy below the peak, while a window of
#: 3 fired at epochs 55-128, beside the 99%-of-peak epochs (87-159). Three pairs = four epochs in a row.
CONVERGENCE_WINDOW = 3

#: The convergence point is the first epoch at this fraction of the run's peak validation metric (PP-GNN §3.3).
PEAK_FRACTION = 0.99


def _ok(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def first_reaching(values: Sequence[float | None], target: float, *, higher_is_better: bool = True) -> int | None:
    """Index of the first value at or beyond ``target`` (``>=``, or ``<=`` when lower is better); None if none."""
    for i, v in enumerate(values):
        if _ok(v) and (v >= target if higher_is_better else v <= target):
            return i
    return None


def index_at_fraction_of_peak(values: Sequence[float | None], fraction: float = PEAK_FRACTION, *,
                              higher_is_better: bool = True) -> int | None:
    """Index of the first value within ``fraction`` of the run's best value (PP-GNN's convergence point).

    Higher is better: the first ``v >= fraction * peak``. Lower is better (a loss): the first
    ``v <= peak / fraction``. None when no value is finite.
    """
    finite = [v for v in values if _ok(v)]
    if not finite:
        return None
    if higher_is_better:
        peak = max(finite)
        threshold = fraction * peak if peak >= 0 else peak / fraction
    else:
        peak = min(finite)
        threshold = peak / fraction if peak >= 0 else fraction * peak
    return first_reaching(values, threshold, higher_is_better=higher_is_better)


def converged_index(values: Sequence[float | None], tol: float = CONVERGENCE_TOL,
                    window: int = CONVERGENCE_WINDOW) -> int | None:
    """Index ``e`` of the first value after ``window`` consecutive changes of at most ``tol`` (see module doc).

    Changes are counted only from the first value that differs from ``values[0]`` on: the plateau right
    after initialization is not convergence. A missing (None/NaN) value breaks a streak.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1 (got {window})")
    start = 0
    if values and _ok(values[0]):
        moved = next((i for i, v in enumerate(values) if not (_ok(v) and v == values[0])), None)
        if moved is None:  # never moved
            return None
        start = moved
    streak = 0
    for t in range(max(start, 1), len(values)):
        a, b = values[t - 1], values[t]
        if _ok(a) and _ok(b) and abs(b - a) <= tol:
            streak += 1
            if streak >= window:
                return t
        else:
            streak = 0
    return None


def split_runs(records: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Per-epoch records grouped by ``run`` (0 when absent) and sorted by ``epoch``."""
    by_run: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        by_run.setdefault(int(rec.get("run", 0)), []).append(rec)
    return {r: sorted(recs, key=lambda x: int(x.get("epoch", 0))) for r, recs in sorted(by_run.items())}


def cumulative_times(records: Sequence[dict[str, Any]]) -> list[float]:
    """Cumulative wall time (s) at the end of each epoch of one run.

    ``time_s`` when the records carry it (the trainer's: training and evaluation of the run so far).
    Older pre-propagation records have only per-epoch ``epoch_time_s`` (training) and ``eval_time_s``;
    their running sum is the same quantity.
    """
    if all("time_s" in r and _ok(r["time_s"]) for r in records):
        return [float(r["time_s"]) for r in records]
    out, total = [], 0.0
    for r in records:
        total += float(r.get("epoch_time_s") or 0.0) + float(r.get("eval_time_s") or 0.0)
        out.append(total)
    return out


def run_time_to_accuracy(records: Sequence[dict[str, Any]], metric: str, target: float | None = None, *,
                         higher_is_better: bool = True) -> dict[str, Any]:
    """The time-to-accuracy figures of one run from its per-epoch records (sorted by epoch).

    Returns:
        ``epoch_at_99pct_peak_val`` and ``converged_epoch`` (epoch indices or None) and, when ``target`` is
        given, ``epochs_to_target`` (a count) and ``time_to_target_s`` (cumulative wall time), None when
        the run never reached the target.
    """
    key = f"val_{metric}"
    kept = [i for i, r in enumerate(records) if r.get(key) is not None]  # the evaluated epochs (--eval-every)
    vals = [records[i][key] for i in kept]
    epochs = [int(records[i].get("epoch", i)) for i in kept]

    def epoch_of(i: int | None) -> int | None:
        return None if i is None else epochs[i]

    out: dict[str, Any] = {
        "epoch_at_99pct_peak_val": epoch_of(index_at_fraction_of_peak(vals, higher_is_better=higher_is_better)),
        "converged_epoch": epoch_of(converged_index(vals)),
    }
    if target is not None:
        i = first_reaching(vals, target, higher_is_better=higher_is_better)
        out["epochs_to_target"] = None if i is None else epochs[i] + 1
        out["time_to_target_s"] = None if i is None else cumulative_times(records)[kept[i]]
    return out


def mean_if_all(values: Sequence[float | int | None]) -> float | None:
    """Mean of ``values`` when every one is present, else None (see the module doc for why)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.fmean(float(v) for v in values if v is not None)


def summarize_time_to_accuracy(records: Iterable[dict[str, Any]], metric: str, target: float | None = None, *,
                               higher_is_better: bool = True) -> dict[str, Any]:
    """The summary fields over every run of ``records`` (a run directory's ``metrics.jsonl``).

    Per-run lists (in run order) plus ``_mean`` for ``epoch_at_99pct_peak_val`` and ``converged_epoch``;
    with a ``target`` also ``target_acc``, ``epochs_to_target``, ``time_to_target_s`` (lists and means)
    and ``runs_reaching_target``.
    """
    per_run = [run_time_to_accuracy(recs, metric, target, higher_is_better=higher_is_better)
               for recs in split_runs(records).values()]
    keys = ["epoch_at_99pct_peak_val", "converged_epoch"]
    out: dict[str, Any] = {}
    if target is not None:
        keys += ["epochs_to_target", "time_to_target_s"]
        out["target_acc"] = target
        out["runs_reaching_target"] = sum(r["epochs_to_target"] is not None for r in per_run)
    for key in keys:
        vals = [r[key] for r in per_run]
        out[key] = vals
        out[f"{key}_mean"] = mean_if_all(vals)
    return out
