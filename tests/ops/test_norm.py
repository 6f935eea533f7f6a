import torch
from hypothesis import given

from tests.ops.strategies import BACKENDS, SETTINGS, backend, edges, graphs, random_graph
from trellis.ops import gcn_norm, row_norm, spmm


def dense_adj(g):
    dst, src = edges(g)
    a = torch.zeros(g.num_dst, g.num_src, dtype=torch.float64)
    a.index_put_((dst, src), torch.ones(g.num_edges, dtype=torch.float64), accumulate=True)
    return a


@SETTINGS
@given(gs=graphs(square=True))
def test_gcn_norm_equals_dense_symmetric_normalization(gs):
    g, seed = gs
    x = torch.randn(g.num_src, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    a_hat = dense_adj(g) + torch.eye(g.num_dst, dtype=torch.float64)
    dinv = a_hat.sum(1).pow(-0.5)
    ref = (dinv[:, None] * a_hat * dinv[None, :]) @ x
    ew, sw = gcn_norm(g)
    assert gcn_norm(g)[0] is ew  # cached
    for name in BACKENDS:
        with backend(name):
            torch.testing.assert_close(spmm(g, x, ew, self_weight=sw), ref, rtol=1e-6, atol=1e-6)


def test_gcn_norm_without_self_loops_zeroes_isolated_nodes():
    g = random_graph(30, 30, 20, seed=4)
    ew, sw = gcn_norm(g, add_self_loops=False)
    assert sw is None and torch.isfinite(ew).all()
    a = dense_adj(g)
    deg = a.sum(1)
    dinv = torch.where(deg > 0, deg.pow(-0.5), torch.zeros_like(deg))
    x = torch.randn(30, 3, dtype=torch.float64)
    torch.testing.assert_close(spmm(g, x, ew), (dinv[:, None] * a * dinv[None, :]) @ x, rtol=1e-6, atol=1e-6)


def test_gcn_norm_on_blocks_uses_global_degrees_when_given():
    g = random_graph(6, 10, 25, seed=1)
    ew, sw = gcn_norm(g)
    dst, src = edges(g)
    dd = g.in_degree() + 1
    ds = g.out_degree().clone()
    ds[:6] += 1
    torch.testing.assert_close(ew, (dd[dst] * ds[src]).rsqrt())
    torch.testing.assert_close(sw, (dd * ds[:6]).rsqrt())
    g2 = random_graph(6, 10, 25, seed=1)
    g2.dst_degree = torch.full((6,), 3.0)
    g2.src_degree = torch.full((10,), 8.0)
    ew2, sw2 = gcn_norm(g2)
    torch.testing.assert_close(ew2, torch.full((25,), 1 / 6.0))
    torch.testing.assert_close(sw2, torch.full((6,), 1 / 6.0))


def test_row_norm_gives_mean():
    g = random_graph(40, 50, 300, seed=3)
    x = torch.randn(50, 6)
    torch.testing.assert_close(spmm(g, x, row_norm(g)), spmm(g, x, reduce="mean"))
