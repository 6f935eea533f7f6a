"""Every strategy through the one trainer: options that used to be ignored, exact resume, the one summary schema."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.train.helpers import metrics_without_timing, summary_without_timing
from tests.train.stubmodel import make_sbm_store
from trellis.cli.main import main
from trellis.errors import TrellisUserError
from trellis.train.compare import compare_runs, load_run_dir
from trellis.train.config import TrainConfig
from trellis.train.rng import seed_everything
from trellis.train.runs import read_json
from trellis.train.strategies import STRATEGIES
from trellis.train.strategies.pp import PrePropagation
from trellis.train.summary import RunSummary
from trellis.train.trainer import Trainer, TrainingInterrupted, train


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_sbm_store(tmp_path_factory.mktemp("strat") / "sbm", n=300)


@pytest.fixture(scope="module")
def pp_dir(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("strat") / "pp"
    assert main(["preprocess", str(store), "--hops", "2", "--out", str(out), "--no-progress"]) == 0
    return out


pytestmark = pytest.mark.usefixtures("one_thread")


def pp_cfg(store, pp_dir, out, **kw) -> TrainConfig:
    values = {"store": str(store), "strategy": "pp", "pp_dir": str(pp_dir), "model": "sign", "hidden": 16,
              "batch_size": 32, "epochs": 12, "device": "cpu", "progress": False, "out": str(out), **kw}
    return TrainConfig(**values)


def test_registry_names_the_cli_choices(capsys):
    assert set(STRATEGIES) == {"full", "mini", "cluster", "pp"}
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--strategy {full,mini,cluster,pp}" in capsys.readouterr().out


def test_pp_trains_with_sgd_and_xavier(store, pp_dir, tmp_path):
    """``--strategy pp`` used to ignore --optimizer, --momentum and --init; now the trainer builds them."""
    cfg = pp_cfg(store, pp_dir, tmp_path / "run", optimizer="sgd", momentum=0.5, init="xavier", lr=0.05)

    def stop(t, rec):
        if rec["epoch"] == 2:
            t.request_stop(signal.SIGTERM)

    with pytest.raises(TrainingInterrupted):
        Trainer(cfg, callbacks=[stop]).fit()
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    group = ckpt["run_state"]["optimizer"]["param_groups"][0]
    assert group["momentum"] == 0.5 and group["lr"] == 0.05 and "betas" not in group  # SGD, not Adam
    # --init xavier: re-initialized weights (same draws for the same seed), zero biases
    strategy = PrePropagation(cfg, torch.device("cpu"))
    strategy.load()
    seed_everything(0)
    xavier = strategy.build_model(lambda *a, **k: None).state_dict()
    seed_everything(0)
    default = PrePropagation(pp_cfg(store, pp_dir, tmp_path / "x"), torch.device("cpu"))
    default.load()
    plain = default.build_model(lambda *a, **k: None).state_dict()
    assert any(not torch.equal(xavier[k], plain[k]) for k in xavier if xavier[k].dim() >= 2)
    assert all(float(v.abs().sum()) == 0.0 for k, v in xavier.items() if k.endswith("bias") and v.dim() == 1)
    strategy.close()
    default.close()


#: Per strategy: options of a small run with the real models.
RESUME = {
    "full": {"model": "gcn", "hidden": 16},
    "full-out-of-core": {"model": "sage", "hidden": 16, "memory_budget": "2G"},
    "mini": {"strategy": "mini", "model": "sage", "hidden": 16, "fanouts": "4,4", "batch_size": 64},
    "cluster": {"strategy": "cluster", "model": "gcn", "hidden": 16, "clusters": 6, "clusters_per_batch": 2,
                "cluster_method": "hash"},
    "pp": {},
}


@pytest.mark.parametrize("strategy", list(RESUME))
def test_resume_is_exact_for_every_strategy(store, pp_dir, tmp_path, strategy):
    kw = {"runs": 2, "checkpoint_every": 3, "epochs": 8, "dropout": 0.5}

    def make(out):
        if strategy == "pp":
            return pp_cfg(store, pp_dir, out, **kw)
        return TrainConfig(store=str(store), device="cpu", progress=False, out=str(out), **kw, **RESUME[strategy])

    train(make(tmp_path / "full"))

    def stop(t, rec):
        if rec["run"] == 1 and rec["epoch"] == 4:
            t.request_stop(signal.SIGINT)

    with pytest.raises(TrainingInterrupted):
        Trainer(make(tmp_path / "cut"), callbacks=[stop]).fit()
    resumed = TrainConfig.from_dict({**read_json(tmp_path / "cut" / "config.json"), "resume": str(tmp_path / "cut"),
                                     "progress": False})
    Trainer(resumed).fit()
    assert metrics_without_timing(tmp_path / "cut") == metrics_without_timing(tmp_path / "full")
    # the pp placement's budget follows the machine's free memory at load time; load time and bytes read vary
    machine = ("placement", "load_time_s", "read_bytes")
    cut, full = (summary_without_timing(tmp_path / d) for d in ("cut", "full"))
    assert {k: v for k, v in cut.items() if k not in machine} == {k: v for k, v in full.items() if k not in machine}


def test_compare_reads_every_strategy_through_one_schema(store, pp_dir, tmp_path):
    runs = {
        "full": ["--model", "gcn"],
        "mini": ["--model", "sage", "--strategy", "mini", "--fanouts", "4,4", "--batch-size", "64"],
        "cluster": ["--model", "gcn", "--strategy", "cluster", "--clusters", "6", "--clusters-per-batch", "2",
                    "--cluster-method", "hash"],
        "pp": ["--model", "sgc", "--strategy", "pp", "--pp-dir", str(pp_dir)],
    }
    dirs = []
    for name, args in runs.items():
        assert main(["train", str(store), *args, "--epochs", "4", "--runs", "2", "--device", "cpu", "--no-progress",
                     "--out", str(tmp_path / name)]) == 0
        dirs.append(tmp_path / name)
    assert main(["sweep", str(store), "--model", "gcn", "--grid", "lr=0.01,0.02", "--epochs", "4", "--device", "cpu",
                 "--no-progress", "--out", str(tmp_path / "sweep")]) == 0
    dirs.append(tmp_path / "sweep" / "configs" / "c00")
    for d in dirs:
        raw = read_json(d / "summary.json")
        s = RunSummary.from_dict(raw)
        assert isinstance(raw["runs"], int) and raw["runs"] == len(raw["per_run"]) == s.runs
        assert raw["epoch_time_s_median"] > 0 and raw["peak_rss_anon_mb"] > 0 and s.metric == "acc"
        vals = raw["test_acc"]
        if len(vals) > 1:  # sample standard deviation everywhere
            mean = sum(vals) / len(vals)
            assert raw["test_acc_std"] == pytest.approx((sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5)
        assert load_run_dir(d).strategy == raw["strategy"]
    result, _ = compare_runs(dirs)
    assert [r["strategy"] for r in result["rows"]] == ["full", "mini", "cluster", "pp", "full"]
    assert all(r["test_mean"] is not None and r["epoch_time_s"] > 0 for r in result["rows"])


@pytest.mark.parametrize(("args", "message"), [
    (["--strategy", "mini", "--memory-budget", "3G"],
     "--memory-budget applies to --strategy mini with --parts-dir PART_DIR (a partition buffer"),
    (["--strategy", "cluster", "--spill-dir", "/tmp"], "--spill-dir applies to --strategy cluster with --parts-dir"),
    (["--strategy", "pp", "--pp-dir", "/tmp", "--model", "sgc", "--overlap"],
     "--overlap does not apply to --strategy pp; it applies to --strategy full"),
    (["--spill-dir", "/tmp"], "--spill-dir applies to --strategy full with --memory-budget only"),
    (["--strategy", "mini", "--clusters", "8"], "--clusters does not apply to --strategy mini"),
    (["--strategy", "cluster", "--labor"], "--labor does not apply to --strategy cluster"),
    (["--prefetch", "0"], "--prefetch does not apply to --strategy full; it applies to --strategy mini and cluster"),
])
def test_an_option_the_strategy_would_ignore_is_refused(store, tmp_path, capsys, args, message):
    assert main(["train", str(store), *args, "--out", str(tmp_path / "run")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_resume_refuses_a_rebuilt_pp_cache(store, tmp_path):
    """A PP_DIR rebuilt with another operator (same hops and width) resumed silently on other features."""
    cache = tmp_path / "pp"
    assert main(["preprocess", str(store), "--hops", "2", "--out", str(cache), "--no-progress"]) == 0

    def stop(t, rec):
        if rec["epoch"] == 2:
            t.request_stop(signal.SIGINT)

    with pytest.raises(TrainingInterrupted):
        Trainer(pp_cfg(store, cache, tmp_path / "cut", checkpoint_every=1, epochs=8), callbacks=[stop]).fit()
    assert main(["preprocess", str(store), "--hops", "2", "--operator", "rw", "--out", str(cache), "--overwrite",
                 "--no-progress"]) == 0
    resumed = TrainConfig.from_dict({**read_json(tmp_path / "cut" / "config.json"), "resume": str(tmp_path / "cut"),
                                     "progress": False})
    with pytest.raises(TrellisUserError, match="changed since it started .*a rebuilt --pp-dir"):
        Trainer(resumed).fit()


def test_a_pp_run_is_read_back_and_refuses_a_rebuilt_cache(store, tmp_path, monkeypatch):
    """``trellis.load_run`` refused every pp run (so ``trellis.train(strategy="pp", nproc=2)`` raised after
    training), and ``trellis predict`` read whatever cache its PP_DIR held by then: a cache rebuilt with other
    hops and another operator predicted with exit 0. The model file now records the cache's settings and its
    absolute path (predict from another directory found no cache)."""
    import numpy as np

    import trellis
    from trellis.train.predict import predict

    cache = tmp_path / "cache"
    assert main(["preprocess", str(store), "--hops", "2", "--out", str(cache), "--no-progress"]) == 0
    monkeypatch.chdir(tmp_path)
    run = trellis.train(str(store), strategy="pp", pp_dir="cache", model="sgc", epochs=3, out=tmp_path / "run")
    back = trellis.load_run(tmp_path / "run")
    assert torch.equal(back.predict(logits=True), run.predict(logits=True))
    monkeypatch.chdir(tmp_path.parent)
    got = predict(tmp_path / "run", store, tmp_path / "p.npy", device="cpu")
    assert got["num_nodes"] == 300 and np.load(tmp_path / "p.npy").shape == (300,)
    assert main(["preprocess", str(store), "--hops", "3", "--operator", "rw", "--out", str(cache), "--overwrite",
                 "--no-progress"]) == 0
    with pytest.raises(TrellisUserError, match=r"rebuilt since the model trained on it \(hops 2 then, 3 now, "
                                               r"operator 'sym' then, 'rw' now\)"):
        predict(tmp_path / "run", store, tmp_path / "q.npy", device="cpu")


def test_a_pp_sweep_under_a_memory_budget_and_its_configs_replay_from_anywhere(store, pp_dir, tmp_path, monkeypatch):
    """``trellis sweep --memory-budget`` with strategy=pp was refused over --spill-dir (never given); the
    configurations' config.json named the cache as typed, so replaying one from another directory failed."""
    import json
    import shutil

    from trellis.train.sweep import SweepConfig, parse_grid, run_sweep

    shutil.copytree(pp_dir, tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    run_sweep(SweepConfig(store=str(store), model="sign", grid=parse_grid(["lr=0.01,0.005"]), epochs=2,
                          base={"strategy": "pp", "pp_dir": "cache", "hidden": "8", "memory_budget": "1G"},
                          out=str(tmp_path / "sw"), progress=False))
    saved = json.loads((tmp_path / "sw" / "configs" / "c00" / "config.json").read_text())
    assert saved["pp_dir"] == str(tmp_path / "cache") and saved["store"] == str(store.resolve())
    monkeypatch.chdir(tmp_path.parent)
    assert main(["train", "--config", str(tmp_path / "sw" / "configs" / "c00" / "config.json"), "--out",
                 str(tmp_path / "replay"), "--no-progress"]) == 0


def test_a_pp_resume_on_a_fuller_machine_keeps_the_runs_reshuffling(store, pp_dir, tmp_path, monkeypatch):
    """Without --memory-budget the placement is planned in 80% of the memory free; a resume on a fuller machine
    chose storage and chunk reshuffling where the run had exact reshuffling in memory, and trained other epochs."""
    import trellis.loader.pp as pp_loader

    ref = tmp_path / "ref"
    train(pp_cfg(store, pp_dir, ref, epochs=4))
    cut = pp_cfg(store, pp_dir, tmp_path / "cut", epochs=4, checkpoint_every=1)

    def stop(t, rec):
        if rec["epoch"] == 1:
            t.request_stop(signal.SIGTERM)

    with pytest.raises(TrainingInterrupted):
        Trainer(cut, callbacks=[stop]).fit()
    again = TrainConfig.from_dict({**read_json(tmp_path / "cut" / "config.json"), "resume": cut.out, "progress": False})
    row = 3 * 8 * 4  # hops x features x float32 of the store above
    with monkeypatch.context() as m:  # the run's rows no longer fit: refused by name, not trained on otherwise
        m.setattr(pp_loader, "default_budget", lambda: (2 * 33 * row + 1, "little free memory"))
        with pytest.raises(TrellisUserError, match=r"--resume: the run trained with --pp-loader prefetch \(chunk "
                                                   r"size 1\), which does not fit now"):
            train(again)
    with monkeypatch.context() as m:  # a budget that plans another loader where the run's fits: the run's is kept
        m.setattr(pp_loader, "default_budget", lambda: (10**9, "lots"))
        m.setattr(pp_loader, "spare_compute", lambda device: (False, "no spare core"))  # index, not prefetch
        resumed = train(again)
    assert metrics_without_timing(tmp_path / "cut") == metrics_without_timing(ref)
    assert resumed["placement"]["loader"] == "prefetch"
