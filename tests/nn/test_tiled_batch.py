"""K configurations in shared out-of-core passes compute what each computes alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.data.generate import generate_sbm
from trellis.data.store import GraphStore
from trellis.nn.models import build_model
from trellis.nn.tiled import Gather, TiledGNN
from trellis.nn.tiled_batch import BatchedTiledGNN
from trellis.ops.tiled import MappedCSR
from trellis.utils.spill import SpillDir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = generate_sbm(tmp_path_factory.mktemp("tiled-batch") / "s", nodes=300, avg_degree=6, features=12,
                        classes=3, seed=0, progress=False)
    st = GraphStore(path)
    return MappedCSR(st.indptr, st.indices, *st.reverse_csr()[:2]), np.array(st.x, dtype=np.float32)


@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
def test_evaluation_equals_each_configuration_alone_and_skips_fusable_hidden_outputs(graph, tmp_path, model):
    """Evaluating, each configuration's logits equal its solo engine's bit for bit. A configuration whose next layer
    transforms first and never reads its input rows (GCN and GIN 16 -> 3 here) takes that layer's transformed rows
    from the previous pass, as its solo run does: its 300 x 16 hidden output is neither written nor read back."""
    mg, x = graph
    bounds = mg.tile_bounds(1.0, 1.0, 1e12, max_rows=41)
    every = Gather.of(np.arange(300))
    models = []
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        models.append(build_model(model, 12, 3, hidden=16, layers=2, dropout=0.5))
    solo, solo_written = [], 0
    for k, m in enumerate(models):
        spill = SpillDir(tmp_path / f"solo{k}")
        eng = TiledGNN(m, mg, x, spill, bounds)
        solo.append(eng.forward(False, every))
        solo_written += eng.io.written
        spill.close()
    spill = SpillDir(tmp_path / "batch")
    batch = BatchedTiledGNN(models, [None] * 3, mg, x, spill, bounds)
    got = batch.forward(False, every)
    hidden_spilled = [spill.has(f"m{k}.h1") for k in range(3)]
    spill.close()
    for a, b in zip(got, solo):
        assert torch.equal(a, b)
    fusable = not batch.engines[0].plan(False).layers[1].order(0) and not batch.engines[0]._reads(1, False)[0]
    assert fusable == (model != "sage")  # SAGE's root reads the hidden rows
    # The batch writes what the three solo runs write (each fusing where it can) but the first aggregation of the
    # undropped features (300 x 12), which it makes once for the three.
    assert batch.io.written == solo_written - 2 * 300 * 12 * 4
    if fusable:
        assert not any(hidden_spilled)


def test_training_after_a_fused_evaluation_still_equals_the_solo_step(graph, tmp_path):
    """An evaluation leaves no fused input behind for the next training step: forward and backward after it give
    each configuration's solo gradients."""
    mg, x = graph
    bounds = mg.tile_bounds(1.0, 1.0, 1e12, max_rows=41)
    rows = Gather.of(np.arange(0, 300, 3))
    models = []
    for seed in (4, 5):
        torch.manual_seed(seed)
        models.append(build_model("gcn", 12, 3, hidden=16, layers=2, dropout=0.0))
    ref = []
    for k, m in enumerate(models):
        spill = SpillDir(tmp_path / f"solo{k}")
        eng = TiledGNN(m, mg, x, spill, bounds)
        out = eng.forward(True, rows)
        eng.backward(rows, torch.ones_like(out))
        ref.append([p.grad.clone() for p in m.parameters()])
        m.zero_grad(set_to_none=True)
        spill.close()
    spill = SpillDir(tmp_path / "batch")
    batch = BatchedTiledGNN(models, [None] * 2, mg, x, spill, bounds)
    batch.forward(False, Gather.of(np.arange(300)))
    outs = batch.forward(True, rows)
    batch.backward(rows, [torch.ones_like(o) for o in outs])
    spill.close()
    for m, grads in zip(models, ref):
        for p, g in zip(m.parameters(), grads):
            assert torch.equal(p.grad, g)
