"""``trellis compare``: which of several finished runs reached a target accuracy first, and at what cost.

Why a command of its own: a faster epoch and a better final accuracy are different answers to "which
setup should I use?". What a user wants to know (Dorylus §7.3 reports it as the time to a target
accuracy) is how long each setup needed to reach a given validation metric, next to its final test
metric, epoch time and memory — and a picture of the validation curves against *wall time*, where a
strategy with short epochs but many of them and one with long epochs but few can be seen side by side.

Everything is read back from the run directories (``summary.json`` for the results, ``metrics.jsonl``
for the curves), so runs trained at different times, with different strategies (``full``, ``mini``,
``cluster``, ``pp``) or on different machines compare alike. Time to target is recomputed from the
per-epoch records with the same rules the trainer's summary uses (:mod:`trellis.train.convergence`), so
any ``--target`` can be asked after the fact.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trellis.errors import TrellisUserError
from trellis.train.convergence import cumulative_times, mean_if_all, run_time_to_accuracy, split_runs
from trellis.train.runs import sweep_dir_error
from trellis.train.summary import RunSummary
from trellis.train.tasks import TASKS


@dataclass
class RunDir:
    """One run directory read back: its summary, its config and its per-epoch records by run."""

    path: Path
    summary: RunSummary
    config: dict[str, Any]
    runs: dict[int, list[dict[str, Any]]]
    metric: str
    higher_is_better: bool

    @property
    def strategy(self) -> str:
        """The run's training strategy."""
        return self.summary.strategy

    @property
    def model(self) -> str:
        """The run's model name."""
        return self.summary.model

    @property
    def target(self) -> float | None:
        """The ``--target-acc`` the run was trained with (None when it had none)."""
        t = self.config.get("target_acc", self.summary.info.get("target_acc"))
        return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TrellisUserError(f"{path}: unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise TrellisUserError(f"{path}: expected a JSON object")
    return data


def _read_records(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TrellisUserError(f"{path}: line {n} is not JSON ({exc.msg})") from None
                if not isinstance(rec, dict):
                    raise TrellisUserError(f"{path}: line {n} is not a JSON object")
                records.append(rec)
    except OSError as exc:
        raise TrellisUserError(f"{path}: unreadable ({exc})") from None
    return records


def _higher_is_better(task: str | None, metric: str) -> bool:
    cls = TASKS.get(task or "")
    return bool(cls.higher_is_better.get(metric, True)) if cls is not None else True


def load_run_dir(path: str | Path) -> RunDir:
    """Read a finished run directory (``trellis train``, any strategy, or a sweep's ``configs/<id>/``).

    Raises:
        TrellisUserError: Not a directory, not a run directory, a run that did not finish (no
            ``summary.json``), or unreadable/empty files; the message names the path.
    """
    p = Path(path)
    if not p.is_dir():
        raise TrellisUserError(f"{p}: no such run directory")
    summary_p, metrics_p, config_p = p / "summary.json", p / "metrics.jsonl", p / "config.json"
    if not summary_p.is_file():
        if config_p.is_file() or metrics_p.is_file():
            raise TrellisUserError(f"{p}: the run is incomplete (no summary.json); finish it with `trellis train "
                                   f"--resume {p}` or leave it out")
        if (err := sweep_dir_error(p)) is not None:
            raise err
        raise TrellisUserError(f"{p}: not a run directory (no summary.json); pass the --out of `trellis train`")
    summary = RunSummary.from_dict(_read_json(summary_p), where=str(summary_p))
    if summary.status != "complete":
        raise TrellisUserError(f"{p}: the run is incomplete (summary.json status {summary.status!r})")
    if not metrics_p.is_file():
        raise TrellisUserError(f"{metrics_p}: missing; the per-epoch curves are needed to compare runs")
    config = _read_json(config_p) if config_p.is_file() else {}
    records = _read_records(metrics_p)
    if not records:
        raise TrellisUserError(f"{metrics_p}: no epochs recorded")
    metric = summary.metric
    if not any(f"val_{metric}" in r for r in records):
        raise TrellisUserError(f"{metrics_p}: no val_{metric} values (the summary's selection metric)")
    return RunDir(p, summary, config, split_runs(records), metric,
                  _higher_is_better(summary.task, metric))


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _names(paths: list[Path]) -> list[str]:
    """Short names: the directory name, or the whole path where two share one."""
    base = [p.name or str(p) for p in paths]
    return [b if base.count(b) == 1 else str(p) for b, p in zip(base, paths)]


def row_for(rd: RunDir, name: str, target: float | None) -> dict[str, Any]:
    """The table row of one run directory (JSON-ready; None where a value does not exist)."""
    s, m = rd.summary, rd.metric
    per_run = [run_time_to_accuracy(recs, m, target, higher_is_better=rd.higher_is_better)
               for recs in rd.runs.values()]
    walls = [cumulative_times(recs)[-1] for recs in rd.runs.values()]
    epochs = [len(recs) for recs in rd.runs.values()]
    epoch_walls = [float(w) / e for w, e in zip(walls, epochs) if _num(w) is not None and e]
    row: dict[str, Any] = {
        "name": name, "run_dir": str(rd.path), "model": rd.model, "strategy": rd.strategy, "metric": m,
        "runs": len(rd.runs), "device": s.info.get("device"),
        "test_mean": _num(s.stat(f"test_{m}")), "test_std": _num(s.stat(f"test_{m}", "std")),
        "val_mean": _num(s.stat(f"val_{m}")),
        # the training step alone (median), as both trainers report it; the wall time per epoch with
        # evaluation (what time to target accumulates) from the per-epoch log
        "epoch_time_s": _num(s.epoch_time_s_median),
        "epoch_wall_s": statistics.fmean(epoch_walls) if epoch_walls else None,
        "epochs_run_mean": statistics.fmean(epochs),
        "epoch_at_99pct_peak_val_mean": mean_if_all([r["epoch_at_99pct_peak_val"] for r in per_run]),
        "converged_epoch_mean": mean_if_all([r["converged_epoch"] for r in per_run]),
        "peak_rss_mb": _num(s.peak_rss_mb), "peak_rss_anon_mb": _num(s.peak_rss_anon_mb),
        "peak_cuda_mb": _num(s.peak_cuda_mb), "target": target,
        # pre-propagation's one-off cost, outside time_s (and so outside time to target)
        "preprocess_s": _num(s.info.get("preprocess_seconds")),
        # --price-per-hour: dollars per epoch and Dorylus's value, 1 / (time x cost)
        "cost_per_epoch_usd": _num(s.info.get("cost_per_epoch_usd")), "value": _num(s.info.get("value")),
    }
    if target is not None:
        ttt = [r["time_to_target_s"] for r in per_run]
        ett = [r["epochs_to_target"] for r in per_run]
        row.update({"runs_reaching_target": sum(v is not None for v in ett),
                    "time_to_target_s": ttt, "time_to_target_s_mean": mean_if_all(ttt),
                    "epochs_to_target": ett, "epochs_to_target_mean": mean_if_all(ett)})
    return row


def compare_runs(paths: list[str | Path], target: float | None = None) -> tuple[dict[str, Any], list[RunDir]]:
    """Read the run directories and build the comparison (see :func:`format_table` for its display).

    Args:
        paths: Run directories.
        target: Validation-metric target; None = each run's own ``--target-acc`` (if any).

    Returns:
        ``(result, run_dirs)``: ``result`` is JSON-ready — ``rows`` (one per run directory, see
        :func:`row_for`), ``first_to_target`` and ``fewest_epochs_to_target`` (names, or None), and
        ``note`` explaining a missing winner; ``run_dirs`` are the loaded directories, for the plot.

    Raises:
        TrellisUserError: No paths, a target outside (0, 1], or a path that is not a finished run dir.
    """
    if not paths:
        raise TrellisUserError("give at least one RUN_DIR")
    if target is not None and not 0.0 < target <= 1.0:
        raise TrellisUserError(f"--target must be in (0, 1] (got {target})")
    rds = [load_run_dir(p) for p in paths]
    names = _names([rd.path for rd in rds])
    rows = [row_for(rd, n, target if target is not None else rd.target) for rd, n in zip(rds, names)]
    result: dict[str, Any] = {"target": target, "rows": rows, "first_to_target": None,
                              "fewest_epochs_to_target": None, "note": None}
    targets = {r["target"] for r in rows}
    metrics = {r["metric"] for r in rows}
    if targets == {None}:
        result["note"] = "no target: pass --target X (or train with --target-acc X) to rank by time to target"
    elif len(targets) > 1:
        result["note"] = ("the runs were trained with different --target-acc values; pass --target X to compare "
                          "them at one target")
    elif len(metrics) > 1:
        result["note"] = f"the runs select by different metrics ({', '.join(sorted(metrics))}); not ranked"
    else:
        result["target"] = next(iter(targets))
        done = [r for r in rows if r["time_to_target_s_mean"] is not None]
        if not done:
            result["note"] = "no run directory reached the target in every one of its runs"
        else:
            result["first_to_target"] = min(done, key=lambda r: r["time_to_target_s_mean"])["name"]
            result["fewest_epochs_to_target"] = min(done, key=lambda r: r["epochs_to_target_mean"])["name"]
    return result, rds


def _fmt(v: Any, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def _to_target(r: dict[str, Any], key: str, spec: str) -> str:
    """A run's mean epochs or time to the target: over every run, else over those that reached it (``k/n``).

    ``never`` only when no run reached it (4 of 5 seeds reaching the target is not "never").
    """
    if r["target"] is None:
        return "-"
    if r.get(f"{key}_mean") is not None:
        return format(r[f"{key}_mean"], spec)
    reached = [v for v in r.get(key) or [] if v is not None]
    if not reached:
        return "never"
    return f"{format(sum(reached) / len(reached), spec)} ({len(reached)}/{r['runs']})"


def format_table(result: dict[str, Any]) -> str:
    """The comparison as an aligned text table plus a line naming the run that reached the target first."""
    rows = result["rows"]
    cuda = any(r["peak_cuda_mb"] is not None for r in rows)
    metric = rows[0]["metric"] if len({r["metric"] for r in rows}) == 1 else "metric"
    head = ["run", "model", "strategy", "runs", f"test {metric}", "step ms", "epoch ms", "epochs", "99%pk ep",
            "conv ep", "target", "reached", "epochs→tgt", "time→tgt s", "peak anon MiB"]
    head += ["CUDA MiB"] if cuda else []
    priced = any(r.get("value") is not None for r in rows)
    head += ["$/epoch", "value"] if priced else []
    table = [head]
    for r in rows:
        test = ("-" if r["test_mean"] is None else f"{r['test_mean']:.4f}" if r["runs"] == 1  # one run: no spread
                else f"{r['test_mean']:.4f} ± {r['test_std'] or 0.0:.4f}")
        if metric == "metric" and r["test_mean"] is not None:  # runs of different metrics: each names its own
            test += f" {r['metric']}"
        has_t = r["target"] is not None
        line = [r["name"], r["model"], r["strategy"], str(r["runs"]), test,
                _fmt(None if r["epoch_time_s"] is None else r["epoch_time_s"] * 1e3, ".1f"),
                _fmt(None if r["epoch_wall_s"] is None else r["epoch_wall_s"] * 1e3, ".1f"),
                f"{r['epochs_run_mean']:.0f}",
                _fmt(r["epoch_at_99pct_peak_val_mean"], ".0f"), _fmt(r["converged_epoch_mean"], ".0f"),
                _fmt(r["target"], "g"),
                f"{r['runs_reaching_target']}/{r['runs']}" if has_t else "-",
                _to_target(r, "epochs_to_target", ".1f"), _to_target(r, "time_to_target_s", ".2f"),
                _fmt(r["peak_rss_anon_mb"], ".0f")] + ([_fmt(r["peak_cuda_mb"], ".0f")] if cuda else [])
        line += [_fmt(r.get("cost_per_epoch_usd"), ".3g"), _fmt(r.get("value"), ".4g")] if priced else []
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    first = result["first_to_target"]
    if first is not None:
        by = {r["name"]: r for r in rows}
        w = by[first]
        others = [r for r in rows if r["name"] != first]
        vs = "; ".join(f"{r['name']} {_time_to_target(r)}" for r in others)
        lines.append(f"first to val {w['metric']} {result['target']:g}: {first} in {w['time_to_target_s_mean']:.2f} s "
                     f"({w['epochs_to_target_mean']:.1f} epochs)" + (f" vs {vs}" if vs else ""))
        fewest = result["fewest_epochs_to_target"]
        if fewest != first:
            lines.append(f"fewest epochs to the target: {fewest} ({by[fewest]['epochs_to_target_mean']:.1f}), "
                         "but its epochs take longer")
    for r in rows:
        if r["preprocess_s"] is not None:
            lines.append(f"{r['name']}: plus {r['preprocess_s']:.2f} s of one-off preprocessing, not in its "
                         "times")
    if result["note"]:
        lines.append(f"note: {result['note']}")
    lines.append("step ms: training step (median); epoch ms: training + evaluation per epoch (mean); epochs, "
                 "99%pk ep, conv ep, epochs→tgt, time→tgt: means over runs (k/n: over the k of n runs that reached the "
                 "target; never: no run did)"
                 + ("; value: 1 / (step s x $ per step), higher is better" if priced else ""))
    return "\n".join(lines)


def plot_compare(result: dict[str, Any], rds: list[RunDir], out: str | Path) -> Path:
    """Draw validation-metric curves against cumulative wall time (left) and epoch (right) to ``out`` (PNG).

    One colour per run directory; with several runs each is drawn faintly and their mean (over the
    epochs every run reached, at the mean time of that epoch) boldly. A dashed line marks the target and
    a dot where each directory reaches it on average.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ends: list[float] = []  # each directory's longest run, to choose the time axis' scale
    for i, (row, rd) in enumerate(zip(result["rows"], rds)):
        color = colors[i % len(colors)]
        key = f"val_{rd.metric}"
        curves = []
        for recs in rd.runs.values():
            t = cumulative_times(recs)
            e = [int(r.get("epoch", k)) for k, r in enumerate(recs)]
            v = [math.nan if _num(r.get(key)) is None else float(r[key]) for r in recs]
            curves.append((t, e, v))
        ends.append(max(c[0][-1] for c in curves))
        many = len(curves) > 1
        for t, e, v in curves:
            ax_t.plot(t, v, color=color, lw=0.8, alpha=0.35 if many else 1.0)
            ax_e.plot(e, v, color=color, lw=0.8, alpha=0.35 if many else 1.0)
        if many:
            n = min(len(c[0]) for c in curves)
            mt = [statistics.fmean(c[0][k] for c in curves) for k in range(n)]
            mv = [statistics.fmean(c[2][k] for c in curves) for k in range(n)]
            ax_t.plot(mt, mv, color=color, lw=2)
            ax_e.plot(range(n), mv, color=color, lw=2)
        label = f"{row['name']} ({row['model']}, {row['strategy']})"
        tt, et = row.get("time_to_target_s_mean"), row.get("epochs_to_target_mean")
        if row["target"] is not None:
            label += (f": target in {tt:.2f} s, {et:.0f} epochs" if tt is not None
                      else f": target reached in {row['runs_reaching_target']}/{row['runs']} runs")
            if tt is not None:
                ax_t.plot([tt], [row["target"]], "o", color=color, ms=7, mec="black")
                ax_e.plot([et - 1], [row["target"]], "o", color=color, ms=7, mec="black")
        ax_e.plot([], [], color=color, lw=2, label=label)
    targets = {r["target"] for r in result["rows"] if r["target"] is not None}
    for t in targets:
        for ax in (ax_t, ax_e):
            ax.axhline(t, color="gray", ls="--", lw=1)
    metric = result["rows"][0]["metric"]
    # Runs whose lengths differ by more than 10x squash the short ones against the axis: log time then.
    log_time = min(ends) > 0 and max(ends) / min(ends) > 10
    if log_time:
        ax_t.set_xscale("log")
    ax_t.set(xlabel="cumulative wall time, training + evaluation (s" + (", log scale)" if log_time else ")"),
             ylabel=f"validation {metric}", title=f"validation {metric} against wall time")
    ax_e.set(xlabel="epoch", ylabel=f"validation {metric}", title=f"validation {metric} against epoch")
    title = "dashed: target" if targets else "no target"
    if result["first_to_target"]:
        title = f"first to val {metric} {result['target']:g}: {result['first_to_target']} (dashed: target)"
    fig.suptitle(title, fontsize=10)
    ax_e.legend(fontsize=7, loc="lower right")
    for ax in (ax_t, ax_e):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out


def _time_to_target(row: dict[str, Any]) -> str:
    """A run set's mean time to the target; ``never``, or how many of its runs reached it."""
    if row.get("time_to_target_s_mean") is not None:
        return f"{row['time_to_target_s_mean']:.2f} s"
    if not row["runs_reaching_target"]:
        return "never"
    return f"not in every run ({row['runs_reaching_target']}/{row['runs']} reached it)"
