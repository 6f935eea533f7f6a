"""``--strategy mini --parts-dir``: training through a partition buffer, its equality with mini, resume, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.train.helpers import metrics_without_timing
from trellis.cli.main import main
from trellis.data.importers import import_graph
from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.partition import partition_graph
from trellis.partition.layout import write_layout
from trellis.train import trainer
from trellis.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def _layout(store: Path, out: Path, parts: int, method: str = "metis") -> Path:
    s = GraphStore(store)
    return write_layout(s, partition_graph(s, method, parts, measure=False), out)


@pytest.fixture(scope="module")
def p4(sbm_store, tmp_path_factory) -> Path:
    return _layout(sbm_store, tmp_path_factory.mktemp("bufl") / "p4", 4)


def _cfg(store, out, **kw) -> TrainConfig:
    base = dict(store=str(store), strategy="mini", model="sage", fanouts="4,3", batch_size=64, epochs=3, hidden=16,
                out=str(out), progress=False, checkpoint_every=0, device="cpu")
    return TrainConfig(**{**base, **kw})


def _interrupt_after_epoch_1(cfg: TrainConfig) -> None:
    """Train ``cfg`` until a stop after epoch 1 (its checkpoint written), as a SIGTERM would."""

    def stop_at(t, rec):
        if rec["epoch"] == 1:
            t.request_stop()

    with pytest.raises(trainer.TrainingInterrupted):
        trainer.Trainer(cfg, callbacks=[stop_at]).fit()


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in metrics_without_timing(run)]


def test_all_resident_equals_mini(sbm_store, p4, tmp_path):
    ref = trainer.train(_cfg(sbm_store, tmp_path / "mini"))
    ours = trainer.train(_cfg(sbm_store, tmp_path / "buf", parts_dir=str(p4), nproc=1))
    assert _losses(tmp_path / "buf") == _losses(tmp_path / "mini")
    assert ours["test_acc"] == ref["test_acc"]
    for a, b in zip(metrics_without_timing(tmp_path / "buf"), metrics_without_timing(tmp_path / "mini")):
        assert {k: a[k] for k in b if k != "wait_s"} == {k: v for k, v in b.items() if k != "wait_s"}


def test_buffer_of_one_part_trains_and_reports(sbm_store, p4, tmp_path):
    summary = trainer.train(_cfg(sbm_store, tmp_path / "k1", parts_dir=str(p4), buffer_parts=1, buffer_cache="0",
                                 epochs=4))
    recs = metrics_without_timing(tmp_path / "k1")
    train_n = GraphStore(sbm_store).split("train").shape[0]
    for r in recs:
        assert r["targets"] == train_n  # every training node a target exactly once per epoch
        assert r["buffer_states"] == 4 and r["cache_hit_rate"] == 0.0
        assert 0 < r["neighbours_kept"] < 1
        assert r["parts_loaded"] >= 3  # every part once (one may still be resident from the last epoch)
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert summary["buffer_parts"] == 1 and summary["num_parts"] == 4


def test_cache_serves_rows_outside_the_buffer(sbm_store, p4, tmp_path):
    trainer.train(_cfg(sbm_store, tmp_path / "c", parts_dir=str(p4), buffer_parts=1, buffer_cache="40K", epochs=1))
    rec = metrics_without_timing(tmp_path / "c")[0]
    assert rec["cache_hit_rate"] > 0


def test_trains_from_the_layout_alone(sbm_store, p4, tmp_path):
    """The store's copy of the features is not needed: the buffer reads the layout's."""
    store = tmp_path / "store"
    shutil.copytree(sbm_store, store)
    ref = trainer.train(_cfg(store, tmp_path / "a", parts_dir=str(p4), buffer_parts=2))
    checksum = GraphStore(store).checksum
    assert GraphStore(store).move_features(p4) > 0
    assert not (store / "x.npy").exists() and GraphStore(store).checksum == checksum
    again = trainer.train(_cfg(store, tmp_path / "b", parts_dir=str(p4), buffer_parts=2))
    assert again["test_acc"] == ref["test_acc"]
    with pytest.raises(TrellisUserError, match="moved to the partitioned layout"):
        trainer.train(_cfg(store, tmp_path / "c"))  # in-memory mini needs the rows: a clear error
    from trellis.data.info import format_info, store_info

    assert f"x moved to {p4}" in format_info(store_info(GraphStore(store)))  # `trellis data info` still works


def test_resume_is_exact(sbm_store, p4, tmp_path):
    c = _cfg(sbm_store, tmp_path / "run", parts_dir=str(p4), buffer_parts=2, epochs=4, checkpoint_every=1)
    _interrupt_after_epoch_1(c)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    trainer.train(TrainConfig.from_dict({**saved, "resume": c.out, "progress": False}))
    trainer.train(_cfg(sbm_store, tmp_path / "ref", parts_dir=str(p4), buffer_parts=2, epochs=4))
    assert _losses(tmp_path / "run") == _losses(tmp_path / "ref")



def test_resume_keeps_the_interrupted_processs_residency(sbm_store, p4, tmp_path, monkeypatch):
    """A budget's plan depends on the process's measured baseline: a resuming process planned another cache
    (4,547 rows against 4,940) and its epochs sampled other neighbourhoods than the uninterrupted run's."""
    import dataclasses

    from trellis.train.strategies.buffered import BufferedMini

    kw = dict(parts_dir=str(p4), buffer_parts=2, memory_budget="2G", epochs=4)
    ref = trainer.train(_cfg(sbm_store, tmp_path / "ref", **kw))
    assert 0 < ref["cache_rows"]
    c = _cfg(sbm_store, tmp_path / "run", checkpoint_every=1, **kw)
    _interrupt_after_epoch_1(c)
    plan = BufferedMini._plan
    monkeypatch.setattr(BufferedMini, "_plan", lambda self, *a: dataclasses.replace(
        plan(self, *a), cache_rows=plan(self, *a).cache_rows // 2))  # as a larger baseline would plan it
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    got = trainer.train(TrainConfig.from_dict({**saved, "resume": c.out, "progress": False}))
    assert _losses(tmp_path / "run") == _losses(tmp_path / "ref")
    assert got["cache_rows"] == ref["cache_rows"]


def test_resume_refuses_a_layout_repartitioned_in_place(sbm_store, tmp_path):
    """A PART_DIR re-partitioned in place (same store, same part count, another method) between a kill and its
    --resume trained the rest of the run on the other parts, silently."""
    parts = _layout(sbm_store, tmp_path / "p4", 4, "metis")
    c = _cfg(sbm_store, tmp_path / "run", parts_dir=str(parts), buffer_parts=2, epochs=4, checkpoint_every=1)
    _interrupt_after_epoch_1(c)
    shutil.rmtree(parts)
    _layout(sbm_store, parts, 4, "random")
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    with pytest.raises(TrellisUserError, match=r"changed since it started \(layout: .*'metis'.* then, .*'random'"):
        trainer.train(TrainConfig.from_dict({**saved, "resume": c.out, "progress": False}))


def test_real_data_bag_of_words_all_resident_equals_mini(dataset, tmp_path):
    """Cora's bag-of-words rows, row-normalized as each part is read, give mini's losses exactly."""
    store = import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False)
    layout = _layout(store, tmp_path / "cora-p4", 4)
    kw = dict(model="gcn", fanouts="5,5", batch_size=64, dropout=0.5)
    trainer.train(_cfg(store, tmp_path / "mini", **kw))
    trainer.train(_cfg(store, tmp_path / "buf", parts_dir=str(layout), **kw))
    assert _losses(tmp_path / "buf") == _losses(tmp_path / "mini")
    trainer.train(_cfg(store, tmp_path / "k1", parts_dir=str(layout), buffer_parts=1, **kw))
    assert np.isfinite(_losses(tmp_path / "k1")).all()


@pytest.mark.parametrize("model", ["gin", "sage", "gcn"])
def test_rehearsal_batches_of_bag_of_words_rows(dataset, tmp_path, model):
    """A kept rehearsal batch carries its first layer's aggregation, and GIN's root term then read the batch's input
    rows as a dense slice: with bag-of-words rows reaching the model sparse it failed ("Sparse CSR tensors do not
    have strides"). The root rows are sliced from the CSR now."""
    store = import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False)
    layout = _layout(store, tmp_path / "cora-p4", 4)
    trainer.train(_cfg(store, tmp_path / "run", model=model, parts_dir=str(layout), buffer_parts=2, buffer_replay=8))
    assert np.isfinite(_losses(tmp_path / "run")).all()


@pytest.mark.parametrize("kw,match", [
    (dict(buffer_parts=5), "--buffer-parts 5: give 1 to 4"),
    (dict(buffer_parts=0), "--buffer-parts"),
    (dict(nproc=2, buffer_parts=3), r"--buffer-parts 3 is more than the 2 part\(s\) rank 0 of 2 holds"),
    (dict(nproc=5), "more ranks than the 4 parts"),
    (dict(memory_budget="64M"), "smallest budget that works"),
    (dict(buffer_cache="lots"), "--buffer-cache"),
    (dict(buffer_replay=8, buffer_replay_share=0.0), r"--buffer-replay-share must be in \(0, 8\]"),
    (dict(buffer_replay_share=0.25), "--buffer-replay-share applies to rehearsal: add --buffer-replay"),
    (dict(buffer_replay_fanouts="5,5"), "--buffer-replay-fanouts applies to rehearsal: add --buffer-replay"),
    (dict(buffer_replay=8, buffer_replay_fanouts="5"), r"--buffer-replay-fanouts '5': give 2 fanouts"),
    (dict(buffer_replay=8, buffer_replay_fanouts="a,b"), r"--buffer-replay-fanouts 'a,b': give 2 fanouts"),
])
def test_bad_input(sbm_store, p4, tmp_path, kw, match):
    with pytest.raises(TrellisUserError, match=match):
        trainer.train(_cfg(sbm_store, tmp_path / "bad", parts_dir=str(p4), **kw))
    assert not (tmp_path / "bad" / "summary.json").exists()


def test_buffer_flags_need_a_layout(sbm_store, tmp_path):
    with pytest.raises(TrellisUserError, match="--buffer-parts applies to --strategy mini with --parts-dir"):
        _cfg(sbm_store, tmp_path / "x", buffer_parts=2)


def test_layout_of_another_store_and_damaged_parts(sbm_store, p4, tmp_path, capsys):
    from trellis.data.generate import generate_sbm

    other = generate_sbm(tmp_path / "other", nodes=500, avg_degree=8, features=16, classes=4, seed=1, progress=False)
    rc = main(["train", str(other), "--strategy", "mini", "--parts-dir", str(p4), "--nproc", "1", "--out",
               str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "made from another store" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(p4, broken)
    (broken / "part-00002" / "x.npy").unlink()
    rc = main(["train", str(sbm_store), "--strategy", "mini", "--parts-dir", str(broken), "--nproc", "1", "--out",
               str(tmp_path / "b"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "part-00002/x.npy" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()


def test_not_destination_owned(sbm_store, tmp_path):
    layout = _layout(sbm_store, tmp_path / "hash", 2, method="hash")
    with pytest.raises(TrellisUserError, match="ownership dst"):
        trainer.train(_cfg(sbm_store, tmp_path / "h", parts_dir=str(layout)))


def test_sampler_processes_give_the_same_losses(sbm_store, tmp_path):
    """``--samplers 1``: batches prepared in a worker process train to the in-process losses, bit for bit."""
    trainer.train(_cfg(sbm_store, tmp_path / "threads"))
    trainer.train(_cfg(sbm_store, tmp_path / "procs", samplers=1))
    assert _losses(tmp_path / "procs") == _losses(tmp_path / "threads")
    with pytest.raises(TrellisUserError, match="--samplers"):
        _cfg(sbm_store, tmp_path / "bad", samplers=-1)


def test_budget_runs_evaluate_over_the_buffer(sbm_store, p4, tmp_path):
    """Under --memory-budget, evaluation runs layer-wise over the buffer; with every part resident it is exact."""
    exact = trainer.train(_cfg(sbm_store, tmp_path / "exact", parts_dir=str(p4)))
    buffered = trainer.train(_cfg(sbm_store, tmp_path / "buf", parts_dir=str(p4), memory_budget="8G",
                                  buffer_parts=4))
    assert buffered["evaluation"] == "buffer" and exact["evaluation"] == "exact"
    assert _losses(tmp_path / "buf") == _losses(tmp_path / "exact")
    assert buffered["test_acc"] == pytest.approx(exact["test_acc"], abs=2e-3)
    small = trainer.train(_cfg(sbm_store, tmp_path / "k1", parts_dir=str(p4), memory_budget="8G", buffer_parts=1,
                               buffer_cache="0"))
    assert 0.0 < small["test_acc_mean"] <= 1.0


def test_budget_evaluation_in_small_chunks_is_the_same_evaluation(sbm_store, p4, tmp_path, monkeypatch):
    """Evaluation over the buffer cut a part into chunks of 2M edges only, so one chunk was a whole part whose rows
    and activations no budget counted (peaks 13-30% over --memory-budget). Chunks are now cut by bytes too; a
    tiny chunk changes nothing of the result."""
    from trellis.train.strategies import buffered

    kw = dict(parts_dir=str(p4), memory_budget="8G", buffer_parts=4, epochs=3)
    whole = trainer.train(_cfg(sbm_store, tmp_path / "whole", **kw))
    monkeypatch.setattr(buffered, "EVAL_CHUNK_BYTES", 4096)  # a few rows per chunk
    tiny = trainer.train(_cfg(sbm_store, tmp_path / "tiny", **kw))
    for key in ("val_acc", "test_acc", "best_epoch"):
        assert tiny[key] == whole[key]
    val = [json.loads(line)["val_loss"] for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line)["val_loss"] for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert val == pytest.approx(ref, abs=1e-6)


def test_kill_9_mid_epoch_and_resume_give_the_uninterrupted_losses(sbm_store, p4, tmp_path):
    import os
    import subprocess
    import sys

    from tests.train.helpers import wait_for_epochs

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
    args = ["--strategy", "mini", "--model", "sage", "--fanouts", "4,3", "--batch-size", "16", "--hidden", "16",
            "--parts-dir", str(p4), "--nproc", "1", "--buffer-parts", "2", "--buffer-replay", "8", "--device", "cpu"]
    proc = subprocess.Popen([sys.executable, "-m", "trellis.cli", "train", str(sbm_store), *args, "--epochs", "400",
                             "--patience", "400", "--checkpoint-every", "1", "--no-progress", "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_epochs(out, proc, 3)
    proc.kill()
    proc.wait(timeout=60)
    cfg = json.loads((out / "config.json").read_text())
    epochs = len(metrics_without_timing(out)) + 2
    trainer.train(TrainConfig.from_dict({**cfg, "resume": str(out), "epochs": epochs, "progress": False}))
    ref = {**cfg, "out": str(tmp_path / "ref"), "epochs": epochs, "progress": False, "checkpoint_every": 0}
    trainer.train(TrainConfig.from_dict(ref))
    assert _losses(out) == _losses(tmp_path / "ref")


def test_cluster_batches_from_the_buffer(sbm_store, p4, tmp_path):
    """``--strategy cluster --parts-dir``: one batch per buffer state; all parts resident = full-batch training."""
    kw = dict(model="sage", dropout=0.0, epochs=3, fanouts=None, batch_size=None)
    full = trainer.train(_cfg(sbm_store, tmp_path / "full", strategy="full", **kw))
    trainer.train(_cfg(sbm_store, tmp_path / "c4", strategy="cluster", parts_dir=str(p4), **kw))
    np.testing.assert_allclose(_losses(tmp_path / "c4"), _losses(tmp_path / "full"), rtol=1e-5)
    assert full["test_acc_mean"] > 0
    k2 = trainer.train(_cfg(sbm_store, tmp_path / "c2", strategy="cluster", parts_dir=str(p4), buffer_parts=2, **kw))
    recs = metrics_without_timing(tmp_path / "c2")
    assert all(r["buffer_states"] == 3 and r["batches"] == 3 for r in recs)
    assert k2["buffer_parts"] == 2


def test_predict_a_buffer_run_from_the_layout(sbm_store, p4, tmp_path):
    """``trellis predict`` on a buffer run reads the layout (the store may have moved its features there)."""
    from trellis.train.predict import predict

    store = tmp_path / "store"
    shutil.copytree(sbm_store, store)
    GraphStore(store).move_features(p4)
    summary = trainer.train(_cfg(store, tmp_path / "run", parts_dir=str(p4), buffer_parts=2, dropout=0.0))
    got = predict(tmp_path / "run", store, tmp_path / "pred.npy", device="cpu")
    pred = np.load(tmp_path / "pred.npy")
    y = np.asarray(GraphStore(store).y)
    test = np.asarray(GraphStore(store).split("test"))
    assert got["num_nodes"] == 500 and pred.shape == (500,)
    assert (pred[test] == y[test]).mean() == pytest.approx(summary["test_acc_mean"], abs=1e-9)
    with pytest.raises(TrellisUserError, match="--device cuda: this run predicts by layer-wise inference over the "
                                               "partitioned layout, which runs on the CPU only"):
        predict(tmp_path / "run", store, tmp_path / "gpu.npy", device="cuda")  # it was silently ignored


@pytest.mark.parametrize("budget", [None, "2G"])
def test_predict_a_buffer_run_writes_the_embeddings_a_run_in_memory_writes(sbm_store, p4, tmp_path, budget):
    """The buffer's prediction wrote the logits as the embeddings; now the last layer's input, as in memory.

    The reference is the same model predicted in memory (its run's config without the layout). Without a budget
    prediction is exact, so every part is resident whatever --buffer-parts the run trained with; within one the
    buffer holds the run's two parts and its cache every other row (the graph is small), so it is exact too.
    """
    from trellis.train.predict import embedding_path, predict

    trainer.train(_cfg(sbm_store, tmp_path / "buf", parts_dir=str(p4), nproc=1, buffer_parts=2, epochs=2))
    shutil.copytree(tmp_path / "buf", tmp_path / "mem")
    cfg = json.loads((tmp_path / "mem" / "config.json").read_text())
    for key in ("parts_dir", "nproc", "buffer_parts"):
        cfg.pop(key, None)
    (tmp_path / "mem" / "config.json").write_text(json.dumps(cfg))
    ref = predict(tmp_path / "mem", sbm_store, tmp_path / "ref.npy", device="cpu", proba=True)
    got = predict(tmp_path / "buf", sbm_store, tmp_path / "got.npy", device="cpu", proba=True, memory_budget=budget)
    assert got["embedding_source"] == ref["embedding_source"] == "penultimate"
    assert got["embedding_dim"] == ref["embedding_dim"] == 16
    emb, emb_ref = np.load(embedding_path(tmp_path / "got.npy")), np.load(embedding_path(tmp_path / "ref.npy"))
    np.testing.assert_allclose(emb, emb_ref, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.load(tmp_path / "got.npy"), np.load(tmp_path / "ref.npy"), rtol=0, atol=1e-5)
    assert not list(tmp_path.glob("*.tmp.npy"))


@pytest.mark.parametrize("fanouts", [[15, 10], [10, 10, 10], [-1, 5]])
def test_the_planned_input_rows_of_a_batch_are_above_the_sampled_ones(dataset, sbm_store, tmp_path, fanouts):
    """The residency plan priced a batch as ``batch × Π fanout`` rows capped at N: every batch of Coauthor CS
    was the whole graph (2.8 GiB of batches in flight planned against a 1.6 GiB run). The estimate from the
    degrees is lower, and must stay above what the sampler really draws (measured on real graphs here)."""
    from trellis.loader.sampler import NeighborSampler
    from trellis.train.strategies.buffered import expected_input_rows

    cora = import_graph(dataset("cora"), tmp_path / "cora", format="planetoid", progress=False)
    for path in (cora, sbm_store):
        s = GraphStore(path)
        indptr, indices = np.asarray(s.indptr, dtype=np.int64), np.asarray(s.indices, dtype=np.int64)
        train = np.asarray(s.split("train"))
        sampler = NeighborSampler(indptr, indices, fanouts)
        rng = np.random.default_rng(0)
        drawn = max(sampler.sample(np.sort(rng.choice(train, train.shape[0], replace=False)), i).node_ids.shape[0]
                    for i in range(3))
        planned = expected_input_rows(train.shape[0], fanouts, np.diff(indptr))
        assert drawn <= planned <= s.num_nodes
        if path == cora and fanouts == [15, 10]:  # the old price: 140 × (1 + 15 + 150) rows, capped at all 2,708
            assert planned < 0.8 * s.num_nodes


def test_label_skew_measures_parts_that_follow_the_labels():
    from trellis.train.strategies.buffered import label_skew

    ids = np.arange(100)
    y = ids % 4
    assert label_skew(y.astype(np.int32), ids, y, 4) == pytest.approx(0.75)  # part = class
    assert label_skew(((ids // 4) % 4).astype(np.int32), ids, y, 4) == pytest.approx(0.0)  # every part mixed


def test_a_skewed_layout_is_warned_about(sbm_store, p4, tmp_path, capsys):
    summary = trainer.train(_cfg(sbm_store, tmp_path / "w", parts_dir=str(p4), buffer_parts=1, epochs=1))
    assert summary["label_skew"] > 0.25 and "follow the labels" in capsys.readouterr().err


def test_budget_evaluation_spills_in_the_run_directory_not_tmpdir(sbm_store, p4, tmp_path, monkeypatch):
    """Evaluation over the buffer spilled into $TMPDIR (a small one: ENOSPC), beside no free-space check; it uses
    --spill-dir or RUN_DIR/spill, as a budgeted full-batch run does, and leaves nothing there."""
    from trellis.train.strategies import buffered

    dirs = []
    real = buffered.OwnedTempDir

    def seen(*args, **kwargs):
        dirs.append(kwargs.get("dir"))
        return real(*args, **kwargs)

    monkeypatch.setattr(buffered, "OwnedTempDir", seen)
    out = tmp_path / "run"
    trainer.train(_cfg(sbm_store, out, parts_dir=str(p4), memory_budget="8G", buffer_parts=2, epochs=1))
    assert dirs and all(Path(d) == out / "spill" for d in dirs)
    assert not (out / "spill").exists()


def test_no_cache_when_one_process_holds_every_part(sbm_store, p4, tmp_path):
    """Without a budget, --buffer-cache with every part resident cached every row a second time (a rank's cache
    holds other ranks' rows: it keeps it)."""
    s = trainer.train(_cfg(sbm_store, tmp_path / "r", parts_dir=str(p4), buffer_cache="1G", epochs=1))
    assert s["buffer_parts"] == 4 and s["cache_rows"] == 0
