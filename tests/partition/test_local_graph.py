"""A part's pull graph (``CSRGraph.from_partition``) computes exactly what the whole graph computes.

The acceptance test of the graph view between layers: GCN, SAGE, GAT and GAT-E run forward and backward over
the local graphs of a destination-owned 2- and 4-part layout, every part in its own thread as a rank would,
through the models' ``view=`` hook. The view is an in-process exchange: before each layer every part
deposits the rows it owns, then reads its owned + halo rows from the concatenation, so the halo copy is an
``index_select`` and its backward returns halo gradients to their owners inside one autograd graph (what an
exchange's autograd op does across processes). Outputs and parameter gradients (sum over parts of the local
losses = the whole loss) must equal the whole graph's within 1e-5.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from trellis.data.generate import generate
from trellis.data.store import GraphStore, open_store
from trellis.errors import TrellisUserError
from trellis.nn import build_model
from trellis.ops.graph import CSRGraph
from trellis.ops.norm import gcn_norm
from trellis.partition import PartitionedGraph, open_partitioned, partition_graph, write_layout

from .conftest import edge_dst

#: (method, parts): destination-owned METIS into 2 and 4, a high-cut hash by destination, Lotan's reverse.
LAYOUTS = [("metis", 2), ("metis", 4), ("hash-dst", 4), ("reverse", 4)]
MODELS = ["gcn", "sage", "gat", "gate"]
TOL = 1e-5


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> GraphStore:
    """A seeded SBM graph with node and edge features (GAT-E reads the edge features in local order)."""
    path = tmp_path_factory.mktemp("local_graph") / "store"
    generate("sbm", path, nodes=700, avg_degree=8, features=12, classes=4, seed=5, edge_features=3,
             progress=False)
    return open_store(path)


@pytest.fixture(scope="module")
def layouts(store: GraphStore, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], PartitionedGraph]:
    """The layouts of :data:`LAYOUTS`, written as ``trellis partition`` writes them."""
    root: Path = tmp_path_factory.mktemp("local_graph_layouts")
    out = {}
    for method, parts in LAYOUTS + [("hash", 2)]:
        book = partition_graph(store, method, parts, measure=False)
        out[(method, parts)] = open_partitioned(write_layout(store, book, root / f"{method}-{parts}"))
    return out


class InProcessExchange:
    """Halo rows copied from their owners' outputs, between threads that play the parts' ranks."""

    def __init__(self, graphs: list[CSRGraph], num_nodes: int) -> None:
        self.barrier = threading.Barrier(len(graphs), timeout=120)
        self.slots: dict[int, list[Tensor | None]] = {}
        self.lock = threading.Lock()
        owned = torch.cat([_owned(g) for g in graphs])
        assert torch.equal(torch.sort(owned).values, torch.arange(num_nodes))  # every node has one owner
        self.position = torch.empty(num_nodes, dtype=torch.int64)
        self.position[owned] = torch.arange(num_nodes)  # global id -> row of the parts' concatenation

    def view(self, part: int) -> PartView:
        """The graph view of one part."""
        return PartView(self, part)

    def gather(self, layer: int, part: int, x: Tensor, ids: Tensor) -> Tensor:
        """Deposit ``x`` (part ``part``'s owned rows), wait for every part, return rows ``ids`` (global)."""
        with self.lock:
            slots = self.slots.setdefault(layer, [None] * self.barrier.parties)
        slots[part] = x
        self.barrier.wait()
        rows = torch.cat([s for s in slots if s is not None])
        assert rows.shape[0] == self.position.shape[0]
        return rows.index_select(0, self.position.index_select(0, ids))

    def assemble(self, outs: list[Tensor]) -> Tensor:
        """The parts' outputs (owned rows, part order) in global node order."""
        return torch.cat(outs).index_select(0, self.position)


class PartView:
    """``GraphView`` of one part: its owned rows plus the halo rows its owners produced."""

    def __init__(self, exchange: InProcessExchange, part: int) -> None:
        self.exchange, self.part = exchange, part

    def layer_input(self, layer: int, graph: CSRGraph, x: Tensor) -> Tensor:
        """Owned rows (``x``, the layer's input after dropout) followed by the halo rows."""
        assert x.shape[0] == graph.num_dst and graph.node_ids is not None
        return self.exchange.gather(layer, self.part, x, graph.node_ids)


def _owned(g: CSRGraph) -> Tensor:
    assert g.node_ids is not None
    return g.node_ids[: g.num_dst]


def run_parts(model: torch.nn.Module, graphs: list[CSRGraph], xs: list[Tensor],
              exchange: InProcessExchange) -> list[Tensor]:
    """Every part's forward in its own thread (one rank each); the autograd graph spans them all."""
    outs: list[Tensor | None] = [None] * len(graphs)
    errors: list[BaseException] = []

    def work(p: int) -> None:
        try:
            outs[p] = model(graphs[p], xs[p], view=exchange.view(p))
        except BaseException as exc:  # a failing part must not leave the others waiting at the barrier
            errors.append(exc)
            exchange.barrier.abort()

    threads = [threading.Thread(target=work, args=(p,)) for p in range(len(graphs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [o for o in outs if o is not None]


def compare(store: GraphStore, pg: PartitionedGraph, name: str, seed: int = 0) -> tuple[float, float, float]:
    """Whole graph vs. the parts: max |difference| of the outputs, of the parameter gradients, and the latter
    relative to the largest gradient entry (the loss is a weighted mean, so gradients are ~0.01-0.1)."""
    n = store.num_nodes
    assert store.x is not None and store.edge_feat is not None
    torch.manual_seed(seed)
    model = build_model(name, store.num_features, 4, hidden=8, layers=2, heads=2, dropout=0.0,
                        edge_dim=int(store.edge_feat.shape[1]) if name == "gate" else 0)
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed + 1)) / n

    whole = model(CSRGraph.from_store(store), torch.from_numpy(np.array(store.x, dtype=np.float32)))
    grads_whole = torch.autograd.grad((whole * weights).sum(), params)

    parts = [pg.part(p) for p in range(pg.num_parts)]
    graphs = [CSRGraph.from_partition(lg) for lg in parts]
    xs = [torch.from_numpy(np.array(lg.x)) for lg in parts]  # each part's own feature rows
    exchange = InProcessExchange(graphs, n)
    outs = run_parts(model, graphs, xs, exchange)
    loss = sum((o * weights.index_select(0, _owned(g))).sum() for o, g in zip(outs, graphs))
    assert isinstance(loss, Tensor)
    grads_parts = torch.autograd.grad(loss, params)

    out_diff = float((exchange.assemble(outs) - whole).detach().abs().max())
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads_whole, grads_parts))
    grad_scale = max(float(a.abs().max()) for a in grads_whole)
    return out_diff, grad_diff, grad_diff / grad_scale


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{m}-{p}" for m, p in LAYOUTS])
def test_parts_with_halo_exchange_equal_the_whole_graph(store, layouts, layout, name):
    out_diff, grad_diff, grad_rel = compare(store, layouts[layout], name)
    assert out_diff <= TOL, f"outputs differ by {out_diff:.3g}"
    assert grad_diff <= TOL and grad_rel <= TOL, f"gradients differ by {grad_diff:.3g} ({grad_rel:.3g} relative)"


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{m}-{p}" for m, p in LAYOUTS])
def test_pull_graph_holds_every_in_edge_with_global_degrees(store, layouts, layout):
    pg = layouts[layout]
    indptr = np.asarray(store.indptr)
    indices = np.asarray(store.indices)
    in_deg = np.diff(indptr)
    seen = []
    for p in range(pg.num_parts):
        lg = pg.part(p)
        g = CSRGraph.from_partition(lg)
        assert g.node_ids is not None and g.src_degree is not None and g.dst_degree is not None
        assert g.edge_ids is not None and g.edge_feat is not None and store.edge_feat is not None
        ids = g.node_ids.numpy()
        assert g.num_dst == lg.num_local and g.num_src == lg.num_nodes
        assert np.array_equal(ids[: g.num_dst], pg.book.nodes(p))  # owned rows first, ascending
        assert np.array_equal(ids, np.asarray(lg.local_to_global))
        np.testing.assert_array_equal(g.src_degree.numpy(), in_deg[ids])  # global, never local
        np.testing.assert_array_equal(g.dst_degree.numpy(), in_deg[ids[: g.num_dst]])
        # the local in-degree equals the global one (SAGE's mean and GAT's softmax read the local one)
        np.testing.assert_array_equal(np.diff(g.indptr.numpy()), in_deg[ids[: g.num_dst]])
        eid = g.edge_ids.numpy()
        dst = ids[np.repeat(np.arange(g.num_dst), np.diff(g.indptr.numpy()))]
        np.testing.assert_array_equal(ids[g.indices.numpy()], indices[eid])  # each edge is the one its id names
        np.testing.assert_array_equal(dst, edge_dst(indptr)[eid])
        np.testing.assert_array_equal(g.edge_feat.numpy(), np.asarray(store.edge_feat)[eid])
        seen.append(eid)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(store.num_edges))  # each edge exactly once


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{m}-{p}" for m, p in LAYOUTS])
def test_gcn_norm_on_a_part_equals_the_whole_graphs(store, layouts, layout):
    pg = layouts[layout]
    ew, sw = gcn_norm(CSRGraph.from_store(store))
    assert sw is not None
    for p in range(pg.num_parts):
        g = CSRGraph.from_partition(pg.part(p))
        lew, lsw = gcn_norm(g)
        assert g.edge_ids is not None and lsw is not None
        torch.testing.assert_close(lew, ew.index_select(0, g.edge_ids), rtol=0, atol=0)
        torch.testing.assert_close(lsw, sw.index_select(0, _owned(g)), rtol=0, atol=0)


def test_push_ownership_has_no_pull_graph(layouts):
    with pytest.raises(TrellisUserError, match="splits a node's in-edges"):
        CSRGraph.from_partition(layouts[("hash", 2)].part(0))


def test_typed_fields_survive_self_loops_and_moves(layouts):
    g = CSRGraph.from_partition(layouts[("metis", 2)].part(1))
    assert g.edge_ids is not None
    s = g.with_self_loops()
    assert s.src_degree is g.src_degree and s.dst_degree is g.dst_degree and s.node_ids is g.node_ids
    assert s.edge_ids is not None and s.num_edges == s.edge_ids.shape[0]
    edge_map = s.cache["edge_map"]
    loops = edge_map < 0
    assert int(loops.sum()) == g.num_dst and bool((s.edge_ids[loops] == -1).all())
    assert torch.equal(s.edge_ids[~loops], g.edge_ids[edge_map[~loops]])
    m = g.to("meta")
    for name in ("src_degree", "dst_degree", "edge_ids", "node_ids", "edge_feat"):
        moved = getattr(m, name)
        assert moved is not None and moved.device.type == "meta" and moved.shape == getattr(g, name).shape
