"""Schedules of the pull exchange: ``--overlap`` equals blocking to 1e-6, ``--staleness 0`` is blocking bit for bit,
``--staleness S`` keeps its bound and resumes exactly (its buffers are in the checkpoint).

Spawned gloo ranks on 127.0.0.1 (one world per size runs every job of that size), on the METIS layouts of the
distributed fixtures, dropout on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.distributed.test_parallel import _cfg, _losses, _worker
from tests.train.helpers import metrics_without_timing
from trellis.distributed.comm import free_port
from trellis.errors import TrellisUserError
from trellis.train.config import TrainConfig
from trellis.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = ("gcn", "sage", "gin")
STOP_AT = 2


@pytest.fixture(scope="module")
def runs(dist_store: Path, layouts: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    """``(world, schedule, model) -> RUN_DIR``; ``stale-cut`` was interrupted at epoch 2 and resumed."""
    root = tmp_path_factory.mktemp("schedules")
    out: dict[tuple, Path] = {}
    for world in (2, 4):
        parts = str(layouts[("metis", world)])
        schedules = {"blocking": {}, "overlap": {"overlap": True}, "stale0": {"staleness": 0},
                     "stale1": {"staleness": 1}, "stale2": {"staleness": 2},
                     "link": {"emulate_link": "20MB/s,10ms"}}
        first, second = [], []
        for model in MODELS:
            for name, kw in schedules.items():
                run = root / f"{world}-{name}-{model}"
                first.append(_cfg(dist_store, model, run, parts_dir=parts, timeout=120.0, **kw).to_dict(session=True))
                out[(world, name, model)] = run
        for name, kw in (("blocking-runs2", {}), ("stale1-runs2", {"staleness": 1})):
            run = root / f"{world}-{name}"
            first.append(_cfg(dist_store, "gcn", run, parts_dir=parts, timeout=120.0, runs=2, **kw)
                         .to_dict(session=True))
            out[(world, name, "gcn")] = run
        cut = root / f"{world}-stale-cut"
        cfg = _cfg(dist_store, "gcn", cut, parts_dir=parts, timeout=120.0, staleness=1, checkpoint_every=1)
        first.append({**cfg.to_dict(session=True), "stop_at": STOP_AT})
        resumed = TrainConfig.from_dict({**cfg.to_dict(session=True), "resume": str(cut)})
        second.append(resumed.to_dict(session=True))
        out[(world, "stale-cut", "gcn")] = cut
        mp.spawn(_worker, args=(world, free_port(), first), nprocs=world, join=True)
        mp.spawn(_worker, args=(world, free_port(), second), nprocs=world, join=True)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_overlap_equals_blocking(runs, world, model):
    got, want = _losses(runs[(world, "overlap", model)]), _losses(runs[(world, "blocking", model)])
    assert len(got) == len(want) > 1
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-6 and abs(g["val_loss"] - w["val_loss"]) <= 1e-6
        assert g["exchange_bytes"] == w["exchange_bytes"]  # the same rows travel, only earlier
        assert g["comm_s"] >= 0 and g["compute_s"] > 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_staleness_zero_is_blocking_bit_for_bit(runs, world, model):
    assert metrics_without_timing(runs[(world, "stale0", model)]) == \
        metrics_without_timing(runs[(world, "blocking", model)])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_an_emulated_link_delays_exchanges_and_changes_nothing_else(runs, world, model):
    assert metrics_without_timing(runs[(world, "link", model)]) == \
        metrics_without_timing(runs[(world, "blocking", model)])
    for slow in _losses(runs[(world, "link", model)]):
        # three exchanges a step (layer 0 forward, layer 1 forward and backward), each >= 10 ms of latency
        assert slow["comm_s"] >= 0.03 and slow["step_time_s"] >= slow["comm_s"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("s", [1, 2])
def test_staleness_keeps_its_bound_and_trains(runs, world, model, s):
    got, exact = _losses(runs[(world, f"stale{s}", model)]), _losses(runs[(world, "blocking", model)])
    assert abs(got[0]["loss"] - exact[0]["loss"]) <= 1e-6  # epoch 0 uses fresh rows (summed in two parts)
    assert got[1]["loss"] != exact[1]["loss"]  # then stale rows
    ages = [{k: v for k, v in r.items() if k.startswith("staleness_a")} for r in got]
    assert all(ages) and all(max(a.values()) <= s for a in ages)
    assert [max(a.values()) for a in ages] == [min(e, s) for e in range(len(got))]
    assert got[-1]["loss"] < got[0]["loss"]


@pytest.mark.parametrize("world", [2, 4])
def test_each_run_starts_from_fresh_halo_rows(runs, world):
    """A second run (seed) must not read the first run's stale rows: its epoch 0 is the exact one."""
    got, exact = _losses(runs[(world, "stale1-runs2", "gcn")]), _losses(runs[(world, "blocking-runs2", "gcn")])
    firsts = [(g, e) for g, e in zip(got, exact) if g["epoch"] == 0]
    assert len(firsts) == 2 and all(g["run"] == e["run"] for g, e in firsts)
    assert all(abs(g["loss"] - e["loss"]) <= 1e-6 for g, e in firsts)


@pytest.mark.parametrize("world", [2, 4])
def test_stale_buffers_are_checkpointed_and_resume_is_exact(runs, world):
    # a fresh process recomputes the first layer's cached evaluation aggregation: its bytes, not its values
    whole, cut = ([{k: v for k, v in r.items() if k != "eval_exchange_bytes"} for r in metrics_without_timing(run)]
                  for run in (runs[(world, "stale1", "gcn")], runs[(world, "stale-cut", "gcn")]))
    assert len(cut) == len(whole) and cut == whole


def test_schedules_refuse_what_they_cannot_run(dist_store, layouts, tmp_path):
    with pytest.raises(TrellisUserError, match="--overlap splits each rank's pull graph"):
        Trainer(_cfg(dist_store, "gcn", tmp_path / "a", parts_dir=str(layouts[("hash", 2)]), nproc=2,
                     overlap=True)).fit()
    with pytest.raises(TrellisUserError, match="--staleness applies to GCN, SAGE and GIN"):
        Trainer(_cfg(dist_store, "gat", tmp_path / "b", parts_dir=str(layouts[("metis", 2)]), nproc=2,
                     staleness=1)).fit()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
