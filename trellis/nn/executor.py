"""The executor of a pushed-down layer's plan, for one configuration or for K batched configurations.

A layer whose message and aggregate are unparameterized (GCN, GraphSAGE, GIN) declares its decomposition
once (:class:`PushdownLayer`): *what* is aggregated (:meth:`~PushdownLayer.aggregation`: edge weights, self
weight, reduce), the transform that commutes with the aggregation (:meth:`~PushdownLayer.transform_weight`)
and the epilogue after it (:meth:`~PushdownLayer.epilogue`, :meth:`~PushdownLayer.output_bias`).
:func:`run_layer` runs the planner's :class:`~trellis.plan.ir.LayerPlan` over those pieces: a layer's own
``forward`` calls it with one configuration, :class:`trellis.nn.batched.BatchedGNN` with K, so the math
of each layer exists once and a configuration of a sweep performs the floating-point operations of its
solo run.

For K configurations the plan says, per configuration, whether it aggregates first and whether it reads the
cached aggregation of the constant input; every aggregation of the layer becomes **one** SpMM over the
configurations' inputs concatenated along the feature axis (columns of an SpMM do not interact, so
configuration k's columns equal its narrow aggregation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from trellis.nn.runtime import AggregationCache
from trellis.ops import spmm
from trellis.ops.graph import Aggregation, CSRGraph
from trellis.ops.sparse_rows import is_sparse, linear
from trellis.plan.decl import LayerDecl
from trellis.plan.ir import LayerPlan


class PushdownLayer(Protocol):
    """A layer decomposed as (transform) -> aggregation -> epilogue, the transform commuting with the aggregation."""

    def declare(self) -> LayerDecl:
        """The layer's declaration (the planner plans from it)."""
        ...

    def aggregation(self, graph: CSRGraph) -> Aggregation:
        """What is aggregated on ``graph`` (the same for every configuration of a batch)."""
        ...

    def transform_weight(self) -> Tensor:
        """``[out, in]``: the linear map a transform-first plan applies to every source row before aggregating."""
        ...

    def epilogue(self, a: Tensor, h: Tensor, z: Tensor | None, aggregate_first: bool, n: int) -> Tensor:
        """The layer's output (before :meth:`output_bias`) from the aggregation.

        Args:
            a: The aggregation ``[n, d]`` (of ``h`` when aggregating first, else of ``z``).
            h: The layer's input ``[num_src, in]`` (root terms read its first ``n`` rows).
            z: ``h`` transformed by :meth:`transform_weight` (transform-first only, else None).
            aggregate_first: Which order the plan chose.
            n: Number of destinations.
        """
        ...

    def output_bias(self) -> Tensor | None:
        """A bias added after the epilogue, fusable with the activation and dropout that follow.

        None when the layer adds its bias inside a linear map of the epilogue.
        """
        ...


def run_layer(convs: Sequence[PushdownLayer], graph: CSRGraph, hs: Sequence[Tensor], plan: LayerPlan, *,
              cache: AggregationCache | None = None, constant: Tensor | None = None,
              prebuilt: Tensor | None = None) -> list[Tensor]:
    """Run one layer's plan for every configuration: one SpMM over the concatenated inputs.

    A graph that carries its :attr:`~trellis.ops.graph.CSRGraph.fixed_aggregation` (a kept rehearsal batch's
    input block) has no SpMM to run: every configuration's epilogue reads that aggregation (aggregate-first).

    Args:
        convs: Per configuration, its layer (all of one kind: the aggregation is the first one's).
        graph: The layer's graph.
        hs: Per configuration, the layer's input ``[graph.num_src, in_k]`` (after dropout and the graph view).
        plan: The layer's plan: per configuration, its order and whether it reads the cached aggregation.
        cache: Where cached aggregations live (None: a cached one is computed, without autograd, every call).
        constant: The constant input a cached configuration's ``hs[k]`` must be (the features, undropped).
        prebuilt: The wide SpMM input when its column blocks were already written in place (dropout written
            straight into the concatenation); used only when the parts are exactly its blocks.

    Returns:
        Per configuration, the layer's output before :meth:`PushdownLayer.output_bias`.
    """
    n = graph.num_dst
    # sparse rows are transformed first (below); a layer without a transform (a user's) aggregates them dense
    hs = [h.to_dense() if is_sparse(h) and not c.declare().transform else h for c, h in zip(convs, hs)]
    if graph.fixed_aggregation is not None:  # computed when the batch was kept: only the epilogue runs
        fixed = graph.fixed_aggregation
        return [conv.epilogue(fixed, h, None, True, n) for conv, h in zip(convs, hs)]
    agg = convs[0].aggregation(graph)
    # Inputs of the wide SpMM. A tensor shared by several aggregate-first configurations (the features,
    # undropped, with the cache rewrite off) enters once; transform-first configurations sharing an input
    # (the features in an evaluation pass) are transformed by one matmul whose output enters as one part.
    parts: list[Tensor] = []
    pieces: list[list[int]] = []  # per part: the widths of the configurations' pieces
    where: dict[int, tuple[int, int]] = {}  # configuration position -> (part, piece)
    zs: dict[int, Tensor] = {}  # configuration position -> its pre-transformed input (GIN's root term)
    agg_input: dict[int, int] = {}  # id of an aggregate-first input -> part
    tr_groups: dict[int, list[int]] = {}
    # A sparse input (bag-of-words rows, trellis.ops.sparse_rows) is always transformed first: its transform
    # is an SpMM over its non-zeros, and aggregating it first would need a dense [N, F] result.
    first = [plan.order(j) and not is_sparse(h) for j, h in enumerate(hs)]
    cached_j = [plan.is_cached(j) and not is_sparse(h) for j, h in enumerate(hs)]
    for j, h in enumerate(hs):
        if cached_j[j]:
            continue
        if first[j]:
            if id(h) not in agg_input:
                agg_input[id(h)] = len(parts)
                parts.append(h)
                pieces.append([h.shape[1]])
            where[j] = (agg_input[id(h)], 0)
        else:
            tr_groups.setdefault(id(h), []).append(j)
    for group in tr_groups.values():
        weights = [convs[j].transform_weight() for j in group]
        z = linear(hs[group[0]], torch.cat(weights, 0) if len(weights) > 1 else weights[0])
        widths = [w.shape[0] for w in weights]
        for q, (j, zj) in enumerate(zip(group, z.split(widths, dim=1) if len(group) > 1 else (z,))):
            zs[j] = zj
            where[j] = (len(parts), q)
        parts.append(z)
        pieces.append(widths)
    aggs: list[list[Tensor]] = []
    if parts:
        if prebuilt is not None and sum(p.shape[1] for p in parts) == prebuilt.shape[1] and all(
                p.data_ptr() == prebuilt.data_ptr() + q * p.shape[1] * p.element_size()
                and p.stride() == prebuilt.stride() for q, p in enumerate(parts)):
            wide = prebuilt  # the parts are its column blocks, in order
        else:
            wide = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        out = aggregate(convs[0], graph, wide, agg)
        per_part = out.split([p.shape[1] for p in parts], dim=1) if len(parts) > 1 else (out,)
        aggs = [list(a.split(w, dim=1)) if len(w) > 1 else [a] for a, w in zip(per_part, pieces)]
    cached: Tensor | None = None
    results = []
    for j, (conv, h) in enumerate(zip(convs, hs)):
        if cached_j[j]:
            if cached is None:
                cached = _cached_aggregation(convs[0], graph, h, agg, cache, constant)
            a = cached
        else:
            part, piece = where[j]
            a = aggs[part][piece]
        results.append(conv.epilogue(a, h, zs.get(j), first[j], n))
    return results


def aggregate(conv: PushdownLayer, graph: CSRGraph, x: Tensor, agg: Aggregation) -> Tensor:
    """``agg`` of ``x`` on ``graph``: one SpMM, or the graph's exchange when its in-edges are split across processes.

    The exchange (:attr:`trellis.ops.graph.CSRGraph.exchange`) runs the aggregation on the edges its process
    holds and completes it with its peers'; it asks ``conv`` for the aggregation on its own local graphs,
    so the weights follow from the same definition (GCN's global-degree norm, mean's global in-degree).
    """
    if graph.exchange is not None:
        return graph.exchange.aggregate(x, conv.aggregation, agg.reduce)
    return spmm(graph, x, agg.edge_weight, reduce=agg.reduce, self_weight=agg.self_weight)


def _cached_aggregation(conv: PushdownLayer, graph: CSRGraph, h: Tensor, agg: Aggregation,
                        cache: AggregationCache | None, constant: Tensor | None) -> Tensor:
    """The aggregation of the constant input, from ``cache`` (computed once) or computed without autograd."""
    if constant is None or h is not constant:
        raise AssertionError("only the undropped input features can be cached")

    def compute() -> Tensor:
        return aggregate(conv, graph, h, agg)

    if cache is None:
        with torch.no_grad():
            return compute()
    return cache.get(graph, h, f"{type(conv).__name__}:{agg.reduce}", compute)


class InputAggregation:
    """A layer's aggregation of constant input rows on a block, without autograd: a kept batch's precomputed part.

    Why: a partition buffer's rehearsal batch (:class:`trellis.loader.buffer.Kept`) is trained again at many
    steps, on the same sampled block and the same (undropped) feature rows. Its first layer's aggregation is
    then the same every time; computed once, the batch keeps it and its destinations' rows instead of all its
    input rows (about a sixth of them at fanouts 10,5), and each rehearsal skips its largest SpMM and the
    transform of every input row. The loader calls it; it holds the model's first layer, which the buffer
    (below ``nn``) does not know. Only a pushed-down layer's aggregation is parameter-free.
    """

    def __init__(self, conv: PushdownLayer) -> None:
        self.conv = conv

    def __call__(self, graph: CSRGraph, x: Tensor) -> Tensor:
        """``[graph.num_dst, F]``: the layer's aggregation of ``x`` (``[graph.num_src, F]``) on ``graph``."""
        with torch.no_grad():
            return aggregate(self.conv, graph, x, self.conv.aggregation(graph))
