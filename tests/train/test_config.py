from __future__ import annotations

import json

import pytest

from trellis.errors import TrellisUserError
from trellis.train.config import BASE_DEFAULTS, TrainConfig, load_config_file, parse_value


def test_gcn_defaults_from_paper():
    cfg = TrainConfig(store="s")
    got = (cfg.model, cfg.hidden, cfg.lr, cfg.weight_decay, cfg.dropout, cfg.epochs)
    assert got == ("gcn", 16, 0.01, 5e-4, 0.5, 200)
    assert cfg.heads == 1 and cfg.layers == 2 and cfg.optimizer == "adam"


def test_gat_defaults_and_explicit_override_wins():
    cfg = TrainConfig(store="s", model="gat")
    assert (cfg.hidden, cfg.heads, cfg.lr, cfg.dropout, cfg.patience) == (8, 8, 0.005, 0.6, 100)
    cfg = TrainConfig(store="s", model="gat", lr=0.01, heads=4)
    assert cfg.lr == 0.01 and cfg.heads == 4 and cfg.hidden == 8


def test_every_model_has_complete_defaults():
    for model in ("gcn", "sage", "gin", "gat", "gate", "mlp"):
        cfg = TrainConfig(store="s", model=model)
        for key in BASE_DEFAULTS:
            assert getattr(cfg, key) is not None


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"hidden": 0}, "--hidden"),
    ({"layers": 0}, "--layers"),
    ({"heads": 0}, "--heads"),
    ({"dropout": 1.0}, "--dropout"),
    ({"dropout": -0.1}, "--dropout"),
    ({"lr": 0.0}, "--lr"),
    ({"lr": float("nan")}, "--lr"),
    ({"weight_decay": -1.0}, "--weight-decay"),
    ({"epochs": 0}, "--epochs"),
    ({"patience": 0}, "--patience"),
    ({"eval_every": 0}, "--eval-every"),
    ({"runs": 0}, "--runs"),
    ({"seed": -1}, "--seed"),
    ({"checkpoint_every": -5}, "--checkpoint-every"),
    ({"device": "gpu"}, "--device"),
    ({"optimizer": "adamm"}, "--optimizer"),
    ({"model": "gcnn"}, "--model"),
    ({"task": "regression"}, "--task"),
    ({"metric": "aucc"}, "--metric"),
    ({"task": "multiclass", "metric": "auc"}, "--metric auc does not fit --task multiclass"),
    ({"task": "binary", "metric": "f1_micro"}, "--metric f1_micro does not fit --task binary"),
    ({"feature_norm": "l1"}, "--feature-norm"),
    ({"hidden": 1.5}, "--hidden"),
    ({"hidden": True}, "--hidden"),
    ({"json": "yes"}, "--json"),
])
def test_validation_names_the_flag(kwargs, flag):
    with pytest.raises(TrellisUserError) as exc:
        TrainConfig(store="s", **kwargs)
    assert flag in str(exc.value)
    assert "\n" not in str(exc.value)


def test_did_you_mean():
    with pytest.raises(TrellisUserError, match="did you mean 'adam'"):
        TrainConfig(store="s", optimizer="adamm")
    with pytest.raises(TrellisUserError, match="did you mean 'weight_decay'"):
        TrainConfig.from_dict({"store": "s", "weight_decy": "1"})


def test_store_required_unless_resume():
    with pytest.raises(TrellisUserError, match="STORE is required"):
        TrainConfig()
    assert TrainConfig(resume="runs/x").store is None


def test_from_dict_parses_strings_per_type():
    cfg = TrainConfig.from_dict({"store": "s", "hidden": "32", "lr": "1e-3", "json": "true", "metric": "none",
                                 "optimizer_args": '{"betas": [0.8, 0.99]}', "weight-decay": 0})
    assert cfg.hidden == 32 and cfg.lr == 1e-3 and cfg.json is True and cfg.metric is None
    assert cfg.optimizer_args == {"betas": [0.8, 0.99]}
    assert cfg.weight_decay == 0.0 and isinstance(cfg.weight_decay, float)


@pytest.mark.parametrize(("name", "text", "flag"), [
    ("hidden", "abc", "--hidden must be an integer"),
    ("lr", "fast", "--lr must be a number"),
    ("json", "maybe", "--json must be true or false"),
    ("model_args", "[1]", "--model-args must be a JSON object"),
])
def test_parse_errors(name, text, flag):
    with pytest.raises(TrellisUserError, match=flag):
        parse_value(name, text)


def test_round_trip_and_session_fields_not_persisted():
    cfg = TrainConfig(store="s", model="gat", runs=3, json=True, explain=True)
    d = cfg.to_dict()
    assert "json" not in d and "explain" not in d and "resume" not in d
    assert TrainConfig.from_dict(json.loads(json.dumps(d))) == TrainConfig(store="s", model="gat", runs=3)


def test_config_files(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"store": "s", "lr": 0.02}))
    (tmp_path / "c.toml").write_text('store = "s"\nmodel = "gat"\nhidden = 4\n')
    assert load_config_file(tmp_path / "c.json") == {"store": "s", "lr": 0.02}
    assert TrainConfig.from_dict(load_config_file(tmp_path / "c.toml")).hidden == 4
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(TrellisUserError, match="not valid JSON"):
        load_config_file(tmp_path / "bad.json")
    with pytest.raises(TrellisUserError, match="no such file"):
        load_config_file(tmp_path / "missing.json")


def test_no_shared_mutable_defaults():
    a, b = TrainConfig(store="s"), TrainConfig(store="s")
    a.model_args["x"] = 1
    assert b.model_args == {}


def test_unknown_strategy_is_refused_by_the_registry(tmp_path):
    from trellis.train.trainer import Trainer

    cfg = TrainConfig(store=str(tmp_path / "missing"), strategy="minibatch", out=str(tmp_path / "run"))
    with pytest.raises(TrellisUserError, match=r"unknown --strategy 'minibatch'; choose one of full, mini"):
        Trainer(cfg).fit()
    assert not (tmp_path / "run").exists()


def test_seeds_beyond_64_bits_are_refused_by_name():
    """torch's generators unpack a signed 64-bit seed: 2**64 was a raw OverflowError from the first run's seeding."""
    with pytest.raises(TrellisUserError, match="--seed must be at most 9223372036854775807 with --runs 1"):
        TrainConfig(store="s", seed=2**64)
    with pytest.raises(TrellisUserError, match="--seed must be at most 9223372036854775806 with --runs 2"):
        TrainConfig(store="s", seed=2**63 - 1, runs=2)
    TrainConfig(store="s", seed=2**63 - 1)


@pytest.mark.parametrize("option", [{"hidden": 64}, {"layers": 3}, {"dropout": 0.2}])
def test_sgc_refuses_the_options_it_would_ignore(option):
    """SGC is one linear layer over the cache's last hop: --hidden 64 trained the same model as without it."""
    with pytest.raises(TrellisUserError, match=f"--{next(iter(option))} does nothing for --model sgc"):
        TrainConfig(store="s", strategy="pp", pp_dir="p", model="sgc", **option)
    TrainConfig(store="s", strategy="pp", pp_dir="p", model="sgc", hidden=256)  # its own default, given: fine
