"""Search spaces: the defaults are valid for their models, files are checked key by key, draws are seeded."""

from __future__ import annotations

import json

import pytest

from trellis.errors import TrellisUserError
from trellis.train.config import TrainConfig
from trellis.train.space import DEFAULT_SPACES, candidates, load_space, parse_space, space_size
from trellis.train.tune import parse_duration, rung_epochs


@pytest.mark.parametrize("model", sorted(DEFAULT_SPACES))
def test_default_spaces_give_valid_training_configs(model):
    space = load_space("default", model)
    draws, how = candidates(space, 20, seed=0)
    assert how == "random" and len(draws) == 20
    extra = {"strategy": "pp", "pp_dir": "unused"} if model == "sign" else {}
    for params in draws:
        for name, value in params.items():
            d = space[name]
            assert value in d.choices if d.finite else d.low <= value <= d.high
        cfg = TrainConfig.from_dict({"store": "unused", "model": model, **extra, **params}, source="test")
        assert cfg.model == model


def test_draws_are_deterministic_and_distinct():
    space = load_space("default", "gcn")
    a, _ = candidates(space, 15, seed=3)
    b, _ = candidates(space, 15, seed=3)
    c, _ = candidates(space, 15, seed=4)
    assert a == b and a != c
    assert len({tuple(p.values()) for p in a}) == 15


def test_a_small_finite_space_is_enumerated():
    space = parse_space({"lr": [0.01, 0.005], "hidden": [16, 32, 64]}, "test")
    assert space_size(space) == 6
    draws, how = candidates(space, 27, seed=0)
    assert how == "grid" and len(draws) == 6
    draws, how = candidates(space, 4, seed=0)  # more points than candidates: random, without repeats
    assert how == "random" and len({tuple(p.values()) for p in draws}) == 4


@pytest.mark.parametrize(("raw", "match"), [
    ({"learning_rate": [0.01]}, "unknown hyperparameter 'learning_rate'"),
    ({"lr": []}, "lr is an empty list"),
    ({"lr": {"log_uniform": [0.01, 0.01]}}, r"lr: the range \[0.01, 0.01\] is empty"),
    ({"dropout": {"uniform": [0.8, 0.2]}}, "dropout: the range .* is empty"),
    ({"lr": {"log_uniform": [0, 0.1]}}, "log_uniform needs low > 0"),
    ({"hidden": {"uniform": [8, 64]}}, "hidden is an integer"),
    ({"optimizer": {"uniform": [0, 1]}}, "takes a list of choices"),
    ({"lr": {"normal": [0, 1]}}, "expected a list of values"),
    ({"hidden": ["wide"]}, "not an integer"),
    ([], "non-empty JSON object"),
])
def test_bad_spaces_name_the_key(raw, match):
    with pytest.raises(TrellisUserError, match=match):
        parse_space(raw, "space.json")


def test_space_files(tmp_path):
    f = tmp_path / "space.json"
    f.write_text(json.dumps({"lr": {"log_uniform": [0.001, 0.1]}, "hidden": [8, 16]}))
    assert set(load_space(str(f), "gcn")) == {"lr", "hidden"}
    with pytest.raises(TrellisUserError, match="no such file"):
        load_space(str(tmp_path / "missing.json"), "gcn")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(TrellisUserError, match="not valid JSON"):
        load_space(str(tmp_path / "bad.json"), "gcn")
    with pytest.raises(TrellisUserError, match="no default search space"):
        load_space("default", "mlp")


def test_halving_schedule():
    assert rung_epochs(27, 200, 3) == [22, 67, 200]
    assert rung_epochs(9, 200, 3) == [22, 67, 200]
    assert rung_epochs(3, 200, 3) == [67, 200]
    assert rung_epochs(27, 40, 3) == [40]  # a first rung below 20 epochs would judge too early
    assert rung_epochs(9, 24, 3, min_epochs=3) == [3, 24]
    assert rung_epochs(1, 200, 3) == [200]


def test_durations():
    assert parse_duration("20m") == 1200 and parse_duration("90s") == 90 and parse_duration("1.5h") == 5400
    assert parse_duration("2") == 120
    for bad in ("soon", "-5m", "0s"):
        with pytest.raises(TrellisUserError, match="--budget"):
            parse_duration(bad)
