"""Edge normalizations computed once per graph: GCN's symmetric norm, row (mean) norm, inverse degrees.

Why cached on the graph: the values depend only on the structure, and a full-batch run calls a GCN layer
on the same graph every step; recomputing ``1/sqrt(deg)`` gathers over ``E`` edges each time would cost as
much as a small SpMM. Everything lands in ``graph.cache`` (internal memos) and is computed on the graph's
device; the global degrees that a loader or partition supplies are read from the graph's typed fields.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trellis.ops.graph import CSRGraph


def _safe_inv(t: Tensor) -> Tensor:
    """``1 / t`` with 0 where ``t == 0`` (an isolated node contributes nothing rather than ``inf``)."""
    return torch.where(t > 0, 1.0 / t.clamp_min(torch.finfo(t.dtype).tiny), torch.zeros_like(t))


def inv_degree(graph: CSRGraph, dtype: torch.dtype = torch.float32) -> Tensor:
    """``1 / in-degree`` per destination (``[num_dst]``, 0 for isolated rows), cached per dtype.

    Mean aggregation scales by it in the forward pass (per output row) and in the backward pass (per
    message, on the reverse graph). It is deliberately the *local* in-degree, not ``graph.dst_degree``:
    the mean is over the edges the graph holds (a sampled block averages its sampled neighbours). A
    destination-owned partition holds every in-edge of its rows, so there the two agree; an engine that
    splits a row's in-edges across parts (push, vertex-cut) must sum first and divide by the global
    in-degree at the owner.
    """
    key = f"inv_degree:{dtype}"
    if key not in graph.cache:
        graph.cache[key] = _safe_inv(graph.in_degree().to(torch.float64)).to(dtype)
    return graph.cache[key]


def row_norm(graph: CSRGraph) -> Tensor:
    """``1 / in-degree(dst)`` for every edge (``float32 [E]``, forward-edge order, cached).

    ``spmm(graph, x, row_norm(graph))`` equals ``spmm(graph, x, reduce="mean")``; the explicit weights are
    for layers that combine them with other per-edge factors.
    """
    if "row_norm" not in graph.cache:
        graph.cache["row_norm"] = inv_degree(graph).index_select(0, graph.dst_of_edges())
    return graph.cache["row_norm"]


def gcn_norm(graph: CSRGraph, add_self_loops: bool = True, weighted: bool = False) -> tuple[Tensor, Tensor | None]:
    """GCN's symmetric normalization ``D^-1/2 (A + I) D^-1/2`` as edge weights plus a diagonal term.

    The self loop is *not* inserted into the CSR: it is returned as ``self_weight`` and :func:`spmm` adds
    ``self_weight[i] * x[i]`` to row ``i``, so the graph (and its cached reverse) is reused as it is.
    Existing self loops in the graph stay ordinary edges (counted in the degree like any other edge).
    Structural only: ``graph.edge_weight`` is not folded in (multiply it in the layer if wanted).

    Degrees (``deg`` includes the added self loop when ``add_self_loops``):

    * square graph (``num_src == num_dst``): the in-degree for both ends, as PyG's ``gcn_norm`` does (for
      an undirected graph in- and out-degree agree);
    * ``graph.dst_degree`` / ``graph.src_degree`` when a loader or a partition supplies the *global*
      in-degrees (without self loops) of the graph's destination / source rows — a sampled block, a cluster
      subgraph, a partition's local graph with halo rows — which makes its normalization equal the full
      graph's on the same edges; each is used on its own, whichever is given;
    * otherwise, on a bipartite block, the block's local in-degree of destinations and local out-degree of
      sources (DGL's ``GraphConv`` convention on blocks).

    The self term ``self_weight[i]`` pairs destination ``i`` with source row ``i``: a graph whose
    destinations are not its first source rows, in the same order, gets wrong self weights.

    With ``weighted`` and a graph that carries ``edge_weight``, PyG's weighted form: ``deg_i = 1 + sum_j
    w_ij`` over the graph's own edges (a block's sampled edges; global degree hints count edges, so they are
    not used), and ``w_ij / sqrt(deg_i deg_j)``. A block whose destinations hold all their in-edges may carry
    ``src_weighted_degree`` (its sources' whole-graph weighted in-degrees): the sources' degrees are then
    those, and the normalization equals the whole graph's.

    Args:
        graph: The graph (full graph, block or partition).
        add_self_loops: Count a self loop in every degree and return its weight (default: True).
        weighted: Fold ``graph.edge_weight`` in (default: False: structural).

    Returns:
        ``(edge_weight [E], self_weight [num_dst] or None)``, float32 on the graph's device, cached in
        ``graph.cache``. A zero degree gives weight 0, never ``inf``.
    """
    weights = graph.edge_weight if weighted else None
    key = f"gcn_norm:{bool(add_self_loops)}:{weights is not None}"
    if key in graph.cache:
        return graph.cache[key]
    loop = 1.0 if add_self_loops else 0.0
    nd = graph.num_dst
    if weights is not None:
        w = weights.to(graph.device, torch.float64)
        dst = graph.dst_of_edges()
        dd = torch.zeros(nd, dtype=torch.float64, device=graph.device).index_add_(0, dst, w) + loop
        if graph.num_src == nd:
            ds = dd
        elif graph.src_weighted_degree is not None:  # every source's whole-graph weighted degree (inference)
            ds = graph.src_weighted_degree.to(graph.device, torch.float64) + loop
        else:
            ds = torch.zeros(graph.num_src, dtype=torch.float64, device=graph.device).index_add_(0, graph.indices, w)
            ds[:nd] += loop
        dd_is, ds_is = _safe_inv(dd).sqrt(), _safe_inv(ds).sqrt()
        ew = (w * dd_is.index_select(0, dst) * ds_is.index_select(0, graph.indices)).to(torch.float32)
        sw = (dd_is * ds_is[:nd]).to(torch.float32) if add_self_loops else None
        graph.cache[key] = (ew, sw)
        return ew, sw
    if graph.dst_degree is not None:
        dd = graph.dst_degree.to(graph.device, torch.float64) + loop
    else:
        dd = graph.in_degree().to(torch.float64) + loop
    if graph.src_degree is not None:
        ds = graph.src_degree.to(graph.device, torch.float64) + loop
    elif graph.num_src == nd:
        ds = dd
    else:
        ds = graph.out_degree().to(torch.float64).clone()
        ds[:nd] += loop  # the self loop of destination i starts at source row i
    dd_is = _safe_inv(dd).sqrt()
    ds_is = _safe_inv(ds).sqrt()
    ew = (dd_is.index_select(0, graph.dst_of_edges()) * ds_is.index_select(0, graph.indices)).to(torch.float32)
    sw = (dd_is * ds_is[:nd]).to(torch.float32) if add_self_loops else None
    graph.cache[key] = (ew, sw)
    return ew, sw


def weighted_mean_norm(graph: CSRGraph) -> Tensor:
    """``w_ij / sum_j w_ij`` over each destination's in-edges (a weighted mean as a sum); 0 where the sum is 0.

    Over the graph's own edges (a block's sampled edges), cached in ``graph.cache``.
    """
    if graph.edge_weight is None:
        raise ValueError("weighted_mean_norm needs a graph with edge weights")
    key = "weighted_mean_norm"
    if key not in graph.cache:
        w = graph.edge_weight.to(graph.device, torch.float64)
        dst = graph.dst_of_edges()
        total = torch.zeros(graph.num_dst, dtype=torch.float64, device=graph.device).index_add_(0, dst, w)
        graph.cache[key] = (w * _safe_inv(total).index_select(0, dst)).to(torch.float32)
    return graph.cache[key]
