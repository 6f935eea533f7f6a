import numpy as np
import pytest
import torch

from trellis.loader.features import ArrayRows
from trellis.loader.inference import chunk_bounds, layerwise_inference
from trellis.loader.sampler import NeighborSampler
from trellis.nn import build_model
from trellis.ops.graph import CSRGraph

from .conftest import random_csr

MODELS = [("gcn", {}), ("sage", {}), ("gin", {}), ("gat", {"heads": 2}), ("mlp", {})]


def setup(name, kw, layers=2, edge_dim=0, seed=0):
    torch.manual_seed(seed)
    indptr, indices = random_csr(n=300, avg_deg=6, seed=seed)
    g = CSRGraph.from_numpy(indptr, indices, 300)
    x = torch.randn(300, 8)
    if edge_dim:
        g.edge_feat = torch.randn(g.num_edges, edge_dim)
    model = build_model(name, 8, 5, hidden=16, layers=layers, dropout=0.5, edge_dim=edge_dim, **kw).eval()
    return indptr, indices, g, x, model


@pytest.mark.parametrize("name,kw", MODELS)
def test_minibatch_forward_with_all_neighbors_equals_full_batch(name, kw):
    indptr, indices, g, x, model = setup(name, kw, layers=3)
    with torch.no_grad():
        full = model(g, x)
        targets = np.array([3, 0, 17, 299, 150, 42])
        b = NeighborSampler(indptr, indices, [-1, -1, -1]).sample(targets, 0)
        out = model(b.graph, x[b.node_ids])
    torch.testing.assert_close(out, full[targets], rtol=1e-5, atol=1e-5)


def test_gate_minibatch_with_edge_features():
    from trellis.loader.blocks import attach_edge_data

    indptr, indices, g, x, model = setup("gate", {"heads": 2}, edge_dim=3)
    with torch.no_grad():
        full = model(g, x)
        targets = np.arange(0, 300, 7)
        b = NeighborSampler(indptr, indices, [-1, -1]).sample(targets, 0)
        attach_edge_data(b.blocks, None, g.edge_feat)
        out = model(b.graph, x[b.node_ids])
    torch.testing.assert_close(out, full[targets], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,kw", MODELS)
def test_layerwise_inference_equals_full_batch(name, kw):
    indptr, indices, g, x, model = setup(name, kw, seed=1)
    model.train()  # inference must switch dropout off itself and restore the mode
    with torch.no_grad():
        full = model.eval()(g, x)
    model.train()
    out = layerwise_inference(model, indptr, indices, x, chunk_edges=300)
    assert model.training
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    rows = np.array([5, 1, 299])
    part = layerwise_inference(model, indptr, indices, x, chunk_edges=300, rows=rows)
    torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)


def test_chunk_bounds_cover_rows():
    indptr, _ = random_csr(n=1000, seed=0)
    b = chunk_bounds(indptr, 500)
    assert b[0] == 0 and b[-1] == 1000 and np.all(np.diff(b) > 0) and len(b) > 5


@pytest.mark.parametrize("name,kw", [("gcn", {}), ("sage", {}), ("gin", {}),
                                     ("gcn", {"residual": True, "norm": "layer", "layers": 3}),
                                     ("sage", {"pre_norm": True, "norm": "layer", "layers": 3}),
                                     ("sage", {"jk": "cat", "layers": 3})])
def test_whole_graph_layers_equal_chunked_layers(name, kw):
    """An SpMM layer run over the whole graph at once gives the chunked layers' outputs, rows or not."""
    kw = dict(kw)
    layers = kw.pop("layers", 2)
    indptr, indices, g, x, model = setup(name, {}, layers=layers)
    model = build_model(name, 8, 5, hidden=16, layers=layers, dropout=0.5, **kw).eval()
    whole = layerwise_inference(model, indptr, indices, x)
    chunked = layerwise_inference(model, indptr, indices, x, chunk_edges=300, whole_layers=False)
    torch.testing.assert_close(whole, chunked, rtol=1e-5, atol=1e-5)
    for rows in (np.array([5, 1, 299]), np.arange(0, 300, 2)):  # few rows: a chunked last layer; many: whole
        part = layerwise_inference(model, indptr, indices, x, rows=rows)
        torch.testing.assert_close(part, chunked[rows], rtol=1e-5, atol=1e-5)
    mapped = layerwise_inference(model, indptr, indices, ArrayRows(x.numpy()))  # first layer chunked, then whole
    torch.testing.assert_close(mapped, chunked, rtol=1e-5, atol=1e-5)


def test_weighted_gcn_inference_equals_the_full_forward():
    """Whole or in chunks, a weighted GCN normalizes by every node's whole-graph weighted degree.

    (A chunk's destinations hold all their in-edges, its sources do not: they carry their whole-graph weighted
    degree, ``CSRGraph.src_weighted_degree``.)
    """
    indptr, indices, g, x, _ = setup("gcn", {})
    model = build_model("gcn", 8, 5, hidden=16, edge_weight=True).eval()
    w = torch.rand(int(indptr[-1])) + 0.1
    g.edge_weight = w
    with torch.no_grad():
        full = model(g, x)
    whole = layerwise_inference(model, indptr, indices, x, edge_weight=w)
    torch.testing.assert_close(whole, full, rtol=1e-5, atol=1e-5)
    chunked = layerwise_inference(model, indptr, indices, x, edge_weight=w, chunk_edges=300, whole_layers=False)
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    mapped = layerwise_inference(model, indptr, indices, ArrayRows(x.numpy()), edge_weight=w, chunk_edges=300)
    torch.testing.assert_close(mapped, full, rtol=1e-5, atol=1e-5)
    rows = np.array([7, 3, 250])
    few = layerwise_inference(model, indptr, indices, x, edge_weight=w, rows=rows)  # a chunked last layer
    torch.testing.assert_close(few, full[rows], rtol=1e-5, atol=1e-5)
    unweighted = layerwise_inference(model, indptr, indices, x)
    assert (unweighted - whole).abs().max() > 1e-3  # the weights changed the result
