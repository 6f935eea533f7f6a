import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.ops.strategies import BACKENDS, SETTINGS, backend, edges, graphs, random_graph
from trellis.ops import edge_softmax, sddmm, spmm

H, D = 2, 3


def softmax_reference(g, logits):
    dst, _ = edges(g)
    out = torch.zeros_like(logits)
    for i in range(g.num_dst):
        ks = torch.nonzero(dst == i).flatten()
        if len(ks):
            out[ks] = torch.softmax(logits[ks], dim=0)
    return out


@pytest.mark.parametrize("name", BACKENDS)
@SETTINGS
@given(gs=graphs(), heads=st.sampled_from([0, 1, 3]))
def test_edge_softmax_matches_dense_and_gradchecks(name, gs, heads):
    g, seed = gs
    gen = torch.Generator().manual_seed(seed)
    shape = (g.num_edges,) if heads == 0 else (g.num_edges, heads)
    logits = (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    with backend(name):
        a = edge_softmax(g, logits)
        torch.testing.assert_close(a, softmax_reference(g, logits.detach()))
        assert torch.autograd.gradcheck(lambda t: edge_softmax(g, t), (logits,))


def test_edge_softmax_is_stable_for_large_logits():
    g = random_graph(20, 20, 200)
    logits = torch.randn(200, 4) * 1e4
    for name in BACKENDS:
        with backend(name):
            a = edge_softmax(g, logits)
        assert torch.isfinite(a).all()
        sums = torch.zeros(20, 4).index_add_(0, g.dst_of_edges(), a)
        torch.testing.assert_close(sums[g.in_degree() > 0], torch.ones_like(sums[g.in_degree() > 0]))


@pytest.mark.parametrize("name", BACKENDS)
@SETTINGS
@given(gs=graphs(), op=st.sampled_from(["add", "dot"]), heads=st.sampled_from([0, 1, 2]))
def test_sddmm_matches_edge_loop_and_gradchecks(name, gs, op, heads):
    g, seed = gs
    gen = torch.Generator().manual_seed(seed)
    if op == "add":
        tail = (heads,) if heads else ()
    else:
        tail = (heads, D) if heads else (D,)
    a = torch.randn(g.num_src, *tail, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(g.num_dst, *tail, generator=gen, dtype=torch.float64).requires_grad_()
    dst, src = edges(g)
    ref = torch.stack([a[s] + b[d] if op == "add" else (a[s] * b[d]).sum(-1) for d, s in zip(dst, src)]) \
        if g.num_edges else torch.zeros(0, *(tail if op == "add" else tail[:-1]), dtype=torch.float64)
    with backend(name):
        out = sddmm(g, a, b, op)
        torch.testing.assert_close(out, ref.detach())
        assert torch.autograd.gradcheck(lambda a, b: sddmm(g, a, b, op), (a, b))


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba not installed")
@pytest.mark.parametrize("power", [0.0, 1.0])
def test_gat_pipeline_numba_equals_torch(power):
    """The GAT composition (sddmm add -> leaky relu -> softmax -> spmm per head), forward and backward."""
    g = random_graph(400, 400, 6000, seed=5, power=power)
    gen = torch.Generator().manual_seed(0)
    z0 = torch.randn(400, 4, 16, generator=gen)
    att = torch.randn(2, 1, 4, 16, generator=gen)
    results = []
    for name in ("numba", "torch"):
        z = z0.clone().requires_grad_()
        with backend(name):
            logits = sddmm(g, (z * att[0]).sum(-1), (z * att[1]).sum(-1), "add")
            alpha = edge_softmax(g, torch.nn.functional.leaky_relu(logits, 0.2))
            out = spmm(g, z, alpha) + sddmm(g, z, z, "dot").sum() * 1e-3
            out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results.append((out, z.grad))
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_sddmm_accepts_full_dst_tensor_and_rejects_bad_shapes():
    g = random_graph(5, 8, 20)
    a = torch.randn(8, 2)
    torch.testing.assert_close(sddmm(g, a, a), sddmm(g, a, a[:5]))
    with pytest.raises(ValueError):
        sddmm(g, a, a, op="mul")
    with pytest.raises(ValueError):
        sddmm(g, a[:7], a)
    with pytest.raises(ValueError):
        sddmm(g, a, torch.randn(8, 3))
    with pytest.raises(ValueError):
        edge_softmax(g, torch.randn(19))
