"""Model batching changes speed, never results: batched outputs, gradients and training curves equal K solo
models with the same initial weights and dropout streams."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trellis.errors import TrellisUserError
from trellis.nn import build_model
from trellis.nn.batched import BatchedGNN, capture_generator, family_of
from trellis.ops.graph import CSRGraph

CONFIGS = [(8, 0.5), (32, 0.0), (16, 0.3), (40, 0.2)]


def random_graph(n=200, e=1600, seed=0):
    rng = np.random.default_rng(seed)
    dst = np.sort(rng.integers(0, n, e))
    src = rng.integers(0, n, e)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return CSRGraph.from_numpy(indptr, src.astype(np.int64), n)


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    return random_graph(), torch.rand(200, 12), torch.randint(0, 5, (200,))


def solo(family, hidden, p, layers=3, seed=0):
    """A configuration's model as its solo run builds it, and its dropout stream."""
    torch.manual_seed(seed)
    model = build_model(family, 12, 5, hidden=hidden, layers=layers, dropout=p)
    return model, capture_generator("cpu")


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.detach().abs().max())))


@pytest.mark.parametrize("family", ["gcn", "sage", "gin"])
@pytest.mark.parametrize("dropout_all", [False, True])
def test_outputs_and_gradients_equal_independent_models(data, family, dropout_all):
    g, x, _ = data
    configs = [(h, p if not dropout_all else max(p, 0.25)) for h, p in CONFIGS]
    reference = []
    for h, p in configs:
        model, gen = solo(family, h, p)
        model.train()
        torch.set_rng_state(gen.get_state())  # the solo run's default generator is in exactly this state
        out = model(g, x)
        out.square().sum().backward()
        reference.append((out.detach(), [q.grad.clone() for q in model.parameters() if q.requires_grad]))
    built = [solo(family, h, p) for h, p in configs]
    torch.manual_seed(999)  # the default generator's state must not matter to the batched model
    bm = BatchedGNN([m for m, _ in built], [gen for _, gen in built])
    bm.train()
    outs = bm(g, x)
    torch.stack([o.square().sum() for o in outs]).sum().backward()
    for k, (out, (ref_out, ref_grads)) in enumerate(zip(outs, reference)):
        close(out, ref_out)
        grads = [q.grad for q in bm.models[k].parameters() if q.requires_grad]
        assert len(grads) == len(ref_grads)
        for a, b in zip(grads, ref_grads):
            close(a, b)
    bm.eval()
    with torch.no_grad():
        evals = bm(g, x)
    for k, (model, _) in enumerate(built):
        model.eval()
        with torch.no_grad():
            close(evals[k], model(g, x))


def test_evaluation_reuses_the_cached_first_aggregation(data):
    g, x, _ = data
    bm = BatchedGNN([solo("gcn", h, p)[0] for h, p in CONFIGS])
    bm.eval()
    with torch.no_grad():
        bm(g, x)
        bm(g, x)
    assert bm.cache.misses == 1 and bm.cache.hits == 1  # one Â X for all configurations and passes
    assert bm.plan(g, training=False).layers[0].is_cached(0)


def test_dropping_a_configuration_leaves_the_others_unchanged(data):
    g, x, _ = data

    def run(drop):
        built = [solo("gcn", h, p) for h, p in CONFIGS]
        bm = BatchedGNN([m for m, _ in built], [gen for _, gen in built])
        bm.train()
        first = bm(g, x)
        if drop is not None:
            bm.drop(drop)
        return first, bm(g, x), list(bm.active)

    full_first, full_second, _ = run(None)
    _, second, active = run(1)
    assert active == [0, 2, 3]
    for k, out in zip(active, second):
        close(out, full_second[k], tol=1e-6)


def train_curves(family, configs, optimizers, batched, epochs=6):
    """Per-configuration training losses and validation losses, solo loops or one batched loop."""
    gen = torch.Generator().manual_seed(1)
    g, x, y = random_graph(seed=1), torch.rand(200, 12, generator=gen), torch.randint(0, 5, (200,), generator=gen)
    train, val = torch.arange(0, 100), torch.arange(100, 150)
    built = [solo(family, h, p, layers=2) for h, p in configs]
    opts = [getattr(torch.optim, name)(m.parameters(), lr=lr, weight_decay=wd)
            for (m, _), (name, lr, wd) in zip(built, optimizers)]
    curves = [[] for _ in configs]
    if batched:
        bm = BatchedGNN([m for m, _ in built], [gen for _, gen in built])
        for _ in range(epochs):
            bm.train()
            for o in opts:
                o.zero_grad(set_to_none=True)
            losses = [F.cross_entropy(out[train], y[train]) for out in bm(g, x)]
            torch.stack(losses).sum().backward()
            for o in opts:
                o.step()
            bm.eval()
            with torch.no_grad():
                for k, out in enumerate(bm(g, x)):
                    curves[k].append((float(losses[k]), float(F.cross_entropy(out[val], y[val]))))
        return curves
    for k, ((model, gen), opt) in enumerate(zip(built, opts)):
        torch.set_rng_state(gen.get_state())
        for _ in range(epochs):
            model.train()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(g, x)[train], y[train])
            loss.backward()
            opt.step()
            model.eval()
            with torch.no_grad():
                curves[k].append((float(loss), float(F.cross_entropy(model(g, x)[val], y[val]))))
    return curves


@pytest.mark.parametrize("family", ["gcn", "sage"])
def test_batched_training_curves_equal_solo_runs(family):
    configs = [(16, 0.5), (32, 0.0), (8, 0.3)]
    optimizers = [("Adam", 0.01, 5e-4), ("Adagrad", 0.05, 0.0), ("SGD", 0.1, 1e-3)]
    solo_curves = train_curves(family, configs, optimizers, batched=False)
    batched_curves = train_curves(family, configs, optimizers, batched=True)
    for s, b in zip(solo_curves, batched_curves):
        np.testing.assert_allclose(np.array(b), np.array(s), rtol=0, atol=1e-5)


def test_refuses_what_cannot_share_a_batch():
    gcn, sage = build_model("gcn", 4, 2, hidden=8), build_model("sage", 4, 2, hidden=8)
    with pytest.raises(TrellisUserError, match="different model families"):
        BatchedGNN([gcn, sage])
    with pytest.raises(TrellisUserError, match="different depths"):
        BatchedGNN([gcn, build_model("gcn", 4, 2, hidden=8, layers=3)])
    with pytest.raises(TrellisUserError, match="cannot be model-batched"):
        BatchedGNN([build_model("gat", 4, 2, hidden=8, heads=2)])
    with pytest.raises(TrellisUserError, match="cannot be model-batched"):
        family_of(build_model("mlp", 4, 2, hidden=8))
    with pytest.raises(TrellisUserError, match="at least one"):
        BatchedGNN([])
    assert family_of(gcn) == "gcn"
