"""The graph view between layers: called once per layer with that layer's graph, and free to supply more rows
than it was given (a partition's owned rows followed by halo rows), for solo models and model batches."""

import numpy as np
import pytest
import torch

from trellis.nn import IDENTITY, GraphView, build_model
from trellis.nn.batched import BatchedGNN, capture_generator
from trellis.ops.graph import CSRGraph

N = 60


def whole_graph(seed=0, n=N, e=420):
    rng = np.random.default_rng(seed)
    dst = np.sort(rng.integers(0, n, e))
    src = rng.integers(0, n, e)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return indptr, src.astype(np.int64)


def part_graph(indptr, indices, own, seed=1):
    """The pull graph of the rows ``own``: destinations ``own``; sources ``own`` then the halo (shuffled).

    Every in-edge of an owned row is kept, so with the global degrees a layer's output on the owned rows
    equals the whole graph's, provided the view supplies the halo rows.
    """
    n = indptr.shape[0] - 1
    deg = np.diff(indptr)
    rows = np.repeat(own, deg[own])  # owned destination of each kept edge, in CSR order
    starts = np.repeat(indptr[own] - np.cumsum(np.r_[0, deg[own][:-1]]), deg[own])
    src = indices[starts + np.arange(rows.shape[0])]
    is_own = np.zeros(n, dtype=bool)
    is_own[own] = True
    halo = np.unique(src[~is_own[src]])
    halo = np.random.default_rng(seed).permutation(halo)  # any order: the view follows the graph's
    node_ids = np.concatenate([own, halo])
    local = np.full(n, -1, dtype=np.int64)
    local[node_ids] = np.arange(node_ids.shape[0])
    local_indptr = np.zeros(own.shape[0] + 1, dtype=np.int64)
    np.cumsum(deg[own], out=local_indptr[1:])
    g = CSRGraph.from_numpy(local_indptr, local[src], node_ids.shape[0])
    g.node_ids = torch.from_numpy(node_ids)
    in_deg = torch.from_numpy(deg.astype(np.float32))
    g.src_degree, g.dst_degree = in_deg[node_ids], in_deg[own]  # GCN normalizes with the global degrees
    return g, torch.from_numpy(own), torch.from_numpy(halo)


class Recorder:
    """Identity view that records what it was asked (and the full rows each layer read)."""

    def __init__(self):
        self.calls = []
        self.inputs = []

    def layer_input(self, layer, graph, x):
        self.calls.append((layer, graph, tuple(x.shape)))
        self.inputs.append(x.detach())
        return x


class Halo:
    """A partition's view: the owned rows it is given, then the halo rows copied from the whole-graph run."""

    def __init__(self, whole_inputs, own, halo):
        self.whole_inputs, self.own, self.halo = whole_inputs, own, halo

    def layer_input(self, layer, graph, x):
        assert x.shape[0] == self.own.shape[0] < graph.num_src
        torch.testing.assert_close(x, self.whole_inputs[layer][self.own], rtol=1e-5, atol=1e-5)
        return torch.cat([x, self.whole_inputs[layer][self.halo]])


def test_protocol_and_identity():
    assert isinstance(IDENTITY, GraphView) and isinstance(Recorder(), GraphView)
    x = torch.randn(3, 2)
    assert IDENTITY.layer_input(0, None, x) is x


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat", "gate"])
def test_the_view_is_asked_once_per_layer_and_the_identity_changes_nothing(name):
    torch.manual_seed(0)
    indptr, indices = whole_graph()
    ef = np.random.default_rng(0).standard_normal((indices.shape[0], 2)).astype(np.float32)
    g = CSRGraph.from_numpy(indptr, indices, N, edge_feat=ef)
    model = build_model(name, 5, 3, hidden=8, layers=3, heads=2, dropout=0.0, edge_dim=2).eval()
    x = torch.randn(N, 5)
    rec = Recorder()
    out = model(g, x, view=rec)
    assert torch.equal(out, model(g, x))
    assert [(i, gr) for i, gr, _ in rec.calls] == [(0, g), (1, g), (2, g)]
    assert rec.calls[0][2] == (N, 5)


def test_per_layer_graphs_each_reach_the_view():
    torch.manual_seed(1)
    indptr, indices = whole_graph()
    g1, g2 = CSRGraph.from_numpy(indptr, indices, N), CSRGraph.from_numpy(indptr, indices, N)
    model = build_model("sage", 5, 3, hidden=8, layers=2, dropout=0.0).eval()
    rec = Recorder()
    model([g1, g2], torch.randn(N, 5), view=rec)
    assert [gr for _, gr, _ in rec.calls] == [g1, g2]


@pytest.mark.parametrize("name", ["gcn", "sage", "gat"])
@pytest.mark.parametrize("parts", [2, 3])
def test_a_view_that_adds_halo_rows_gives_the_whole_graph_result(name, parts):
    """Bipartite local graphs (``num_src > num_dst``): each layer gets only its owned rows, the view appends
    the halo; every part's output equals the whole graph's rows, forward and backward."""
    torch.manual_seed(2)
    indptr, indices = whole_graph(seed=parts)
    g = CSRGraph.from_numpy(indptr, indices, N)
    model = build_model(name, 5, 3, hidden=8, layers=2, heads=2, dropout=0.0).eval()
    x = torch.randn(N, 5)
    rec = Recorder()
    whole = model(g, x, view=rec)
    owner = np.random.default_rng(parts).integers(0, parts, N)
    grads = torch.zeros_like(x)
    for p in range(parts):
        local, own, halo = part_graph(indptr, indices, np.flatnonzero(owner == p))
        assert local.num_src > local.num_dst
        x_own = x[own].clone().requires_grad_(True)
        out = model(local, x_own, view=Halo(rec.inputs, own, halo))
        assert out.shape == (own.shape[0], 3)
        torch.testing.assert_close(out, whole[own], rtol=1e-5, atol=1e-5)
        out.sum().backward()
        grads[own] = x_own.grad
    # The owned rows' own gradient path (no halo gradient is sent back here): nonzero and finite.
    assert torch.isfinite(grads).all() and grads.abs().sum() > 0


@pytest.mark.parametrize("family", ["gcn", "sage", "gin"])
def test_a_model_batch_asks_the_view_once_per_distinct_input_and_matches_solo_runs(family):
    torch.manual_seed(3)
    indptr, indices = whole_graph()
    g = CSRGraph.from_numpy(indptr, indices, N)
    x = torch.randn(N, 5)
    models = []
    for hidden in (8, 12):
        torch.manual_seed(hidden)
        models.append(build_model(family, 5, 3, hidden=hidden, layers=2, dropout=0.0).eval())
    rec = Recorder()
    bm = BatchedGNN(models, [capture_generator("cpu") for _ in models]).eval()
    outs = bm(g, x, view=rec)
    assert [i for i, _, _ in rec.calls] == [0, 1, 1]  # the features shared by both configurations: one call
    for m, o in zip(models, outs):
        torch.testing.assert_close(o, m(g, x), rtol=1e-5, atol=1e-6)
    # a halo view on a part's local graph, passed as per-layer graphs
    owner = np.random.default_rng(3).integers(0, 2, N)
    local, own, halo = part_graph(indptr, indices, np.flatnonzero(owner == 0))
    for m in models:
        solo = Recorder()
        whole = m(g, x, view=solo)
        bm_k = BatchedGNN([m]).eval()
        out = bm_k([local, local], x[own], view=Halo(solo.inputs, own, halo))[0]
        torch.testing.assert_close(out, whole[own], rtol=1e-5, atol=1e-5)
