"""Typed per-strategy options: definitions, rules, nesting, and the CLI generated from them."""

from __future__ import annotations

import dataclasses

import pytest

import trellis
from trellis.cli.main import main
from trellis.errors import TrellisUserError
from trellis.train.config import TrainConfig, load_config_file
from trellis.train.options import OPTIONS, ClusterOptions, FullOptions, MiniOptions, PPOptions, option_fields


def test_the_typed_view_holds_the_strategy_options_and_only_them():
    cfg = TrainConfig(store="s", strategy="mini", model="sage", fanouts="10,5", labor=True, prefetch=0)
    opts = cfg.options
    assert isinstance(opts, MiniOptions)
    assert (opts.fanouts, opts.labor, opts.prefetch, opts.batch_size) == ("10,5", True, 0, 1024)
    assert not hasattr(opts, "clusters") and not hasattr(opts, "pp_dir")
    assert isinstance(TrainConfig(store="s").options, FullOptions)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.labor = False  # type: ignore[misc]


def test_every_strategy_option_is_a_config_field_with_the_options_default():
    cfg_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name, f in option_fields().items():
        assert name in cfg_fields, name
        assert cfg_fields[name].default == f.default and cfg_fields[name].metadata["help"] == f.metadata["help"]
    # each strategy's flags are exactly its dataclass's fields
    assert {f.name for f in dataclasses.fields(ClusterOptions)} >= {"clusters", "prefetch", "parts_dir"}
    assert "batch_size" in PPOptions.names() and "batch_size" not in FullOptions.names()


def test_the_library_takes_an_options_object_and_flattens_it():
    cfg = TrainConfig.from_dict({"store": "s", "model": "sage", "strategy": MiniOptions(fanouts=[10, 5], labor=True)})
    assert (cfg.strategy, cfg.fanouts, cfg.labor) == ("mini", "10,5", True)
    assert cfg == TrainConfig(store="s", model="sage", strategy="mini", fanouts="10,5", labor=True)
    with pytest.raises(TrellisUserError, match="--fanouts is given both in MiniOptions"):
        TrainConfig.from_dict({"store": "s", "model": "sage", "strategy": MiniOptions(fanouts="5,5"),
                               "fanouts": "10,5"})


def test_a_config_file_may_nest_a_strategy_table(tmp_path):
    good = tmp_path / "c.toml"
    good.write_text('model = "sage"\nstrategy = "mini"\n[mini]\nfanouts = "10,5"\nbatch-size = 256\n')
    cfg = TrainConfig.from_dict({"store": "s", **load_config_file(good)})
    assert (cfg.fanouts, cfg.batch_size) == ("10,5", 256)
    wrong = tmp_path / "w.toml"
    wrong.write_text('strategy = "full"\n[mini]\nfanouts = "10,5"\n')
    with pytest.raises(TrellisUserError, match="options for --strategy mini given, but the strategy is 'full'"):
        load_config_file(wrong)
    typo = tmp_path / "t.toml"
    typo.write_text('strategy = "cluster"\n[cluster]\nclusterz = 8\n')
    with pytest.raises(TrellisUserError, match=r"\[cluster\] has no option 'clusterz'; did you mean 'clusters'"):
        load_config_file(typo)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"strategy": "cluster", "clusters": 4, "clusters_per_batch": 8}, "--clusters-per-batch 8 exceeds --clusters 4"),
    ({"strategy": "cluster", "parts_dir": "p", "nproc": 1, "clusters": 8}, "--clusters does not apply with "
                                                                           "--parts-dir"),
    ({"strategy": "mini", "buffer_parts": 2}, "--buffer-parts applies to --strategy mini with --parts-dir"),
    ({"strategy": "mini", "parts_dir": "p", "samplers": 2}, "--samplers with --parts-dir"),
    ({"strategy": "mini", "buffer_parts": 0, "parts_dir": "p"}, "--buffer-parts must be an integer >= 1"),
    ({"strategy": "full", "staleness": 1}, "--staleness applies to distributed runs only"),
    ({"strategy": "full", "nproc": 2}, "--nproc needs --parts-dir"),
    ({"strategy": "pp", "model": "sgc"}, "--strategy pp needs --pp-dir"),
    ({"strategy": "pp", "model": "sgc", "pp_dir": "d", "pp_loader": "chunky"}, "did you mean 'chunk'"),
    ({"strategy": "full", "labor": True}, "--labor does not apply to --strategy full; it applies to --strategy mini"),
    ({"strategy": "full", "memory_budget": "lots"}, "--memory-budget"),
    ({"strategy": "pp", "model": "sgc", "pp_dir": "d", "timeout": 30}, "--timeout applies to pp with --nproc"),
])
def test_each_strategy_validates_its_own_options(kwargs, message):
    with pytest.raises(TrellisUserError, match=message):
        TrainConfig(store="s", **kwargs)


def test_the_python_error_is_the_cli_error(tmp_path, capsys):
    with pytest.raises(TrellisUserError) as exc:
        trellis.train(str(tmp_path), strategy=ClusterOptions(clusters=2, clusters_per_batch=3))
    assert main(["train", str(tmp_path), "--strategy", "cluster", "--clusters", "2", "--clusters-per-batch",
                 "3"]) == 2
    assert str(exc.value) in capsys.readouterr().err


def test_help_lists_options_under_their_strategies(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for title in ("options of --strategy full", "options of --strategy mini and cluster",
                  "options of --strategy pp"):
        assert title in out
    mini = out.index("options of --strategy mini:")
    assert out.index("--labor", mini) > mini and set(OPTIONS) == {"full", "mini", "cluster", "pp"}
