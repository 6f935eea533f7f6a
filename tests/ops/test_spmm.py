import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.ops.strategies import BACKENDS, SETTINGS, backend, edges, graphs, random_graph
from trellis.ops import REDUCES, spmm

WEIGHTS = ["none", "scalar", "head"]
H, D = 3, 2


def dense_reference(g, x, w, reduce, sw):
    """out[d] = reduce over edges of w * x[src], by an explicit loop per destination (x [Ns, H, D], w [E, H])."""
    dst, src = edges(g)
    out = x.new_zeros((g.num_dst, *x.shape[1:]))
    for i in range(g.num_dst):
        ks = torch.nonzero(dst == i).flatten()
        if len(ks) == 0:
            continue
        msg = x[src[ks]] * (w[ks][:, :, None] if w is not None else 1)
        out[i] = {"sum": msg.sum(0), "mean": msg.mean(0), "max": msg.max(0).values}[reduce]
    if sw is not None:
        out = out + sw[:, None, None] * x[: g.num_dst]
    return out


def dense_matmul_reference(g, x, w):
    """Sum aggregation as a dense per-head adjacency matmul (duplicates add up)."""
    dst, src = edges(g)
    a = x.new_zeros((x.shape[1], g.num_dst, g.num_src))
    for h in range(x.shape[1]):
        a[h].index_put_((dst, src), w[:, h] if w is not None else torch.ones_like(dst, dtype=x.dtype),
                        accumulate=True)
    return torch.einsum("hds,shf->dhf", a, x)


def inputs(g, seed, weights, with_sw, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g.num_src, H, D, generator=gen, dtype=dtype)
    w = None
    if weights == "scalar":
        w = torch.rand(g.num_edges, generator=gen, dtype=dtype) + 0.5
    elif weights == "head":
        w = torch.rand(g.num_edges, H, generator=gen, dtype=dtype) + 0.5
    sw = torch.rand(g.num_dst, generator=gen, dtype=dtype) if with_sw else None
    return x, w, sw


def w_as_heads(w):
    return None if w is None else (w[:, None].expand(-1, H) if w.dim() == 1 else w)


@pytest.mark.parametrize("name", BACKENDS)
@SETTINGS
@given(gs=graphs(), reduce=st.sampled_from(REDUCES), weights=st.sampled_from(WEIGHTS), with_sw=st.booleans())
def test_forward_matches_dense_reference(name, gs, reduce, weights, with_sw):
    g, seed = gs
    x, w, sw = inputs(g, seed, weights, with_sw, torch.float64)
    with backend(name):
        out = spmm(g, x, w, reduce, sw)
    ref = dense_reference(g, x, w_as_heads(w), reduce, sw)
    torch.testing.assert_close(out, ref)
    if reduce == "sum" and sw is None:
        torch.testing.assert_close(out, dense_matmul_reference(g, x, w_as_heads(w)))


@pytest.mark.parametrize("name", BACKENDS)
@SETTINGS
@given(gs=graphs(max_dst=6, max_edges=16), reduce=st.sampled_from(REDUCES), weights=st.sampled_from(WEIGHTS),
       with_sw=st.booleans(), flat=st.booleans())
def test_gradcheck(name, gs, reduce, weights, with_sw, flat):
    g, seed = gs
    x, w, sw = inputs(g, seed, weights, with_sw, torch.float64)
    if flat and weights != "head":
        x = x.reshape(g.num_src, H * D)
    args = [t.requires_grad_() if t is not None else None for t in (x, w, sw)]

    def f(x, w, sw):
        return spmm(g, x, w, reduce, sw)

    with backend(name):
        assert torch.autograd.gradcheck(f, tuple(args))


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("power", [0.0, 1.0])
@pytest.mark.skipif("numba" not in BACKENDS, reason="numba not installed")
def test_numba_equals_torch_float32(reduce, weights, power):
    g = random_graph(300, 350, 5000, seed=3, power=power)
    x, w, sw = inputs(g, 7, weights, True, torch.float32)
    x = x.repeat(1, 1, 7)  # D = 14: exercises the feature loops beyond one vector
    results = []
    for name in ("numba", "torch"):
        xs, ws, sws = (t.clone().requires_grad_() if t is not None else None for t in (x, w, sw))
        with backend(name):
            out = spmm(g, xs, ws, reduce, sws)
            out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results.append([out, xs.grad, None if ws is None else ws.grad, sws.grad])
    for a, b in zip(*results):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_mean_is_sum_over_degree_and_isolated_rows_are_zero():
    g = random_graph(50, 50, 30, seed=1)  # most rows have no in-edge
    x = torch.randn(50, 4)
    deg = g.in_degree()[:, None]
    for name in BACKENDS:
        with backend(name):
            mean, total, mx = spmm(g, x, reduce="mean"), spmm(g, x), spmm(g, x, reduce="max")
        torch.testing.assert_close(mean * deg, total)
        assert (mean[deg[:, 0] == 0] == 0).all() and (mx[deg[:, 0] == 0] == 0).all()


def test_only_requested_gradients_are_computed():
    g = random_graph(20, 20, 100)
    x, w = torch.randn(20, 8), torch.rand(100, requires_grad=True)
    spmm(g, x, w).sum().backward()
    assert x.grad is None and w.grad is not None


@pytest.mark.parametrize("bad", ["reduce", "rows", "weight", "head", "self"])
def test_rejects_bad_arguments(bad):
    g = random_graph(5, 6, 10)
    x = torch.randn(6, 2, 3)
    kw = {"reduce": "min"} if bad == "reduce" else {}
    if bad == "rows":
        x = torch.randn(5, 2, 3)
    if bad == "weight":
        kw["edge_weight"] = torch.ones(9)
    if bad == "head":
        kw["edge_weight"] = torch.ones(10, 3)
    if bad == "self":
        kw["self_weight"] = torch.ones(6)
    with pytest.raises(ValueError):
        spmm(g, x, **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("kind", ["none", "scalar", "head"])
def test_cuda_matches_cpu(kind):
    """Forward and every gradient on the GPU (cuSPARSE for flat sums, torch scatter otherwise) equal the CPU's."""
    g = random_graph(100, 120, 1000)
    x, w, sw = inputs(g, 0, kind, True, torch.float32)
    gc = g.to("cuda")
    for reduce in REDUCES:
        leaves = [t for t in (x, w, sw) if t is not None]
        for t in leaves:
            t.requires_grad_(True)
        ref = spmm(g, x, w, reduce, sw)
        ref_grads = torch.autograd.grad(ref.square().sum(), leaves)
        cu = [t.detach().cuda().requires_grad_(True) for t in leaves]
        it = iter(cu)
        xc = next(it)
        wc = next(it) if w is not None else None
        swc = next(it)
        out = spmm(gc, xc, wc, reduce, swc)
        grads = torch.autograd.grad(out.square().sum(), cu)
        torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-4, atol=1e-4)
        for a, b in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", BACKENDS)
def test_constant_weights_cached_for_backward_follow_changes(name):
    g = random_graph(30, 30, 200, seed=2)
    x = torch.randn(30, 4, requires_grad=True)
    w = torch.rand(200)
    with backend(name):
        for step in range(3):
            if step == 2:
                w.mul_(2)  # in-place change: the cached permuted weights must not be reused
            (gx,) = torch.autograd.grad(spmm(g, x, w, "mean").square().sum(), x)
            dense = torch.zeros(30, 30).index_put_(edges(g), w, accumulate=True) / g.in_degree().clamp_min(1)[:, None]
            (ref,) = torch.autograd.grad((dense @ x).square().sum(), x)
            torch.testing.assert_close(gx, ref, rtol=1e-4, atol=1e-5)
            w = w.clone() if step == 0 else w  # a new tensor with the same values


@pytest.mark.parametrize("name", BACKENDS)
def test_spmm_on_a_reverse_graph_and_its_gradients(name):
    """Aggregating over graph.reverse() (rows = sources) works forward and backward (perm of the reverse)."""
    g = random_graph(7, 9, 30, seed=4)
    rev = g.reverse()
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(30, dtype=torch.float64, requires_grad=True)
    dst, src = edges(g)
    with backend(name):
        out = spmm(rev, x, w[g.perm])  # weights in the reverse graph's edge order
        dense = torch.zeros(9, 7, dtype=torch.float64).index_put_((src, dst), w, accumulate=True)
        torch.testing.assert_close(out, dense @ x)
        wr = w.detach()[g.perm].clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda x, wr: spmm(rev, x, wr), (x, wr))
