"""Aggregation as SpMM: ``out[i] = reduce over in-edges (w_e * x[src_e])`` (+ a diagonal self term).

Why a custom autograd function: the gradient w.r.t. ``x`` is the same aggregation on the *reverse* graph
(rows = sources), so it runs row-parallel without atomics on the cached reverse CSR, with each edge's
weight taken through ``graph.perm`` (per-head weights inside the kernel; scalar weights permuted once, and
cached while they are constant). The gradient w.r.t. the edge weights is an SDDMM (one dot product per
edge), and only the gradients autograd asks for are computed. No ``[E, F]`` message
tensor exists on the numba path, in either direction; the pure-torch path (CUDA, other dtypes) gathers
messages with ``index_select`` and scatters with ``index_add_`` / ``scatter_reduce``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, overload

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from trellis.ops import kernels as K
from trellis.ops.graph import CSRGraph
from trellis.ops.norm import inv_degree
from trellis.ops.segment import bcast, check_reduce, one, opt, torch_scatter_max


# ---- primitives (numba kernel or torch equivalent) -------------------------------------------------------
def _coefficients(graph: CSRGraph, w: Tensor | None, eid: Tensor | None, nscale: Tensor | None) -> Tensor | None:
    """Per-CSR-position coefficients ``w[eid[k]] * nscale[indices[k]]`` (None when all factors are absent).

    One E-length gather here keeps every kernel's hot loop free of optional factors. On a reverse graph the
    result is cached while the weights are constant (GCN's normalization: same tensor, not trainable,
    unmodified), so a full-batch run permutes them once rather than every backward pass. The cache keeps
    a reference to ``w``, so its storage cannot be reused by another tensor while the entry lives.
    """
    if eid is None and nscale is None:
        return w
    key = None
    if w is None or not w.requires_grad:
        key = (eid is not None, None if w is None else (w.data_ptr(), w.shape, w.dtype, w._version),
               None if nscale is None else (nscale.data_ptr(), nscale.dtype))
        hit = graph.cache.get("_coef")
        if hit is not None and hit[0] == key:
            return hit[2]
    coef = None if w is None else (w if eid is None else w.index_select(0, eid))
    if nscale is not None:
        ns = nscale.index_select(0, graph.indices)
        coef = ns if coef is None else coef * bcast(ns, coef)
    if key is not None:
        graph.cache["_coef"] = (key, (w, nscale), coef)
    return coef


def _ones(graph: CSRGraph, x: Tensor) -> Tensor:
    """Unit edge values for an unweighted sparse matmul, cached on the graph per dtype."""
    key = f"_ones_{x.dtype}"
    t = graph.cache.get(key)
    if t is None:
        t = graph.cache[key] = torch.ones(graph.num_edges, dtype=x.dtype, device=x.device)
    return t


def prim_spmm_sum(graph: CSRGraph, x: Tensor, w: Tensor | None = None, eid: Tensor | None = None,
                  nscale: Tensor | None = None, rscale: Tensor | None = None, sw: Tensor | None = None) -> Tensor:
    """``out[i] = rscale[i] * sum_k w[eid[k]] nscale[s_k] x[s_k] + sw[i] x[i]`` over row ``i``'s edges.

    Args:
        graph: CSR to aggregate over (the reverse graph in a backward pass).
        x: ``[num_src, F]`` (then ``w`` is ``[E]`` or None) or ``[num_src, H, D]`` (then ``w`` is ``[E, H]``).
        w: Edge weights indexed by edge id (``eid[k]``, or ``k`` when ``eid`` is None).
        eid: Edge id of each CSR position (``graph.perm`` when ``graph`` is a reverse CSR).
        nscale: ``[num_src]`` factor per source row (mean's ``1/deg`` in a backward pass).
        rscale: ``[num_dst]`` factor per output row (mean's ``1/deg`` in a forward pass).
        sw: ``[n <= num_dst]`` diagonal term added after scaling.
    """
    n = graph.num_dst
    shape = (n, *x.shape[1:])
    if x.dim() == 3 and w is not None and w.shape[1] == 1:  # one coefficient per edge: the flat, faster kernel
        x, w = x.reshape(x.shape[0], -1), w.reshape(-1)
    if x.dim() == 3 and w is None:
        raise ValueError("a multi-head x needs [E, H] weights")
    if K.wants_numba(x):
        dt = K.np_(x).dtype
        out = x.new_empty((n, *x.shape[1:]))
        if x.dim() == 2:
            K.launch(K.spmm_sum_1, graph, graph.num_edges, x, K.np_(graph.indptr), K.np_(graph.indices),
                     opt(_coefficients(graph, w, eid, nscale), dt), K.np_(x), opt(rscale, dt), opt(sw, dt), 0,
                     out.numpy())
        else:  # per-head weights are read through eid inside the kernel; nscale is folded in beforehand
            if nscale is not None:
                w, eid = _coefficients(graph, w, eid, nscale), None
            assert w is not None  # refused above for a multi-head x
            K.launch(K.spmm_sum_h, graph, graph.num_edges, x, K.np_(graph.indptr), K.np_(graph.indices),
                     opt(eid, np.int64), K.np_(w), K.np_(x), opt(rscale, dt), opt(sw, dt), out.numpy())
        return out.view(shape)
    coef = _coefficients(graph, w, eid, nscale)
    if x.dim() == 2 and x.is_cuda and x.dtype in (torch.float32, torch.float64):
        # cuSPARSE CSR x dense: no [E, F] message tensor on the GPU either.
        vals = coef.to(x.dtype) if coef is not None else _ones(graph, x)
        crow, col = graph.indptr.to(x.device), graph.indices.to(x.device)  # no-ops when already there
        with warnings.catch_warnings():  # torch >= 2.11 warns, once per process, that CSR support is "beta"
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
            warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
            # the CSR comes from a validated store: torch's O(E) invariant check would only cost time
            a = torch.sparse_csr_tensor(crow, col, vals, (n, x.shape[0]), check_invariants=False)
        out = torch.sparse.mm(a, x)
    else:
        msg = x.index_select(0, graph.indices)
        if coef is not None:
            msg = msg * bcast(coef, msg)
        out = x.new_zeros((n, *x.shape[1:])).index_add_(0, graph.dst_of_edges(), msg)
    if rscale is not None:
        out = out * bcast(rscale, out)
    if sw is not None:
        m = sw.shape[0]
        out[:m] += bcast(sw, x[:m]) * x[:m]
    return out.view(shape)


def prim_spmm_max(graph: CSRGraph, x: Tensor, w: Tensor | None, sw: Tensor | None) -> tuple[Tensor, Tensor]:
    """Max aggregation of ``w[k, h] * x[s_k, h, :]`` (``x [N, H, D]``, ``w [E, H]`` or None) and its argmax."""
    n = graph.num_dst
    if K.wants_numba(x):
        dt = K.np_(x).dtype
        out = x.new_empty((n, *x.shape[1:]))
        arg = torch.empty((n, *x.shape[1:]), dtype=torch.int64)
        K.launch(K.spmm_max, graph, graph.num_edges, x, K.np_(graph.indptr), K.np_(graph.indices), opt(w, dt, 2),
                 K.np_(x), opt(sw, dt), one(x), out.numpy(), arg.numpy())
        return out, arg
    msg = x.index_select(0, graph.indices)
    if w is not None:
        msg = msg * w[:, :, None]
    out, arg = torch_scatter_max(graph.dst_of_edges(), msg, n)
    if sw is not None:
        m = sw.shape[0]
        out[:m] += sw[:, None, None] * x[:m]
    return out, arg


def prim_spmm_max_bwd_x(graph: CSRGraph, arg: Tensor, g: Tensor, w: Tensor | None, sw: Tensor | None) -> Tensor:
    """Gradient of :func:`prim_spmm_max` w.r.t. ``x``: each ``g[i, h, d]`` goes to the argmax edge's source."""
    ns = graph.num_src
    if K.wants_numba(g):
        dt = K.np_(g).dtype
        rev, perm = graph.reverse(), graph.edge_perm()
        out = g.new_empty((ns, *g.shape[1:]))
        K.launch(K.spmm_max_bwd_x, rev, graph.num_edges, g, K.np_(rev.indptr), K.np_(rev.indices),
                 K.np_(perm), opt(w, dt, 2), K.np_(arg), K.np_(g), opt(sw, dt), one(g), out.numpy())
        return out
    _, hh, dd = g.shape
    out = g.new_zeros((ns, hh, dd))
    i, h, d = torch.nonzero(arg >= 0, as_tuple=True)
    e = arg[i, h, d]
    val = g[i, h, d] if w is None else g[i, h, d] * w[e, h]
    out.view(-1).index_add_(0, (graph.indices[e] * hh + h) * dd + d, val)
    if sw is not None:
        m = sw.shape[0]
        out[:m] += sw[:, None, None] * g[:m]
    return out


def prim_spmm_max_bwd_w(graph: CSRGraph, arg: Tensor, g: Tensor, x: Tensor) -> Tensor:
    """Gradient of :func:`prim_spmm_max` w.r.t. ``w [E, H]``: ``g * x[src]`` summed where the edge won.

    Torch only (weighted max with trainable weights is rare): one gather and one scatter of ``num_dst x H x D``.
    """
    e_count, hh = graph.num_edges, g.shape[1]
    out = g.new_zeros((e_count, hh))
    i, h, d = torch.nonzero(arg >= 0, as_tuple=True)
    e = arg[i, h, d]
    out.view(-1).index_add_(0, e * hh + h, g[i, h, d] * x[graph.indices[e], h, d])
    return out


def prim_sddmm_dot(graph: CSRGraph, a: Tensor, b: Tensor, rscale: Tensor | None = None) -> Tensor:
    """``out[k, h] = rscale[i] * dot(a[s_k, h], b[i, h])`` (``a [num_src, H, D]``, ``b [num_dst, H, D]``)."""
    if K.wants_numba(a, b):
        out = a.new_empty((graph.num_edges, a.shape[1]))
        K.launch(K.sddmm_dot, graph, graph.num_edges, a, K.np_(graph.indptr), K.np_(graph.indices), K.np_(a),
                 K.np_(b), opt(rscale, K.np_(a).dtype), one(a), out.numpy())
        return out
    dst = graph.dst_of_edges()
    out = (a.index_select(0, graph.indices) * b.index_select(0, dst)).sum(-1)
    return out if rscale is None else out * rscale.index_select(0, dst)[:, None]


def prim_spmm_bwd_fused(graph: CSRGraph, g: Tensor, x: Tensor, w: Tensor, nscale: Tensor | None,
                       sw: Tensor | None) -> tuple[Tensor, Tensor]:
    """Gradients w.r.t. ``x [Ns, H, D]`` and ``w [E, H]`` of a weighted sum/mean SpMM in one reverse pass.

    Numba only (callers check :func:`~trellis.ops.kernels.wants_numba`): it reads each gathered gradient row
    once for both products instead of once per gradient (see :func:`trellis.ops.kernels.spmm_bwd_fused`).
    """
    rev, perm = graph.reverse(), graph.edge_perm()
    dt = K.np_(g).dtype
    gx = g.new_empty((graph.num_src, *g.shape[1:]))
    gw = g.new_empty((graph.num_edges, g.shape[1]))
    K.launch(K.spmm_bwd_fused, rev, graph.num_edges, g, K.np_(rev.indptr), K.np_(rev.indices), K.np_(perm),
             K.np_(w), opt(nscale, dt), K.np_(g), K.np_(x), opt(sw, dt), one(g), gx.numpy(), gw.numpy())
    return gx, gw


# ---- autograd ---------------------------------------------------------------------------------------------
def _as3(t: Tensor) -> Tensor:
    return t if t.dim() == 3 else t.view(t.shape[0], 1, t.shape[1])


@overload
def _w2(w: Tensor) -> Tensor: ...
@overload
def _w2(w: None) -> None: ...
def _w2(w: Tensor | None) -> Tensor | None:
    """``[E]`` weights as ``[E, 1]`` (``[E, H]`` and None unchanged)."""
    return w if w is None or w.dim() == 2 else w.view(-1, 1)


class _SpMM(torch.autograd.Function):
    """``x`` is ``[Ns, F]`` with ``w [E]``/None, or ``[Ns, H, D]`` with ``w [E, H]`` (see :func:`spmm`)."""

    @staticmethod
    def forward(ctx: Any, graph: CSRGraph, x: Tensor, w: Tensor | None, sw: Tensor | None, reduce: str) -> Tensor:
        _, need_x, need_w, need_sw, _ = ctx.needs_input_grad
        ctx.graph, ctx.reduce, ctx.x_shape = graph, reduce, x.shape
        ctx.w_shape = None if w is None else w.shape
        if reduce == "max":
            out, arg = prim_spmm_max(graph, _as3(x), _w2(w), sw)
            out = out.view(graph.num_dst, *x.shape[1:])
        else:
            arg = None
            rscale = inv_degree(graph, x.dtype) if reduce == "mean" else None
            out = prim_spmm_sum(graph, x, w, rscale=rscale, sw=sw)
        ctx.save_for_backward(x if (need_w or need_sw) else None,
                              w if need_x else None, sw if need_x else None,
                              arg if (need_x or need_w) else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        _, need_x, need_w, need_sw, _ = ctx.needs_input_grad
        x, w, sw, arg = ctx.saved_tensors
        graph: CSRGraph = ctx.graph
        g = g.contiguous()
        gx = gw = gsw = None
        mean = ctx.reduce == "mean"
        if ctx.reduce == "max":
            if need_x:
                gx = prim_spmm_max_bwd_x(graph, arg, _as3(g), _w2(w), sw).view(ctx.x_shape)
            if need_w:
                gw = prim_spmm_max_bwd_w(graph, arg, _as3(g), _as3(x))
        else:
            invdeg = inv_degree(graph, g.dtype) if mean else None
            if need_x and need_w and K.wants_numba(g):
                assert w is not None  # need_w: the SpMM was weighted
                gx, gw = prim_spmm_bwd_fused(graph, _as3(g), _as3(x), _w2(w), invdeg, sw)
                gx = gx.view(ctx.x_shape)
            else:
                if need_x:
                    gx = prim_spmm_sum(graph.reverse(), g, w, eid=graph.perm, nscale=invdeg, sw=sw)
                if need_w:
                    gw = prim_sddmm_dot(graph, _as3(x), _as3(g), rscale=invdeg)
        if gw is not None:
            gw = gw.view(ctx.w_shape)
        if need_sw:
            nd = graph.num_dst
            gsw = (g.reshape(nd, -1) * x[:nd].reshape(nd, -1)).sum(1)
        return None, gx, gw, gsw, None


def spmm(graph: CSRGraph, x: Tensor, edge_weight: Tensor | None = None, reduce: str = "sum",
         self_weight: Tensor | None = None) -> Tensor:
    """Aggregate source rows into destinations: ``out[i] = reduce_{e=(s->i)} w_e x[s] (+ self_weight[i] x[i])``.

    The one graph operator every message-passing layer lowers to (DGL's ``gspmm``). On CPU float32/float64
    tensors it runs numba kernels that are row-parallel over destinations (forward) and over sources
    (backward, on ``graph.reverse()``); elsewhere a pure-torch equivalent.

    Args:
        graph: In-edge CSR (rows = destinations).
        x: Source features ``[num_src, F]`` or multi-head ``[num_src, H, D]``.
        edge_weight: ``[E]`` (one scalar per edge, any ``x`` shape) or ``[E, H]`` (per head, ``x`` must be
            ``[num_src, H, D]``), in forward-edge order; None means 1 (default: None).
        reduce: ``"sum"``, ``"mean"`` (the sum divided by the in-degree; the weights do not enter the count)
            or ``"max"`` (elementwise max of the weighted messages; the gradient goes to the first edge that
            reaches it). A destination without in-edges gets 0 (default: ``"sum"``).
        self_weight: ``[num_dst]``; adds ``self_weight[i] * x[i]`` to row ``i`` *after* the reduction —
            GCN's self loop without rebuilding the CSR. Needs ``num_src >= num_dst`` with destination ``i``
            being source row ``i`` (true of full graphs and of blocks) (default: None).

    Returns:
        ``[num_dst, F]`` or ``[num_dst, H, D]``; differentiable w.r.t. ``x``, ``edge_weight`` and
        ``self_weight`` (once).
    """
    check_reduce(reduce)
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be [num_src, F] or [num_src, H, D]; got shape {tuple(x.shape)}")
    if x.shape[0] != graph.num_src:
        raise ValueError(f"x has {x.shape[0]} rows but the graph has {graph.num_src} source nodes")
    e, ns, nd = graph.num_edges, graph.num_src, graph.num_dst
    w = edge_weight
    per_head = False
    if w is not None:
        if w.shape[0] != e or w.dim() > 2:
            raise ValueError(f"edge_weight must be [E] or [E, H] with E = {e}; got shape {tuple(w.shape)}")
        per_head = w.dim() == 2 and w.shape[1] != 1
        if per_head and (x.dim() != 3 or x.shape[1] != w.shape[1]):
            raise ValueError(f"per-head edge_weight {tuple(w.shape)} needs x of shape [num_src, {w.shape[1]}, D]; "
                             f"got {tuple(x.shape)}")
        w = w.to(x.dtype)
        w = w.contiguous() if per_head else w.reshape(e)
    sw = self_weight
    if sw is not None:
        if ns < nd:
            raise ValueError("self_weight needs num_src >= num_dst (destination i is source row i)")
        if sw.shape != (nd,):
            raise ValueError(f"self_weight must be [num_dst] = [{nd}]; got shape {tuple(sw.shape)}")
        sw = sw.to(x.dtype)
    xi = x.contiguous() if per_head else x.reshape(ns, math.prod(x.shape[1:])).contiguous()
    out = _SpMM.apply(graph, xi, w, sw, reduce)
    return out.view(nd, *x.shape[1:])
