"""The planner's estimates against what the engines actually do, within 2x, on generated graphs.

Measured: dense FLOPs with ``FlopCounterMode``; the graph engine's FLOPs and bytes from the actual tensors
each SpMM kernel call receives (``prim_spmm_sum`` instrumented, forward and backward); the tensor engine's
bytes from every aten op's actual inputs and outputs (a dispatch mode; views and allocations excluded).
"""

import importlib

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from trellis.data.generate import generate_sbm
from trellis.nn import GCNConv, build_model
from trellis.nn.batched import BatchedGNN, capture_generator
from trellis.ops.graph import CSRGraph

spmm_module = importlib.import_module("trellis.ops.spmm")

_NO_TRAFFIC = ("empty", "zeros", "ones", "view", "detach", "alias", "expand", "slice", "split", "transpose",
               "as_strided", "unsqueeze", "squeeze", "select", "permute", "_unsafe_view", "aten.t.", "sym_",
               "lift_fresh", "_to_copy", "scalar_tensor")


class TensorBytes(TorchDispatchMode):
    """Bytes of every aten op's tensor inputs plus its new outputs (in-place results count once)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if not any(k in name for k in _NO_TRAFFIC):
            ins = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
            self.bytes += sum(a.numel() * a.element_size() for a in ins)
            self.bytes += sum(o.numel() * o.element_size() for o in outs if not any(o is a for a in ins))
        return out


@pytest.fixture
def graph_calls(monkeypatch):
    """Record (FLOPs, bytes) of every SpMM kernel call from the tensors it actually receives."""
    calls = []
    orig = spmm_module.prim_spmm_sum

    def wrapped(graph, x, w=None, eid=None, nscale=None, rscale=None, sw=None):
        e, n, f = graph.num_edges, graph.num_dst, x[0].numel()
        moved = (e * f * x.element_size() + graph.indices.numel() * 8 + graph.indptr.numel() * 8
                 + (e * 4 if w is not None else 0) + n * f * x.element_size())
        calls.append((2.0 * e * f, moved))
        return orig(graph, x, w, eid, nscale, rscale, sw)

    monkeypatch.setattr(spmm_module, "prim_spmm_sum", wrapped)
    return calls


def random_graph(n=2000, e=24_000, seed=0):
    rng = np.random.default_rng(seed)
    dst = np.sort(rng.integers(0, n, e))
    src = rng.integers(0, n, e)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return CSRGraph.from_numpy(indptr, src.astype(np.int64), n)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    from trellis.data.store import open_store

    store = generate_sbm(tmp_path_factory.mktemp("g") / "sbm", nodes=1500, avg_degree=12, features=48, classes=5,
                         seed=0, progress=False)
    return {"random": random_graph(), "sbm": CSRGraph.from_store(open_store(store))}


def estimate(plan, training):
    out = {}
    for engine in ("graph", "tensor"):
        ops = [op for op in plan.ops if op.engine == engine and not op.cached]
        out[f"{engine}_flops"] = sum(op.cost.flops + (op.backward.flops if training else 0) for op in ops)
        out[f"{engine}_bytes"] = sum(op.cost.bytes + (op.backward.bytes if training else 0) for op in ops)
    return out


def assert_within_2x(est, measured, what):
    assert measured > 0 and 0.5 <= est / measured <= 2.0, f"{what}: estimate {est:.3g} vs measured {measured:.3g}"


@pytest.mark.parametrize(("which", "family"), [("sbm", "gcn"), ("sbm", "sage"), ("sbm", "gin"), ("random", "gcn")])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_model_plan_estimates_match_measurements(graphs, graph_calls, family, training, k, which):
    g = graphs[which]
    f = 48
    x = torch.rand(g.num_src, f)
    models, gens = [], []
    for hidden, p in [(64, 0.5), (32, 0.0), (96, 0.3)][:k]:
        torch.manual_seed(0)
        models.append(build_model(family, f, 5, hidden=hidden, layers=2, dropout=p))
        gens.append(capture_generator("cpu"))
    bm = BatchedGNN(models, gens)
    bm.train(training)
    plan = bm.plan(g, training)
    if not training:
        bm(g, x)  # the cached aggregation is computed once, outside the measured step
    graph_calls.clear()
    with FlopCounterMode(display=False) as flops, TensorBytes() as tb:
        outs = bm(g, x)
        if training:
            torch.stack([o.square().mean() for o in outs]).sum().backward()
    est = estimate(plan, training)
    g_flops, g_bytes = sum(c[0] for c in graph_calls), sum(c[1] for c in graph_calls)
    assert_within_2x(est["graph_flops"], g_flops, "graph FLOPs")
    assert_within_2x(est["graph_bytes"], g_bytes, "graph bytes")
    assert_within_2x(est["tensor_flops"], flops.get_total_flops(), "dense FLOPs")
    assert_within_2x(est["graph_flops"] + est["tensor_flops"], g_flops + flops.get_total_flops(), "total FLOPs")
    assert_within_2x(est["tensor_bytes"], tb.bytes, "tensor bytes")


@pytest.mark.parametrize("dims", [(48, 96), (96, 8)])
def test_layer_plan_of_explain_matches_the_layer(graphs, graph_calls, dims):
    """``trellis train --explain`` prints each layer's plan (planner v1); it matches the layer's work."""
    g = graphs["sbm"]
    conv = GCNConv(*dims)
    x = torch.rand(g.num_src, dims[0])
    plan = conv.plan(g)
    graph_calls.clear()
    with FlopCounterMode(display=False) as flops:
        conv(g, x)
    graph_ops = [op for op in plan.ops if op.engine == "graph"]
    assert_within_2x(sum(op.cost.flops for op in graph_ops), sum(c[0] for c in graph_calls), "graph FLOPs")
    assert_within_2x(sum(op.cost.bytes for op in graph_ops), sum(c[1] for c in graph_calls), "graph bytes")
    dense = sum(op.cost.flops for op in plan.ops if op.kind == "linear")
    assert_within_2x(dense, flops.get_total_flops(), "dense FLOPs")
