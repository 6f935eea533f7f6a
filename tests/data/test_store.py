from __future__ import annotations

import json
import os

import numpy as np
import pytest

from trellis.data import store as store_mod
from trellis.data.csr import edges_to_csr
from trellis.data.store import StoreWriter, open_store, store_writer, write_store
from trellis.errors import TrellisUserError
from trellis.utils.csr import build_reverse_csr


def small_graph():
    csr = edges_to_csr([0, 1, 2, 3, 0], [1, 2, 3, 0, 2], 5, symmetrize=True)
    rng = np.random.default_rng(0)
    return {
        "indptr": csr.indptr,
        "indices": csr.indices,
        "x": rng.standard_normal((5, 3)).astype(np.float32),
        "y": np.array([0, 1, 2, 1, -1]),
        "splits": {"train": np.array([0, 1]), "val": np.array([2]), "test": np.array([3])},
        "edge_weight": np.arange(csr.num_edges, dtype=np.float32),
        "edge_feat": np.arange(2 * csr.num_edges, dtype=np.float32).reshape(-1, 2),
    }


def assert_nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_round_trip(tmp_path):
    g = small_graph()
    path = write_store(tmp_path / "s", name="tiny", source={"importer": "test"}, **g)
    s = open_store(path, verify=True)
    assert (s.num_nodes, s.num_edges, s.num_features, s.num_classes, s.task, s.name) == (5, 10, 3, 3, "multiclass",
                                                                                         "tiny")
    for key in ("indptr", "indices", "x", "y", "edge_weight", "edge_feat"):
        np.testing.assert_array_equal(getattr(s, key), g[key])
    for k, ids in g["splits"].items():
        np.testing.assert_array_equal(s.split(k), ids)
    for got, want in zip(s.reverse_csr(), build_reverse_csr(g["indptr"], g["indices"], 5)):
        np.testing.assert_array_equal(got, want)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "trellis-store" and manifest["source"] == {"importer": "test"}
    assert set(manifest["arrays"]) >= {"indptr", "indices", "rev_indptr", "rev_indices", "rev_perm", "x", "y"}
    assert all(len(m["sha256"]) == 64 for m in manifest["arrays"].values())


def test_store_directory_honours_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_store(tmp_path / "s", **small_graph())
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o755  # readable by others, like any output directory


def test_tampered_array_is_refused(tmp_path):
    path = write_store(tmp_path / "s", **small_graph())
    x = path / "x.npy"
    data = bytearray(x.read_bytes())
    data[-1] ^= 0xFF  # flip a feature byte; shape and dtype unchanged
    x.write_bytes(bytes(data))
    with pytest.raises(TrellisUserError, match=r"x.npy: sha256 does not match the manifest .* re-import"):
        open_store(path)
    open_store(path, verify=False)  # explicit opt-out still opens (for huge stores)


def test_truncated_and_missing_files_are_refused(tmp_path):
    path = write_store(tmp_path / "s", **small_graph())
    idx = path / "indices.npy"
    idx.write_bytes(idx.read_bytes()[:-16])
    with pytest.raises(TrellisUserError, match=r"indices.npy: unreadable .* damaged, re-import"):
        open_store(path, verify=False)
    (path / "indices.npy").unlink()
    with pytest.raises(TrellisUserError, match=r"indices.npy: array 'indices' listed in the manifest is missing"):
        open_store(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(TrellisUserError, match="manifest is not valid JSON"):
        open_store(path)
    (path / "manifest.json").unlink()
    with pytest.raises(TrellisUserError, match="not a Trellis store"):
        open_store(path)


def test_interrupted_write_leaves_nothing(tmp_path):
    out = tmp_path / "s"
    with pytest.raises(KeyboardInterrupt):
        with store_writer(out) as w:
            w.add("indptr", np.array([0, 1]))
            raise KeyboardInterrupt
    assert_nothing_written(out)


def test_failure_during_commit_leaves_nothing(tmp_path, monkeypatch):
    def boom(path):
        raise OSError("disk full")

    monkeypatch.setattr(store_mod, "_array_meta", boom)
    out = tmp_path / "s"
    with pytest.raises(OSError, match="disk full"):
        write_store(out, **small_graph())
    assert_nothing_written(out)


def test_killed_writer_leaves_no_store_that_opens(tmp_path):
    out = tmp_path / "s"
    w = StoreWriter(out)
    w.add("indptr", np.array([0, 1]))
    w.add("indices", np.array([0]))  # process "killed" here: no commit
    with pytest.raises(TrellisUserError, match="not a Trellis store"):
        open_store(out)
    assert w.tmp.exists()  # the hidden temp dir is the only trace
    w.abort()
    assert_nothing_written(out)


def test_overwrite(tmp_path):
    g = small_graph()
    path = write_store(tmp_path / "s", **g)
    with pytest.raises(TrellisUserError, match="already exists"):
        write_store(path, **g)
    g2 = dict(g, x=g["x"] * 2)
    write_store(path, overwrite=True, **g2)
    np.testing.assert_array_equal(open_store(path).x, g2["x"])
    assert [p.name for p in tmp_path.iterdir()] == ["s"]


def test_validation_errors_write_nothing(tmp_path):
    g = small_graph()
    out = tmp_path / "s"
    for bad, match in (
        (dict(x=g["x"][:3]), "features have 3 rows but the graph has 5 nodes"),
        (dict(y=g["y"][:4]), "labels have 4 rows"),
        (dict(splits={"train": np.array([9])}), "train split row 0 has node id 9 outside"),
        (dict(edge_weight=np.full(10, np.nan, dtype=np.float32)), "edge weights row 0 contains NaN"),
        (dict(splits={"train": np.array([0, 1]), "test": np.array([1, 3])}),
         "node 1 is in both the train and the test"),
        (dict(splits={"train": np.array([0, 4])}), r"train node 4 has no label \(-1\)"),
    ):
        with pytest.raises(TrellisUserError, match=match):
            write_store(out, **{**g, **bad})
        assert_nothing_written(out)


def test_feature_norm_auto_reads_the_features_not_the_importer(tmp_path, data_dir):
    """The same Cora features get the same choice from either importer; Computers' long rows get l2."""
    from trellis.data.importers import import_graph
    from trellis.data.store import feature_norm_of, open_store

    cora = import_graph(data_dir / "cora", tmp_path / "cora", format="planetoid", progress=False)
    assert open_store(cora).preferred_feature_norm == "row"
    npz = import_graph(data_dir / "cora-npz", tmp_path / "coranpz", format="npz", progress=False)
    assert open_store(npz).preferred_feature_norm == "row"
    comp = import_graph(data_dir / "amazon-computers" / "amazon_electronics_computers.npz", tmp_path / "comp",
                        format="npz", progress=False)
    assert open_store(comp).preferred_feature_norm == "l2"
    # the share of non-zeros decides whether batch strategies take the rows sparse (at most 10%)
    x = np.asarray(open_store(cora).x)
    assert open_store(cora).feature_density == np.count_nonzero(x) / x.size  # Cora is read whole: exact
    assert 0.3 < open_store(comp).feature_density < 0.4  # Computers' long rows stay dense
    import trellis

    trellis.partition(cora, 2, out=tmp_path / "lay", move_features=True)  # the rows leave: both are recorded
    moved = open_store(cora)
    assert moved.moved_to("x") is not None and moved.manifest["feature_density"] == np.count_nonzero(x) / x.size
    assert moved.feature_density == moved.manifest["feature_density"]
    rng = np.random.default_rng(0)
    assert feature_norm_of(rng.normal(size=(100, 8)))[0] == "none"  # signed
    assert feature_norm_of(rng.random((100, 8)))[0] == "none"  # dense
    bow = (rng.random((100, 1000)) < 0.02).astype(np.float32)  # ~20 words per row
    assert feature_norm_of(bow)[0] == "row"
    long_rows = (rng.random((100, 1000)) < 0.3).astype(np.float32)  # ~300 words per row
    assert feature_norm_of(long_rows)[0] == "l2"


def _rewrite(path, name, arr):
    """Replace array ``name`` of the store at ``path`` and re-hash the manifest (a damage the hash cannot see)."""
    manifest = json.loads((path / "manifest.json").read_text())
    np.save(path / f"{name}.npy", arr)
    meta = manifest["arrays"][name]
    meta["shape"], meta["dtype"] = list(arr.shape), str(arr.dtype)
    meta["sha256"] = store_mod.sha256_file(path / f"{name}.npy")
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("damage", "match"), [
    (lambda g: ("x", g["x"][:4]), "array 'x' has 4 rows but the graph has 5 nodes"),
    (lambda g: ("indptr", np.concatenate([g["indptr"][:2], g["indptr"][1:]])), "array 'indptr' has 7 rows"),
    (lambda g: ("indptr", np.array([0, 5, 2, 6, 8, 10])), "not monotone"),
    (lambda g: ("indices", np.where(np.arange(10) == 3, 99, g["indices"])), "edge 3 has node id 99 outside"),
    (lambda g: ("rev_indices", np.roll(np.asarray(g["rev_indices"]), 1)), "reverse CSR does not hold the same edges"),
    (lambda g: ("x", np.where(np.arange(15).reshape(5, 3) == 4, np.nan, g["x"]).astype(np.float32)), "NaN"),
], ids=["x-rows", "indptr-rows", "indptr-order", "index-range", "reverse", "nan"])
def test_a_store_whose_arrays_disagree_is_refused_at_open(tmp_path, damage, match):
    """Each array matching its own manifest entry is not enough: arrays that disagree with each other or hold
    impossible values (re-hashed, so only the cross-checks can see it) are one error naming the store."""
    g = small_graph()
    path = write_store(tmp_path / "s", **g)
    st = open_store(path)
    g["rev_indices"] = np.asarray(st.reverse_csr()[1])
    name, arr = damage(g)
    _rewrite(path, name, np.asarray(arr))
    with pytest.raises(TrellisUserError, match=match) as err:
        open_store(path)
    assert "the store is damaged, re-import it" in str(err.value)
