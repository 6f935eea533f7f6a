"""Layers against dense references, and plan-order invariance (the planner may reorder, never change results)."""

import dataclasses

import numpy as np
import pytest
import torch

from trellis.nn import GATConv, GCNConv, GINConv, SAGEConv, build_model
from trellis.ops.graph import CSRGraph


def random_graph(n=12, p=0.3, seed=0, self_loops=True, edge_dim=0):
    rng = np.random.default_rng(seed)
    adj = rng.random((n, n)) < p
    if not self_loops:
        np.fill_diagonal(adj, False)
    adj[0, :] = False  # node 0 has no in-edges (isolated as a destination)
    dst, src = np.nonzero(adj)  # row = destination
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    ef = rng.standard_normal((len(src), edge_dim)).astype(np.float32) if edge_dim else None
    g = CSRGraph.from_numpy(indptr, src.astype(np.int64), n, edge_feat=ef)
    return g, torch.from_numpy(adj.astype(np.float32))


def flipped(layer, graph, x):
    """The layer's step plan for this input with the other order of transform and aggregation."""
    plan = layer.step_plan(graph, x)
    return dataclasses.replace(plan, aggregate_first=not plan.aggregate_first)


def test_gcn_matches_dense_reference():
    torch.manual_seed(0)
    g, adj = random_graph(self_loops=False)
    x = torch.randn(12, 5)
    conv = GCNConv(5, 3)
    a_hat = adj + torch.eye(12)
    dinv = a_hat.sum(1).pow(-0.5)
    ref = (dinv[:, None] * a_hat * dinv[None, :]) @ x @ conv.lin.weight.T + conv.bias
    torch.testing.assert_close(conv(g, x), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls", [GCNConv, SAGEConv, GINConv])
@pytest.mark.parametrize("dims", [(4, 9), (9, 4)])
def test_reordering_gives_same_result_and_gradient(cls, dims):
    torch.manual_seed(1)
    g, _ = random_graph()
    conv = cls(*dims)
    x = torch.randn(12, dims[0], requires_grad=True)
    out1 = conv(g, x)
    (gx1,) = torch.autograd.grad(out1.square().sum(), x)
    out2 = conv(g, x, plan=flipped(conv, g, x))
    (gx2,) = torch.autograd.grad(out2.square().sum(), x)
    torch.testing.assert_close(out1, out2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx1, gx2, rtol=1e-4, atol=1e-5)


def test_sage_and_gin_match_dense():
    torch.manual_seed(2)
    g, adj = random_graph()
    x = torch.randn(12, 6)
    sage = SAGEConv(6, 4)
    deg = adj.sum(1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(sage(g, x), sage.lin_l((adj @ x) / deg) + sage.lin_r(x), rtol=1e-4, atol=1e-5)
    gin = GINConv(6, 4, eps=0.3)
    ref = gin.lin2(torch.relu(gin.lin1(adj @ x + 1.3 * x)))
    torch.testing.assert_close(gin(g, x), ref, rtol=1e-4, atol=1e-5)


def dense_gat(conv, adj, x, ef_dense=None):
    n, h, d = x.shape[0], conv.heads, conv.out_dim
    a = adj.clone()
    a.fill_diagonal_(1.0)
    z = conv.lin(x).view(n, h, d)
    el = (z * conv.att_src).sum(-1)  # [n, h]
    er = (z * conv.att_dst).sum(-1)
    logits = er[:, None, :] + el[None, :, :]  # [dst, src, h]
    if ef_dense is not None:
        logits = logits + ef_dense @ conv.att_edge
    logits = torch.nn.functional.leaky_relu(logits, 0.2).masked_fill(a[:, :, None] == 0, float("-inf"))
    alpha = torch.softmax(logits, dim=1)
    out = torch.einsum("ijh,jhd->ihd", alpha, z)
    if ef_dense is not None:
        agg = torch.einsum("ijh,ije->ihe", alpha, ef_dense)
        out = out + torch.einsum("nhe,hed->nhd", agg, conv.lin_edge)
    return out.reshape(n, h * d) + conv.bias


def test_gat_matches_dense_reference():
    torch.manual_seed(3)
    g, adj = random_graph()
    x = torch.randn(12, 5)
    conv = GATConv(5, 3, heads=2).eval()
    torch.testing.assert_close(conv(g, x), dense_gat(conv, adj, x), rtol=1e-4, atol=1e-5)


def test_gate_uses_edge_features_in_logits_and_messages():
    torch.manual_seed(4)
    g, adj = random_graph(self_loops=False, edge_dim=3)
    x = torch.randn(12, 5)
    conv = GATConv(5, 3, heads=2, edge_dim=3).eval()
    dst = g.dst_of_edges()
    ef_dense = torch.zeros(12, 12, 3)
    ef_dense[dst, g.indices] = g.edge_feat
    torch.testing.assert_close(conv(g, x), dense_gat(conv, adj, x, ef_dense), rtol=1e-4, atol=1e-5)
    # a signal that lives only in edge features reaches the output
    g2 = CSRGraph(g.indptr, g.indices, g.num_src, edge_feat=g.edge_feat * 2)
    assert not torch.allclose(conv(g, x), conv(g2, x))


def test_models_forward_backward_and_explain():
    g, _ = random_graph(edge_dim=2)
    x = torch.randn(12, 7)
    for name in ["gcn", "sage", "gin", "gat", "gate", "mlp"]:
        model = build_model(name, 7, 3, hidden=8, layers=2, heads=2, dropout=0.1, edge_dim=2)
        out = model(g, x)
        assert out.shape == (12, 3)
        out.sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        assert isinstance(model.explain(g), str)
        emb = model(g, x, return_embedding=True)
        assert emb.shape[0] == 12


def test_model_runs_on_blocks():
    torch.manual_seed(5)
    g, _ = random_graph()
    model = build_model("sage", 4, 2, hidden=8, layers=2, dropout=0.0).eval()
    x = torch.randn(12, 4)
    full = model(g, x)
    blocks = model([g, g], x)
    torch.testing.assert_close(full, blocks)


def test_gate_gradients_match_dense_reference_in_float64():
    """GAT-E's backward (reverse CSR, edge permutation, self loops) against autograd through a dense copy.

    Why float64 and gradcheck: the sparse kernels have hand-written backward passes that run on the
    reverse graph and move per-edge values (attention, edge features) through ``perm``; a wrong
    permutation gives the right forward result and a wrong gradient, which only a gradient check sees.
    """
    torch.manual_seed(6)
    g32, adj = random_graph(n=9, p=0.35, seed=6, self_loops=False, edge_dim=3)
    adj = adj.double()
    conv = GATConv(4, 3, heads=2, edge_dim=3).double().eval()
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    ef = g32.edge_feat.double().requires_grad_(True)
    dst = g32.dst_of_edges()

    def sparse(x, ef):  # a fresh graph per call: nothing cached from another edge-feature tensor
        return conv(CSRGraph(g32.indptr, g32.indices, g32.num_src, edge_feat=ef), x)

    def dense(x, ef):
        ef_dense = torch.zeros(9, 9, 3, dtype=torch.float64).index_put((dst, g32.indices), ef)
        return dense_gat(conv, adj, x, ef_dense)

    assert torch.autograd.gradcheck(sparse, (x, ef))
    weight = torch.randn(9, 6, dtype=torch.float64)
    grads = []
    for f in (sparse, dense):
        conv.zero_grad()
        out = f(x, ef)
        gx, gef = torch.autograd.grad((out * weight).sum(), (x, ef), retain_graph=True)
        (out * weight).sum().backward()
        grads.append([gx, gef] + [p.grad.clone() for p in conv.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert grads[0][1].abs().sum() > 0  # the edge features do receive a gradient
