from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from trellis.data.generate import generate, generate_rmat, generate_sbm
from trellis.data.info import store_info
from trellis.data.store import open_store
from trellis.errors import TrellisUserError


@pytest.mark.parametrize("fn", [generate_sbm, generate_rmat])
def test_deterministic_from_seed(tmp_path, fn):
    opts = dict(nodes=2000, avg_degree=6, features=8, classes=4, progress=False)
    a = open_store(fn(tmp_path / "a", seed=3, **opts))
    b = open_store(fn(tmp_path / "b", seed=3, **opts))
    c = open_store(fn(tmp_path / "c", seed=4, **opts))
    assert a.checksum == b.checksum
    assert a.checksum != c.checksum
    # the graph does not depend on the feature width (independent random streams)
    d = open_store(fn(tmp_path / "d", seed=3, **{**opts, "features": 3}))
    np.testing.assert_array_equal(a.indices, d.indices)


@pytest.mark.parametrize("fn", [generate_sbm, generate_rmat])
def test_clean_symmetric_graph_with_requested_degree(tmp_path, fn):
    s = open_store(fn(tmp_path / "g", nodes=3000, avg_degree=8, features=4, classes=3, seed=0, progress=False))
    info = store_info(s)
    assert info["symmetric"] and info["self_loops"] == 0 and info["duplicate_edges"] == 0 and info["sorted_rows"]
    assert 7.5 <= s.num_edges / s.num_nodes <= 8.0
    assert s.num_classes == 3 and s.num_features == 4 and s.task == "multiclass"
    sizes = [int(s.split(k).shape[0]) for k in ("train", "val", "test")]
    assert sizes == [300, 300, 2400]
    assert np.unique(np.concatenate([s.split(k) for k in ("train", "val", "test")])).size == 3000


def test_rmat_is_power_law(tmp_path):
    s = open_store(generate_rmat(tmp_path / "g", nodes=4096, avg_degree=8, features=0, seed=0, progress=False))
    deg = np.diff(np.asarray(s.indptr))
    assert deg.max() > 20 * deg.mean()  # heavy tail: hubs far above the mean
    assert s.x is None


def _propagate(s):
    n = s.num_nodes
    a = sp.csr_matrix((np.ones(s.num_edges), np.asarray(s.indices), np.asarray(s.indptr)), shape=(n, n)) + sp.eye(n)
    d = sp.diags(1 / np.sqrt(np.asarray(a.sum(1)).ravel()))
    return d @ a @ d


def _centroid_accuracy(x, y, train, test):
    classes = np.unique(y)
    means = np.stack([x[train][y[train] == c].mean(0) for c in classes])
    pred = classes[np.argmin(((x[test][:, None, :] - means[None]) ** 2).sum(-1), axis=1)]
    return float((pred == y[test]).mean())


def test_sbm_features_are_learnable_but_graph_helps(tmp_path):
    s = open_store(generate_sbm(tmp_path / "g", nodes=4000, avg_degree=10, features=32, classes=4, seed=0,
                                progress=False))
    x, y = np.asarray(s.x), np.asarray(s.y)
    train, test = np.asarray(s.split("train")), np.asarray(s.split("test"))
    a = _propagate(s)
    raw = _centroid_accuracy(x, y, train, test)
    smoothed = _centroid_accuracy(a @ (a @ x), y, train, test)
    assert 0.3 < raw < 0.8  # above chance (0.25), far from perfect: features alone are not enough
    assert smoothed > raw + 0.3  # propagating over a homophilous graph (a GCN) helps a lot
    # measured edge homophily is the requested one
    dst = np.repeat(np.arange(s.num_nodes), np.diff(np.asarray(s.indptr)))
    assert abs(float((y[dst] == y[np.asarray(s.indices)]).mean()) - 0.8) < 0.03


def test_homophily_zero_and_one(tmp_path):
    for h in (0.0, 1.0):
        s = open_store(generate_sbm(tmp_path / f"g{h}", nodes=500, avg_degree=6, features=0, classes=3,
                                    homophily=h, seed=1, progress=False))
        y = np.asarray(s.y)
        dst = np.repeat(np.arange(s.num_nodes), np.diff(np.asarray(s.indptr)))
        assert float((y[dst] == y[np.asarray(s.indices)]).mean()) == h


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        (dict(nodes=0), "--nodes must be >= 1"),
        (dict(nodes=10, avg_degree=8), "too dense"),
        (dict(nodes=10, avg_degree=2, classes=11), "--classes must be between 1"),
        (dict(nodes=10, avg_degree=2, homophily=1.5), "--homophily must be in"),
        (dict(nodes=10, avg_degree=2, feature_noise=-1), "--feature-noise must be >= 0"),
        (dict(nodes=10, avg_degree=2, train_frac=0.9, val_frac=0.2), "split fractions"),
    ],
)
def test_bad_arguments(tmp_path, opts, match):
    with pytest.raises(TrellisUserError, match=match):
        generate_sbm(tmp_path / "g", progress=False, **opts)
    assert not (tmp_path / "g").exists()


def test_dispatch(tmp_path):
    with pytest.raises(TrellisUserError, match="unknown generator"):
        generate("er", tmp_path / "g", nodes=10)
    with pytest.raises(TrellisUserError, match="must be >= 0 and sum to at most 1"):
        generate("rmat", tmp_path / "g", nodes=10, avg_degree=1, a=0.9, b=0.2)
