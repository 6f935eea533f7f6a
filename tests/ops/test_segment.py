import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.ops.strategies import BACKENDS, SETTINGS, backend, edges, graphs, random_graph
from trellis.ops import REDUCES, segment_reduce, spmm


def reference(g, vals, reduce):
    dst, _ = edges(g)
    out = vals.new_zeros((g.num_dst, *vals.shape[1:]))
    for i in range(g.num_dst):
        ks = torch.nonzero(dst == i).flatten()
        if len(ks):
            v = vals[ks]
            out[i] = {"sum": v.sum(0), "mean": v.mean(0), "max": v.max(0).values}[reduce]
    return out


@pytest.mark.parametrize("name", BACKENDS)
@SETTINGS
@given(gs=graphs(), reduce=st.sampled_from(REDUCES), tail=st.sampled_from([(), (3,), (2, 2)]))
def test_matches_reference_and_gradchecks(name, gs, reduce, tail):
    g, seed = gs
    gen = torch.Generator().manual_seed(seed)
    vals = torch.randn(g.num_edges, *tail, generator=gen, dtype=torch.float64).requires_grad_()
    with backend(name):
        out = segment_reduce(g, vals, reduce)
        torch.testing.assert_close(out, reference(g, vals.detach(), reduce))
        assert torch.autograd.gradcheck(lambda v: segment_reduce(g, v, reduce), (vals,))


@pytest.mark.skipif("numba" not in BACKENDS, reason="numba not installed")
@pytest.mark.parametrize("reduce", REDUCES)
def test_numba_equals_torch_and_spmm(reduce):
    g = random_graph(300, 300, 4000, seed=2, power=1.0)
    x = torch.randn(300, 5)
    msgs = x[g.indices]
    results = []
    for name in ("numba", "torch"):
        v = msgs.clone().requires_grad_()
        with backend(name):
            out = segment_reduce(g, v, reduce)
            out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
            torch.testing.assert_close(out, spmm(g, x, reduce=reduce), rtol=1e-5, atol=1e-5)
        results.append((out, v.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rejects_bad_arguments():
    g = random_graph(4, 4, 10)
    with pytest.raises(ValueError):
        segment_reduce(g, torch.randn(9, 2))
    with pytest.raises(ValueError):
        segment_reduce(g, torch.randn(10, 2), reduce="prod")
