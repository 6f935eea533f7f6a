"""Comparison helpers: metrics and summaries without the fields that measure time, memory or paths."""

from __future__ import annotations

from pathlib import Path

from trellis.train.runs import read_json, read_jsonl

#: Per-epoch fields that measure time or I/O (an out-of-core epoch after --resume rebuilds its cached spills).
TIMING = {"step_time_s", "time_s", "spill_written_bytes", "spill_read_bytes", "spill_gathered_bytes",
          "storage_read_bytes"}
VOLATILE_SUMMARY = {"epoch_time_s_median", "epoch_time_s_mean", "train_time_s", "wall_time_s_this_process",
                    "peak_rss_mb", "peak_rss_anon_mb", "peak_cuda_mb", "run_dir", "config", "per_run", "threads",
                    "time_to_target_s", "time_to_target_s_mean", "baseline_rss_anon_bytes"}


def metrics_without_timing(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in rec.items() if k not in TIMING} for rec in read_jsonl(Path(run_dir) / "metrics.jsonl")]


def summary_without_timing(run_dir: Path) -> dict:
    s = read_json(Path(run_dir) / "summary.json")
    out = {k: v for k, v in s.items() if k not in VOLATILE_SUMMARY}
    out["per_run"] = [{k: v for k, v in r.items() if k not in TIMING} for r in s["per_run"]]
    return out
