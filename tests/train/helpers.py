"""Comparison helpers: metrics and summaries without the fields that measure time, memory or paths."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from trellis.train.runs import read_json, read_jsonl

#: Per-epoch fields that measure time or I/O (an out-of-core epoch after --resume rebuilds its cached spills).
TIMING = {"step_time_s", "time_s", "spill_written_bytes", "spill_read_bytes", "spill_gathered_bytes",
          "storage_read_bytes", "compute_s", "comm_s"}
VOLATILE_SUMMARY = {"epoch_time_s_median", "epoch_time_s_mean", "train_time_s", "wall_time_s_this_process",
                    "peak_rss_mb", "peak_rss_anon_mb", "peak_cuda_mb", "run_dir", "config", "per_run", "threads",
                    "time_to_target_s", "time_to_target_s_mean", "baseline_rss_anon_bytes", "batch_wait_share"}


def metrics_without_timing(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in rec.items() if k not in TIMING} for rec in read_jsonl(Path(run_dir) / "metrics.jsonl")]


def summary_without_timing(run_dir: Path) -> dict:
    s = read_json(Path(run_dir) / "summary.json")
    out = {k: v for k, v in s.items() if k not in VOLATILE_SUMMARY}
    out["per_run"] = [{k: v for k, v in r.items() if k not in TIMING} for r in s["per_run"]]
    return out


def wait_for_epochs(out: Path, proc: subprocess.Popen, n: int, timeout: float = 120.0) -> None:
    """Wait until the run ``out`` of the child ``proc`` has logged ``n`` epochs (fail if it exits first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        m = out / "metrics.jsonl"
        if m.is_file() and len(m.read_text().splitlines()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} epochs (exit {proc.poll()}): {proc.stderr.read().decode() if proc.stderr else ''}")


def two_rank_resume_matches(kw: dict, tmp_path: Path, keys: tuple[str, ...], epochs: int) -> None:
    """Train ``kw`` on 2 spawned ranks whole, and cut after epoch 1 then resumed: the same ``keys`` every epoch."""
    import torch.multiprocessing as mp

    from tests.distributed.test_parallel import _worker
    from trellis.distributed.comm import free_port
    from trellis.train.config import TrainConfig

    whole = TrainConfig(**kw, out=str(tmp_path / "whole"))
    cut = TrainConfig(**kw, out=str(tmp_path / "cut"))
    mp.spawn(_worker, args=(2, free_port(), [whole.to_dict(session=True), {**cut.to_dict(session=True), "stop_at": 1}]),
             nprocs=2, join=True)
    assert len(read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == 2
    resumed = TrainConfig.from_dict({**cut.to_dict(session=True), "resume": str(tmp_path / "cut")})
    mp.spawn(_worker, args=(2, free_port(), [resumed.to_dict(session=True)]), nprocs=2, join=True)
    got, want = read_jsonl(tmp_path / "cut" / "metrics.jsonl"), read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    assert len(got) == len(want) == epochs
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]


def one_rank_then_one_process(monkeypatch, ranked: object, plain: object) -> None:
    """Train ``ranked()`` as a world of one started as a rank (``RANK`` etc. set), then ``plain`` without those.

    ``ranked`` makes its :class:`~trellis.train.config.TrainConfig` once the variables are set (its options are
    checked as a rank's); ``plain`` is one. The caller compares their records.
    """
    import io

    import torch

    from trellis.distributed.comm import free_port
    from trellis.train.trainer import Trainer

    threads = torch.get_num_threads()
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    try:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        Trainer(ranked(), err=io.StringIO()).fit()  # type: ignore[operator]
        for k in env:
            monkeypatch.delenv(k)
        Trainer(plain, err=io.StringIO()).fit()
    finally:
        torch.set_num_threads(threads)
