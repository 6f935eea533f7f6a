"""Model options real graphs need: residual, layer/batch norm, jumping knowledge, GIN's MLP width, edge weights.

Each is checked against a dense reference or against the whole-graph forward (layer-wise inference and
mini-batches with every neighbour must give the same outputs), and the default model is unchanged.
"""

import numpy as np
import pytest
import torch

from tests.nn.test_layers import random_graph
from trellis.errors import TrellisUserError
from trellis.loader.inference import layerwise_inference
from trellis.nn import GCNConv, SAGEConv, build_model
from trellis.nn.batched import BatchedGNN, capture_generator, check_tileable, family_of
from trellis.ops.graph import CSRGraph

OPTIONS = [dict(residual=True), dict(norm="layer"), dict(norm="batch"), dict(jk="cat"), dict(jk="max"),
           dict(residual=True, norm="layer", jk="cat"), dict(pre_norm=True, norm="layer"), dict(pre_norm=True)]


def test_default_model_is_the_plain_stack():
    model = build_model("gcn", 5, 3, hidden=8)
    assert model.plain
    assert sorted(model.state_dict()) == ["convs.0.bias", "convs.0.lin.weight", "convs.1.bias", "convs.1.lin.weight"]
    assert family_of(model) == "gcn"


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
@pytest.mark.parametrize("opts", OPTIONS)
def test_layerwise_inference_equals_the_forward(name, opts):
    torch.manual_seed(0)
    g, _ = random_graph(n=40, p=0.15, seed=3)
    x = torch.randn(40, 6)
    if opts.get("pre_norm") and name == "gat":
        return  # pre-norm blocks are built for gcn, sage and gin (the config refuses gat)
    model = build_model(name, 6, 3, hidden=8, layers=3, heads=2, **opts)
    assert not model.plain
    model.train()
    model(g, x).sum().backward()  # batch norm: running statistics move away from their initial values
    model.eval()
    with torch.no_grad():
        full = model(g, x)
    layered = layerwise_inference(model, g.indptr, g.indices, x, chunk_edges=50)
    torch.testing.assert_close(layered, full, rtol=1e-4, atol=1e-5)
    rows = np.array([3, 17, 39])
    some = layerwise_inference(model, g.indptr, g.indices, x, chunk_edges=50, rows=rows)
    torch.testing.assert_close(some, full[rows], rtol=1e-4, atol=1e-5)
    with pytest.raises(TrellisUserError, match="--norm, --residual, --jk or --pre-norm" if name != "gat" else "GAT"):
        check_tileable(model)


def test_pre_norm_blocks_are_platonovs_gcn():
    """Input layer, blocks ``h + act(Â norm(h) W + b)``, output norm and layer: checked against dense algebra."""
    torch.manual_seed(2)
    g, adj = random_graph(n=15, self_loops=False, seed=5)
    x = torch.randn(15, 6)
    model = build_model("gcn", 6, 3, hidden=8, layers=2, pre_norm=True, norm="layer", dropout=0.0).eval()
    a_hat = adj + torch.eye(15)
    dinv = a_hat.sum(1).pow(-0.5)
    prop = dinv[:, None] * a_hat * dinv[None, :]
    h = torch.relu(x @ model.encoder.weight.T + model.encoder.bias)
    for i, conv in enumerate(model.convs):
        h = h + torch.relu(prop @ model.norms[i](h) @ conv.lin.weight.T + conv.bias)
    ref = model.head(model.norms[2](h))
    torch.testing.assert_close(model(g, x), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model(g, x, return_embedding=True), h, rtol=1e-4, atol=1e-5)
    assert len(model.convs) == 2 and model.convs[0].lin.weight.shape == (8, 8)
    with pytest.raises(TrellisUserError, match="--pre-norm blocks .* run one configuration at a time"):
        family_of(model)


def test_residual_adds_the_projected_input():
    torch.manual_seed(1)
    g, _ = random_graph(n=12)
    x = torch.randn(12, 5)
    model = build_model("sage", 5, 3, hidden=4, layers=2, residual=True, dropout=0.0)
    plain = build_model("sage", 5, 3, hidden=4, layers=2, dropout=0.0)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("skips")})
    h1 = torch.relu(plain.convs[0](g, x)) + x @ model.skips[0].weight.T
    torch.testing.assert_close(model(g, x), plain.convs[1](g, h1))


def test_gin_mlp_width_is_separate():
    model = build_model("gin", 6, 3, hidden=8, mlp_hidden=32)
    assert model.convs[0].lin1.weight.shape == (32, 6) and model.convs[0].lin2.weight.shape == (8, 32)
    g, _ = random_graph(n=12)
    x = torch.randn(12, 6, requires_grad=True)
    model(g, x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def _weighted(seed=4):
    g, adj = random_graph(n=12, self_loops=False, seed=seed)
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.1, 2.0, g.num_edges).astype(np.float32)
    gw = CSRGraph.from_numpy(g.indptr.numpy(), g.indices.numpy(), 12, edge_weight=w)
    dense = torch.zeros(12, 12)
    dst = torch.repeat_interleave(torch.arange(12), torch.diff(g.indptr))
    dense[dst, g.indices] = torch.from_numpy(w)
    return gw, dense


def test_weighted_gcn_is_pygs_normalization():
    torch.manual_seed(5)
    g, wadj = _weighted()
    x = torch.randn(12, 5)
    conv = GCNConv(5, 3, edge_weight=True)
    a_hat = wadj + torch.eye(12)
    dinv = a_hat.sum(1).pow(-0.5)
    ref = (dinv[:, None] * a_hat * dinv[None, :]) @ x @ conv.lin.weight.T + conv.bias
    torch.testing.assert_close(conv(g, x), ref, rtol=1e-4, atol=1e-5)
    unweighted = GCNConv(5, 3)
    unweighted.load_state_dict(conv.state_dict())
    assert not torch.allclose(unweighted(g, x), conv(g, x))


def test_weighted_sage_is_a_weighted_mean():
    torch.manual_seed(6)
    g, wadj = _weighted()
    x = torch.randn(12, 5)
    conv = SAGEConv(5, 3, edge_weight=True)
    total = wadj.sum(1, keepdim=True)
    mean = torch.where(total > 0, wadj / total.clamp_min(1e-12), torch.zeros_like(wadj)) @ x
    ref = mean @ conv.lin_l.weight.T + conv.lin_l.bias + x @ conv.lin_r.weight.T
    torch.testing.assert_close(conv(g, x), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gcn", "sage", "gin"])
def test_model_batching_runs_the_options_as_solo_runs(family):
    """K configurations with different options in one batch: each equals its solo model (outputs, gradients)."""
    g, _ = random_graph(n=60, p=0.1, seed=7)
    x = torch.randn(60, 6)
    configs = [dict(), dict(residual=True, norm="layer"), dict(jk="cat", norm="batch"), dict(jk="max", residual=True)]

    def build(k, opts):
        torch.manual_seed(k)
        return build_model(family, 6, 3, hidden=8, layers=3, dropout=0.3, **opts), capture_generator("cpu")

    reference = []
    for k, opts in enumerate(configs):
        model, gen = build(k, opts)
        model.train()
        torch.set_rng_state(gen.get_state())
        out = model(g, x)
        out.square().sum().backward()
        reference.append((out.detach(), [q.grad.clone() for q in model.parameters() if q.requires_grad]))
    built = [build(k, opts) for k, opts in enumerate(configs)]
    torch.manual_seed(123)
    bm = BatchedGNN([m for m, _ in built], [gen for _, gen in built])
    bm.train()
    outs = bm(g, x)
    torch.stack([o.square().sum() for o in outs]).sum().backward()
    for k, (out, (ref, grads)) in enumerate(zip(outs, reference)):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip([q.grad for q in bm.models[k].parameters() if q.requires_grad], grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert family_of(built[1][0]) == family
