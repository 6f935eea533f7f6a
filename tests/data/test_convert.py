from __future__ import annotations

from types import SimpleNamespace

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from trellis.data.convert import from_arrays, from_networkx, from_pyg, from_scipy
from trellis.data.store import open_store
from trellis.errors import TrellisUserError


def test_from_arrays_keeps_graph_as_given(tmp_path):
    s = open_store(from_arrays([0, 1, 1, 2, 0], [1, 2, 2, 2, 1], out=tmp_path / "s", edge_weight=[1, 2, 3, 4, 5],
                                symmetrize=False))
    # directed, self loop kept, duplicates dropped keeping the first
    assert s.num_nodes == 3 and s.num_edges == 3
    np.testing.assert_array_equal(s.indptr, [0, 0, 1, 3])
    np.testing.assert_array_equal(s.indices, [0, 1, 2])
    np.testing.assert_array_equal(s.edge_weight, [1, 2, 4])


def test_from_arrays_torch_and_masks(tmp_path):
    mask = torch.tensor([True, False, True, False])
    s = open_store(from_arrays(torch.tensor([0, 1]), torch.tensor([1, 2]), 4, out=tmp_path / "s",
                               x=torch.ones(4, 2), y=torch.tensor([0, 1, 0, 1]), splits={"train": mask},
                               symmetrize=True))
    assert s.num_edges == 4 and s.split("train").tolist() == [0, 2] and s.num_features == 2


def test_from_arrays_errors(tmp_path):
    out = tmp_path / "s"
    with pytest.raises(TrellisUserError, match="x: features have 2 rows but the graph has 3 nodes"):
        from_arrays([0], [1], 3, out=out, x=np.ones((2, 2)))
    with pytest.raises(TrellisUserError, match="y: labels have 2 rows but the graph has 3 nodes"):
        from_arrays([0], [1], 3, out=out, y=np.ones(2, dtype=int))
    with pytest.raises(TrellisUserError, match="row 0 has node id 5 but the graph has 3 nodes"):
        from_arrays([5], [1], 3, out=out)
    with pytest.raises(TrellisUserError, match="unknown split 'dev'"):
        from_arrays([0], [1], 3, out=out, splits={"dev": [0]})
    with pytest.raises(TrellisUserError, match="x: features: row 1 contains NaN"):
        from_arrays([0], [1], 3, out=out, x=np.array([[0.0], [np.nan], [1.0]]))
    assert not out.exists()


def test_from_scipy(tmp_path):
    adj = sp.csr_matrix(np.array([[0, 2, 0], [0, 0, 3], [1, 0, 0]], dtype=np.float32))
    s = open_store(from_scipy(adj, out=tmp_path / "s", weighted=True))
    # adj[i, j] is i -> j, so row j of the in-edge CSR lists i
    np.testing.assert_array_equal(s.indptr, [0, 1, 2, 3])
    np.testing.assert_array_equal(s.indices, [2, 0, 1])
    np.testing.assert_array_equal(s.edge_weight, [1, 2, 3])
    with pytest.raises(TrellisUserError, match="must be square"):
        from_scipy(sp.csr_matrix((2, 3)), out=tmp_path / "t")


def test_from_scipy_sums_a_coos_repeated_entries_as_scipy_does(tmp_path):
    """A COO's repeated entries are one matrix entry, their sum; the importer kept the first (weight 1 for an
    entry scipy reads as 3) and an entry summing to zero stayed an edge."""
    adj = sp.coo_matrix((np.array([1.0, 2.0, 4.0, -4.0, 5.0]), (np.array([0, 0, 1, 1, 2]), np.array([1, 1, 2, 2, 0]))),
                        shape=(3, 3))
    s = open_store(from_scipy(adj, out=tmp_path / "s", weighted=True))
    np.testing.assert_array_equal(s.indptr, [0, 1, 2, 2])  # 1 -> 2 summed to zero: no edge
    np.testing.assert_array_equal(s.indices, [2, 0])
    np.testing.assert_array_equal(s.edge_weight, [5, 3])
    assert adj.tocsr()[0, 1] == 3


def test_from_networkx(tmp_path):
    g = nx.Graph()
    g.add_node("a", feat=[1.0, 0.0], label=0)
    g.add_node("b", feat=[0.0, 1.0], label=1)
    g.add_node("c", feat=[1.0, 1.0], label=1)
    g.add_edge("a", "b", w=2.0)
    g.add_edge("b", "c", w=3.0)
    s = open_store(from_networkx(g, out=tmp_path / "s", feature_attr="feat", label_attr="label", weight_attr="w"))
    assert s.num_nodes == 3 and s.num_edges == 4  # undirected -> both directions
    np.testing.assert_array_equal(s.y, [0, 1, 1])
    np.testing.assert_array_equal(s.x[2], [1.0, 1.0])
    np.testing.assert_array_equal(s.edge_weight, [2, 2, 3, 3])
    d = open_store(from_networkx(nx.DiGraph([(0, 1), (1, 2)]), out=tmp_path / "d"))
    assert d.num_edges == 2


def test_from_pyg_duck_typed(tmp_path):
    data = SimpleNamespace(
        edge_index=torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]]),
        num_nodes=4,
        x=torch.arange(8, dtype=torch.float32).reshape(4, 2),
        y=torch.tensor([0, 1, 1, 0]),
        train_mask=torch.tensor([[True, False], [False, True], [False, False], [False, False]]),
        val_mask=torch.tensor([False, False, True, False]),
        test_mask=torch.tensor([False, False, False, True]),
        edge_attr=torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]),
    )
    s = open_store(from_pyg(data, tmp_path / "s", split_index=1))
    assert s.num_nodes == 4 and s.num_edges == 4 and s.edge_feat.shape == (4, 2)
    assert s.split("train").tolist() == [1] and s.split("val").tolist() == [2]
    # edge features follow their edges: edge 1 -> 2 had [0, 1]
    row2 = slice(int(s.indptr[2]), int(s.indptr[3]))
    assert s.indices[row2].tolist() == [1] and s.edge_feat[row2].tolist() == [[0.0, 1.0]]
    with pytest.raises(TrellisUserError, match=r"edge_index must have shape \[2, E\]"):
        from_pyg(SimpleNamespace(edge_index=torch.zeros(3, 3)), tmp_path / "t")


def test_multi_split_masks_become_the_stores_fixed_splits(tmp_path):
    """PyG's [N, S] masks (WikiCS, the heterophilous sets) kept only one column: split_seed=K had nothing to pick.
    All S are now kept, a mask given once (WikiCS's test mask) is every split's, and split_index is the store's."""
    n = 6
    train = np.zeros((n, 3), bool)
    train[[0, 1, 2], [0, 1, 2]] = True
    val = np.zeros((n, 3), bool)
    val[3, :] = True
    test = np.zeros(n, bool)
    test[[4, 5]] = True
    data = SimpleNamespace(edge_index=torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 5]]), num_nodes=n,
                           x=torch.ones(n, 2), y=torch.tensor([0, 1, 0, 1, 0, 1]),
                           train_mask=torch.from_numpy(train), val_mask=torch.from_numpy(val),
                           test_mask=torch.from_numpy(test))
    s = open_store(from_pyg(data, tmp_path / "s", split_index=2))
    np.testing.assert_array_equal(np.asarray(s.split_sets), [[1, 0, 0, 2, 3, 3], [0, 1, 0, 2, 3, 3],
                                                             [0, 0, 1, 2, 3, 3]])
    assert s.split("train").tolist() == [2] and s.split("val").tolist() == [3] and s.split("test").tolist() == [4, 5]
    with pytest.raises(TrellisUserError, match="split_index 3 is out of range: the masks hold 3 splits"):
        from_pyg(data, tmp_path / "t", split_index=3)
    with pytest.raises(TrellisUserError, match=r"val split: node 3 is in split 0's val mask and in another"):
        from_arrays([0], [1], out=tmp_path / "t", splits={"train": train | val, "val": val})
    with pytest.raises(TrellisUserError, match=r"train split, val split hold different numbers of splits \(3, 2\)"):
        from_arrays([0], [1], out=tmp_path / "t", splits={"train": train, "val": val[:, :2]})
    assert not (tmp_path / "t").exists()


def test_from_arrays_symmetrizes_by_default_like_the_cli(tmp_path):
    s = open_store(from_arrays([0, 1, 2], [1, 2, 0], 3, out=tmp_path / "s"))
    assert s.num_edges == 6  # every edge in both directions
    kept = open_store(from_arrays([0, 1, 2], [1, 2, 0], 3, out=tmp_path / "k", symmetrize=False))
    assert kept.num_edges == 3


@pytest.mark.parametrize("train, message", [
    (np.array([1, 0, 1, 0, 0, 0], dtype=np.uint8), "node 0 appears 4 times in the split; it looks like a 0/1 mask"),
    (np.array([2, 2, 3]), r"node 2 appears 2 times in the split; give each node once"),
    (np.zeros((2, 6), dtype=bool), r"masks of shape \[2, 6\] for 6 nodes; give them as \[nodes, splits\]"),
    (np.zeros((6, 2)), r"a 2-D split must be boolean masks \[nodes, splits\] \(got dtype float64\)"),
])
def test_split_ids_that_would_train_on_the_wrong_nodes_are_refused(tmp_path, train, message):
    """A uint8 mask (older PyG and DGL) was read as node ids, duplicates trained a node several times, and a 2-D mask
    was flattened into positions that are not node ids (a 2-D mask is now S splits, [nodes, splits], and one the
    other way round or of values that are not 0/1 is refused)."""
    with pytest.raises(TrellisUserError, match=message):
        from_arrays([0, 1, 2], [1, 2, 3], out=tmp_path / "s", num_nodes=6, x=np.ones((6, 2), np.float32),
                    y=np.array([0, 1, 0, 1, 0, 1]), splits={"train": train})
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("kw", [{"x": np.full((4, 2), 1e300)}, {"edge_weight": [1e300, 1.0, 1.0]}])
def test_values_beyond_float32_are_refused_before_they_become_inf(tmp_path, kw):
    """1e300 features imported with exit 0 as Inf, and the store then refused to open ("damaged, re-import")."""
    with pytest.raises(TrellisUserError, match=r"row 0 holds 1e\+300, beyond float32"):
        from_arrays([0, 1, 2], [1, 2, 3], out=tmp_path / "s", num_nodes=4, **kw)
    assert not (tmp_path / "s").exists()


def test_a_stray_huge_class_id_is_refused_at_import(tmp_path):
    """A label of 1e9 imported as 1,000,000,001 classes; training then died allocating 64 GB."""
    with pytest.raises(TrellisUserError, match=r"label row 2 is class 1000000000, so the store would have "
                                               r"1,000,000,001 classes for 4 nodes"):
        from_arrays([0, 1, 2], [1, 2, 3], out=tmp_path / "s", num_nodes=4, y=np.array([0, 1, 10**9, 1]))
    assert not (tmp_path / "s").exists()
