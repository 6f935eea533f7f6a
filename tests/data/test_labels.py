"""Binary and multilabel labels through the importers and the generators: the manifest's task, bad values."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from trellis.cli.main import main
from trellis.data.generate import generate_sbm
from trellis.data.importers import import_graph
from trellis.data.store import open_store
from trellis.errors import TrellisUserError


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} should not exist"
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _ring_npz(path: Path, n: int, **labels: np.ndarray) -> Path:
    adj = sp.csr_matrix((np.ones(n), (np.arange(n), (np.arange(n) + 1) % n)), shape=(n, n))
    np.savez(path, adj_data=adj.data, adj_indices=adj.indices, adj_indptr=adj.indptr, adj_shape=adj.shape,
             attr_matrix=np.eye(n, 4, dtype=np.float32), **labels)
    return path


def _edgelist(folder: Path, labels: np.ndarray) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    n = labels.shape[0]
    (folder / "edges.txt").write_text("".join(f"{i} {(i + 1) % n}\n" for i in range(n)))
    np.save(folder / "features.npy", np.ones((n, 2), dtype=np.float32))
    np.save(folder / "labels.npy", labels)
    np.save(folder / "train.npy", np.array([0, 1]))
    np.save(folder / "val.npy", np.array([2]))
    np.save(folder / "test.npy", np.array([3]))
    return folder


def test_npz_multilabel_dense_and_sparse(tmp_path):
    rng = np.random.default_rng(0)
    y = (rng.random((100, 3)) < 0.4).astype(np.int64)
    y[5] = -1  # an unlabelled node: kept out of every split
    store = open_store(import_graph(_ring_npz(tmp_path / "d.npz", 100, labels=y), tmp_path / "d", progress=False))
    assert store.task == "multilabel" and store.num_classes == 3
    np.testing.assert_array_equal(store.y, y.astype(np.float32))
    ids = np.concatenate([store.split(k) for k in ("train", "val", "test")])
    assert sorted(ids.tolist()) == [i for i in range(100) if i != 5]
    assert store.split("train").size == 10 and store.manifest["source"]["split"] == "random-10/10/80"

    m = sp.csr_matrix(np.maximum(y, 0))
    p = _ring_npz(tmp_path / "s.npz", 100, label_data=m.data, label_indices=m.indices, label_indptr=m.indptr,
                  label_shape=m.shape)
    sparse = open_store(import_graph(p, tmp_path / "s", progress=False))
    assert sparse.task == "multilabel" and np.asarray(sparse.y).shape == (100, 3)


def test_npz_multilabel_not_01_is_refused(tmp_path):
    y = np.zeros((20, 3), dtype=np.int64)
    y[7, 2] = 2
    p = _ring_npz(tmp_path / "bad.npz", 20, labels=y)
    with pytest.raises(TrellisUserError, match=r"bad.npz \(labels\): multilabel row 7 has the value 2"):
        import_graph(p, tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path / "out")
    assert main(["data", "import", str(p), "--out", str(tmp_path / "out")]) == 2
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize(("labels", "task", "num_classes"), [
    (np.array([0, 1, 1, 0, -1]), "binary", 2),
    (np.array([1, 2, 2, 1, -1]), "multiclass", 3),  # two values that are not 0/1 stay multiclass
    (np.array([0, 1, 2, 1, 0]), "multiclass", 3),
    (np.array([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0], [-1, -1, -1]]), "multilabel", 3),
    (np.array([[1, 0], [0, 1], [1, 1], [0, 0], [np.nan, np.nan]]), "multilabel", 2),  # NaN row: unlabelled
    (np.array([[1], [0], [1], [0], [-1]]), "binary", 2),  # one column is a vector
])
def test_edgelist_records_task(tmp_path, labels, task, num_classes):
    store = open_store(import_graph(_edgelist(tmp_path / "g", labels), tmp_path / "s", progress=False))
    assert store.task == task and store.num_classes == num_classes
    if task == "multilabel":
        assert np.asarray(store.y)[4].tolist() == [-1.0] * num_classes


@pytest.mark.parametrize(("row", "match"), [
    ([1, -1, 0], "multilabel row 2 has the value -1"),  # -1 only as a whole row
    ([1, 0.5, 0], "multilabel row 2 has the value 0.5"),
    ([1, np.nan, 0], "multilabel row 2 has the value nan"),
])
def test_edgelist_bad_multilabel_rows(tmp_path, row, match):
    labels = np.zeros((5, 3))
    labels[2] = row
    src = _edgelist(tmp_path / "g", labels)
    with pytest.raises(TrellisUserError, match=r"labels\.npy: " + match):
        import_graph(src, tmp_path / "s", progress=False)
    assert_nothing_written(tmp_path / "s")


def test_ogb_multilabel_csv(tmp_path):
    root = tmp_path / "ogbn_ml"

    def gz(rel: str, text: str) -> None:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(root / rel, "wt") as f:
            f.write(text)

    gz("raw/edge.csv.gz", "0,1\n1,2\n2,3\n")
    gz("raw/node-feat.csv.gz", "1,0\n0,1\n1,1\n0,0\n")
    gz("raw/node-label.csv.gz", "1,0,1\n0,1,1\nnan,nan,nan\n1,1,0\n")
    for key, ids in (("train", "0\n"), ("valid", "1\n"), ("test", "3\n")):
        gz(f"split/s/{key}.csv.gz", ids)
    store = open_store(import_graph(root, tmp_path / "s", progress=False))
    assert store.task == "multilabel" and store.num_classes == 3
    assert np.asarray(store.y)[2].tolist() == [-1, -1, -1]


@pytest.mark.parametrize("kind", ["sbm", "rmat"])
def test_generate_binary_and_multilabel(tmp_path, kind):
    b = open_store(main_generate(tmp_path / "b", kind, "--task", "binary"))
    y = np.asarray(b.y)
    assert b.task == "binary" and b.num_classes == 2 and set(np.unique(y)) == {0, 1}
    m = open_store(main_generate(tmp_path / "m", kind, "--task", "multilabel", "--labels", "5"))
    ym = np.asarray(m.y)
    assert m.task == "multilabel" and m.num_classes == 5 and ym.shape == (300, 5) and ym.dtype == np.float32
    assert set(np.unique(ym)) == {0.0, 1.0} and m.manifest["source"]["labels"] == 5
    plain = open_store(main_generate(tmp_path / "p", kind))
    assert plain.task == "multiclass" and "task" not in plain.manifest["source"]
    # the graph and features do not depend on the task: only the labels differ
    np.testing.assert_array_equal(plain.indices, m.indices)
    np.testing.assert_array_equal(plain.x, b.x)
    np.testing.assert_array_equal(np.asarray(plain.y) % 2, y)


def main_generate(out: Path, kind: str, *extra: str) -> Path:
    assert main(["data", "generate", kind, "--nodes", "300", "--features", "8", "--out", str(out), *extra]) == 0
    return out


@pytest.mark.parametrize(("extra", "match"), [
    (["--task", "binary", "--labels", "3"], "--labels sets the label count of --task multilabel"),
    (["--task", "binary", "--classes", "1"], "--task binary needs --classes >= 2"),
])
def test_generate_bad_task_options(tmp_path, capsys, extra, match):
    out = tmp_path / "g"
    assert main(["data", "generate", "sbm", "--nodes", "50", "--out", str(out), *extra]) == 2
    assert match in capsys.readouterr().err
    assert_nothing_written(out)
    with pytest.raises(TrellisUserError, match="--task must be one of"):
        generate_sbm(out, nodes=50, task="regression")
    assert_nothing_written(out)
