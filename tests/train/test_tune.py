"""``trellis tune``: halving on validation only, the final report, exact replay, resume after SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train.stubmodel import make_sbm_store
from trellis.cli.main import main
from trellis.errors import TrellisUserError
from trellis.train import tune as tune_mod
from trellis.train.strategies import full as full_mod
from trellis.train.tune import TuneConfig, run_tune

ARGS = ["--candidates", "9", "--epochs", "24", "--min-epochs", "3", "--patience", "30", "--seeds", "2",
        "--batch-models", "3", "--no-progress"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return str(make_sbm_store(tmp_path_factory.mktemp("tune") / "sbm", n=300, features=8))


def _rows(board):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in board["rows"]]


def test_search_never_reads_the_test_split(store, tmp_path, monkeypatch):
    seen: list[tuple[str, bool]] = []
    real_eval, real_final = full_mod.evaluate_logits, tune_mod.Tune.final_runs
    state = {"final": False}

    def spy_eval(task, logits, y, splits):
        seen.append((",".join(sorted(splits)), state["final"]))
        return real_eval(task, logits, y, splits)

    def spy_final(self, best):
        state["final"] = True
        return real_final(self, best)

    monkeypatch.setattr(full_mod, "evaluate_logits", spy_eval)
    monkeypatch.setattr(tune_mod.Tune, "final_runs", spy_final)
    tc = TuneConfig(store=store, candidates=9, epochs=24, min_epochs=3, patience=30, seeds=2, batch_models=3,
                    out=str(tmp_path / "t"), progress=False)
    board = run_tune(tc)
    search = [s for s, final in seen if not final]
    assert search and set(search) == {"train,val"}  # every search evaluation, and none with test
    assert {s for s, final in seen if final} == {"test,train,val"}
    for r in board["rows"]:
        assert not any(k.startswith("test") for k in r)
        recs = [json.loads(line) for line in open(tmp_path / "t" / "configs" / r["config"] / "metrics.jsonl")]
        assert recs and not any(k.startswith("test") for rec in recs for k in rec)
    # the schedule: 9 candidates for 3 epochs, the best third for 24
    assert [(s["candidates"], s["kept"], s["epochs"]) for s in board["schedule"]] == [(9, 3, 3), (3, 3, 24)]
    assert sum(r["epochs"] == 24 or r["stopped"] == "patience" for r in board["rows"]) >= 3
    # the playoff: the finalists retrained with fresh seeds, train and validation only (the spy above), and
    # the choice is the best mean of those runs, ties to the cheaper configuration
    finalists = [r for r in board["rows"] if r["rung"] == 1]
    assert sorted(p["config"] for p in board["playoff"]) == sorted(r["config"] for r in finalists)
    hidden = {r["config"]: r["hidden"] for r in board["rows"]}
    for p in board["playoff"]:
        assert len(p["val_runs"]) == 3 and p["val_mean"] == pytest.approx(sum(p["val_runs"]) / 3)
        for k, v in enumerate(p["val_runs"]):
            run = tmp_path / "t" / "playoff" / "configs" / f"{p['config']}-p{k}"
            assert json.loads((run / "config.json").read_text())["seed"] == k + 1  # fresh: the search's was 0
            recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
            assert max(rec["val_acc"] for rec in recs) == v and not any("test_acc" in rec for rec in recs)
    best = max(board["playoff"], key=lambda p: (p["val_mean"], -hidden[p["config"]]))
    assert board["best"]["config"] == best["config"] == board["playoff"][0]["config"]
    report = (tmp_path / "t" / "report.md").read_text()
    second = board["playoff"][1]
    assert f"The playoff's runner-up ({second['config']}) averaged {100 * second['val_mean']:.2f}" in report
    assert len(board["final"]) == 2 and all(f["test_acc"] is not None for f in board["final"])
    for name in ("leaderboard.csv", "leaderboard.json", "leaderboard.png", "report.md", "best/config.json"):
        assert (tmp_path / "t" / name).is_file()
    assert "test acc" in (tmp_path / "t" / "report.md").read_text()


def test_without_a_playoff_the_choice_is_the_searchs_best_run(store, tmp_path):
    tc = TuneConfig(store=store, candidates=9, epochs=24, min_epochs=3, patience=30, seeds=1, batch_models=3,
                    playoff=1, out=str(tmp_path / "t"), progress=False)
    board = run_tune(tc)
    finalists = [r for r in board["rows"] if r["rung"] == 1]
    best = max(finalists, key=lambda r: (r["val_acc"], -r["cost"][1]))
    assert board["playoff"] == [] and board["best"]["config"] == best["config"] == board["rows"][0]["config"]
    assert not (tmp_path / "t" / "playoff").exists()
    assert "The top five candidates scored" in (tmp_path / "t" / "report.md").read_text()


def test_the_playoff_takes_the_best_trained_finalists_the_budget_pays_for():
    from types import SimpleNamespace as NS

    # 2 playoff seeds; final runs: 1 split x 1 seed at --epochs 20 (each finalist trained 20 epochs)
    tune = NS(tc=NS(playoff=3, playoff_seeds=2, seeds=1), max_epochs=20, split_seeds=[None])
    tune._final_of = lambda s: tune_mod.Tune._final_of(tune, s)
    finalists = [NS(name=n, epochs=e, time_s=t) for n, e, t in
                 [("a", 20, 5.0), ("untrained", 0, 0.0), ("b", 20, 4.0), ("c", 20, 6.0), ("d", 20, 1.0)]]

    def pick(left):
        return [f.name for f in tune_mod.Tune._contenders(tune, finalists, left)]

    assert pick(None) == ["a", "b", "c"]  # --playoff 3 of those that trained, in rank order
    # playoff 2 x (5 + 4 + 6) s, then the final runs of the dearest contender (c, 6 s): any of them may win
    assert pick(36.0) == ["a", "b", "c"]
    # c does not fit (2 x (5 + 4 + 6) + 6 > 35.9): passed over, and d, cheaper, takes its place
    assert pick(35.9) == ["a", "b", "d"]  # 2 x (5 + 4 + 1) + 5
    assert pick(22.9) == ["a", "d"]  # 2 x (5 + 1) + 5: b (2 x 9 + 5) and c do not fit
    assert pick(16.9) == []  # fewer than two fit: nothing to choose between


def test_time_the_playoff_leaves_races_the_finalists_within_noise_of_the_leader():
    from types import SimpleNamespace as NS

    # 2 playoff seeds; final runs: 1 split x 1 seed at --epochs 20 (each finalist trained 20 epochs)
    tune = NS(tc=NS(playoff=5, playoff_seeds=2, seeds=1), max_epochs=20, split_seeds=[None], run_s={})
    tune._final_of = lambda s: tune_mod.Tune._final_of(tune, s)

    def state(i, time_s, hidden=16):
        return NS(entry=NS(id=i, cfg=NS(layers=2, hidden=hidden, heads=1)), epochs=20, time_s=time_s)

    top = [state("a", 5.0), state("b", 4.0), state("c", 6.0), state("d", 1.0)]
    # pooled within-configuration variance: 4 x 2 x 0.01^2 / 4 = 2e-4; s.e. of a difference of 2-run
    # means: sqrt(2e-4 x (1/2 + 1/2)) = 0.0141, so "close" means at most 0.0283 behind the leader
    runs = {"a": [0.80, 0.82], "b": [0.83, 0.85], "c": [0.78, 0.80], "d": [0.60, 0.62]}

    def race(left, r=runs):
        return [f.entry.id for f in tune_mod.Tune._race(tune, top, r, left)]

    # b leads (0.84); a is 0.03 behind, past 0.0283: only the leader is left, nothing to race
    assert race(1000.0) == []
    runs2 = {**runs, "a": [0.81, 0.83]}  # 0.02 behind b: within noise; c (0.05) and d are not
    assert race(1000.0, runs2) == ["b", "a"]  # leader first, then the close ones by mean
    # the round is priced as the playoff's: 2 x (4 + 5) s, then the dearest's final runs (a, 5 s)
    assert race(23.0, runs2) == ["b", "a"]
    assert race(22.9, runs2) == []  # the round does not fit: the race ends
    # more runs narrow the standard error: a third run at each mean (pooled variance 1e-4, s.e. 0.0082) and
    # a's 0.02 is more than two standard errors behind
    assert race(1000.0, {k: [*v, sum(v) / 2] for k, v in runs2.items()}) == []
    assert race(1000.0, {k: [v[0]] for k, v in runs2.items()}) == []  # one run each: no variance to judge by
    # all the close finalists or none: 2 x (4 + 5 + 6) s, then c's 6 s of final runs
    runs3 = {"a": [0.81, 0.83], "b": [0.83, 0.85], "c": [0.81, 0.83], "d": [0.60, 0.62]}
    assert race(36.0, runs3) == ["b", "a", "c"] and race(35.9, runs3) == []  # not a and b alone
    # a round is priced at each finalist's longest run so far (b's playoff runs took 30 s)
    tune.run_s = {"b": 30.0}
    assert race(1000.0, runs3) == ["b", "a", "c"] and race(87.9, runs3) == []  # 2 x (30 + 5 + 6) + 6
    # only those still in the race are compared (b raced out stays out: a leads a and c); the variance is
    # pooled over every finalist's runs
    assert [f.entry.id for f in tune_mod.Tune._race(tune, [top[0], top[2]], runs3, 1000.0)] == ["a", "c"]


def test_the_playoff_races_rounds_until_the_choice_is_clear_or_the_budget_is_spent(monkeypatch):
    from types import SimpleNamespace as NS

    # 2 playoff seeds; final runs: 1 split x 1 seed at --epochs 20 (each finalist trained 20 epochs): a
    # finalist's final runs cost its search run's time, its playoff round twice that
    tune = NS(tc=NS(playoff=3, playoff_seeds=2, seeds=1), max_epochs=20, split_seeds=[None], run_s={})
    for name in ("_final_of", "_contenders", "_race"):
        setattr(tune, name, getattr(tune_mod.Tune, name).__get__(tune))

    def state(i, time_s):
        return NS(entry=NS(id=i, cfg=NS(layers=2, hidden=16, heads=1)), epochs=20, time_s=time_s,
                  stopper=NS(best_value=0.9))

    finalists = [state("dear", 40.0), state("a", 5.0), state("b", 4.0), state("c", 1.0)]
    # each round's two runs per finalist: a stays within noise of b for two rounds, then falls clearly behind
    scores = {"a": [[0.80, 0.84], [0.81, 0.83], [0.76, 0.78]], "b": [[0.82, 0.84]] * 3, "c": [[0.50, 0.52]] * 3,
              "dear": [[0.30, 0.32]] * 3}
    clock = {"t": 0.0}
    monkeypatch.setattr(tune_mod, "time", NS(perf_counter=lambda: clock["t"]))
    rounds: list[list[str]] = []

    def fake_round(top, k, runs):  # a round takes what it is priced at
        rounds.append([f.entry.id for f in top])
        clock["t"] += sum(2 * f.time_s for f in top)
        for f in top:
            runs[f.entry.id] += scores[f.entry.id][k]

    tune._playoff_round = fake_round
    # 100 s: dear (2 x 40 s, then its 40 s of final runs) does not fit beside a and b: c takes its place
    best, rows = tune_mod.Tune.playoff(tune, finalists, 100.0)
    assert rounds[0] == ["a", "b", "c"] and tune.playoff_skipped == ["dear"]
    # 80 s left: b leads, a is within two standard errors, c is not: b and a race (2 x 9 s + a's 5 s of final
    # runs); after round 2 a is still close; after round 3 it is clearly behind, and the race ends
    assert rounds[1:] == [["b", "a"], ["b", "a"]] and tune.playoff_rounds == 3
    assert best.id == "b" and [r["config"] for r in rows] == ["b", "a", "c"]
    assert [len(r["val_runs"]) for r in rows] == [6, 6, 2] and [r["raced_out"] for r in rows] == [False] * 2 + [True]
    assert rows[1]["val_mean"] == pytest.approx((0.80 + 0.84 + 0.81 + 0.83 + 0.76 + 0.78) / 6)
    # 35 s: the first round (20 s) leaves 15 s, which does not pay for a race round (23 s)
    rounds.clear()
    tune_mod.Tune.playoff(tune, finalists, 35.0)
    assert rounds == [["a", "b", "c"]] and tune.playoff_rounds == 1
    # without a budget: one round (the tune is deterministic from its settings), dear included
    rounds.clear()
    tune_mod.Tune.playoff(tune, finalists, None)
    assert rounds == [["dear", "a", "b"]] and tune.playoff_rounds == 1 and tune.playoff_skipped == []


def test_a_further_bracket_starts_only_when_the_playoff_keeps_its_contenders():
    from types import SimpleNamespace as NS

    tune = NS(tc=NS(playoff=3, playoff_seeds=2, seeds=1), max_epochs=20, split_seeds=[None])
    tune._final_of = lambda s: tune_mod.Tune._final_of(tune, s)
    tune._contenders = lambda f, left: tune_mod.Tune._contenders(tune, f, left)
    state = {n: NS(entry=NS(id=n), epochs=20, time_s=t) for n, t in
             [("a", 5.0), ("b", 4.0), ("c", 6.0), ("d", 1.0), ("dear", 50.0)]}

    def room(names, left, bracket=10.0, final=5.0):
        return tune_mod.Tune._room_for_bracket(tune, [state[n] for n in names], left, bracket, final)

    assert room("abcd", 100.0)  # a, b, c before and after
    # 40 s pay for a, b, c (2 x 15 + 6); after a 10-s bracket c no longer fits: stop the search here
    assert not room("abcd", 40.0)
    # a dear finalist the playoff passes over now and after does not block the bracket (it did: 400 s unspent)
    assert room(["a", "dear", "b", "d"], 60.0)
    assert not room("abcd", 14.9)  # the final runs no longer fit after the bracket
    assert room("a", 15.0)  # one finalist, no playoff: only the final runs are reserved


def test_a_candidate_whose_final_runs_the_budget_cannot_pay_for_neither_sets_the_deadline_nor_is_chosen():
    from types import SimpleNamespace as NS

    # final runs: 1 split x 1 seed at --epochs 20; each candidate measured over 10 epochs
    tune = NS(tc=NS(budget_s=100.0, seeds=1), max_epochs=20, split_seeds=[None])
    for name in ("_final_of", "_affordable", "by_price"):
        setattr(tune, name, getattr(tune_mod.Tune, name).__get__(tune))

    def state(i, value, time_s, epochs=10):
        cfg = NS(layers=2, hidden=16, heads=1)
        return NS(stopper=NS(best_value=value, best_val_loss=0.5), entry=NS(id=i, cfg=cfg, params={}),
                  epochs=epochs, time_s=time_s)

    dear, cheap, mid, untrained = state("dear", 0.9, 60.0), state("cheap", 0.7, 1.0), state("mid", 0.8, 10.0), \
        state("new", 0.0, 0.0, epochs=0)
    ranked = tune_mod.rank_states([cheap, dear, untrained, mid])
    # dear's final runs take 120 s (6 s/epoch x 20): more than 100 s left, so it goes behind mid and cheap
    assert [s.entry.id for s in tune.by_price(ranked, 100.0)] == ["mid", "cheap", "dear", "new"]
    assert [s.entry.id for s in tune.by_price(ranked, 120.0)] == ["dear", "mid", "cheap", "new"]
    assert tune.by_price(ranked, None) == ranked  # no budget: validation alone

    tune.progress = {"active": ["dear", "cheap", "mid", "new"], "finalists": []}
    tune.states = {s.entry.id: s for s in (dear, cheap, mid, untrained)}
    tune._final_estimate = tune_mod.Tune._final_estimate.__get__(tune)
    assert tune._final_estimate(100.0) == 20.0  # mid's final runs: 1 s/epoch x 20 (it was dear's 120 s)
    # first among the candidates whose final runs take at most half the budget (50 s): with mid's at 60 s
    # (within the 100 s left), cheap's 2 s set the deadline, not mid's (a 20-minute tune stopped in rung 0)
    mid.time_s = 30.0
    assert tune._final_estimate(100.0) == 2.0 and tune._final_estimate(55.0) == 2.0
    tune.states = {"mid": mid}
    assert tune._final_estimate(100.0) == 60.0  # none within half: the best that the time left pays for
    mid.time_s = 10.0
    tune.states = {"dear": dear}
    # the only measured candidate is too dear: no reservation yet (the search stopped here before)
    assert tune._final_estimate(100.0) == 0.0
    tune.states = {}
    assert tune._final_estimate(100.0) is None


def test_ties_go_to_the_cheaper_configuration():
    from types import SimpleNamespace as NS

    def state(i, value, hidden, loss=0.5):
        cfg = NS(layers=2, hidden=hidden, heads=1)
        return NS(stopper=NS(best_value=value, best_val_loss=loss), entry=NS(id=i, cfg=cfg, params={}))

    ranked = tune_mod.rank_states([state("a", 0.9, 256), state("b", 0.9, 16, loss=0.9), state("c", 0.8, 8)])
    assert [s.entry.id for s in ranked] == ["b", "a", "c"]


def test_best_config_replays_its_reported_test_accuracy(store, tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["tune", store, *ARGS, "--out", str(out), "--json"]) == 0
    board = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    first = board["final"][0]
    assert first["run"] == "s0-r0"
    assert main(["train", "--config", str(out / "best" / "config.json"), "--out", str(tmp_path / "replay"),
                 "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["test_acc"] == [first["test_acc"]] and summary["val_acc"] == [first["val_acc"]]


def test_gat_tunes_one_candidate_at_a_time(store, tmp_path):
    tc = TuneConfig(store=store, model="gat", grid=["lr=0.01,0.005", "hidden=4"], epochs=4, seeds=1,
                    out=str(tmp_path / "g"), progress=False, base={"heads": "2"})
    board = run_tune(tc)
    assert board["candidates"] == 2 and len(board["final"]) == 1
    assert all(len(b) == 1 for s in board["schedule"] for b in s["batches"])


def test_resume_after_sigterm_gives_the_same_leaderboard(store, tmp_path, one_thread):
    # The plain stack's space: its kernels give the same bits on any thread count, so the in-process reference
    # and the killed 1-thread subprocess agree bit for bit. (Layer norm's parameter gradients are sums over rows
    # split by torch's thread pool: with it, exact resume holds on the same number of threads, docs/api.md.)
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"lr": {"log_uniform": [0.002, 0.05]}, "weight_decay": {"log_uniform": [1e-6, 1e-3]},
                                 "hidden": [32, 64, 128, 256], "dropout": {"uniform": [0.1, 0.8]}}))
    args = [*ARGS, "--space", str(space)]
    ref = tmp_path / "ref"
    assert main(["tune", store, *args, "--out", str(ref)]) == 0
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "trellis.cli", "tune", store, *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list((out / "state").glob("*.pt")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert f"trellis tune --resume {out}" in err
    assert not (out / "leaderboard.json").exists()
    assert main(["tune", "--resume", str(out), "--no-progress"]) == 0
    a = json.loads((ref / "leaderboard.json").read_text())
    b = json.loads((out / "leaderboard.json").read_text())
    assert _rows(a) == _rows(b)
    assert [{k: v for k, v in f.items() if k != "time_s"} for f in a["final"]] == \
        [{k: v for k, v in f.items() if k != "time_s"} for f in b["final"]]
    for r in a["rows"]:  # the candidates' logs hold each epoch once
        recs = [json.loads(x) for x in open(out / "configs" / r["config"] / "metrics.jsonl")]
        assert [x["epoch"] for x in recs] == list(range(r["epochs"]))


def test_split_seed_redraws_the_importers_split(data_dir, tmp_path):
    from trellis.data.importers import import_graph
    from trellis.data.store import open_store
    from trellis.train.data import redraw_split

    src = data_dir / "cora-npz"
    s0 = open_store(import_graph(src, tmp_path / "s0", format="npz", progress=False))
    s1 = open_store(import_graph(src, tmp_path / "s1", format="npz", split_seed=1, progress=False))
    y = np.asarray(s0.y)
    for name, ids in redraw_split(s0, y, 1).items():
        assert np.array_equal(np.sort(ids), np.sort(np.asarray(s1.split(name))))
    for name, ids in redraw_split(s0, y, 0).items():
        assert np.array_equal(np.sort(ids), np.sort(np.asarray(s0.split(name))))


def test_split_seed_is_refused_without_the_protocol(store, tmp_path, capsys):
    rc = main(["train", store, "--split-seed", "1", "--epochs", "1", "--out", str(tmp_path / "r"), "--no-progress"])
    assert rc == 2 and "does not record a per-class split protocol" in capsys.readouterr().err
    assert not Path(tmp_path / "r").exists()


def _fixed_split_store(tmp_path, splits=4):
    """A store imported from a file laid out like Platonov et al.'s (``[S, N]`` masks, a split per row)."""
    from trellis.data.importers import import_graph
    from trellis.data.store import open_store

    sbm = open_store(make_sbm_store(tmp_path / "sbm", n=300, features=8))
    n, rng = sbm.num_nodes, np.random.default_rng(0)
    masks = {k: np.zeros((splits, n), bool) for k in ("train", "val", "test")}
    for s in range(splits):
        order = rng.permutation(n)
        for k, part in zip(masks, np.split(order, [n // 2, 3 * n // 4]), strict=True):
            masks[k][s, part] = True
    dst = np.repeat(np.arange(n), np.diff(np.asarray(sbm.indptr)))
    np.savez(tmp_path / "f.npz", node_features=np.asarray(sbm.x), node_labels=np.asarray(sbm.y),
             edges=np.stack([np.asarray(sbm.indices), dst], axis=1), **{f"{k}_masks": m for k, m in masks.items()})
    return open_store(import_graph(tmp_path / "f.npz", tmp_path / "store", progress=False)), masks


def test_split_seed_picks_a_stores_fixed_split(tmp_path, capsys):
    from trellis.train.data import load_labels

    store, masks = _fixed_split_store(tmp_path)
    for k in (None, 0, 2, 3):
        _, ids, _ = load_labels(store, "auto", torch.device("cpu"), k)
        for name, m in masks.items():
            np.testing.assert_array_equal(ids[name].numpy(), np.flatnonzero(m[k or 0]))
    rc = main(["train", str(store.path), "--split-seed", "4", "--epochs", "1", "--out", str(tmp_path / "r"),
               "--no-progress"])
    assert rc == 2 and "holds 4 fixed splits; give a split number from 0 to 3" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_final_runs_take_the_stores_fixed_splits(tmp_path):
    store, _ = _fixed_split_store(tmp_path)
    tc = TuneConfig(store=str(store.path), candidates=2, epochs=4, min_epochs=2, patience=30, seeds=1,
                    batch_models=2, splits=3, playoff=1, out=str(tmp_path / "t"), progress=False)
    board = run_tune(tc)
    assert board["split_seeds"] == [None, 1, 2]
    assert sorted({r["split"] for r in board["final"]}) == [0, 1, 2]
    again = run_tune(TuneConfig(**{**tc.__dict__, "splits": 1, "out": str(tmp_path / "t1")}))
    # split 0 of the final runs is the store's own: the same run in both tunes
    first = [r for r in board["final"] if r["split"] == 0]
    assert [r["test_acc"] for r in first] == [r["test_acc"] for r in again["final"]]
    with pytest.raises(TrellisUserError, match="holds 4 fixed splits; give --splits 4 or fewer"):
        run_tune(TuneConfig(**{**tc.__dict__, "splits": 5, "out": str(tmp_path / "t5")}))


def test_a_budget_that_cuts_before_some_candidates_trained_reports_the_rest(store, tmp_path):
    """Candidates the deadline left untrained have no validation value: the report ranks only the others."""
    tc = TuneConfig(store=store, candidates=9, epochs=24, min_epochs=3, patience=30, seeds=1, batch_models=1,
                    budget_s=0.05, out=str(tmp_path / "t"), progress=False)
    board = run_tune(tc)
    assert board["rows"] and all(r["val_acc"] is not None for r in board["rows"])
    assert len(board["rows"]) < 9 and board["cut"] is not None
    report = (tmp_path / "t" / "report.md").read_text()
    assert "test acc" in report and "one split: --splits 1, or the store has no other" in report
    # a 20-s tune ran 53 s without saying why: its final runs alone outlast the budget
    assert board["final_time_s"] > 0.05 and "The final runs alone took longer than the whole budget" in report


def test_a_budget_left_after_the_schedule_buys_more_brackets(store, tmp_path):
    """The schedule ends early on a small graph: the rest of --budget runs brackets of fresh candidates."""
    tc = TuneConfig(store=store, candidates=4, epochs=6, min_epochs=2, patience=30, seeds=1, batch_models=4,
                    budget_s=12.0, out=str(tmp_path / "t"), progress=False)
    board = run_tune(tc)
    brackets = {r["bracket"] for r in board["schedule"]}
    assert len(brackets) >= 2 and board["candidates"] > 4
    assert board["wall_time_s"] > 0.4 * 12.0  # the budget is spent, not only capped
    assert board["wall_time_s"] < 12.0 * 1.5
    ids = [r["config"] for r in board["rows"]]
    assert any(i.startswith("b1c") for i in ids) and len(set(ids)) == len(ids)
    report = (tmp_path / "t" / "report.md").read_text()
    assert "more bracket(s) of fresh candidates" in report
    first = [r for r in board["schedule"] if r["bracket"] == 0]
    assert report.count("→") == len(first) - 1  # the schedule once, not once per bracket


def test_sign_tunes_over_a_preprocessed_cache_and_its_choice_replays(store, tmp_path, capsys):
    """``--set strategy=pp``: candidates share each batch's rows in the search; the final runs (the cache keeps
    its one split) replay exactly through ``trellis train --config``."""
    from trellis.loader.ppcache import preprocess

    pp = tmp_path / "pp"
    preprocess(store, pp, hops=2)
    out = tmp_path / "t"
    assert main(["tune", store, "--model", "sign", "--grid", "lr=0.01,0.003", "dropout=0,0.5", "--epochs", "8",
                 "--min-epochs", "4", "--seeds", "2", "--no-progress", "--json", "--out", str(out),
                 "--set", "strategy=pp", f"pp_dir={pp}", "batch_size=64", "hidden=16"]) == 0
    board = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert board["candidates"] == 4 and len(board["final"]) == 2
    first_rung = board["schedule"][0]
    assert first_rung["candidates"] == 4 and [len(b) for b in first_rung["batches"]] == [4]
    recs = [json.loads(line) for line in open(out / "configs" / "c000" / "metrics.jsonl")]
    assert recs[0]["batch_size"] == 4 and not any(k.startswith("test") for k in recs[0])
    first = board["final"][0]
    assert main(["train", "--config", str(out / "best" / "config.json"), "--out", str(tmp_path / "replay"),
                 "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["test_acc"] == [first["test_acc"]] and summary["val_acc"] == [first["val_acc"]]


def test_a_space_value_no_run_takes_is_refused_before_anything_trains(store, tmp_path, capsys):
    """dropout uniform in [0.1, 1.0005] was accepted; a later bracket's draw reached 1.0 and the tune exited 2 after
    brackets of work, its state left behind (and its resume failed on the same draw)."""
    for space, message in (({"dropout": {"uniform": [0.1, 1.0005]}}, "the range [0.1, 1.0005] reaches 1.0005"),
                           ({"hidden": {"int_uniform": [0, 64]}}, "the range [0, 64] reaches 0")):
        (tmp_path / "s.json").write_text(json.dumps(space))
        rc = main(["tune", store, "--model", "gcn", "--space", str(tmp_path / "s.json"), "--candidates", "1",
                   "--budget", "20s", "--out", str(tmp_path / "t")])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "which no run takes" in err, err
        assert not (tmp_path / "t").exists()


def test_the_default_space_under_a_memory_budget_holds_what_tiles_train(store):
    """Its residual and layer-norm candidates were refused under --memory-budget, naming flags never given."""
    from trellis.train.tune import TuneConfig

    plain = TuneConfig(store=store, model="gcn", out="x").search_space()
    budgeted = TuneConfig(store=store, model="gcn", out="x", base={"memory_budget": "2G"}).search_space()
    assert {"residual", "norm"} <= set(plain) and not {"residual", "norm"} & set(budgeted)
    assert set(budgeted) == set(plain) - {"residual", "norm"}


def test_a_candidate_refused_by_its_run_leaves_no_tune_directory(store, tmp_path, capsys):
    rc = main(["tune", store, "--model", "gcn", "--grid", "residual=true,false", "--memory-budget", "2G",
               "--budget", "20s", "--out", str(tmp_path / "t")])
    assert rc == 2 and "cannot train under --memory-budget" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()  # tune.json and state/ were left behind


def test_a_tune_records_absolute_paths_and_a_finished_one_is_not_resumed(store, tmp_path, monkeypatch, capsys):
    """tune --resume from another directory did not find a store named relative; --resume of a finished tune ran
    its playoff and final runs again and replaced its wall time."""
    monkeypatch.chdir(tmp_path)
    rel = os.path.relpath(store, tmp_path)
    assert main(["tune", rel, "--grid", "lr=0.01,0.02", "--epochs", "2", "--seeds", "1", "--out", "t"]) == 0
    settings = json.loads((tmp_path / "t" / "tune.json").read_text())["settings"]
    assert settings["store"] == str(Path(store).resolve()) and Path(settings["out"]).is_absolute()
    capsys.readouterr()
    monkeypatch.chdir("/")
    assert main(["tune", "--resume", str(tmp_path / "t")]) == 2
    assert "the tune has finished" in capsys.readouterr().err


def test_the_report_does_not_call_a_passed_over_choice_clear():
    """"The top five candidates scored 91.67 to 97.00, so the choice is clear" of a choice ranked 8th, whose seven
    betters the budget passed over."""
    from trellis.train.tune import _margin

    board = {"playoff": [], "top5_val": [0.97, 0.95, 0.93, 0.92, 0.9167], "val_std": 0.001}
    assert "clear" in _margin(board)
    text = _margin({**board, "passed_over": [{"config": "c008", "final_s_est": 2.2}] * 7})
    assert "clear" not in text and "the 7 ranked above it were passed over" in text


def test_the_choice_is_marked_selected_in_the_leaderboard(store, tmp_path):
    assert main(["tune", store, "--grid", "lr=0.01,0.02", "--epochs", "2", "--seeds", "1", "--out",
                 str(tmp_path / "t")]) == 0
    board = json.loads((tmp_path / "t" / "leaderboard.json").read_text())
    chosen = [r for r in board["rows"] if r["config"] == board["best"]["config"]]
    assert chosen and chosen[0]["stopped"] == "selected"  # it read "epochs": the search's epochs ran out
