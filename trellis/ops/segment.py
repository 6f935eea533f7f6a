"""Segmented reductions: per-edge tensors reduced to their destination rows, with backward.

In a CSR the edges of destination ``i`` are the contiguous positions ``indptr[i]:indptr[i+1]``, so reducing
a materialized per-edge tensor (a general message, GAT-E's ``alpha * edge_feat``) is a *segmented*
reduction: no scatter, no atomics, one pass. The primitives here (``prim_*``) are shared by the other ops:
each runs the numba kernel for CPU float tensors and a pure-torch equivalent otherwise (CUDA, other
dtypes, ``TRELLIS_DISABLE_NUMBA=1``); the torch version is also the reference the tests compare against.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from trellis.ops import kernels as K
from trellis.ops.graph import CSRGraph
from trellis.ops.norm import inv_degree

REDUCES = ("sum", "mean", "max")


def check_reduce(reduce: str) -> None:
    """Raise ``ValueError`` unless ``reduce`` is one of :data:`REDUCES`."""
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {', '.join(REDUCES)}; got {reduce!r}")


def one(t: Tensor) -> Any:
    """``1`` as a numpy scalar of ``t``'s dtype (keeps numba kernels in float32 for float32 data)."""
    return np.dtype(str(t.dtype).replace("torch.", "")).type(1)


def opt(t: Tensor | None, dtype: Any, ndim: int = 1) -> np.ndarray:
    """Numpy view of an optional tensor, or the shared empty array standing for "absent"."""
    return K.empty(dtype, ndim) if t is None else K.np_(t)


def bcast(v: Tensor, like: Tensor) -> Tensor:
    """View a ``[N]`` or ``[N, H]`` per-row factor so it broadcasts against ``like`` ``[N, ...]``."""
    return v.reshape(*v.shape, *([1] * (like.dim() - v.dim())))


def torch_scatter_max(dst: Tensor, vals: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Per-row max of ``vals [E, ...]`` grouped by ``dst``, and the *first* edge reaching it (``-1`` if none).

    The first-argmax rule matches the numba kernels, so both paths send a tie's gradient to the same edge
    (ties are real: duplicate edges carry identical messages).
    """
    e = vals.shape[0]
    idx = bcast(dst, vals).expand_as(vals)
    out = vals.new_zeros((n, *vals.shape[1:])).scatter_reduce(0, idx, vals, "amax", include_self=False)
    eids = bcast(torch.arange(e, device=vals.device), vals).expand_as(vals)
    cand = torch.where(vals == out.gather(0, idx), eids, torch.full_like(eids, e))
    arg = torch.full(out.shape, e, dtype=torch.int64, device=vals.device)
    arg = arg.scatter_reduce(0, idx, cand, "amin", include_self=True)
    arg[arg == e] = -1
    return out, arg


# ---- primitives -------------------------------------------------------------------------------------------
def prim_segment_sum(graph: CSRGraph, vals: Tensor, eid: Tensor | None = None,
                     rscale: Tensor | None = None) -> Tensor:
    """``out[i] = rscale[i] * sum of vals[eid[k]]`` over row ``i``'s positions ``k`` (``vals [E, F]``)."""
    n = graph.num_dst
    if K.wants_numba(vals):
        out = vals.new_empty((n, vals.shape[1]))
        K.launch(K.segment_sum, graph, graph.num_edges, vals, K.np_(graph.indptr), opt(eid, np.int64),
                 K.np_(vals), opt(rscale, K.np_(vals).dtype), out.numpy())
        return out
    v = vals if eid is None else vals.index_select(0, eid)
    out = vals.new_zeros((n, vals.shape[1])).index_add_(0, graph.dst_of_edges(), v)
    return out if rscale is None else out * rscale[:, None]


def prim_segment_bcast(graph: CSRGraph, g: Tensor, rscale: Tensor | None = None) -> Tensor:
    """``out[k] = rscale[i] * g[i]`` for every edge ``k`` of row ``i`` (``g [num_dst, F]`` -> ``[E, F]``).

    A plain gather: torch's ``index_select`` is already parallel and bandwidth-bound, so no kernel.
    """
    gr = g if rscale is None else g * rscale[:, None]
    return gr.index_select(0, graph.dst_of_edges())


def prim_segment_max(graph: CSRGraph, vals: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row max of ``vals [E, F]`` and the edge id of the maximum (``-1`` for an empty row)."""
    n = graph.num_dst
    if K.wants_numba(vals):
        out = vals.new_empty((n, vals.shape[1]))
        arg = torch.empty((n, vals.shape[1]), dtype=torch.int64)
        K.launch(K.segment_max, graph, graph.num_edges, vals, K.np_(graph.indptr), K.np_(vals), out.numpy(),
                 arg.numpy())
        return out, arg
    return torch_scatter_max(graph.dst_of_edges(), vals, n)


def prim_segment_max_bwd(graph: CSRGraph, arg: Tensor, g: Tensor) -> Tensor:
    """Gradient of :func:`prim_segment_max`: ``g[i, f]`` to edge ``arg[i, f]``, zero elsewhere (``[E, F]``).

    One scatter of ``num_dst x F`` values (each edge/feature receives at most one), done by torch.
    """
    e, f = graph.num_edges, g.shape[1]
    out = g.new_zeros((e, f))
    valid = arg >= 0
    cols = torch.arange(f, device=g.device).expand_as(arg)
    out.view(-1).index_put_((arg[valid] * f + cols[valid],), g[valid])
    return out


# ---- autograd ---------------------------------------------------------------------------------------------
class _SegmentReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: CSRGraph, vals: Tensor, reduce: str) -> Tensor:
        ctx.graph, ctx.reduce = graph, reduce
        if reduce == "max":
            out, arg = prim_segment_max(graph, vals)
            ctx.save_for_backward(arg)
            return out
        rscale = inv_degree(graph, vals.dtype) if reduce == "mean" else None
        return prim_segment_sum(graph, vals, rscale=rscale)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        if not ctx.needs_input_grad[1]:
            return None, None, None
        g = g.contiguous()
        if ctx.reduce == "max":
            (arg,) = ctx.saved_tensors
            return None, prim_segment_max_bwd(ctx.graph, arg, g), None
        rscale = inv_degree(ctx.graph, g.dtype) if ctx.reduce == "mean" else None
        return None, prim_segment_bcast(ctx.graph, g, rscale), None


def segment_reduce(graph: CSRGraph, edge_values: Tensor, reduce: str = "sum") -> Tensor:
    """Reduce a per-edge tensor to its destinations: ``out[i] = reduce(edge_values[indptr[i]:indptr[i+1]])``.

    Use it when messages must be materialized per edge (a message that is not a scaled source row, GAT-E's
    edge features); when the message is ``w_e * x[src]`` use :func:`trellis.ops.spmm`, which never builds
    the ``[E, ...]`` tensor.

    Args:
        graph: The CSR whose rows are the destinations.
        edge_values: ``[E, ...]`` in forward-edge order.
        reduce: ``"sum"``, ``"mean"`` (sum / in-degree) or ``"max"`` (elementwise; the gradient goes to the
            first edge reaching the maximum). Rows without edges give 0 (default: ``"sum"``).

    Returns:
        ``[num_dst, ...]`` with the trailing shape of ``edge_values``.
    """
    check_reduce(reduce)
    if edge_values.shape[0] != graph.num_edges:
        raise ValueError(f"edge_values has {edge_values.shape[0]} rows but the graph has {graph.num_edges} edges")
    tail = edge_values.shape[1:]
    flat = edge_values.reshape(graph.num_edges, math.prod(tail)).contiguous()
    out = _SegmentReduce.apply(graph, flat, reduce)
    return out.reshape(graph.num_dst, *tail)
