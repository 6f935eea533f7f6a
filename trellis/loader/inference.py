"""Exact layer-wise inference over every node, in chunks of destination rows.

Why layer-wise: a model trained on sampled blocks is evaluated on full neighbourhoods (sampling at test
time makes predictions noisy -- GraphTheta §1 cites this), but running the full ``L``-hop neighbourhood
of each test chunk recomputes shared neighbours again and again (the neighbour explosion). Layer-wise
inference computes layer ``l``'s output for *every* node -- one chunk of destination rows at a time, each
over its full in-neighbourhood -- before moving to layer ``l + 1``. Each layer reads every edge once, and
memory is one ``[N, width]`` matrix per layer plus one chunk, so a graph whose full-batch forward does not
fit still gets exact predictions. The result equals the full-batch forward (up to float summation order).

A layer whose input is already a whole matrix on the compute device and whose plan is one SpMM (GCN, SAGE,
GIN) skips the chunks: it runs once over the whole graph. A chunk gathers its sources' rows, and on a graph
without locality every chunk's sources are most of the graph, so chunking copied the layer's input about once
per chunk (a 1M-node, 10M-edge graph: 2.4× slower than the whole-graph layer, same result). The whole-graph
layer needs no per-edge memory beyond GCN's edge weights and one ``[N, min(in, out)]`` intermediate. Features
read from a :class:`FeatureSource` (a memory map, a partitioned layout) are never held whole, so the first layer
then stays in chunks. A run under a memory budget evaluates within it instead
(:func:`trellis.loader.buffer_inference.buffer_inference`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from trellis.loader.blocks import attach_edge_data
from trellis.loader.features import FeatureSource, np_int64
from trellis.loader.sampler import NeighborSampler
from trellis.nn.layers import PushdownConv
from trellis.ops.graph import CSRGraph

#: Default edges per chunk: bounds a chunk's gathered input rows and per-edge work.
DEFAULT_CHUNK_EDGES = 4_000_000


def chunk_bounds(indptr: np.ndarray, chunk_edges: int = DEFAULT_CHUNK_EDGES, max_rows: int = 1 << 20) -> np.ndarray:
    """Row boundaries splitting a CSR into chunks of about ``chunk_edges`` edges (and at most ``max_rows`` rows)."""
    n = indptr.shape[0] - 1
    cost = np.asarray(indptr, dtype=np.int64) + np.arange(n + 1, dtype=np.int64)  # an empty row still costs one
    k = max(1, int(-(-int(cost[-1]) // max(1, chunk_edges))), -(-n // max(1, max_rows)))
    b = np.unique(np.searchsorted(cost, np.linspace(0, cost[-1], k + 1)))
    b[0], b[-1] = 0, n
    return b.astype(np.int64)


Post = Callable[[int, Tensor, Tensor], Tensor]


def _as_is(i: int, h: Tensor) -> Tensor:
    return h


def _layers(model: nn.Module) -> tuple[list[nn.Module], Callable[[int, Tensor], Tensor], Post] | None:
    """The message-passing layers and what each aggregates and what follows it, if ``model`` is a stack.

    ``pre(i, input)`` is what layer ``i`` aggregates of its input, ``post(i, input, output)`` what follows it.
    A :class:`trellis.nn.models.GNN` says both (a pre-norm block's norm; normalization, activation, residual);
    a stack with only ``convs`` and ``activation`` applies the activation between layers.
    """
    convs = getattr(model, "convs", None)
    post = getattr(model, "post", None)
    if convs is None:
        return None
    if post is None:
        act = getattr(model, "activation", None)
        if act is None:
            return None
        last = len(convs) - 1
        return list(convs), _as_is, lambda i, h, y: y if i == last else act(y)
    return list(convs), getattr(model, "pre", _as_is), post


def _readout(model: nn.Module, outs: list[Tensor]) -> Tensor:
    """The model's output from its layers' outputs (jumping knowledge, a pre-norm output layer) or the last."""
    readout = getattr(model, "readout", None)
    return outs[-1] if readout is None else readout(outs)


def _encoded(model: nn.Module, x: Tensor | FeatureSource, dev: torch.device,
             chunk_rows: int = 1 << 16) -> Tensor | FeatureSource:
    """The first layer's input rows: ``x``, or every row through a pre-norm model's input layer, in chunks."""
    if getattr(model, "encoder", None) is None:
        return x
    n = _num_rows(x)
    out: Tensor | None = None
    for a in range(0, n, chunk_rows):
        sel = torch.arange(a, min(n, a + chunk_rows))
        rows_x = x.gather(sel) if isinstance(x, FeatureSource) else x.index_select(0, sel.to(x.device))
        y = model.encode(rows_x.to(dev))  # type: ignore[operator]
        if out is None:
            out = torch.empty((n, y.shape[1]), dtype=y.dtype, device=dev)
        out[a:a + y.shape[0]] = y
    assert out is not None
    return out


@torch.no_grad()
def layerwise_inference(model: nn.Module, indptr: np.ndarray | Tensor, indices: np.ndarray | Tensor,
                        x: Tensor | FeatureSource, *,
                        chunk_edges: int = DEFAULT_CHUNK_EDGES, edge_weight: Tensor | None = None,
                        edge_feat: Tensor | None = None, device: torch.device | str | None = None,
                        rows: np.ndarray | Tensor | None = None, whole_layers: bool = True,
                        first_input: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Outputs of ``model`` for every node (or for ``rows``), computed layer by layer in chunks.

    Args:
        model: A layer stack with ``convs`` and ``activation`` (:class:`trellis.nn.models.GNN`); other
            models (the MLP) are run per chunk of rows.
        indptr: ``int64 [N+1]`` in-edge CSR of the whole graph.
        indices: ``int64 [E]`` sources.
        x: ``[N, F]`` input features (on the compute device or the CPU), or a
            :class:`~trellis.loader.features.FeatureSource` whose rows are gathered per chunk (a memory map or a
            partitioned layout: the features are never held whole).
        chunk_edges: Edges per chunk (default: 4M).
        edge_weight: ``[E]`` edge weights of the graph (None = none).
        edge_feat: ``[E, D]`` edge features of the graph (None = none).
        device: Where layers run (default: ``x``'s device).
        rows: Only these nodes' final outputs are returned (the last layer runs only for their rows when
            their in-edges reach under a quarter of the graph); None = all nodes.
        whole_layers: Run an SpMM layer whose input is a tensor on ``device`` over the whole graph at once
            (default); False chunks every layer (tests compare the two).
        first_input: Applied to the first layer's input rows before the layer (the batch strategies' sparse
            rows of a bag-of-words store: evaluation takes the path training took).

    Returns:
        ``[N or len(rows), out_dim]`` on ``device``.
    """
    was_training = model.training
    model.eval()
    try:
        dev = torch.device(device) if device is not None else x.device
        if isinstance(x, FeatureSource) and getattr(model, "embed_inputs", None) is not None:
            raise ValueError("an embedding model reads node ids, not a feature source")
        indptr_np = np_int64(indptr)
        indices_np = np_int64(indices)
        n = indptr_np.shape[0] - 1
        sampler = NeighborSampler(indptr_np, indices_np, [-1])
        rows_np = None if rows is None else np_int64(rows)
        stack = _layers(model)
        if stack is None:
            return _rowwise(model, x, rows_np, dev, chunk_edges)
        convs, pre, post = stack
        jk = getattr(model, "jk", "none") != "none"
        outs: list[Tensor] = []
        embed = getattr(model, "embed_inputs", None)  # --features embedding:D: ids -> table rows, once
        h: Tensor | FeatureSource = x if embed is None else embed(x.to(dev))  # type: ignore[union-attr]
        h = _encoded(model, h, dev)
        whole: CSRGraph | None = None  # the whole graph as one square block, built on first use
        wdeg: Tensor | None = None  # every node's weighted in-degree (a weighted GCN's chunks), on first use
        for li, conv in enumerate(convs):
            last = li == len(convs) - 1
            # the last layer of a few rows whose in-edges reach a small part of the graph reads only those
            few = last and rows_np is not None and 4 * rows_np.shape[0] * _avg_degree(indptr_np) < n
            out: Tensor
            if whole_layers and not few and isinstance(conv, PushdownConv) and isinstance(h, Tensor) \
                    and h.device.type == dev.type and (h.device.index or 0) == (dev.index or 0):  # cuda == cuda:0
                if whole is None:
                    whole = _whole_graph(indptr_np, indices_np, edge_weight, edge_feat, dev)
                h0 = first_input(h) if li == 0 and first_input is not None else h
                out = post(li, h0, conv(whole, pre(li, h0)))
                if last and rows_np is not None:
                    out = out.index_select(0, torch.from_numpy(rows_np).to(dev))
            else:
                if edge_weight is not None and wdeg is None:
                    wdeg = _weighted_in_degree(indptr_np, edge_weight)
                out = _chunked_layer(li, conv, pre, post, h, sampler, rows_np if last else None, chunk_edges,
                                     edge_weight, edge_feat, dev, wdeg, first_input if li == 0 else None)
            if jk:  # the readout reads every layer's output of the returned rows
                outs.append(out if rows_np is None or last else out.index_select(0, torch.from_numpy(rows_np).to(dev)))
            h = out
        assert isinstance(h, Tensor)
        return _readout(model, outs if jk else [h])
    finally:
        model.train(was_training)


def _chunked_layer(li: int, conv: nn.Module, pre: Callable[[int, Tensor], Tensor], post: Post,
                   h: Tensor | FeatureSource, sampler: NeighborSampler, targets: np.ndarray | None, chunk_edges: int,
                   edge_weight: Tensor | None, edge_feat: Tensor | None, dev: torch.device,
                   wdeg: Tensor | None = None, first_input: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Layer ``li``'s output for every node (or ``targets``), one chunk of destination rows at a time.

    ``wdeg``: every node's weighted in-degree; a chunk's sources carry theirs, so a weighted GCN normalizes
    them as the whole graph does (a chunk's destinations hold all their in-edges, their sources do not).
    """
    indptr = sampler.indptr
    if targets is not None:
        bounds = np.arange(0, targets.shape[0] + 1, max(1, chunk_edges // max(1, _avg_degree(indptr))))
        if bounds[-1] != targets.shape[0]:
            bounds = np.append(bounds, targets.shape[0])
    else:
        bounds = chunk_bounds(indptr, chunk_edges)
    out: Tensor | None = None
    for a, b in zip(bounds[:-1], bounds[1:]):
        seeds = np.arange(a, b, dtype=np.int64) if targets is None else targets[a:b]
        batch = sampler.sample(seeds, 0)
        block = batch.blocks[0]
        attach_edge_data([block], edge_weight, edge_feat)
        if wdeg is not None:
            block.src_weighted_degree = wdeg.index_select(0, batch.node_ids)
        block = block.to(dev)  # a no-op when already there
        if isinstance(h, FeatureSource):
            h_in = h.gather(batch.node_ids).to(dev)
        else:
            h_in = h.index_select(0, batch.node_ids.to(h.device)).to(dev)
        if first_input is not None:
            h_in = first_input(h_in)
        y = post(li, h_in, conv(block, pre(li, h_in)))
        if out is None:
            total = indptr.shape[0] - 1 if targets is None else targets.shape[0]
            out = torch.empty((total, *y.shape[1:]), dtype=y.dtype, device=dev)
        out[a:b] = y
    assert out is not None
    return out


def _weighted_in_degree(indptr: np.ndarray, edge_weight: Tensor) -> Tensor:
    """``float64 [N]``: the sum of each node's in-edge weights, summed as :func:`trellis.ops.norm.gcn_norm` does."""
    n = indptr.shape[0] - 1
    dst = torch.repeat_interleave(torch.arange(n), torch.from_numpy(np.diff(indptr)))
    return torch.zeros(n, dtype=torch.float64).index_add_(0, dst, edge_weight.detach().cpu().to(torch.float64))


def _whole_graph(indptr: np.ndarray, indices: np.ndarray, edge_weight: Tensor | None, edge_feat: Tensor | None,
                 device: torch.device) -> CSRGraph:
    """The whole graph as one square block on ``device`` (its edges in store order, so edge data needs no lookup).

    A read-only memory map is wrapped, not copied: the kernels only read it, and its pages stay page cache.
    """
    with warnings.catch_warnings():  # torch warns that a read-only array is not writable; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        g = CSRGraph(torch.from_numpy(indptr), torch.from_numpy(indices), int(indptr.shape[0] - 1))
    g.edge_weight, g.edge_feat = edge_weight, edge_feat
    return g.to(device)


def _num_rows(x: Tensor | FeatureSource) -> int:
    return x.num_rows if isinstance(x, FeatureSource) else int(x.shape[0])


def _avg_degree(indptr: np.ndarray) -> int:
    n = indptr.shape[0] - 1
    return max(1, int(indptr[-1]) // max(1, n))


def _rowwise(model: nn.Module, x: Tensor | FeatureSource, rows: np.ndarray | None, device: torch.device,
             chunk_rows: int) -> Tensor:
    """Graph-agnostic models: the forward on chunks of rows (a featureless empty graph of that many rows)."""
    ids = torch.arange(_num_rows(x)) if rows is None else torch.from_numpy(rows)
    outs = []
    step = max(1, min(chunk_rows, 1 << 20))
    for a in range(0, ids.shape[0], step):
        sel = ids[a:a + step]
        m = int(sel.shape[0])
        g = CSRGraph(torch.zeros(m + 1, dtype=torch.int64, device=device),
                     torch.zeros(0, dtype=torch.int64, device=device), m)
        rows_x = x.gather(sel) if isinstance(x, FeatureSource) else x.index_select(0, sel.to(x.device))
        outs.append(model(g, rows_x.to(device)))
    return torch.cat(outs) if outs else torch.empty(0, device=device)


@torch.no_grad()
def ranked_inference(model: nn.Module, indptr: np.ndarray | Tensor, indices: np.ndarray | Tensor, owned: np.ndarray,
                     gather: Callable[[np.ndarray, Tensor | None], Tensor], agree: Callable[[int], int], *,
                     rows: np.ndarray | None = None, chunk_edges: int = DEFAULT_CHUNK_EDGES,
                     edge_weight: Tensor | None = None, edge_feat: Tensor | None = None,
                     device: torch.device | str = "cpu", first_input: Callable[[Tensor], Tensor] | None = None
                     ) -> Tensor:
    """:func:`layerwise_inference` split over ranks: each computes its own nodes' rows of every layer.

    Why: one process holding a ``[N, width]`` matrix per layer is what stops exact evaluation on a graph split
    over ranks; here a rank holds its ``owned`` rows of each layer and asks their owners for the rest.

    Args:
        model: A layer stack (as :func:`layerwise_inference`).
        indptr: ``int64 [N+1]`` in-edge CSR of the whole graph (every rank reads its own rows' in-edges).
        indices: ``int64 [E]`` sources.
        owned: Sorted global ids of this rank's nodes.
        gather: ``gather(ids, served)``: rows of ``ids`` (any rank's) of the previous layer, where ``served`` is
            this rank's previous layer aligned with ``owned`` (None: the model's inputs). Collective: every rank
            calls it the same number of times.
        agree: ``agree(k)``: the largest ``k`` over the ranks (how many chunk rounds a layer takes).
        rows: Sorted subset of ``owned`` whose final outputs are returned (None: all of ``owned``).
        chunk_edges: In-edges per chunk of destination rows.
        edge_weight: ``[E]`` edge weights (None = none).
        edge_feat: ``[E, D]`` edge features (None = none).
        device: Where layers run.
        first_input: As :func:`layerwise_inference`'s.

    Returns:
        ``[len(rows), out_dim]`` on ``device``.
    """
    was_training = model.training
    model.eval()
    try:
        dev = torch.device(device)
        indptr_np, indices_np = np_int64(indptr), np_int64(indices)
        sampler = NeighborSampler(indptr_np, indices_np, [-1])
        stack = _layers(model)
        if stack is None:
            raise ValueError("ranked inference needs a message-passing layer stack")
        convs, pre, post = stack
        jk = getattr(model, "jk", "none") != "none"
        rows_np = owned if rows is None else np_int64(rows)
        at_rows = torch.from_numpy(np.searchsorted(owned, rows_np))
        served: Tensor | None = None
        if getattr(model, "encoder", None) is not None:  # every rank's own rows through the input layer, once
            encoded = _encoded(model, gather(owned, None).to(dev), dev)
            assert isinstance(encoded, Tensor)
            served = encoded
        outs: list[Tensor] = []
        for li, conv in enumerate(convs):
            last = li == len(convs) - 1
            seeds = rows_np if last else owned
            costs = np.concatenate([[0], np.cumsum(indptr_np[seeds + 1] - indptr_np[seeds])])
            bounds = chunk_bounds(costs, chunk_edges)
            mine = bounds.shape[0] - 1 if seeds.shape[0] else 0
            out: Tensor | None = None
            for c in range(agree(mine)):
                if c >= mine:  # this rank is done with the layer: it still serves its peers' rows
                    gather(np.empty(0, dtype=np.int64), served)
                    continue
                a, b = int(bounds[c]), int(bounds[c + 1])
                batch = sampler.sample(seeds[a:b], 0)
                block = batch.blocks[0]
                attach_edge_data([block], edge_weight, edge_feat)
                h_in = gather(batch.node_ids.numpy(), served).to(dev)
                if li == 0 and first_input is not None and served is None:
                    h_in = first_input(h_in)
                y = post(li, h_in, conv(block.to(dev), pre(li, h_in)))
                if out is None:
                    out = torch.empty((seeds.shape[0], *y.shape[1:]), dtype=y.dtype, device=dev)
                out[a:b] = y
            if out is None:  # no rows here (a rank without scored rows at the last layer)
                out = torch.empty((0, 0), device=dev)
            if jk:
                outs.append(out if last else out.index_select(0, at_rows.to(dev)))
            served = out
        assert served is not None
        return _readout(model, outs if jk else [served])
    finally:
        model.train(was_training)
