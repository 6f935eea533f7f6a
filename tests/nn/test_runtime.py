"""The runtime of the planner's rewrites: the aggregation cache, the fused epilogue, per-configuration streams."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trellis.nn.runtime import AggregationCache, bias_act_dropout, dropout, generator_scope
from trellis.ops.dropout import dropout as model_dropout
from trellis.ops.graph import CSRGraph


def _graph(n=40, p=0.2, seed=0):
    rng = np.random.default_rng(seed)
    adj = rng.random((n, n)) < p
    dst, src = np.nonzero(adj)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return CSRGraph.from_numpy(indptr, src.astype(np.int64), n)


def test_aggregation_cache_hits_and_invalidates():
    g, g2 = _graph(), _graph(seed=1)
    x = torch.randn(40, 3)
    cache = AggregationCache()
    calls = []

    def compute():
        calls.append(1)
        return x * 2

    a = cache.get(g, x, "k", compute)
    assert cache.get(g, x, "k", compute) is a and len(calls) == 1 and cache.hits == 1
    cache.get(g2, x, "k", compute)  # another graph
    cache.get(g, x, "other", compute)  # another key
    x.add_(1)  # in-place write bumps the version: stale entry is not returned
    cache.get(g, x, "k", compute)
    assert len(calls) == 4 and not a.requires_grad
    assert cache.nbytes > 0
    cache.clear()
    assert cache.nbytes == 0


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_fused_epilogue_equals_the_unfused_chain(p):
    torch.manual_seed(0)
    x1 = torch.randn(50, 7, requires_grad=True)
    b1 = torch.randn(7, requires_grad=True)
    x2, b2 = x1.detach().clone().requires_grad_(), b1.detach().clone().requires_grad_()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    y1 = bias_act_dropout(x1, b1, act=True, p=p, training=True, generator=g1)
    with generator_scope(g2):  # the solo model's chain: relu, then its dropout drawing from the default generator
        y2 = model_dropout(F.relu(x2 + b2), p, True)
    assert torch.equal(y1, y2)
    w = torch.randn(50, 7)
    (y1 * w).sum().backward()
    (y2 * w).sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    torch.testing.assert_close(b1.grad, b2.grad)
    assert torch.equal(g1.get_state(), g2.get_state())  # both drew the same random numbers


@pytest.mark.parametrize("op", ["model", "torch"])
def test_a_generator_draws_what_the_default_generator_would(op):
    """A configuration's generator reproduces the solo run's masks: the models' (counter-based) dropout on
    CPU through :func:`dropout`, and ``F.dropout`` (what other devices run) through :func:`generator_scope`."""
    torch.manual_seed(7)
    state = torch.get_rng_state()
    expected = model_dropout(torch.ones(1000), 0.5, True) if op == "model" else F.dropout(torch.ones(1000), 0.5, True)
    g = torch.Generator()
    g.set_state(state)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    if op == "model":
        got = dropout(torch.ones(1000), 0.5, True, g)
    else:
        with generator_scope(g):
            got = F.dropout(torch.ones(1000), 0.5, True)
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), before)  # the default generator is left as it was
    assert dropout(torch.ones(3), 0.5, False, g).eq(1).all()
