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
        (dict(nodes=10, avg_degree=2, edge_features=-1), "--edge-features must be >= 0"),
        (dict(nodes=10, avg_degree=2, edge_features=2, edge_feature_noise=-0.5), "--edge-feature-noise must be"),
        (dict(nodes=10, avg_degree=2, node_features="zeros"), "--node-features must be one of signal, noise"),
        (dict(nodes=10, avg_degree=2, features=0, node_features="noise"), "--node-features noise needs --features"),
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


def _mean_in_edge_features(s):
    """Per node, the mean feature row of its in-edges (what one aggregation over edge features sees)."""
    indptr = np.asarray(s.indptr)
    deg = np.maximum(np.diff(indptr), 1)[:, None]
    return np.add.reduceat(np.asarray(s.edge_feat), indptr[:-1], axis=0) / deg


def test_edge_features_carry_the_class_signal_alone(tmp_path):
    opts = dict(nodes=3000, avg_degree=10, features=8, classes=4, seed=5, progress=False)
    s = open_store(generate_sbm(tmp_path / "e", edge_features=6, node_features="noise", **opts))
    plain = open_store(generate_sbm(tmp_path / "p", **opts))
    # the graph, labels and splits do not depend on the feature options (independent random streams)
    for name in ("indptr", "indices", "y", "train_idx", "test_idx"):
        np.testing.assert_array_equal(s.array(name), plain.array(name))
    ef = np.asarray(s.edge_feat)
    assert ef.shape == (s.num_edges, 6) and ef.dtype == np.float32
    # both directions of an undirected edge carry the same row (as an import of a symmetrized edge list)
    rev_indptr, rev_indices, rev_perm = s.reverse_csr()
    np.testing.assert_array_equal(ef, ef[rev_perm])
    assert len({tuple(r) for r in ef.round(5).tolist()}) == s.num_edges // 2
    y, train, test = np.asarray(s.y), np.asarray(s.split("train")), np.asarray(s.split("test"))
    assert _centroid_accuracy(np.asarray(s.x), y, train, test) < 0.33  # node features: chance (0.25)
    assert _centroid_accuracy(_mean_in_edge_features(s), y, train, test) > 0.85  # in-edges: the class
    assert s.manifest["source"]["edge_features"] == 6 and s.manifest["source"]["node_features"] == "noise"
    again = open_store(generate_sbm(tmp_path / "e2", edge_features=6, node_features="noise", **opts))
    assert again.checksum == s.checksum


def test_rmat_edge_features_follow_both_directions(tmp_path):
    s = open_store(generate_rmat(tmp_path / "g", nodes=1024, avg_degree=6, features=0, edge_features=3, seed=2,
                                 edge_feature_noise=0.0, progress=False))
    ef, y = np.asarray(s.edge_feat), np.asarray(s.y)
    np.testing.assert_array_equal(ef, ef[s.reverse_csr()[2]])
    # without noise, a row is a function of the endpoints' classes only
    dst = np.repeat(np.arange(s.num_nodes), np.diff(np.asarray(s.indptr)))
    pair = np.minimum(y[dst], y[np.asarray(s.indices)]) * 4 + np.maximum(y[dst], y[np.asarray(s.indices)])
    for key in np.unique(pair):
        rows = ef[pair == key]
        np.testing.assert_allclose(rows, np.broadcast_to(rows[0], rows.shape), rtol=1e-6)


@pytest.mark.parametrize("kw, message", [
    ({"feature_noise": float("nan")}, "--feature-noise must be a finite number"),  # an unreadable store
    ({"feature_noise": float("inf")}, "--feature-noise must be a finite number"),
    ({"avg_degree": float("nan")}, "--avg-degree must be a finite number"),  # a traceback
    ({"edge_features": 2, "edge_feature_noise": float("nan")}, "--edge-feature-noise must be a finite number"),
])
def test_non_finite_generator_settings_are_refused(tmp_path, kw, message):
    with pytest.raises(TrellisUserError, match=message):
        generate_sbm(tmp_path / "g", nodes=100, progress=False, **kw)
    assert not (tmp_path / "g").exists()


def test_rmat_that_cannot_draw_the_edges_asked_for_says_so(tmp_path):
    """a=0.97 wrote 6,206 of 10,000 edges (a=1: none) with exit 0; a=nan was accepted."""
    with pytest.raises(TrellisUserError, match=r"drew only [\d,]+ distinct undirected pairs of the 5,000 asked for"):
        generate_rmat(tmp_path / "g", nodes=1000, avg_degree=10, a=0.97, b=0.01, c=0.01, progress=False)
    with pytest.raises(TrellisUserError, match="R-MAT probabilities"):
        generate_rmat(tmp_path / "h", nodes=100, a=float("nan"), progress=False)
    assert not (tmp_path / "g").exists() and not (tmp_path / "h").exists()
