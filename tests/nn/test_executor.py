"""The executor of pushed-down layers: a block carrying its first layer's precomputed aggregation."""

import numpy as np
import pytest
import torch

from trellis.loader.blocks import attach_edge_data
from trellis.loader.sampler import NeighborSampler
from trellis.nn import build_model
from trellis.nn.models import input_aggregation
from trellis.ops.graph import CSRGraph


def _sampled(weighted: bool):
    rng = np.random.default_rng(0)
    n = 60
    deg = rng.integers(1, 9, n)
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    indices = rng.integers(0, n, int(indptr[-1])).astype(np.int64)
    sampler = NeighborSampler(indptr, indices, [4, 3], degrees=np.diff(indptr).astype(np.float32))
    batch = sampler.sample(np.array([2, 5, 11, 30, 41]), 7)
    if weighted:
        attach_edge_data(batch.blocks, torch.from_numpy(rng.uniform(0.2, 2.0, indices.shape[0]).astype(np.float32)))
    x = torch.randn(batch.num_inputs, 6, generator=torch.Generator().manual_seed(1))
    return batch, x


CASES = [(name, opts) for name in ("gcn", "sage", "gin")
         for opts in ({}, dict(residual=True, norm="layer"), dict(jk="cat"), dict(edge_weight=True))
         if not (name == "gin" and opts.get("edge_weight"))]  # GIN has no edge weights


@pytest.mark.parametrize("name,opts", CASES)
def test_a_fixed_input_aggregation_computes_as_the_block(name, opts):
    """A first block replaced by one without edges over its destinations, carrying the layer's aggregation of
    the input rows, gives the same logits and weight gradients (no dropout: the aggregation is of undropped
    rows) -- what a partition buffer's collapsed rehearsal batch relies on."""
    batch, x = _sampled(weighted=bool(opts.get("edge_weight")))
    torch.manual_seed(0)
    model = build_model(name, 6, 3, hidden=8, layers=2, dropout=0.0, **opts)
    agg = input_aggregation(model)
    assert agg is not None
    b0 = batch.blocks[0]
    n1 = b0.num_dst
    fixed = CSRGraph(torch.zeros(n1 + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), n1,
                     fixed_aggregation=agg(b0, x))
    assert fixed.fixed_aggregation is not None and not fixed.fixed_aggregation.requires_grad
    want = model(batch.blocks, x)
    want.square().sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    got = model([fixed, *batch.blocks[1:]], x[:n1])
    got.square().sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    for k, p in model.named_parameters():
        if k in grads:
            assert torch.allclose(p.grad, grads[k], atol=1e-5), k


def test_only_pushed_down_first_layers_have_an_input_aggregation():
    assert input_aggregation(build_model("gat", 6, 3, hidden=4)) is None
    assert input_aggregation(build_model("mlp", 6, 3, hidden=4)) is None
