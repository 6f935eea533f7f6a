"""The out-of-core memory plan (trellis/plan/outofcore.py) counts every spill the engine writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trellis.data.generate import generate_sbm
from trellis.data.store import GraphStore
from trellis.nn.models import build_model
from trellis.nn.tiled import Gather, TiledGNN, layer_shapes
from trellis.ops.tiled import MappedCSR
from trellis.plan.cost import GraphStats
from trellis.plan.outofcore import plan_out_of_core
from trellis.utils.spill import SpillDir


@pytest.mark.parametrize(("features", "hidden"), [(12, 16), (40, 8)], ids=["aggregate-first", "transform-first"])
def test_planned_disk_is_what_a_training_step_and_an_evaluation_leave_on_disk(tmp_path, features, hidden):
    """A spill directory sized by the plan ended a run in SIGBUS: the plan left out the cached first aggregation of
    the undropped input and the logits' gradient."""
    path = generate_sbm(tmp_path / "s", nodes=300, avg_degree=6, features=features, classes=3, seed=0, progress=False)
    st = GraphStore(path)
    mg = MappedCSR(st.indptr, st.indices, *st.reverse_csr()[:2])
    x = np.array(st.x, dtype=np.float32)
    torch.manual_seed(0)
    model = build_model("gcn", features, 3, hidden=hidden, layers=2, dropout=0.5)
    spill = SpillDir(tmp_path / "spill")
    eng = TiledGNN(model, mg, x, spill, mg.tile_bounds(1.0, 1.0, 1e12, max_rows=41))
    rows = Gather.of(np.arange(0, 300, 3))
    out = eng.forward(True, rows)
    eng.backward(rows, torch.ones_like(out))
    eng.forward(False, Gather.of(np.arange(300)))
    on_disk = sum(f.stat().st_size for f in (tmp_path / "spill").rglob("*") if f.is_file() and f.name != "owner")
    spill.close()
    plan = plan_out_of_core(num_nodes=300, max_degree=50, layers=layer_shapes(model, GraphStats(300, 300, 1800)),
                            params=0, budget=2**32, baseline=0, resident_vectors=0, input_spilled=False, dropout=True)
    assert on_disk <= plan.spill_bytes
