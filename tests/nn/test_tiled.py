"""The out-of-core executor equals the in-memory model: forward rows and parameter gradients, dropout included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.data.generate import generate_sbm
from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.nn.batched import BatchedGNN
from trellis.nn.models import build_model
from trellis.nn.tiled import Gather, TiledGNN, aggregation_kind
from trellis.ops.graph import CSRGraph
from trellis.ops.tiled import MappedCSR
from trellis.plan.decl import LayerDecl
from trellis.utils.spill import SpillDir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = generate_sbm(tmp_path_factory.mktemp("tiled") / "s", nodes=300, avg_degree=6, features=12, classes=3,
                        seed=0, progress=False)
    st = GraphStore(path)
    x = np.array(st.x, dtype=np.float32)
    return CSRGraph.from_store(st), MappedCSR(st.indptr, st.indices, *st.reverse_csr()[:2]), x, st


#: Tiles of one row, of seven rows, and uneven ones.
BOUNDS = {"one-row": dict(max_rows=1), "seven-row": dict(max_rows=7), "uneven": [0, 100, 101, 250, 300]}


def _bounds(mg: MappedCSR, spec) -> np.ndarray:
    return np.asarray(spec) if isinstance(spec, list) else mg.tile_bounds(1.0, 1.0, 1e12, **spec)


@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
@pytest.mark.parametrize(("hidden", "layers"), [(16, 2), (5, 3)])
@pytest.mark.parametrize("tiles", list(BOUNDS))
def test_tiled_training_pass_equals_the_in_memory_one(graph, tmp_path, model, hidden, layers, tiles):
    g, mg, x, st = graph
    rows = np.asarray(st.split("train"))[::-1].copy()  # any order: logits come back in it
    torch.manual_seed(0)
    m = build_model(model, 12, 3, hidden=hidden, layers=layers, dropout=0.5)
    eng, spill = _train_pass_equals_in_memory(m, g, mg, x, rows, _bounds(mg, BOUNDS[tiles]), tmp_path)
    assert eng.io.written > 0 and eng.io.read > 0 and eng.io.gathered > 0
    spill.close()


def _train_pass_equals_in_memory(m, g, mg, x, rows, bounds, tmp_path):
    """A tiled forward and backward of ``m`` on ``rows`` equal the in-memory pass (logits, parameter gradients)."""
    batched = BatchedGNN([m]).train()
    torch.manual_seed(5)
    out = batched(g, torch.from_numpy(x))[0][torch.from_numpy(rows)]
    out.pow(2).sum().backward()
    ref = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)

    spill = SpillDir(tmp_path / "spill")
    eng = TiledGNN(m, mg, x, spill, bounds)
    torch.manual_seed(5)  # the same dropout seeds, drawn in the same order
    got = eng.forward(True, Gather.of(rows))
    torch.testing.assert_close(got, out.detach(), atol=1e-6, rtol=1e-6)
    eng.backward(Gather.of(rows), 2 * got)
    grads = {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys()
    for k, r in ref.items():
        torch.testing.assert_close(grads[k], r, atol=1e-6 * max(1.0, float(r.abs().max())), rtol=1e-6)
    return eng, spill


@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
def test_tiled_inference_equals_the_in_memory_eval_pass(graph, tmp_path, model):
    g, mg, x, _ = graph
    torch.manual_seed(1)
    m = build_model(model, 12, 3, hidden=8, layers=2, dropout=0.5)
    ref = BatchedGNN([m]).eval()(g, torch.from_numpy(x))[0].detach()
    spill = SpillDir(tmp_path / "spill")
    eng = TiledGNN(m, mg, x, spill, mg.tile_bounds(1.0, 1.0, 1e12, max_rows=13))
    every = np.concatenate([np.arange(300), [5, 5, 0]])  # repeated ids get their row each time
    for _ in range(2):  # the second pass reuses the cached first-layer aggregation where the plan caches it
        torch.testing.assert_close(eng.forward(False, Gather.of(every)), ref[torch.from_numpy(every)], atol=1e-6,
                                   rtol=1e-6)
    spill.close()


def test_sixteen_layers_run_tiled(graph, tmp_path):
    g, mg, x, st = graph
    rows = np.sort(np.asarray(st.split("train")))
    torch.manual_seed(0)
    m = build_model("gcn", 12, 3, hidden=8, layers=16, dropout=0.1)
    batched = BatchedGNN([m]).train()
    torch.manual_seed(2)
    out = batched(g, torch.from_numpy(x))[0][torch.from_numpy(rows)]
    out.sum().backward()
    ref = m.convs[0].lin.weight.grad.clone()
    m.zero_grad(set_to_none=True)
    spill = SpillDir(tmp_path / "spill")
    eng = TiledGNN(m, mg, x, spill, mg.tile_bounds(1.0, 1.0, 1e12, max_rows=64))
    torch.manual_seed(2)
    torch.testing.assert_close(eng.forward(True, Gather.of(rows)), out.detach(), atol=1e-6, rtol=1e-5)
    eng.backward(Gather.of(rows), torch.ones(len(rows), 3))
    torch.testing.assert_close(m.convs[0].lin.weight.grad, ref, atol=1e-7, rtol=1e-4)
    spill.close()


def test_a_max_aggregation_is_refused():
    with pytest.raises(TrellisUserError, match="cannot run out of core"):
        aggregation_kind(LayerDecl("sage", 4, 4, message="copy", aggregate="max", root="linear"))


def test_a_transform_first_layer_recomputes_its_dropped_out_input_per_tile(graph, tmp_path):
    """64 features into 4 hidden: the first layer transforms first, so its dropped-out features are only read
    tile by tile; they are recomputed from the counter-based mask, never spilled, and the pass equals the
    in-memory one."""
    g, mg, _, st = graph
    x = np.random.default_rng(0).standard_normal((300, 64)).astype(np.float32)
    torch.manual_seed(0)
    m = build_model("sage", 64, 3, hidden=4, layers=2, dropout=0.5)
    bounds = mg.tile_bounds(1.0, 1.0, 1e12, max_rows=37)
    eng, spill = _train_pass_equals_in_memory(m, g, mg, x, np.sort(np.asarray(st.split("train"))), bounds, tmp_path)
    assert not eng.plan(True).layers[0].order(0)  # transform first
    assert not spill.has("h0") and spill.has("z0")
    assert eng.io.written < 300 * 64 * 4  # less than the dropped-out features alone
    spill.close()


@pytest.mark.parametrize("model", ["gcn", "sage"])
def test_each_tile_s_tensors_are_released_before_the_next_tile_s_are_made(graph, tmp_path, monkeypatch, model):
    """The plan holds one tile: when a pass builds a tile's aggregation or input rows, no earlier tile's are
    alive (a loop variable used to keep the last tile's, which doubled the peak of wide inputs)."""
    import weakref

    g, mg, _, st = graph
    x = np.random.default_rng(1).standard_normal((300, 64)).astype(np.float32)
    made: dict[str, list] = {"_aggregate": [], "_input": []}

    def watch(name):
        method = getattr(TiledGNN, name)

        def wrapped(self, *args, **kwargs):
            alive = [r for r in made[name] if r() is not None]
            assert not alive, f"{name}: {len(alive)} earlier tile tensor(s) alive"
            t = method(self, *args, **kwargs)
            made[name].append(weakref.ref(t))
            return t
        monkeypatch.setattr(TiledGNN, name, wrapped)

    for name in made:
        watch(name)
    torch.manual_seed(0)
    m = build_model(model, 64, 3, hidden=4, layers=2, dropout=0.5)
    spill = SpillDir(tmp_path / "spill")
    eng = TiledGNN(m, mg, x, spill, mg.tile_bounds(1.0, 1.0, 1e12, max_rows=37))
    rows = Gather.of(np.sort(np.asarray(st.split("train"))))
    got = eng.forward(True, rows)
    eng.backward(rows, torch.ones_like(got))
    eng.forward(False, rows)
    assert len(made["_aggregate"]) > 8 and len(made["_input"]) > 8
    spill.close()


def test_evaluation_takes_a_transform_first_layer_s_rows_from_the_previous_pass(graph, tmp_path):
    """Evaluating, a next layer that transforms first gets its transformed rows from the previous layer's pass:
    the same logits bit for bit, and the hidden layer's output (300 x 16 floats) is not written; with
    ``keep_outputs`` (predict's embeddings) it is."""
    g, mg, x, _ = graph
    torch.manual_seed(1)
    m = build_model("gcn", 12, 3, hidden=16, layers=2, dropout=0.5)
    every = Gather.of(np.arange(300))
    written, logits = [], []
    for keep in (False, True):
        spill = SpillDir(tmp_path / f"spill-{keep}")
        eng = TiledGNN(m, mg, x, spill, mg.tile_bounds(1.0, 1.0, 1e12, max_rows=41))
        assert not eng.plan(False).layers[1].order(0)  # the second layer transforms first
        eng.keep_outputs = keep
        logits.append(eng.forward(False, every))
        written.append(eng.io.written)
        spill.close()
    assert torch.equal(logits[0], logits[1])
    assert written[1] - written[0] == 300 * 16 * 4
