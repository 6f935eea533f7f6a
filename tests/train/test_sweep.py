"""Sweeps: grid parsing and validation, the leaderboard, and equality with solo ``trellis train`` runs."""

import csv
import json

import pytest

import trellis.train.trainer as trainer
from tests.train.stubmodel import make_sbm_store
from trellis.errors import TrellisUserError
from trellis.train.config import TrainConfig
from trellis.train.runs import read_jsonl
from trellis.train.sweep import SweepConfig, expand_grid, make_entries, parse_grid, run_sweep


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(make_sbm_store(tmp_path_factory.mktemp("sweep") / "sbm", n=240, features=10))


def test_parse_and_expand_grid():
    grid = parse_grid(["lr=0.01,0.005", "hidden=16,32", "optimizer=adam,adagrad", "init=default,xavier",
                       "weight-decay=0,5e-4", "dropout=0.5"])
    assert grid["lr"] == [0.01, 0.005] and grid["hidden"] == [16, 32] and grid["weight_decay"] == [0.0, 5e-4]
    combos = expand_grid(grid)
    assert len(combos) == 32 and combos[0]["optimizer"] == "adam" and combos[1]["dropout"] == 0.5
    assert len({tuple(sorted(c.items())) for c in combos}) == 32


@pytest.mark.parametrize("items, message", [
    ([], "--grid is empty"),
    (["lr"], "expected KEY=V1,V2"),
    (["=0.1"], "expected KEY=V1,V2"),
    (["lrr=0.1"], "unknown hyperparameter 'lrr'; did you mean 'lr'"),
    (["epochs=5,10"], "unknown hyperparameter 'epochs'"),
    (["model=gcn,sage"], "different model families cannot share a batch"),
    (["lr=0.1,abc"], "lr value 'abc' is not a number"),
    (["lr=nan"], "not a finite number"),
    (["hidden=64.5"], "hidden value '64.5' is not an integer"),
    (["optimizer=adamx"], "not one of adam"),
    (["init=glorot"], "init value 'glorot' is not one of default, xavier, he"),
    (["lr="], "needs comma-separated values"),
    (["lr=0.1,,0.2"], "needs comma-separated values"),
    (["lr=0.1", "lr=0.2"], "given twice"),
    (["hidden=16,16"], "value 16 of hidden is given twice"),
])
def test_bad_grids_are_user_errors(items, message):
    with pytest.raises(TrellisUserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_grid(items)


def test_values_trellis_train_refuses_are_refused_naming_the_configuration(store):
    sc = SweepConfig(store=store, grid=parse_grid(["dropout=0.5,1.5"]))
    with pytest.raises(TrellisUserError, match=r"configuration dropout=1.5: --dropout must be in \[0, 1\)"):
        make_entries(sc)
    with pytest.raises(TrellisUserError, match="--set lr and --grid lr"):
        SweepConfig(store=store, grid=parse_grid(["lr=0.1"]), base={"lr": "0.2"})
    with pytest.raises(TrellisUserError, match="unknown option"):
        SweepConfig(store=store, grid=parse_grid(["lr=0.1"]), base={"lrate": "0.2"})
    with pytest.raises(TrellisUserError, match="--batch-models"):
        SweepConfig(store=store, grid=parse_grid(["lr=0.1"]), batch_models=0)
    for key in ("epochs", "patience", "device"):  # overridden by the sweep's own flag, silently
        with pytest.raises(TrellisUserError, match=f"--set {key}: set by the sweep itself.*\\(--{key}\\)"):
            SweepConfig(store=store, grid=parse_grid(["lr=0.1"]), base={key: "0" if key != "device" else "cuda"})



def test_set_values_are_typed_as_a_python_callers(store):
    """``--set layers=3`` (a string) and ``base={"layers": 3}`` are one setting in sweep.json and a resume."""
    grid = parse_grid(["lr=0.1"])
    cli = SweepConfig(store=store, grid=grid, base={"layers": "3", "dropout": "0.25", "residual": "true"})
    api = SweepConfig(store=store, grid=grid, base={"layers": 3, "dropout": 0.25, "residual": True})
    assert cli.base == api.base == {"layers": 3, "dropout": 0.25, "residual": True}
    assert json.dumps(cli.base) == json.dumps(api.base)
    with pytest.raises(TrellisUserError, match="--set: --layers must be an integer"):
        SweepConfig(store=store, grid=grid, base={"layers": "three"})


def solo_metrics(cfg_path, out):
    """Run the configuration's saved config.json through the real trainer, as `trellis train --config`."""
    values = json.loads(cfg_path.read_text())
    values.update(out=str(out), progress=False)
    trainer.Trainer(TrainConfig.from_dict(values)).fit()
    return read_jsonl(out / "metrics.jsonl")


def test_sweep_equals_solo_runs_and_lists_every_configuration_once(store, tmp_path):
    grid = parse_grid(["lr=0.05,0.01", "optimizer=adam,adagrad", "dropout=0,0.5"])
    out = tmp_path / "sweep"
    board = run_sweep(SweepConfig(store=store, model="gcn", grid=grid, base={"hidden": "16"}, epochs=12,
                                  patience=3, batch_models=3, out=str(out), progress=False))
    rows = board["rows"]
    assert sorted(r["config"] for r in rows) == [f"c{i:02d}" for i in range(8)]  # each exactly once
    assert [r["rank"] for r in rows] == list(range(1, 9))
    vals = [r["val_acc"] for r in rows]
    assert vals == sorted(vals, reverse=True)
    assert [len(b["configs"]) for b in board["batches"]] == [3, 3, 2] and board["batch_models"] == {"2": 3}
    with open(out / "leaderboard.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["config"] for t in table] == [r["config"] for r in rows]
    assert {"lr", "optimizer", "dropout", "val_acc", "test_acc", "epochs", "time_s"} <= set(table[0])
    assert (out / "leaderboard.png").stat().st_size > 0 and (out / "leaderboard.json").is_file()
    assert not list(tmp_path.glob(".sweep.tmp-*"))
    for r in rows:  # early stopping is per configuration
        assert r["epochs"] == (r["best_epoch"] + 4 if r["stopped"] == "patience" else 12)
    # Every configuration's curve equals its solo `trellis train` run: adam and adagrad, with and without
    # dropout, in batches where other configurations stopped earlier or later.
    for cid in ("c00", "c03", "c06"):
        batched = read_jsonl(out / "configs" / cid / "metrics.jsonl")
        solo = solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{cid}")
        assert len(batched) == len(solo)
        for a, b in zip(batched, solo):
            assert abs(a["loss"] - b["loss"]) <= 1e-4 and abs(a["val_loss"] - b["val_loss"]) <= 1e-4
            assert a["val_acc"] == pytest.approx(b["val_acc"], abs=1e-9) and a["best_epoch"] == b["best_epoch"]
        summary = json.loads((out / "configs" / cid / "summary.json").read_text())
        solo_summary = json.loads((tmp_path / f"solo-{cid}" / "summary.json").read_text())
        assert summary["test_acc_mean"] == pytest.approx(solo_summary["test_acc_mean"], abs=1e-9)
        for key in ("epoch_at_99pct_peak_val", "converged_epoch"):  # time-to-accuracy fields, as a solo run's
            assert summary[key] == solo_summary[key]
        assert (out / "configs" / cid / "models" / "run-0.pt").is_file()


def test_a_batchs_time_is_divided_by_the_cost_models_estimate_of_each_configuration(store, tmp_path):
    """A wide configuration batched with a narrow one is not priced at half the batch (a tune reserves its
    final runs at that price)."""
    import torch

    from trellis.train.sweep import build_config_model, load_sweep_data

    sc = SweepConfig(store=store, model="gcn", grid=parse_grid(["hidden=4,128"]), epochs=3, patience=3,
                     batch_models=2, out=str(tmp_path / "sweep"), progress=False)
    run_sweep(sc)
    entries = make_entries(sc)
    strategy = load_sweep_data(entries, torch.device("cpu"))
    w = [strategy.epoch_weight(build_config_model(e, strategy, torch.device("cpu"))[0]) for e in entries]
    assert w[1] > 2 * w[0]
    narrow, wide = (read_jsonl(tmp_path / "sweep" / "configs" / c / "metrics.jsonl") for c in ("c00", "c01"))
    for a, b in zip(narrow, wide):
        assert a["batch_size"] == 2 and a["batch_step_time_s"] == b["batch_step_time_s"]
        assert a["step_time_s"] + b["step_time_s"] == pytest.approx(a["batch_step_time_s"])
        assert b["step_time_s"] / a["step_time_s"] == pytest.approx(w[1] / w[0])


def test_init_and_momentum_in_the_grid_equal_solo_runs(store, tmp_path):
    """``init`` and ``momentum`` are training options: the saved config.json replays them solo exactly."""
    grid = parse_grid(["init=xavier,he", "optimizer=sgd", "momentum=0.5,0.9"])
    out = tmp_path / "sweep"
    board = run_sweep(SweepConfig(store=store, model="gcn", grid=grid, base={"hidden": "16"}, epochs=6,
                                  patience=6, batch_models=4, out=str(out), progress=False))
    assert len(board["rows"]) == 4 and len(board["batches"]) == 1
    for cid in ("c00", "c03"):
        saved = json.loads((out / "configs" / cid / "config.json").read_text())
        assert saved["init"] in ("xavier", "he") and saved["momentum"] in (0.5, 0.9)
        batched = read_jsonl(out / "configs" / cid / "metrics.jsonl")
        solo = solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{cid}")
        assert [round(a["loss"], 4) for a in batched] == pytest.approx([round(b["loss"], 4) for b in solo], abs=1e-4)


def test_wide_features_without_dropout_equal_solo_runs_bit_for_bit(tmp_path):
    """Wide inputs, no dropout (Lotan's grid on Amazon Computers): the sweep aggregates the constant features
    once and reuses ``ÂX``. A solo run goes through the same planner v2 path (a one-configuration batch), so
    the per-epoch losses are identical; computing ``Â(XW)`` there instead let Adam's first step turn last-bit
    differences of tiny gradients into ``±lr`` updates (measured per-epoch loss gaps of 1e-3 to 2)."""
    wide = str(make_sbm_store(tmp_path / "wide", n=240, features=300))
    grid = parse_grid(["optimizer=adam,adagrad", "lr=0.05"])
    out = tmp_path / "sweep"
    run_sweep(SweepConfig(store=wide, model="gcn", grid=grid, base={"hidden": "64", "layers": "3", "dropout": "0"},
                          epochs=8, patience=8, batch_models=2, out=str(out), progress=False))
    for cid in ("c00", "c01"):
        batched = [r["loss"] for r in read_jsonl(out / "configs" / cid / "metrics.jsonl")]
        solo = [r["loss"] for r in solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{cid}")]
        assert batched == solo


def test_existing_output_is_refused_and_left_alone(store, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(TrellisUserError, match="already exists"):
        run_sweep(SweepConfig(store=store, grid=parse_grid(["lr=0.1"]), out=str(out), progress=False))
    assert (out / "keep.txt").read_text() == "x"


def test_families_that_cannot_batch_run_one_at_a_time(store, tmp_path):
    grid = parse_grid(["lr=0.01,0.005"])
    with pytest.raises(TrellisUserError, match="cannot be model-batched"):
        run_sweep(SweepConfig(store=store, model="gat", grid=grid, epochs=2, batch_models=2,
                              out=str(tmp_path / "x"), progress=False))
    board = run_sweep(SweepConfig(store=store, model="gat", grid=grid, base={"hidden": "4", "heads": "2"}, epochs=3,
                                  out=str(tmp_path / "gat"), progress=False))
    assert len(board["rows"]) == 2 and [len(b["configs"]) for b in board["batches"]] == [1, 1]
    batched = read_jsonl(tmp_path / "gat" / "configs" / "c01" / "metrics.jsonl")
    solo = solo_metrics(tmp_path / "gat" / "configs" / "c01" / "config.json", tmp_path / "solo-gat")
    assert [round(r["loss"], 5) for r in batched] == [round(r["loss"], 5) for r in solo]


def test_pre_norm_configurations_run_apart_from_the_batch_and_equal_solo_runs(store, tmp_path):
    """A grid over --pre-norm: the plain configurations share a batch, the pre-norm ones run one at a time."""
    grid = parse_grid(["pre_norm=false,true", "lr=0.01,0.005"])
    board = run_sweep(SweepConfig(store=store, model="gcn", grid=grid, base={"hidden": "8", "norm": "layer"},
                                  epochs=3, patience=3, batch_models=4, out=str(tmp_path / "s"), progress=False))
    assert sorted(board["batch_models"]) == ["2", "2-pre-norm"] and board["batch_models"]["2-pre-norm"] == 1
    sizes = sorted(len(b["configs"]) for b in board["batches"])
    assert sizes == [1, 1, 2]
    for cid in ("c02", "c03"):  # pre_norm=true rows of the grid
        saved = json.loads((tmp_path / "s" / "configs" / cid / "config.json").read_text())
        assert saved["pre_norm"] is True
        batched = [r["loss"] for r in read_jsonl(tmp_path / "s" / "configs" / cid / "metrics.jsonl")]
        solo = [r["loss"] for r in solo_metrics(tmp_path / "s" / "configs" / cid / "config.json",
                                                tmp_path / f"solo-{cid}")]
        assert batched == solo


def test_leaderboard_labels_name_the_configuration():
    from trellis.train.sweep import config_label

    row = {"rank": 1, "config": "c03", "lr": 0.01, "hidden": 64, "val_acc": 0.8, "residual": True}
    assert config_label(row) == "#1 c03 lr=0.01 hidden=64 residual=True"


def _losses(path):
    return [r["loss"] for r in read_jsonl(path)]


def test_pp_sweep_reads_each_batch_once_for_every_configuration_and_equals_solo_runs(store, tmp_path):
    """SIGN sweeps: K configurations share each batch's rows (one batch here), each equals its solo run."""
    from trellis.loader.ppcache import preprocess

    pp = tmp_path / "pp"
    preprocess(store, pp, hops=2)
    grid = parse_grid(["lr=0.01,0.003", "dropout=0,0.5"])
    out = tmp_path / "sweep"
    board = run_sweep(SweepConfig(store=store, model="sign", grid=grid, epochs=6, patience=6, out=str(out),
                                  base={"strategy": "pp", "pp_dir": str(pp), "batch_size": "64", "hidden": "16"},
                                  progress=False))
    assert [len(b["configs"]) for b in board["batches"]] == [4]  # every configuration over one read of the rows
    for cid in ("c00", "c03"):
        recs = read_jsonl(out / "configs" / cid / "metrics.jsonl")
        assert {r["batch_size"] for r in recs} == {4} and "test_acc" in recs[0]
        solo = solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{cid}")
        assert [r["loss"] for r in recs] == [r["loss"] for r in solo]
        assert [r["val_acc"] for r in recs] == [r["val_acc"] for r in solo]


def test_out_of_core_sweep_shares_every_tile_and_equals_solo_runs_bit_for_bit(store, tmp_path, monkeypatch):
    """``--set memory-budget=SIZE``: K configurations of different widths and dropout share one pass per layer
    over the tiles; each one's losses equal its solo out-of-core run's exactly; the spills are gone afterwards."""
    from trellis.train.strategies.outofcore import OutOfCoreFull

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 50)  # the same tiles for one and for four configurations
    grid = parse_grid(["hidden=8,16", "dropout=0,0.5"])
    # 300 features: the first layer transforms first (dropped-out features recomputed per tile, not spilled)
    wide = str(make_sbm_store(tmp_path / "wide", n=240, features=300))
    for model, layers, data in (("sage", "2", store), ("gin", "3", store), ("gcn", "2", wide)):
        out = tmp_path / f"sweep-{model}"
        board = run_sweep(SweepConfig(store=data, model=model, grid=grid, epochs=4, patience=4, out=str(out),
                                      base={"memory_budget": "3G", "layers": layers}, progress=False))
        assert [len(b["configs"]) for b in board["batches"]] == [4]
        assert "every tile's graph reads and aggregations are shared" in board["batch_choice"][layers]["text"]
        assert not list(out.rglob("spill"))
        for cid in ("c01", "c02"):
            summary = json.loads((out / "configs" / cid / "summary.json").read_text())
            assert summary["tiles"] >= 5
            recs = read_jsonl(out / "configs" / cid / "metrics.jsonl")
            assert {r["batch_size"] for r in recs} == {4} and recs[0]["spill_gathered_bytes"] > 0
            solo = solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{model}-{cid}")
            assert [r["loss"] for r in recs] == [r["loss"] for r in solo]
            assert [r["val_acc"] for r in recs] == [r["val_acc"] for r in solo]


def test_out_of_core_sweep_on_bag_of_words_rows_equals_solo_runs_bit_for_bit(dataset, tmp_path, monkeypatch):
    """Cora's bag-of-words rows reach every configuration's first layer as sparse tiles, read once per tile for all
    of them and dropped out per configuration; each equals its solo out-of-core run exactly."""
    from trellis.data.importers import import_graph
    from trellis.train.strategies.outofcore import OutOfCoreFull

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 700)
    cora = import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False)
    out = tmp_path / "sweep"
    for model in ("gcn", "sage"):
        run_sweep(SweepConfig(store=str(cora), model=model, grid=parse_grid(["hidden=8,16", "dropout=0,0.5"]),
                              epochs=3, patience=3, out=str(out / model), base={"memory_budget": "3G"},
                              progress=False))
        for cid in ("c00", "c03"):
            recs = read_jsonl(out / model / "configs" / cid / "metrics.jsonl")
            assert {r["batch_size"] for r in recs} == {4}
            assert recs[-1]["spill_read_bytes"] < 2708 * 1433 * 4  # less than one read of the dense rows
            solo = solo_metrics(out / model / "configs" / cid / "config.json", tmp_path / f"solo-{model}-{cid}")
            assert [r["loss"] for r in recs] == [r["loss"] for r in solo]
            assert [r["val_acc"] for r in recs] == [r["val_acc"] for r in solo]


def test_out_of_core_configurations_with_equal_dropout_streams_aggregate_their_features_once(store, tmp_path,
                                                                                           monkeypatch):
    """A grid over learning rate and weight decay at one dropout rate: every configuration draws the same masks
    (same seed), so their dropped-out features are one block, aggregated once; each still equals its solo run."""
    from trellis.train.strategies.outofcore import OutOfCoreFull

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 50)
    grid = parse_grid(["lr=0.05,0.01", "weight_decay=0,5e-4"])
    out = tmp_path / "sweep"
    run_sweep(SweepConfig(store=store, model="gcn", grid=grid, epochs=4, patience=4, out=str(out),
                          base={"memory_budget": "3G", "dropout": "0.5", "hidden": "8"}, progress=False))
    solo_gathered = None
    for cid in ("c00", "c03"):
        recs = read_jsonl(out / "configs" / cid / "metrics.jsonl")
        solo = solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{cid}")
        assert [r["loss"] for r in recs] == pytest.approx([r["loss"] for r in solo], abs=1e-6)
        solo_gathered = solo[-1]["spill_gathered_bytes"]
    # four configurations gather far less than four solo runs: the first layer's aggregation is shared
    assert recs[-1]["spill_gathered_bytes"] < 0.75 * 4 * solo_gathered


def test_out_of_core_configurations_with_equal_masks_drop_out_each_feature_tile_once(tmp_path, monkeypatch):
    """Transform-first configurations (300 features, hidden 8) recompute their dropped-out features per tile; with
    one dropout rate and seed the mask is applied once per tile and pass for all four, not once per configuration,
    and each still equals its solo run exactly."""
    from trellis.nn import tiled_batch
    from trellis.train.strategies.outofcore import OutOfCoreFull

    monkeypatch.setattr(OutOfCoreFull, "max_tile_rows", 50)
    wide = str(make_sbm_store(tmp_path / "wide", n=240, features=300))
    widths: list[int] = []
    apply = tiled_batch.hash_dropout.apply_

    def counted(t, *args, **kwargs):
        widths.append(int(t.shape[-1]))
        return apply(t, *args, **kwargs)

    monkeypatch.setattr(tiled_batch.hash_dropout, "apply_", counted)
    out = tmp_path / "sweep"
    run_sweep(SweepConfig(store=wide, model="gcn", grid=parse_grid(["lr=0.05,0.01", "weight_decay=0,5e-4"]),
                          epochs=2, patience=2, out=str(out),
                          base={"memory_budget": "3G", "dropout": "0.5", "hidden": "8"}, progress=False))
    monkeypatch.setattr(tiled_batch.hash_dropout, "apply_", apply)
    tiles = json.loads((out / "configs" / "c00" / "summary.json").read_text())["tiles"]
    # per epoch: the forward's transform pass and the backward's weight-gradient pass, 2 epochs
    assert widths.count(300) == 2 * 2 * tiles
    for cid in ("c00", "c03"):
        solo = solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{cid}")
        assert _losses(out / "configs" / cid / "metrics.jsonl") == [r["loss"] for r in solo]


def test_out_of_core_batch_tiles_hold_one_configurations_dense_work_at_a_time():
    """K configurations' tiles hold their aggregations and outputs side by side but one configuration's dense
    work at a time: four transform-first configurations (256 -> 16) plan rows far narrower than four solo rows."""
    from trellis.plan.outofcore import LayerShape, joint_shape

    solo = LayerShape(256, 16, aggregate_first=False, root=False)
    joint = joint_shape([solo] * 4, first=True)
    assert (joint.w_in, joint.w_out, joint.w_agg) == (1024, 64, 64) and not joint.aggregate_first
    assert joint.input_width == 256  # one feature array, read by all four
    assert joint.row_floats == solo.row_floats + 2 * 4 * (16 + 16) + 256
    assert solo.row_floats < joint.row_floats < 3 * solo.row_floats
    later = joint_shape([LayerShape(16, 10, aggregate_first=True, root=True)] * 4, first=False)
    assert later.w_agg == 64 and later.root and later.row_floats == later.busiest and later.input_width == 64
    # one configuration aggregating its features first: their dropped-out copy is a spill, not recomputed
    mixed = joint_shape([solo, LayerShape(256, 512, aggregate_first=True, root=False)], first=True)
    assert not mixed.aggregate_first and mixed.reads_whole_input and not solo.reads_whole_input


def test_out_of_core_batches_drop_configurations_that_stop_early(store, tmp_path):
    """Early stopping inside a shared out-of-core batch: a stopped configuration leaves the passes, the others go on
    exactly as alone."""
    grid = parse_grid(["lr=0.5,0.005"])
    out = tmp_path / "sweep"
    board = run_sweep(SweepConfig(store=store, model="gcn", grid=grid, epochs=12, patience=2, out=str(out),
                                  base={"memory_budget": "3G", "hidden": "8"}, progress=False))
    epochs = {r["config"]: r["epochs"] for r in board["rows"]}
    assert len(set(epochs.values())) == 2, epochs  # one stopped before the other
    for cid in epochs:
        solo = solo_metrics(out / "configs" / cid / "config.json", tmp_path / f"solo-{cid}")
        assert _losses(out / "configs" / cid / "metrics.jsonl") == pytest.approx([r["loss"] for r in solo], abs=1e-6)


def test_strategies_a_sweep_cannot_train_are_refused_before_anything_is_written(store, tmp_path):
    with pytest.raises(TrellisUserError, match="a sweep trains --strategy full or pp"):
        SweepConfig(store=store, grid=parse_grid(["lr=0.1"]), base={"strategy": "mini"})
