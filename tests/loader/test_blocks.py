"""Edge data follows its edges into every batch (sampled blocks, cluster subgraphs, inference chunks).

Why: GAT-E reads one feature row per edge. A block whose ``eid`` points at the wrong global edge still
runs and still trains -- on the wrong features -- so these tests encode each edge's identity in its
features and check every block row against the edge it claims to be, then check GAT-E's outputs and
gradients on batches against the full graph.
"""

import numpy as np
import pytest
import torch

from trellis.loader.blocks import attach_edge_data
from trellis.loader.cluster import ClusterLoader, hash_clusters
from trellis.loader.inference import layerwise_inference
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.nn import build_model
from trellis.ops.graph import CSRGraph

from .conftest import random_csr


def identity_features(indptr, indices):
    """``ef[k] = (dst, src, k)``: a row that names its own edge."""
    dst = np.repeat(np.arange(indptr.shape[0] - 1), np.diff(indptr))
    return torch.from_numpy(np.stack([dst, indices, np.arange(indices.shape[0])], 1).astype(np.float32))


def check_block_rows(block, node_ids, ef, ew):
    ids = node_ids.numpy()
    dst = np.repeat(np.arange(block.num_dst), np.diff(block.indptr.numpy()))
    got = block.edge_feat.numpy()
    np.testing.assert_array_equal(got[:, 0], ids[dst])
    np.testing.assert_array_equal(got[:, 1], ids[block.indices.numpy()])
    np.testing.assert_array_equal(got[:, 2], block.edge_ids.numpy())
    np.testing.assert_array_equal(block.edge_weight.numpy(), ew.numpy()[block.edge_ids.numpy()])
    assert np.array_equal(ef.numpy()[block.edge_ids.numpy()], got)


@pytest.mark.parametrize("fanouts", [[3, 2], [-1, 4]])
def test_sampled_blocks_carry_their_edges_features(fanouts):
    indptr, indices = random_csr(n=300, avg_deg=6, seed=2)
    ef = identity_features(indptr, indices)
    ew = torch.rand(indices.shape[0])
    loader = NeighborLoader(NeighborSampler(indptr, indices, fanouts), np.arange(0, 300, 2), 32, prefetch=0,
                            edge_weight=ew, edge_feat=ef)
    for batch in loader.epoch(0):
        for block in batch.blocks:
            check_block_rows(block, batch.node_ids[: block.num_src], ef, ew)


@pytest.mark.parametrize("hops", [0, 1, 2])
def test_cluster_batches_carry_their_edges_features(hops):
    indptr, indices = random_csr(n=300, avg_deg=4, seed=3, hubs=False)
    ef = identity_features(indptr, indices)
    ew = torch.rand(indices.shape[0])
    loader = ClusterLoader(indptr, indices, hash_clusters(300, 12, seed=0), 3, num_layers=2, boundary_hops=hops,
                           edge_weight=ew, edge_feat=ef, prefetch=0)
    for batch in loader.epoch(1):
        for block in batch.blocks:
            check_block_rows(block, batch.node_ids[: block.num_src], ef, ew)


def _gate_setup(seed=0):
    torch.manual_seed(seed)
    indptr, indices = random_csr(n=200, avg_deg=5, seed=seed)
    g = CSRGraph.from_numpy(indptr, indices, 200)
    g.edge_feat = torch.randn(g.num_edges, 3)
    x = torch.randn(200, 6)
    model = build_model("gate", 6, 4, hidden=4, layers=2, heads=2, dropout=0.0, edge_dim=3).eval()
    return indptr, indices, g, x, model


def test_gate_on_blocks_matches_full_graph_forward_and_backward():
    """All-neighbour blocks give the full graph's outputs and parameter gradients for the targets."""
    indptr, indices, g, x, model = _gate_setup()
    targets = np.array([5, 0, 199, 3, 77])
    full = model(g, x)[targets]
    w = torch.randn_like(full)
    want = torch.autograd.grad((full * w).sum(), list(model.parameters()))
    b = NeighborSampler(indptr, indices, [-1, -1]).sample(targets, 0)
    attach_edge_data(b.blocks, None, g.edge_feat)
    out = model(b.graph, x[b.node_ids])
    got = torch.autograd.grad((out * w).sum(), list(model.parameters()))
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


def test_gate_on_one_cluster_batch_matches_full_graph():
    """A cluster batch holding every cluster is the whole graph in another node order."""
    indptr, indices, g, x, model = _gate_setup(seed=1)
    loader = ClusterLoader(indptr, indices, hash_clusters(200, 5, seed=0), 5, num_layers=2, x=x.numpy(),
                           edge_feat=g.edge_feat, prefetch=0)
    (batch,) = list(loader.epoch(0))
    with torch.no_grad():
        full = model(g, x)
        out = model(batch.graph, batch.x)
    torch.testing.assert_close(out, full[batch.targets], rtol=1e-5, atol=1e-5)


def test_gate_layerwise_inference_reads_edge_features():
    indptr, indices, g, x, model = _gate_setup(seed=2)
    with torch.no_grad():
        full = model(g, x)
    out = layerwise_inference(model, indptr, indices, x, chunk_edges=150, edge_feat=g.edge_feat)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-5)
