"""Choosing K, the number of configurations trained as one model-batched model.

Lotan §6 and §7.2.3: the time of a batched step is a constant part (reading the graph, launching ops) plus
a part that grows with K (each configuration's transforms and its columns of the aggregation). Throughput
``K / T(K)`` therefore grows with K until the per-model part dominates, then plateaus; memory grows
linearly in K (every configuration's activations are alive at once). Lotan only observed this; Trellis's
planner uses it (NOTES #6): for every candidate K it splits the configurations into balanced batches,
estimates each batch's epoch time (training step plus evaluation pass, from
:func:`trellis.plan.planner.plan_model`) and peak memory, drops the K whose batches do not fit the memory
budget, and takes the knee of the curve: the smallest K that reaches 90% of the largest feasible estimated
gain over K = 1. Past the knee the per-configuration part dominates and a larger batch buys little time
for its memory (and a batch waits for its slowest configuration's early stop). The rule is scale-free: it
finds the knee whether batching is estimated to save 10% or 5x. Under 5% of estimated gain it does not
batch at all: that is within the model's error, and batching costs memory locality the model leaves out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from trellis.errors import TrellisUserError
from trellis.plan.cost import GraphStats
from trellis.plan.ir import ModelDecl, ModelPlan
from trellis.plan.planner import plan_model
from trellis.plan.rewrites import DEFAULT_REWRITES


def balanced_batches(n: int, k: int) -> list[range]:
    """Split ``n`` configurations (in order) into ``ceil(n / k)`` batches of near-equal size ``<= k``.

    Why balanced: 12 configurations at K = 8 run faster as 6 + 6 than as 8 + 4 (two batches either way;
    the per-batch constant is paid twice regardless, the largest batch sets the memory).
    """
    if n <= 0:
        return []
    k = max(1, min(k, n))
    nb = math.ceil(n / k)
    base, extra = divmod(n, nb)
    out, start = [], 0
    for i in range(nb):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class BatchEstimate:
    """The cost model's estimate for one candidate K.

    Attributes:
        k: Largest batch size.
        batches: Number of batches.
        epoch_seconds: Estimated seconds of one epoch of all batches (training step + evaluation pass each).
        peak_bytes: Estimated peak memory of the largest batch.
        fits: Whether ``peak_bytes`` fits the memory budget.
    """

    k: int
    batches: int
    epoch_seconds: float
    peak_bytes: float
    fits: bool

    def speedup(self, solo: BatchEstimate) -> float:
        """Estimated speedup over training the configurations one at a time."""
        return solo.epoch_seconds / self.epoch_seconds if self.epoch_seconds > 0 else 1.0


@dataclass(frozen=True)
class BatchChoice:
    """The chosen K with the table it was chosen from.

    Attributes:
        k: Configurations per batch.
        reason: Why this K (cost model, memory budget or ``--batch-models``).
        estimates: One row per candidate K.
        budget_bytes: Memory budget used.
    """

    k: int
    reason: str
    estimates: tuple[BatchEstimate, ...] = field(default_factory=tuple)
    budget_bytes: float = 0.0

    def format(self) -> str:
        """The candidate table and the decision, as ``--explain`` prints it."""
        lines = [f"model batching: K = {self.k} ({self.reason})",
                 f"  {'K':>3s} {'batches':>7s} {'est. epoch':>11s} {'speedup':>8s} {'est. peak mem':>14s}"]
        solo = self.estimates[0] if self.estimates else None
        for e in self.estimates:
            mark = "  <- chosen" if e.k == self.k else ("  (over budget)" if not e.fits else "")
            sp = f"{e.speedup(solo):7.2f}x" if solo else ""
            lines.append(f"  {e.k:3d} {e.batches:7d} {e.epoch_seconds * 1e3:9.1f}ms {sp:>8s} "
                         f"{e.peak_bytes / 2**20:11.0f} MiB{mark}")
        lines.append(f"  memory budget {self.budget_bytes / 2**20:.0f} MiB")
        return "\n".join(lines)


def epoch_plans(models: Sequence[ModelDecl], stats: GraphStats, rewrites: Sequence[str] | None = None
                ) -> tuple[ModelPlan, ModelPlan]:
    """The training-step plan and the evaluation-pass plan of one batch (one epoch = one of each)."""
    rw = DEFAULT_REWRITES if rewrites is None else tuple(rewrites)
    return plan_model(models, stats, training=True, rewrites=rw), plan_model(models, stats, training=False, rewrites=rw)


def estimate(models: Sequence[ModelDecl], stats: GraphStats, k: int, budget_bytes: float,
             rewrites: Sequence[str] | None = None) -> BatchEstimate:
    """Estimate an epoch over all ``models`` batched ``k`` at a time (balanced, in order)."""
    seconds, peak = 0.0, 0.0
    batches = balanced_batches(len(models), k)
    for b in batches:
        train, evaluate = epoch_plans([models[i] for i in b], stats, rewrites)
        seconds += train.seconds() + evaluate.seconds()
        peak = max(peak, train.peak_bytes, evaluate.peak_bytes)
    return BatchEstimate(max(len(b) for b in batches), len(batches), seconds, peak, peak <= budget_bytes)


def choose_k(models: Sequence[ModelDecl], stats: GraphStats, *, budget_bytes: float,
             override: int | None = None, knee: float = 0.9, min_gain: float = 0.05, max_k: int = 64,
             rewrites: Sequence[str] | None = None) -> BatchChoice:
    """Choose how many configurations to batch into one model.

    Args:
        models: Every configuration of one family and depth, in sweep order.
        stats: Statistics of the graph.
        budget_bytes: Memory the sweep may use.
        override: ``--batch-models K``: at most K configurations per batch, balanced (12 at K = 5 run as
            4 + 4 + 4); still reported against the estimates.
        knee: Take the smallest K whose estimated gain over K = 1 reaches this fraction of the largest
            feasible gain (default: 0.9).
        min_gain: Batch only when the largest feasible estimated gain reaches this (default: 0.05). Below
            it the gain is within the model's error — which leaves out memory locality: on Amazon
            Computers a batch of 12 estimated at +2% measured 5-12% slower than one at a time, its 12
            configurations' activations alive at once.
        max_k: Largest K considered (default: 64).
        rewrites: Rewrites the plans use (default: all).

    Raises:
        TrellisUserError: ``override`` is not a positive integer.
    """
    n = len(models)
    if n == 0:
        raise TrellisUserError("nothing to batch: the sweep has no configurations")
    if override is not None and override < 1:
        raise TrellisUserError(f"--batch-models must be a positive integer (got {override})")
    candidates = sorted({len(balanced_batches(n, k)[0]) for k in range(1, min(n, max_k) + 1)})
    forced = len(balanced_batches(n, override)[0]) if override is not None else None
    if forced is not None and forced not in candidates:
        candidates = sorted({*candidates, forced})
    rows = tuple(estimate(models, stats, k, budget_bytes, rewrites) for k in candidates)
    if forced is not None:
        row = next(r for r in rows if r.k == forced)
        note = f"; balanced into {row.batches} batch(es) of up to {forced}" if forced != override else ""
        note += "" if row.fits else "; over the memory budget by the estimate"
        return BatchChoice(forced, f"--batch-models {override}{note}", rows, budget_bytes)
    feasible = [r for r in rows if r.fits]
    if not feasible:
        return BatchChoice(1, "even one configuration exceeds the memory budget by the estimate; running them "
                              "one at a time", rows, budget_bytes)
    solo = rows[0].epoch_seconds
    best = max(solo / r.epoch_seconds - 1.0 for r in feasible)
    if best < min_gain:
        return BatchChoice(1, f"the cost model predicts at most {best:.1%} from batching here (under "
                              f"{min_gain:.0%}): the per-configuration work dominates, so one configuration at "
                              "a time keeps memory low; --batch-models K forces batching", rows, budget_bytes)
    chosen = min((r for r in feasible if solo / r.epoch_seconds - 1.0 >= knee * best), key=lambda r: r.k)
    largest = max(r.k for r in feasible)
    if chosen.k == largest and largest < rows[-1].k:
        why = f"largest K that fits the memory budget ({len(feasible)} of {len(rows)} candidates fit)"
    elif chosen.k == n:
        why = "the estimated gain grows up to one batch of all configurations"
    else:
        why = (f"reaches {knee:.0%} of the largest estimated gain ({best:.1%}); past it the "
               "per-configuration work dominates")
    return BatchChoice(chosen.k, why, rows, budget_bytes)


def default_budget_bytes(fraction: float = 0.6) -> float:
    """A memory budget of ``fraction`` of the memory available now (psutil)."""
    import psutil

    return float(psutil.virtual_memory().available) * fraction
