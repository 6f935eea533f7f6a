"""Attention on the graph: SDDMM (per-edge scores from node tensors) and edge softmax.

Why these two ops and no fused "attention layer": a GAT layer is ``sddmm -> leaky_relu -> edge_softmax ->
spmm(x, alpha)``, and each step only ever holds ``[E, H]`` per-edge tensors; the ``[E, H, D]`` messages are
never materialized because :func:`trellis.ops.spmm` consumes per-head weights directly. Each op has its own
backward that is again a CSR pass (a segmented sum for ``add``, two SpMMs for ``dot``, a per-row reduction
for the softmax), so layers compose them freely.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from trellis.ops import kernels as K
from trellis.ops.graph import CSRGraph
from trellis.ops.segment import one, prim_segment_sum
from trellis.ops.spmm import prim_sddmm_dot, prim_spmm_sum

SDDMM_OPS = ("add", "dot")


# ---- primitives -------------------------------------------------------------------------------------------
def prim_sddmm_add(graph: CSRGraph, a: Tensor, b: Tensor) -> Tensor:
    """``out[k] = a[s_k] + b[i]`` for edge ``k`` of row ``i`` (``a [num_src, F]``, ``b [num_dst, F]``)."""
    if K.wants_numba(a, b):
        out = a.new_empty((graph.num_edges, a.shape[1]))
        K.launch(K.sddmm_add, graph, graph.num_edges, a, K.np_(graph.indptr), K.np_(graph.indices), K.np_(a),
                 K.np_(b), out.numpy())
        return out
    return a.index_select(0, graph.indices) + b.index_select(0, graph.dst_of_edges())


def prim_softmax(graph: CSRGraph, logits: Tensor) -> Tensor:
    """Softmax of ``logits [E, H]`` within each destination's edges (max-subtracted)."""
    if K.wants_numba(logits):
        out = logits.new_empty(logits.shape)
        K.launch(K.softmax_fwd, graph, graph.num_edges, logits, K.np_(graph.indptr), K.np_(logits), out.numpy())
        return out
    dst = graph.dst_of_edges()
    idx = dst[:, None].expand_as(logits)
    m = logits.new_full((graph.num_dst, logits.shape[1]), -math.inf)
    m = m.scatter_reduce(0, idx, logits, "amax", include_self=True)
    ex = torch.exp(logits - m.index_select(0, dst))
    s = logits.new_zeros(m.shape).index_add_(0, dst, ex)
    return ex / s.index_select(0, dst)


def prim_softmax_bwd(graph: CSRGraph, a: Tensor, g: Tensor) -> Tensor:
    """Gradient of :func:`prim_softmax`: ``a * (g - sum_row(a * g))``."""
    if K.wants_numba(a, g):
        out = a.new_empty(a.shape)
        K.launch(K.softmax_bwd, graph, graph.num_edges, a, K.np_(graph.indptr), K.np_(a), K.np_(g), one(a),
                 out.numpy())
        return out
    ag = a * g
    s = prim_segment_sum(graph, ag)
    return ag - a * s.index_select(0, graph.dst_of_edges())


# ---- autograd ---------------------------------------------------------------------------------------------
class _SDDMMAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: CSRGraph, a: Tensor, b: Tensor) -> Tensor:
        ctx.graph = graph
        return prim_sddmm_add(graph, a, b)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        graph: CSRGraph = ctx.graph
        g = g.contiguous()
        ga = prim_segment_sum(graph.reverse(), g, eid=graph.perm) if ctx.needs_input_grad[1] else None
        gb = prim_segment_sum(graph, g) if ctx.needs_input_grad[2] else None
        return None, ga, gb


class _SDDMMDot(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: CSRGraph, a: Tensor, b: Tensor) -> Tensor:
        ctx.graph = graph
        ctx.save_for_backward(a if ctx.needs_input_grad[2] else None, b if ctx.needs_input_grad[1] else None)
        return prim_sddmm_dot(graph, a, b)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        graph: CSRGraph = ctx.graph
        a, b = ctx.saved_tensors
        g = g.contiguous()
        # d out[k,h] / d a[s,h,:] = b[i,h,:]: an SpMM on the reverse graph with the grads as per-head weights.
        ga = prim_spmm_sum(graph.reverse(), b, g, eid=graph.perm) if ctx.needs_input_grad[1] else None
        gb = prim_spmm_sum(graph, a, g) if ctx.needs_input_grad[2] else None
        return None, ga, gb


class _EdgeSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, graph: CSRGraph, logits: Tensor) -> Tensor:
        ctx.graph = graph
        out = prim_softmax(graph, logits)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        (a,) = ctx.saved_tensors
        return None, prim_softmax_bwd(ctx.graph, a, g.contiguous())


def _rows(t: Tensor, n: int, what: str) -> Tensor:
    if t.shape[0] < n:
        raise ValueError(f"{what} has {t.shape[0]} rows but the graph needs {n}")
    return t[:n]


def sddmm(graph: CSRGraph, a_src: Tensor, b_dst: Tensor, op: str = "add") -> Tensor:
    """Per-edge scores from a source-side and a destination-side node tensor (sampled dense-dense op).

    Args:
        graph: In-edge CSR.
        a_src: Source-side tensor, ``num_src`` rows.
        b_dst: Destination-side tensor; its first ``num_dst`` rows are used (so a full ``[num_src, ...]``
            tensor may be passed for a block whose destinations come first).
        op: ``"add"``: ``a_src[src] + b_dst[dst]``, shapes ``[N, ...] -> [E, ...]`` (GAT's
            ``el[src] + er[dst]``); ``"dot"``: ``(a_src[src] * b_dst[dst]).sum(-1)``, shapes ``[N, H, D] ->
            [E, H]`` or ``[N, D] -> [E]`` (dot-product attention) (default: ``"add"``).

    Returns:
        ``[E, ...]`` in forward-edge order, differentiable w.r.t. both inputs; ``"dot"`` never builds an
        ``[E, H, D]`` tensor on the numba path, and its backward is two SpMMs with the gradient as weights.
    """
    if op not in SDDMM_OPS:
        raise ValueError(f"op must be one of {', '.join(SDDMM_OPS)}; got {op!r}")
    if a_src.shape[0] != graph.num_src:
        raise ValueError(f"a_src has {a_src.shape[0]} rows but the graph has {graph.num_src} source nodes")
    b = _rows(b_dst, graph.num_dst, "b_dst")
    if a_src.shape[1:] != b.shape[1:]:
        raise ValueError(f"a_src and b_dst differ in trailing shape: {tuple(a_src.shape)} vs {tuple(b_dst.shape)}")
    dt = torch.promote_types(a_src.dtype, b.dtype)
    a, b = a_src.to(dt), b.to(dt)
    ns, nd, e = graph.num_src, graph.num_dst, graph.num_edges
    if op == "add":
        tail = a.shape[1:]
        f = math.prod(tail)
        out = _SDDMMAdd.apply(graph, a.reshape(ns, f).contiguous(), b.reshape(nd, f).contiguous())
        return out.view(e, *tail)
    if a.dim() == 2:
        out = _SDDMMDot.apply(graph, a.view(ns, 1, a.shape[1]).contiguous(), b.reshape(nd, 1, b.shape[1]).contiguous())
        return out.view(e)
    if a.dim() != 3:
        raise ValueError(f"op='dot' needs [N, D] or [N, H, D] inputs; got {tuple(a.shape)}")
    return _SDDMMDot.apply(graph, a.contiguous(), b.contiguous())


def edge_softmax(graph: CSRGraph, logits: Tensor) -> Tensor:
    """Softmax over the in-edges of each destination, per head: ``a_e = exp(l_e) / sum_{e' -> dst} exp(l_e')``.

    Numerically stable (the per-destination max is subtracted first). The backward pass is
    ``grad_l = a * (g - sum_{dst's edges} a * g)``, one more per-row pass; only ``a`` is kept for it.

    Args:
        graph: In-edge CSR; edges of a destination are contiguous, so this is a segmented softmax.
        logits: ``[E]`` or ``[E, H]`` (or ``[E, ...]``) in forward-edge order.

    Returns:
        Attention weights of the same shape, summing to 1 over each non-empty destination.
    """
    if logits.shape[0] != graph.num_edges:
        raise ValueError(f"logits has {logits.shape[0]} rows but the graph has {graph.num_edges} edges")
    tail = logits.shape[1:]
    flat = logits.reshape(graph.num_edges, math.prod(tail)).contiguous()
    return _EdgeSoftmax.apply(graph, flat).view(logits.shape)

