from __future__ import annotations

import gzip
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from trellis.data.importers import detect_format, import_graph
from trellis.data.importers.planetoid import load_planetoid
from trellis.data.info import store_info
from trellis.data.store import open_store
from trellis.errors import TrellisUserError


def _flip_bytes(src: Path, dst: Path, start: int, count: int) -> None:
    """``dst`` = ``src`` with ``count`` bytes from ``start`` inverted (bit rot, a bad copy)."""
    data = bytearray(src.read_bytes())
    data[start: start + count] = bytes(b ^ 0xFF for b in data[start: start + count])
    dst.write_bytes(bytes(data))


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} should not exist"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, f"temporary files left behind: {leftovers}"


def split_sizes(store):
    return tuple(int(store.split(k).shape[0]) for k in ("train", "val", "test"))


# ---- planetoid (real data) ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "nodes", "edges", "features", "classes", "sizes"),
    [("cora", 2708, 10556, 1433, 7, (140, 500, 1000)), ("citeseer", 3327, 9104, 3703, 6, (120, 500, 1000))],
)
def test_planetoid_counts_and_public_split(dataset, tmp_path, name, nodes, edges, features, classes, sizes):
    store = open_store(import_graph(dataset(name), tmp_path / name, progress=False))
    assert (store.num_nodes, store.num_edges, store.num_features, store.num_classes) == (nodes, edges, features,
                                                                                           classes)
    assert store.name == name and store.manifest["source"]["importer"] == "planetoid"
    assert split_sizes(store) == sizes
    train, val, test = (np.asarray(store.split(k)) for k in ("train", "val", "test"))
    n_train = sizes[0]
    np.testing.assert_array_equal(train, np.arange(n_train))
    np.testing.assert_array_equal(val, np.arange(n_train, n_train + 500))
    assert np.all(np.diff(test) > 0) and test.min() >= n_train + 500
    y = np.asarray(store.y)
    assert np.all(np.bincount(y[train], minlength=classes) == 20)  # 20 per class
    assert np.all(y[test] >= 0)
    x = np.asarray(store.x)
    assert set(np.unique(x)) <= {0.0, 1.0}  # raw binary bag of words, not row-normalized
    info = store_info(store)
    assert info["symmetric"] and info["self_loops"] == 0 and info["duplicate_edges"] == 0


def test_planetoid_follows_pyg_test_reordering(dataset):
    d = load_planetoid(dataset("cora"))
    import pickle

    folder = dataset("cora")
    with open(folder / "ind.cora.tx", "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the pickle names scipy.sparse.csr
        tx = pickle.load(f, encoding="latin1").toarray()
    test_index = np.loadtxt(folder / "ind.cora.test.index", dtype=np.int64)
    # node test_index[i] has row i of tx (PyG: x[test_index] = x[sorted_test_index] after concatenation)
    np.testing.assert_array_equal(d["x"][test_index], tx)


def test_citeseer_isolated_test_nodes_are_unlabelled(dataset, tmp_path):
    store = open_store(import_graph(dataset("citeseer"), tmp_path / "cs", format="planetoid", progress=False))
    y, x = np.asarray(store.y), np.asarray(store.x)
    missing = np.flatnonzero(y < 0)
    assert missing.size == 15  # ids in the test range absent from test.index
    assert np.all(x[missing] == 0)
    assert not np.isin(missing, np.asarray(store.split("test"))).any()
    assert np.all(missing >= 2312)


def test_planetoid_missing_file(dataset, tmp_path):
    src = tmp_path / "cora"
    shutil.copytree(dataset("cora"), src)
    (src / "ind.cora.tx").unlink()
    out = tmp_path / "out"
    with pytest.raises(TrellisUserError, match=r"ind.cora.tx: missing Planetoid file 'tx'"):
        import_graph(src, out, format="planetoid")
    assert_nothing_written(out)


def test_planetoid_refuses_tampered_pickle(dataset, tmp_path):
    import pickle

    src = tmp_path / "cora"
    shutil.copytree(dataset("cora"), src)
    (src / "ind.cora.x").chmod(0o644)
    with open(src / "ind.cora.x", "wb") as f:
        pickle.dump(shutil.rmtree, f)  # a pickle that would call a function
    out = tmp_path / "out"
    with pytest.raises(TrellisUserError, match="refusing to load shutil.rmtree"):
        import_graph(src, out, format="planetoid")
    assert_nothing_written(out)


def test_planetoid_damaged_sparse_matrix_is_an_error_not_a_segfault(dataset, tmp_path):
    """400 flipped bytes inside ind.cora.allx unpickled into a CSR with a non-monotone indptr, whose toarray
    crashed the importer with a segmentation fault (exit 139)."""
    src = tmp_path / "cora"
    shutil.copytree(dataset("cora"), src)
    path = src / "ind.cora.allx"
    path.chmod(0o644)
    _flip_bytes(path, path, 1000, 400)
    out = tmp_path / "out"
    with pytest.raises(TrellisUserError, match=r"ind.cora.allx: the sparse matrix is damaged \(indptr must be"):
        import_graph(src, out, format="planetoid")
    assert_nothing_written(out)


# ---- Shchur et al. npz (real data) --------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "nodes", "edges", "features", "classes"),
    [("amazon-computers", 13381, 2 * 245778, 767, 10), ("coauthor-cs", 18333, 2 * 81894, 6805, 15)],
)
def test_npz_lcc_counts(dataset, tmp_path, name, nodes, edges, features, classes):
    store = open_store(import_graph(dataset(name), tmp_path / name, progress=False), verify=False)
    assert (store.num_nodes, store.num_edges, store.num_features, store.num_classes) == (nodes, edges, features,
                                                                                           classes)
    assert split_sizes(store) == (20 * classes, 30 * classes, nodes - 50 * classes)
    y = np.asarray(store.y)
    assert np.all(np.bincount(y[np.asarray(store.split("train"))], minlength=classes) == 20)
    assert np.all(np.bincount(y[np.asarray(store.split("val"))], minlength=classes) == 30)


def test_npz_without_lcc_and_split_seed(dataset, tmp_path):
    src = dataset("amazon-computers")
    full = open_store(import_graph(src, tmp_path / "full", lcc=False, progress=False))
    assert (full.num_nodes, full.num_edges) == (13752, 491722)  # PyG Amazon('Computers')
    a = open_store(import_graph(src, tmp_path / "a", split_seed=1, progress=False))
    b = open_store(import_graph(src, tmp_path / "b", split_seed=1, progress=False))
    c = open_store(import_graph(src, tmp_path / "c", split_seed=2, progress=False))
    np.testing.assert_array_equal(a.split("train"), b.split("train"))
    assert not np.array_equal(a.split("train"), c.split("train"))
    assert a.checksum == b.checksum
    assert not full.has("node_ids")  # nothing dropped, nothing to map
    # --lcc (the default for these files) renumbers: node_ids maps each node back to the file's id
    ids = np.asarray(a.get("node_ids"))
    assert ids.shape == (13381,) and np.all(np.diff(ids) > 0) and ids[-1] < 13752
    np.testing.assert_array_equal(np.asarray(a.x), np.asarray(full.x)[ids])
    np.testing.assert_array_equal(np.asarray(a.y), np.asarray(full.y)[ids])


def test_npz_small_classes_give_what_they_have(tmp_path):
    import scipy.sparse as sp

    n = 60
    adj = sp.csr_matrix((np.ones(n - 1), (np.arange(n - 1), np.arange(1, n))), shape=(n, n))
    labels = np.zeros(n, dtype=np.int64)
    labels[:25] = 1  # class 1 has 25 nodes: 20 train, 5 val, 0 test
    p = tmp_path / "tiny.npz"
    np.savez(p, adj_data=adj.data, adj_indices=adj.indices, adj_indptr=adj.indptr, adj_shape=adj.shape,
             attr_matrix=np.eye(n, 4, dtype=np.float32), labels=labels)
    store = open_store(import_graph(p, tmp_path / "out", progress=False))
    y = np.asarray(store.y)
    assert np.bincount(y[np.asarray(store.split("train"))]).tolist() == [20, 20]
    assert np.bincount(y[np.asarray(store.split("val"))]).tolist() == [15, 5]
    assert np.bincount(y[np.asarray(store.split("test"))], minlength=2).tolist() == [0, 0]


def test_npz_bad_file(tmp_path):
    p = tmp_path / "x.npz"
    np.savez(p, something=np.arange(3))
    with pytest.raises(TrellisUserError, match="no adjacency"):
        import_graph(p, tmp_path / "out", format="npz")
    p.write_bytes(b"not a zip")
    with pytest.raises(TrellisUserError, match="not a readable .npz"):
        import_graph(p, tmp_path / "out", format="npz")
    assert_nothing_written(tmp_path / "out")


# ---- Platonov et al. npz: fixed splits (synthetic, their keys and shapes) -----------------------------
def make_fixed_split_npz(path: Path, n: int = 40, splits: int = 4, seed: int = 0, **override) -> Path:
    """A file laid out like Platonov et al.'s (``edges`` stored once, ``[S, N]`` boolean masks)."""
    rng = np.random.default_rng(seed)
    src = np.arange(n - 1)
    edges = np.stack([src, src + 1], axis=1)  # a path: one connected component
    edges = np.concatenate([edges, [[0, n - 1], [3, 17]]]).astype(np.int64)
    order = np.stack([rng.permutation(n) for _ in range(splits)])
    arrays = {"node_features": rng.normal(size=(n, 5)).astype(np.float32), "node_labels": rng.integers(0, 3, n),
              "edges": edges, "train_masks": np.zeros((splits, n), bool), "val_masks": np.zeros((splits, n), bool),
              "test_masks": np.zeros((splits, n), bool)}
    for s in range(splits):  # 50% / 25% / 25%, a different draw per split
        arrays["train_masks"][s, order[s, : n // 2]] = True
        arrays["val_masks"][s, order[s, n // 2: 3 * n // 4]] = True
        arrays["test_masks"][s, order[s, 3 * n // 4:]] = True
    arrays.update(override)
    np.savez(path, **arrays)
    return path


def test_fixed_split_npz_keeps_every_split_and_node(tmp_path):
    p = make_fixed_split_npz(tmp_path / "roman_like.npz")
    z = np.load(p)
    store = open_store(import_graph(p, tmp_path / "s", progress=False))
    assert (store.num_nodes, store.num_edges) == (40, 2 * 41)  # undirected: each stored edge both ways
    np.testing.assert_array_equal(store.x, z["node_features"])
    np.testing.assert_array_equal(store.y, z["node_labels"])
    sets = np.asarray(store.split_sets)
    assert sets.shape == (4, 40) and store.manifest["source"]["split"] == "fixed"
    for s in range(4):
        for k, code in (("train", 1), ("val", 2), ("test", 3)):
            np.testing.assert_array_equal(np.flatnonzero(sets[s] == code), np.flatnonzero(z[f"{k}_masks"][s]))
    for k in ("train", "val", "test"):  # the store's own split is the first
        np.testing.assert_array_equal(store.split(k), np.flatnonzero(z[f"{k}_masks"][0]))
    info = store_info(store.path)
    assert info["fixed_splits"] == 4
    directed = open_store(import_graph(p, tmp_path / "d", symmetrize=False, progress=False))
    assert directed.num_edges == 41


def test_fixed_split_npz_with_lcc_drops_nodes_from_every_split(tmp_path):
    edges = np.array([[0, 1], [1, 2], [2, 3], [4, 5]], dtype=np.int64)  # nodes 4, 5 apart
    p = make_fixed_split_npz(tmp_path / "f.npz", n=6, splits=2, edges=edges)
    z = np.load(p)
    store = open_store(import_graph(p, tmp_path / "s", lcc=True, progress=False))
    assert store.num_nodes == 4 and np.asarray(store.split_sets).shape == (2, 4)
    for k, code in (("train", 1), ("val", 2), ("test", 3)):
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(store.split_sets)[1] == code),
                                      np.flatnonzero(z[f"{k}_masks"][1][:4]))


@pytest.mark.parametrize(("override", "match"), [
    ({"edges": np.zeros((5, 3), np.int64)}, "edges has shape"),
    ({"test_masks": np.zeros((3, 40), bool)},
     r"f.npz: train_masks, val_masks, test_masks hold different numbers of splits \(4, 4, 3\)"),
    ({"val_masks": np.zeros((4, 39), bool)}, r"val_masks has shape \(4, 39\)"),
    ({"node_labels": np.zeros(39, np.int64)}, "labels have 39 rows"),
])
def test_fixed_split_npz_bad_arrays(tmp_path, override, match):
    p = make_fixed_split_npz(tmp_path / "f.npz", **override)
    with pytest.raises(TrellisUserError, match=match):
        import_graph(p, tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path / "out")


def test_fixed_split_npz_refuses_overlaps_missing_keys_and_split_options(tmp_path):
    train = np.zeros((4, 40), bool)
    train[2, 7] = True
    p = make_fixed_split_npz(tmp_path / "f.npz")
    z = dict(np.load(p))
    z["train_masks"] = z["train_masks"] | train
    z["val_masks"][2, 7], z["test_masks"][2, 7] = True, False
    np.savez(tmp_path / "overlap.npz", **z)
    with pytest.raises(TrellisUserError, match=r"val_masks: node 7 is in split 2's val mask and in another"):
        import_graph(tmp_path / "overlap.npz", tmp_path / "out", progress=False)
    del z["test_masks"]
    np.savez(tmp_path / "missing.npz", **z)
    with pytest.raises(TrellisUserError, match="test_masks missing"):
        import_graph(tmp_path / "missing.npz", tmp_path / "out", progress=False)
    with pytest.raises(TrellisUserError, match="--split-seed does not apply: the file holds 4 fixed splits"):
        import_graph(p, tmp_path / "out", split_seed=1, progress=False)
    assert_nothing_written(tmp_path / "out")


# ---- OGB raw layout (synthetic) -----------------------------------------------------------------
def _write_gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write(text)


def make_ogb(root: Path, *, labels: str = "0\n1\nnan\n1\n0\n2\n", edge_feat: bool = True) -> Path:
    # 6 nodes (node 5 isolated, known only from num-node-list), 5 directed edges incl. a duplicate
    _write_gz(root / "raw" / "edge.csv.gz", "0,1\n1,2\n2,3\n3,0\n0,1\n")
    _write_gz(root / "raw" / "num-node-list.csv.gz", "6\n")
    _write_gz(root / "raw" / "node-feat.csv.gz", "".join(f"{i}.5,{-i}\n" for i in range(6)))
    _write_gz(root / "raw" / "node-label.csv.gz", labels)
    if edge_feat:
        _write_gz(root / "raw" / "edge-feat.csv.gz", "".join(f"{10 * i},{i}\n" for i in range(5)))
    _write_gz(root / "split" / "time" / "train.csv.gz", "0\n1\n")
    _write_gz(root / "split" / "time" / "valid.csv.gz", "3\n")
    _write_gz(root / "split" / "time" / "test.csv.gz", "4\n5\n")
    _write_gz(root / "split" / "other" / "train.csv.gz", "4\n")
    _write_gz(root / "split" / "other" / "valid.csv.gz", "0\n")
    _write_gz(root / "split" / "other" / "test.csv.gz", "1\n")
    return root


def test_ogb_import(tmp_path):
    root = make_ogb(tmp_path / "ogbn_tiny")
    assert detect_format(root) == "ogb"
    store = open_store(import_graph(root, tmp_path / "s", progress=False))
    assert store.name == "ogbn_tiny" and store.num_nodes == 6 and store.num_edges == 8  # 4 undirected edges
    np.testing.assert_array_equal(store.y, [0, 1, -1, 1, 0, 2])
    np.testing.assert_array_equal(store.x[:, 0], np.arange(6) + 0.5)
    # split "other" sorts first alphabetically
    assert store.split("train").tolist() == [4] and store.split("val").tolist() == [0]
    # edge features follow their edges in both directions; the duplicate 0,1 (row 4) loses to row 0
    indptr, indices, ef = np.asarray(store.indptr), np.asarray(store.indices), np.asarray(store.edge_feat)
    for v in range(6):
        for k in range(indptr[v], indptr[v + 1]):
            u = indices[k]
            row = {(0, 1): 0, (1, 2): 1, (2, 3): 2, (0, 3): 3}[(min(u, v), max(u, v))]
            np.testing.assert_array_equal(ef[k], [10 * row, row])
    timed = open_store(import_graph(root, tmp_path / "t", split_name="time", symmetrize=False, progress=False))
    assert timed.num_edges == 4 and timed.split("val").tolist() == [3] and timed.split("test").tolist() == [4, 5]


def test_ogb_streaming_equals_in_memory(tmp_path):
    root = make_ogb(tmp_path / "ogbn_tiny")
    a = open_store(import_graph(root, tmp_path / "a", progress=False))
    b = open_store(import_graph(root, tmp_path / "b", streaming=True, chunk_edges=1, progress=False))
    for name in a.manifest["arrays"]:
        np.testing.assert_array_equal(a.array(name), b.array(name), err_msg=name)


def test_ogb_errors(tmp_path):
    root = make_ogb(tmp_path / "o", labels="0\n1\n")
    out = tmp_path / "out"
    with pytest.raises(TrellisUserError, match="node-label.csv.gz: labels have 2 rows but the graph has 6 nodes"):
        import_graph(root, out)
    root = make_ogb(tmp_path / "o2")
    with pytest.raises(TrellisUserError, match="no split 'nope'; available: other, time"):
        import_graph(root, out, split_name="nope")
    _write_gz(root / "raw" / "edge.csv.gz", "0,1\n1,x\n")
    with pytest.raises(TrellisUserError, match=r"edge.csv.gz: line 2: 'x' is not an integer"):
        import_graph(root, out)
    _write_gz(root / "raw" / "edge.csv.gz", "0,1\n1,6\n")
    with pytest.raises(TrellisUserError, match=r"edge.csv.gz: line 2: node id 6 but the graph has 6 nodes"):
        import_graph(root, out)
    with pytest.raises(TrellisUserError, match="no raw/ folder"):
        import_graph(tmp_path, out, format="ogb")
    assert_nothing_written(out)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1,1\n2,2\n3,3\n4,4\n", r"edge-feat.csv.gz: has 4 rows but the edge list .*edge.csv.gz has 5 edges"),
        ("1,1\n2,2\n3,nan\n4,4\n5,5\n", r"edge-feat.csv.gz: row 2 contains NaN or Inf"),
        ("1,1\n2,2\n3,inf\n4,4\n5,5\n", r"edge-feat.csv.gz: row 2 contains NaN or Inf"),
    ],
)
def test_ogb_bad_edge_features(tmp_path, text, match):
    root = make_ogb(tmp_path / "o")
    _write_gz(root / "raw" / "edge-feat.csv.gz", text)
    out = tmp_path / "out"
    for streaming in (False, True):
        with pytest.raises(TrellisUserError, match=match):
            import_graph(root, out, streaming=streaming, progress=False)
        assert_nothing_written(out)


def test_ogb_without_edge_features(tmp_path):
    store = open_store(import_graph(make_ogb(tmp_path / "o", edge_feat=False), tmp_path / "s", progress=False))
    assert store.edge_feat is None and not store.has("edge_feat")


# ---- edge list ----------------------------------------------------------------------------------
def make_edgelist(folder: Path, *, text: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    edges = np.array([[0, 1], [1, 2], [2, 0], [2, 3], [1, 0], [3, 3], [0, 1]])
    if text:
        (folder / "edges.txt").write_text("# src dst\n" + "".join(f"{s}\t{d}\n" for s, d in edges))
    else:
        np.save(folder / "edges.npy", edges)
    np.save(folder / "features.npy", np.arange(10, dtype=np.float32).reshape(5, 2))  # node 4 isolated
    np.save(folder / "labels.npy", np.array([0, 1, 0, 1, -1]))
    np.save(folder / "train.npy", np.array([0, 1]))
    np.save(folder / "val.npy", np.array([False, False, True, False, False]))  # a mask works too
    np.save(folder / "test.npy", np.array([3]))
    np.save(folder / "edge_weights.npy", np.arange(7, dtype=np.float32) + 1)
    np.save(folder / "edge_features.npy", np.arange(14, dtype=np.float32).reshape(7, 2))
    return folder


@pytest.mark.parametrize("text", [True, False])
def test_edgelist_import(tmp_path, text):
    src = make_edgelist(tmp_path / "g", text=text)
    assert detect_format(src) == "edgelist"
    store = open_store(import_graph(src, tmp_path / "s", progress=False))
    assert store.num_nodes == 5 and store.num_edges == 8  # {0,1} {1,2} {0,2} {2,3}, both directions
    assert store.split("val").tolist() == [2] and store.split("test").tolist() == [3]
    indptr, indices = np.asarray(store.indptr), np.asarray(store.indices)
    w = np.asarray(store.edge_weight)
    first_row = {(0, 1): 0, (1, 2): 1, (0, 2): 2, (2, 3): 3}
    for v in range(5):
        for k in range(indptr[v], indptr[v + 1]):
            u = int(indices[k])
            assert w[k] == first_row[(min(u, v), max(u, v))] + 1
    directed = open_store(import_graph(src, tmp_path / "d", symmetrize=False, progress=False))
    assert directed.num_edges == 5  # duplicate 0->1 and self loop 3->3 dropped; 1->0 kept


@pytest.mark.parametrize("streaming", [False, True])
def test_edgelist_edge_features_follow_symmetrization_and_dedup(tmp_path, streaming):
    # rows: 0:0-1 1:1-2 2:2-0 3:2-3 4:1-0 (same pair as row 0) 5:3-3 (self loop) 6:0-1 (duplicate of row 0)
    src = make_edgelist(tmp_path / "g")
    feat = np.arange(14, dtype=np.float32).reshape(7, 2)
    store = open_store(import_graph(src, tmp_path / "s", streaming=streaming, chunk_edges=2, progress=False))
    indptr, indices, ef = np.asarray(store.indptr), np.asarray(store.indices), np.asarray(store.edge_feat)
    dst = np.repeat(np.arange(store.num_nodes), np.diff(indptr))
    first_row = {(0, 1): 0, (1, 2): 1, (0, 2): 2, (2, 3): 3}  # the first row naming the pair, either direction
    want = feat[[first_row[(min(u, v), max(u, v))] for u, v in zip(indices, dst)]]
    np.testing.assert_array_equal(ef, want)
    # the reverse CSR's permutation gives each reversed edge its forward edge's row
    rev_indptr, rev_indices, rev_perm = store.reverse_csr()
    rsrc = np.repeat(np.arange(store.num_nodes), np.diff(rev_indptr))
    np.testing.assert_array_equal(indices[rev_perm], rsrc)
    np.testing.assert_array_equal(dst[rev_perm], rev_indices)
    np.testing.assert_array_equal(ef[rev_perm], feat[[first_row[(min(u, v), max(u, v))]
                                                      for u, v in zip(rsrc, rev_indices)]])
    directed = open_store(import_graph(src, tmp_path / "d", symmetrize=False, streaming=streaming, progress=False))
    d_dst = np.repeat(np.arange(directed.num_nodes), np.diff(np.asarray(directed.indptr)))
    rows = {(0, 1): 0, (1, 2): 1, (2, 0): 2, (2, 3): 3, (1, 0): 4}  # direction kept; row 6 loses to row 0
    want = feat[[rows[(u, v)] for u, v in zip(np.asarray(directed.indices), d_dst)]]
    np.testing.assert_array_equal(np.asarray(directed.edge_feat), want)


def test_edgelist_one_dimensional_edge_features(tmp_path):
    src = make_edgelist(tmp_path / "g")
    np.save(src / "edge_features.npy", np.arange(7, dtype=np.float64))
    store = open_store(import_graph(src, tmp_path / "s", progress=False))
    assert store.edge_feat.shape == (store.num_edges, 1) and store.edge_feat.dtype == np.float32


def test_edgelist_streaming_equals_in_memory(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "g"
    folder.mkdir()
    e = rng.integers(0, 50, (400, 2))
    (folder / "edges.csv").write_text("\n".join(f"{s},{d}" for s, d in e))
    np.save(folder / "edge_features.npy", rng.standard_normal((400, 3)).astype(np.float32))
    np.save(folder / "labels.npy", rng.integers(0, 3, 60))
    a = open_store(import_graph(folder, tmp_path / "a", progress=False))
    b = open_store(import_graph(folder, tmp_path / "b", streaming=True, chunk_edges=7, progress=False))
    assert b.manifest["source"]["streaming"] is True
    assert a.num_nodes == b.num_nodes == 60
    for name in a.manifest["arrays"]:
        np.testing.assert_array_equal(a.array(name), b.array(name), err_msg=name)


def test_edgelist_single_file_and_num_nodes(tmp_path):
    p = tmp_path / "edges.txt"
    p.write_text("0 1\n1 2\n")
    store = open_store(import_graph(p, tmp_path / "s", num_nodes=10, progress=False))
    assert store.num_nodes == 10 and store.num_edges == 4 and store.x is None


BAD_INPUTS = {
    "non-integer id": ("edges.txt", "0 1\n2 x\n", r"edges.txt: line 2: 'x' is not an integer"),
    "negative id": ("edges.txt", "0 1\n# c\n-2 1\n", r"edges.txt: line 3: negative node id"),
    "empty graph": ("edges.txt", "# nothing here\n\n", r"edges.txt: no edges found"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_edgelist_bad_text(tmp_path, case):
    fname, content, match = BAD_INPUTS[case]
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / fname).write_text(content)
    out = tmp_path / "out"
    with pytest.raises(TrellisUserError, match=match):
        import_graph(folder, out)
    assert_nothing_written(out)


@pytest.mark.parametrize(
    ("file", "value", "match"),
    [
        ("edges.npy", np.array([[0, 1], [1, -1]]), r"edges.npy \(column 1\): row 1 has negative node id -1"),
        ("edges.npy", np.array([[0, 1], [1, 9]]), r"edges.npy \(column 1\): row 1 has node id 9 but the graph has 5"),
        ("edges.npy", np.array([[0, 1.5]]), "row 0 has non-integer node id 1.5"),
        ("features.npy", np.array([[0, 1.0]] * 4 + [[np.nan, 0]]), r"features.npy: features: row 4 contains NaN"),
        ("features.npy", np.zeros((3, 2)), r"features.npy has 3 rows but .*labels.npy has 5"),
        ("labels.npy", np.zeros(4, dtype=int), r"features.npy has 5 rows but .*labels.npy has 4"),
        ("labels.npy", np.array([0, 1, 0.5, 1, 0]), r"labels.npy: label row 2 is 0.5"),
        ("train.npy", np.array([0, 7]), r"train.npy: row 1 has node id 7 but the graph has 5 nodes"),
        ("edge_weights.npy", np.ones(3), r"edge_weights.npy: has 3 rows but the edge list .* has 7 edges"),
        ("edge_features.npy", np.full((7, 2), np.inf), r"edge_features.npy: row 0 contains NaN or Inf"),
        ("edge_features.npy", np.array(["a"] * 7), r"edge_features.npy: dtype <U1 is not numeric"),
        ("edge_features.npy", np.ones((5, 2)), r"edge_features.npy: has 5 rows but the edge list .*edges.txt has 7 "
                                               r"edges"),
        ("edge_features.npy", np.ones((7, 2, 2)), r"edge_features.npy: expected a 2-D array \(\[E, D\]\) but got "
                                                  r"shape \(7, 2, 2\)"),
        ("edge_features.npy", np.array([[0.0, 1]] * 3 + [[1, np.nan]] + [[0, 1]] * 3),
         r"edge_features.npy: row 3 contains NaN or Inf"),
    ],
)
def test_edgelist_bad_arrays(tmp_path, file, value, match):
    folder = make_edgelist(tmp_path / "g", text=file != "edges.npy")
    np.save(folder / file, value)
    out = tmp_path / "out"
    for streaming in (False, True):
        with pytest.raises(TrellisUserError, match=match):
            import_graph(folder, out, streaming=streaming, progress=False)
        assert_nothing_written(out)


def test_edgelist_rows_against_num_nodes(tmp_path):
    folder = make_edgelist(tmp_path / "g")
    with pytest.raises(TrellisUserError, match=r"features.npy: features have 5 rows but the graph has 6 nodes"):
        import_graph(folder, tmp_path / "out", num_nodes=6)
    (folder / "features.npy").unlink()
    with pytest.raises(TrellisUserError, match=r"labels.npy: labels have 5 rows but the graph has 4 nodes"):
        import_graph(folder, tmp_path / "out", num_nodes=4)
    assert_nothing_written(tmp_path / "out")


def test_missing_inputs_and_unknown_format(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(TrellisUserError, match="not found"):
        import_graph(tmp_path / "nope", out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrellisUserError, match="no edge file"):
        import_graph(tmp_path / "empty", out, format="edgelist")
    with pytest.raises(TrellisUserError, match="cannot tell the format"):
        import_graph(tmp_path / "empty", out)
    with pytest.raises(TrellisUserError, match="unknown format 'graphml'"):
        import_graph(tmp_path / "empty", out, format="graphml")
    with pytest.raises(TrellisUserError, match="--split-name does not apply to --format edgelist"):
        import_graph(make_edgelist(tmp_path / "g"), out, split_name="x")
    assert_nothing_written(out)


def test_existing_output(tmp_path):
    src = make_edgelist(tmp_path / "g")
    out = tmp_path / "s"
    import_graph(src, out, progress=False)
    with pytest.raises(TrellisUserError, match="already exists"):
        import_graph(src, out)
    import_graph(src, out, overwrite=True, symmetrize=False, progress=False)
    assert open_store(out).num_edges == 5
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(TrellisUserError, match="not a Trellis store; refusing to overwrite"):
        import_graph(src, precious, overwrite=True)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_edgelist_random_fractional_split(tmp_path):
    src = make_edgelist(tmp_path / "g")
    for f in ("train.npy", "val.npy", "test.npy"):
        (src / f).unlink()
    store = open_store(import_graph(src, tmp_path / "s", split="0.5,0.25,0.25", split_seed=3, progress=False))
    got = {k: store.split(k).tolist() for k in ("train", "val", "test")}
    assert sorted(got["train"] + got["val"] + got["test"]) == [0, 1, 2, 3]  # the labelled nodes, once each
    assert (len(got["train"]), len(got["val"]), len(got["test"])) == (2, 1, 1)
    again = open_store(import_graph(src, tmp_path / "t", split=(0.5, 0.25, 0.25), split_seed=3, progress=False))
    assert {k: again.split(k).tolist() for k in got} == got
    with pytest.raises(TrellisUserError, match="summing to 1"):
        import_graph(src, tmp_path / "u", split="0.5,0.5,0.5", progress=False)
    with pytest.raises(TrellisUserError, match="--split-seed seeds --split"):
        import_graph(src, tmp_path / "v", split_seed=1, progress=False)
    assert not (tmp_path / "u").exists() and not (tmp_path / "v").exists()
    make_edgelist(tmp_path / "h")
    with pytest.raises(TrellisUserError, match="has split files"):
        import_graph(tmp_path / "h", tmp_path / "w", split="0.5,0.25,0.25", progress=False)


def test_edgelist_random_split_of_multilabel_labels_skips_unlabelled_rows(tmp_path):
    """A multilabel store's --split put its unlabelled rows (all -1) into the splits; training then refused it."""
    src = tmp_path / "g"
    src.mkdir()
    (src / "edges.txt").write_text("".join(f"{i} {i + 1}\n" for i in range(9)))
    y = np.array([[0, 1], [1, 1], [-1, -1], [-1, -1], [0, 0], [1, 0], [-1, -1], [1, 1], [0, 1], [-1, -1]])
    np.save(src / "labels.npy", y)
    store = open_store(import_graph(src, tmp_path / "s", split="0.4,0.3,0.3", progress=False))
    ids = np.concatenate([store.split(k) for k in ("train", "val", "test")])
    assert sorted(ids.tolist()) == [0, 1, 4, 5, 7, 8]


def test_edgelist_short_labels_are_named_as_the_cause(tmp_path):
    src = tmp_path / "g"
    src.mkdir()
    (src / "edges.txt").write_text("0 1\n1 2\n2 3\n3 4\n")
    np.save(src / "labels.npy", np.array([0, 1, 0]))
    with pytest.raises(TrellisUserError, match=r"labels.npy has 3 rows, so the graph has 3 nodes, but the edges "
                                               r"name more .*give labels.npy one row per node, or pass --num-nodes"):
        import_graph(src, tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()


def test_edge_list_errors_name_the_file_at_fault(tmp_path):
    """A split file's bad id was blamed on labels.npy ('give labels.npy one row per node'); a uint64 id beyond 2**63
    was reported as a negative id."""
    from trellis.data.importers.edgelist import import_edgelist

    edges = np.array([[0, 1], [1, 2], [2, 3], [3, 0]])
    d = tmp_path / "oob"
    d.mkdir()
    np.save(d / "edges.npy", edges)
    np.save(d / "labels.npy", np.array([0, 1, 0, 1]))
    np.save(d / "train.npy", np.array([0, 9]))
    with pytest.raises(TrellisUserError, match=r"train\.npy: row 1 has node id 9") as err:
        import_edgelist(d, tmp_path / "s1", progress=False)
    assert "labels.npy" not in str(err.value)
    u = tmp_path / "u64"
    u.mkdir()
    np.save(u / "edges.npy", np.array([[0, 1], [2**63 + 5, 1]], dtype=np.uint64))
    with pytest.raises(TrellisUserError, match="node id 9223372036854775813, beyond 64-bit signed ids"):
        import_edgelist(u, tmp_path / "s2", progress=False)


def test_planetoid_test_index_beyond_the_graph_is_refused(dataset, tmp_path):
    """One damaged test.index line (999999) wrote a 1,000,000-node, 5.4 GB store padded with empty rows."""
    src = tmp_path / "cora"
    shutil.copytree(dataset("cora"), src)
    ids = (src / "ind.cora.test.index").read_text().split()
    ids[0] = "999999"
    (src / "ind.cora.test.index").write_text("\n".join(ids) + "\n")
    with pytest.raises(TrellisUserError, match=r"ind\.cora\.test\.index: test id 999999 but the graph has 2708 nodes"):
        load_planetoid(src)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("fmt", ["txt", "npy"])
def test_a_stray_huge_id_is_refused_before_its_node_arrays_are_made(tmp_path, streaming, fmt):
    """One id of 5e9 in an edge list (no node count given) asked for 37 GiB: a MemoryError traceback."""
    from trellis.data.importers.edgelist import import_edgelist

    d = tmp_path / "el"
    d.mkdir()
    if fmt == "txt":
        (d / "edges.txt").write_text("# ids\n0 1\n1 2\n2 5000000000\n")
        where = r"edges\.txt: line 4"
    else:
        np.save(d / "edges.npy", np.array([[0, 1], [1, 2], [2, 5_000_000_000]]))
        where = r"edges\.npy \(column 1\): row 2"
    with pytest.raises(TrellisUserError, match=where + r" has node id 5,000,000,000, so the graph would have "
                                                     r"5,000,000,001 nodes.*renumber them"):
        import_edgelist(d, tmp_path / "s", streaming=streaming, progress=False)
    assert not (tmp_path / "s").exists()


def test_from_arrays_refuses_a_huge_id_too(tmp_path):
    from trellis.data import from_arrays

    with pytest.raises(TrellisUserError, match=r"dst: row 1 has node id 99,999,999,999"):
        from_arrays(src=np.array([0, 1]), dst=np.array([1, 99_999_999_999]), out=tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_npz_with_a_damaged_member_is_one_error(dataset, tmp_path):
    """2,000 flipped bytes inside amazon_electronics_computers.npz: a BadZipFile traceback (bad CRC-32 of a member,
    read lazily after the file opened)."""
    src = tmp_path / "computers.npz"
    original = dataset("amazon-computers") / "amazon_electronics_computers.npz"
    _flip_bytes(original, src, original.stat().st_size // 2, 2000)
    out = tmp_path / "out"
    with pytest.raises(TrellisUserError, match=r"computers.npz: (a member of the .npz file is damaged|not a readable)"):
        import_graph(src, out, format="npz")
    assert_nothing_written(out)


def test_from_networkx_names_the_node_without_the_attribute(tmp_path):
    import networkx as nx

    from trellis.data.convert import from_networkx

    g = nx.Graph()
    g.add_node("a", feat=[1.0, 2.0])
    g.add_node("b")
    g.add_edge("a", "b")
    with pytest.raises(TrellisUserError, match=r"node 'b' has no attribute 'feat'"):
        from_networkx(g, out=tmp_path / "s", feature_attr="feat")
