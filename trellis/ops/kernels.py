"""Numba CPU kernels of the graph engine, the thread launcher that runs them, and the on/off switch.

Every kernel walks a CSR row by row over *row chunks*: contiguous row ranges holding about the same
number of edges (:func:`row_chunks`). Rows are destinations, so each output row is written by exactly one
thread and no atomics are needed; backward passes run the same kernels on the reverse CSR, whose rows are
sources, with per-edge data taken through ``perm`` (each reverse position's forward edge id). Balancing
by edges rather than rows matters on power-law graphs, where an even split of rows would leave one
thread with the hubs.

Why serial ``nogil`` kernels run by a thread pool rather than ``prange``: a ``parallel=True`` kernel takes
about twice as long to compile (measured: the cold test suite spent 37 s of CPU compiling with ``prange``,
10 s without), and numba's OpenMP/TBB threading layers are not fork-safe (a forked data-loader worker can
deadlock). The launcher cuts the chunks into ``torch.get_num_threads()`` contiguous ranges of equal cost,
runs the first on the calling thread and the rest on a pool; the kernels release the GIL. Single-thread
kernel speed equals the ``prange`` version once ``noalias`` is set (see :func:`_noalias_option`).

Conventions shared by the kernels (``lo, hi`` = the chunk range of one task):

* ``x``/``out`` are C-contiguous; a multi-head tensor is ``[N, H, D]``, a single-coefficient one ``[N, F]``.
* Optional arrays are passed as empty arrays (numba compiles one signature per dtype, not per option);
  ``one`` is ``1`` in the data's dtype so optional factors never promote float32 to float64.
* ``eid[k]`` (empty = identity) is the edge id used to read per-edge data for CSR position ``k``.
* ``rscale[i]`` scales output row ``i`` (mean's ``1/deg`` in the forward pass); ``sw[i]`` adds
  ``sw[i] * x[i]`` to output row ``i < len(sw)`` after the reduction (GCN's self loop).
* ``arg`` of a max holds the forward edge id of the maximum (``-1`` for a row without edges).

The fastmath flags exclude ``nnan``/``ninf`` so max and softmax keep IEEE semantics for infinities.
Set ``TRELLIS_DISABLE_NUMBA=1`` to run the pure-torch path everywhere.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from trellis.utils.numba import WITH_NUMBA, njit

#: Whether the numba kernels are used for CPU tensors (tests flip it with :func:`use_numba`).
_enabled = WITH_NUMBA
#: Reassociation and contraction let LLVM vectorize the feature loops; no nnan/ninf (see module doc).
_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}


def _noalias_option() -> dict[str, bool]:
    """``{"noalias": True}`` if numba's CPU target can be taught the option, else ``{}``.

    Why: without it LLVM must assume ``out`` may overlap the gathered rows and versions every feature loop
    behind runtime overlap checks; measured 10-25% slower at F = 16..128 than with ``noalias`` (which numba
    itself sets on ``parallel=True`` kernels). Every kernel here writes only to a freshly allocated output,
    so the promise holds. The option exists in numba's flags but not in the decorator's mapping, so it is
    registered here; if numba's internals change, kernels compile without it (slower, still correct).
    """
    try:
        from numba.core.cpu import CPUTargetOptions
        from numba.core.options import TargetOptions

        if not hasattr(CPUTargetOptions, "noalias"):
            CPUTargetOptions.noalias = TargetOptions.Mapping("noalias")
        return {"noalias": True}
    except Exception:  # pragma: no cover - depends on numba's version
        return {}


_JIT: dict[str, Any] = {"nogil": True, "fastmath": _FM, "cache": True, **(_noalias_option() if WITH_NUMBA else {})}
#: Row chunks per graph (fixed, so the cached boundaries serve any thread count).
NUM_CHUNKS = 256
#: Tasks per thread. One: every task hand-off costs a GIL round trip, which on a loaded machine costs
#: more than the imbalance it would fix (chunks are already of equal cost).
TASKS_PER_THREAD = 1
#: Kernels with fewer element-operations (edges x row width) than this run on the calling thread: handing
#: work to a pool costs tens of microseconds idle and hundreds on a loaded machine.
SERIAL_WORK = 1 << 16
_NUMPY_DTYPES = (torch.float32, torch.float64)


def enabled() -> bool:
    """Whether CPU tensors currently go through the numba kernels."""
    return _enabled


@contextmanager
def use_numba(flag: bool) -> Iterator[None]:
    """Temporarily force (``True``, if numba is importable) or forbid (``False``) the numba kernels."""
    global _enabled
    old = _enabled
    _enabled = bool(flag) and WITH_NUMBA
    try:
        yield
    finally:
        _enabled = old


def wants_numba(*tensors: torch.Tensor | None) -> bool:
    """True when the numba path applies: enabled, and every given tensor is a float32/64 CPU tensor."""
    if not _enabled:
        return False
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or (t.is_floating_point() and t.dtype not in _NUMPY_DTYPES):
            return False
    return True


_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] = (-1, 0)


_pool_lock = threading.Lock()


def _get_pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool, rebuilt after a fork (a forked child inherits no threads) or a thread-count change."""
    global _pool, _pool_key
    key = (os.getpid(), workers)
    if _pool is not None and _pool_key == key:
        return _pool
    with _pool_lock:
        if _pool is None or _pool_key != key:
            if _pool is not None and _pool_key[0] == os.getpid():
                _pool.shutdown(wait=False)  # tasks already queued by other callers still run
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trellis-ops")
            _pool_key = key
        return _pool


def launch(kernel: Callable[..., None], graph: Any, num_edges: int, t: torch.Tensor, *args: Any) -> None:
    """Run ``kernel(lo, hi, bounds, *args)`` over all row chunks of ``graph``, in parallel when worth it.

    Uses ``torch.get_num_threads()`` threads, so the engine and torch's own kernels never oversubscribe
    the cores. Work is estimated as ``num_edges`` times the row width of ``t``; small work runs inline.
    """
    bounds = row_chunks(graph)
    nc = bounds.shape[0] - 1
    threads = torch.get_num_threads()
    if threads <= 1 or num_edges * (t.numel() // max(1, t.shape[0])) < SERIAL_WORK:
        kernel(0, nc, bounds, *args)
        return
    parts = np.linspace(0, nc, TASKS_PER_THREAD * threads + 1).astype(np.int64).tolist()
    pool = _get_pool(threads - 1)
    futures = [pool.submit(kernel, lo, hi, bounds, *args) for lo, hi in zip(parts[1:-1], parts[2:])]
    kernel(parts[0], parts[1], bounds, *args)  # the calling thread takes the first part itself
    for f in futures:
        f.result()


def row_chunks(graph: Any) -> np.ndarray:
    """Row boundaries ``[NUM_CHUNKS + 1]`` splitting the CSR into chunks of about equal cost (cached).

    Cost of a row = its edges + 1 (the row's own write), so chunks balance both hub rows and long runs of
    low-degree rows.
    """
    b = graph.cache.get("_row_chunks")
    if b is None:
        indptr = graph.indptr.cpu().numpy()
        n = indptr.shape[0] - 1
        cost = indptr + np.arange(n + 1, dtype=np.int64)
        b = np.searchsorted(cost, np.linspace(0, cost[-1], NUM_CHUNKS + 1)).astype(np.int64)
        b[0], b[-1] = 0, n
        graph.cache["_row_chunks"] = b
    return b


def np_(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor (made contiguous first)."""
    return t.detach().contiguous().numpy()


_EMPTY: dict[tuple[Any, int], np.ndarray] = {}


def empty(dtype: Any, ndim: int = 1) -> np.ndarray:
    """A shared empty array standing for "absent" (``ndim`` matters to the compiled signature)."""
    dt = np.dtype(dtype)
    key = (dt, ndim)
    if key not in _EMPTY:
        _EMPTY[key] = np.empty((0,) * ndim, dtype=dt)
    return _EMPTY[key]


# ---------------------------------------------------------------------------------------------------------
# SpMM: sum / mean
# ---------------------------------------------------------------------------------------------------------
@njit(**_JIT)
def spmm_sum_1(lo, hi, bounds, indptr, indices, w, x, rscale, sw, soff, out):  # pragma: no cover
    """``out[i] = rscale[i] * sum_k w[k] x[indices[k]] + sw[i] x[soff + i]`` with one scalar per CSR position.

    ``w`` is empty for an unweighted sum (a separate loop without multiplies); ``x``/``out`` are ``[N, F]``.
    Edges are taken four at a time: four independent row streams keep more loads in flight, which is what
    a gather-bound loop needs (measured ~10-20% over one edge at a time at F = 64..256). Coefficients are
    precomputed per CSR position by the caller (weights permuted to the reverse graph, mean's scaling), so
    the hot loop carries no optional factors. ``soff`` is the source row of output row 0's self term: 0 for
    a whole graph or block, the tile's first row for a row tile of a larger CSR (:mod:`trellis.ops.tiled`).
    """
    F = x.shape[1]
    has_w = w.shape[0] > 0
    has_r = rscale.shape[0] > 0
    nself = sw.shape[0]
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            for f in range(F):
                out[i, f] = 0
            k = indptr[i]
            end = indptr[i + 1]
            if has_w:
                while k + 4 <= end:
                    s0 = indices[k]
                    s1 = indices[k + 1]
                    s2 = indices[k + 2]
                    s3 = indices[k + 3]
                    c0 = w[k]
                    c1 = w[k + 1]
                    c2 = w[k + 2]
                    c3 = w[k + 3]
                    for f in range(F):
                        out[i, f] += (c0 * x[s0, f] + c1 * x[s1, f]) + (c2 * x[s2, f] + c3 * x[s3, f])
                    k += 4
                while k < end:
                    s0 = indices[k]
                    c0 = w[k]
                    for f in range(F):
                        out[i, f] += c0 * x[s0, f]
                    k += 1
            else:
                while k + 4 <= end:
                    s0 = indices[k]
                    s1 = indices[k + 1]
                    s2 = indices[k + 2]
                    s3 = indices[k + 3]
                    for f in range(F):
                        out[i, f] += (x[s0, f] + x[s1, f]) + (x[s2, f] + x[s3, f])
                    k += 4
                while k < end:
                    s0 = indices[k]
                    for f in range(F):
                        out[i, f] += x[s0, f]
                    k += 1
            if has_r:
                r = rscale[i]
                for f in range(F):
                    out[i, f] *= r
            if i < nself:
                a = sw[i]
                for f in range(F):
                    out[i, f] += a * x[soff + i, f]


@njit(**_JIT)
def spmm_sum_h(lo, hi, bounds, indptr, indices, eid, w, x, rscale, sw, out):  # pragma: no cover
    """Per-head weights: ``out[i, h] = rscale[i] * sum_k w[eid[k], h] x[s_k, h] + sw[i] x[i, h]``.

    ``w`` is ``[E, H]``, ``x``/``out`` are ``[N, H, D]``; the head loop sits inside the edge loop so each
    source row is read once, contiguously, for all heads. ``eid`` (the reverse graph's ``perm`` in a
    backward pass) is read here rather than gathered beforehand: the ``H`` weights of an edge are one
    small random read next to a ``H x D`` row gather (a separate ``[E, H]`` gather cost ~10% of the pass).
    """
    H = x.shape[1]
    D = x.shape[2]
    has_eid = eid.shape[0] > 0
    has_r = rscale.shape[0] > 0
    nself = sw.shape[0]
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            for h in range(H):
                for d in range(D):
                    out[i, h, d] = 0
            k = indptr[i]
            end = indptr[i + 1]
            while k + 2 <= end:
                s0 = indices[k]
                s1 = indices[k + 1]
                e0 = eid[k] if has_eid else k
                e1 = eid[k + 1] if has_eid else k + 1
                for h in range(H):
                    c0 = w[e0, h]
                    c1 = w[e1, h]
                    for d in range(D):
                        out[i, h, d] += c0 * x[s0, h, d] + c1 * x[s1, h, d]
                k += 2
            if k < end:
                s0 = indices[k]
                e0 = eid[k] if has_eid else k
                for h in range(H):
                    c0 = w[e0, h]
                    for d in range(D):
                        out[i, h, d] += c0 * x[s0, h, d]
            if has_r:
                r = rscale[i]
                for h in range(H):
                    for d in range(D):
                        out[i, h, d] *= r
            if i < nself:
                a = sw[i]
                for h in range(H):
                    for d in range(D):
                        out[i, h, d] += a * x[i, h, d]


@njit(**_JIT)
def spmm_bwd_fused(lo, hi, bounds, rindptr, rindices, perm, w, nscale, g, x, sw, one, gx, gw):  # pragma: no cover
    """Both gradients of a weighted sum/mean SpMM in one pass over the reverse CSR (rows = sources ``s``).

    For each out-edge ``e = perm[k]`` of ``s`` to ``t = rindices[k]`` and head ``h``, with
    ``a = nscale[t]`` (mean's ``1/deg``, else 1):
    ``gx[s, h] += a w[e, h] g[t, h]`` and ``gw[e, h] = a dot(g[t, h], x[s, h])``; plus ``sw[s] g[s]``.

    Why fused: the edge-weight gradient is an SDDMM that would gather every ``g[t]`` row a second time in
    forward order; here each gathered row feeds both products while ``x[s]`` stays in cache, so attention's
    backward reads the ``[E, H x D]`` rows once instead of twice. ``gw`` writes are scattered (through
    ``perm``) but every edge is written exactly once, so threads never collide.
    """
    H = x.shape[1]
    D = x.shape[2]
    has_n = nscale.shape[0] > 0
    nself = sw.shape[0]
    for c in range(lo, hi):
        for s in range(bounds[c], bounds[c + 1]):
            for h in range(H):
                for d in range(D):
                    gx[s, h, d] = 0
            for k in range(rindptr[s], rindptr[s + 1]):
                t = rindices[k]
                e = perm[k]
                a = nscale[t] if has_n else one
                for h in range(H):
                    cf = w[e, h] * a
                    acc = one - one
                    for d in range(D):
                        gv = g[t, h, d]
                        gx[s, h, d] += cf * gv
                        acc += gv * x[s, h, d]
                    gw[e, h] = acc * a
            if s < nself:
                b = sw[s]
                for h in range(H):
                    for d in range(D):
                        gx[s, h, d] += b * g[s, h, d]


# ---------------------------------------------------------------------------------------------------------
# SpMM: max
# ---------------------------------------------------------------------------------------------------------
@njit(**_JIT)
def spmm_max(lo, hi, bounds, indptr, indices, w, x, sw, one, out, arg):  # pragma: no cover
    """``out[i, h, d] = max_k w[k, h] x[s_k, h, d]`` (0 and ``arg = -1`` for a row without edges).

    ``w`` is ``[E, H]`` or empty (unweighted); ``arg`` keeps the first edge reaching the maximum, which is
    where the backward pass routes the gradient. ``sw`` adds ``sw[i] x[i]`` after the max.
    """
    H = x.shape[1]
    D = x.shape[2]
    has_w = w.shape[0] > 0
    nself = sw.shape[0]
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            start = indptr[i]
            end = indptr[i + 1]
            if start == end:
                for h in range(H):
                    for d in range(D):
                        out[i, h, d] = 0
                        arg[i, h, d] = -1
            else:
                s = indices[start]
                for h in range(H):
                    a = w[start, h] if has_w else one
                    for d in range(D):
                        out[i, h, d] = a * x[s, h, d]
                        arg[i, h, d] = start
                for k in range(start + 1, end):
                    s = indices[k]
                    for h in range(H):
                        a = w[k, h] if has_w else one
                        for d in range(D):
                            v = a * x[s, h, d]
                            if v > out[i, h, d]:
                                out[i, h, d] = v
                                arg[i, h, d] = k
            if i < nself:
                b = sw[i]
                for h in range(H):
                    for d in range(D):
                        out[i, h, d] += b * x[i, h, d]


@njit(**_JIT)
def spmm_max_bwd_x(lo, hi, rbounds, rindptr, rindices, perm, w, arg, g, sw, one, out):  # pragma: no cover
    """Gradient of :func:`spmm_max` w.r.t. ``x``, row-parallel over the reverse CSR (rows = sources).

    ``out[s, h, d] = sum over out-edges e = perm[k] to t = rindices[k] with arg[t, h, d] == e of
    w[e, h] g[t, h, d]`` plus ``sw[s] g[s, h, d]``.
    """
    H = g.shape[1]
    D = g.shape[2]
    has_w = w.shape[0] > 0
    nself = sw.shape[0]
    for c in range(lo, hi):
        for s in range(rbounds[c], rbounds[c + 1]):
            for h in range(H):
                for d in range(D):
                    out[s, h, d] = 0
            for k in range(rindptr[s], rindptr[s + 1]):
                t = rindices[k]
                e = perm[k]
                for h in range(H):
                    a = w[e, h] if has_w else one
                    for d in range(D):
                        if arg[t, h, d] == e:
                            out[s, h, d] += a * g[t, h, d]
            if s < nself:
                b = sw[s]
                for h in range(H):
                    for d in range(D):
                        out[s, h, d] += b * g[s, h, d]


# ---------------------------------------------------------------------------------------------------------
# SDDMM
# ---------------------------------------------------------------------------------------------------------
@njit(**_JIT)
def sddmm_dot(lo, hi, bounds, indptr, indices, a, b, rscale, one, out):  # pragma: no cover
    """``out[k, h] = rscale[i] * dot(a[s_k, h, :], b[i, h, :])`` for edge ``k`` of row ``i``."""
    H = a.shape[1]
    D = a.shape[2]
    has_r = rscale.shape[0] > 0
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            for k in range(indptr[i], indptr[i + 1]):
                s = indices[k]
                for h in range(H):
                    acc = one - one
                    for d in range(D):
                        acc += a[s, h, d] * b[i, h, d]
                    out[k, h] = acc * rscale[i] if has_r else acc


@njit(**_JIT)
def sddmm_add(lo, hi, bounds, indptr, indices, a, b, out):  # pragma: no cover
    """``out[k, f] = a[s_k, f] + b[i, f]`` for edge ``k`` of row ``i`` (``[N, F]`` operands)."""
    F = a.shape[1]
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            for k in range(indptr[i], indptr[i + 1]):
                s = indices[k]
                for f in range(F):
                    out[k, f] = a[s, f] + b[i, f]


# ---------------------------------------------------------------------------------------------------------
# Segment reductions (per-edge values -> per-row), their backward, edge softmax
# ---------------------------------------------------------------------------------------------------------
@njit(**_JIT)
def segment_sum(lo, hi, bounds, indptr, eid, vals, rscale, out):  # pragma: no cover
    """``out[i, f] = rscale[i] * sum_k vals[eid[k], f]`` over row ``i``'s CSR positions ``k``."""
    F = vals.shape[1]
    has_eid = eid.shape[0] > 0
    has_r = rscale.shape[0] > 0
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            for f in range(F):
                out[i, f] = 0
            for k in range(indptr[i], indptr[i + 1]):
                e = eid[k] if has_eid else k
                for f in range(F):
                    out[i, f] += vals[e, f]
            if has_r:
                r = rscale[i]
                for f in range(F):
                    out[i, f] *= r


@njit(**_JIT)
def segment_max(lo, hi, bounds, indptr, vals, out, arg):  # pragma: no cover
    """``out[i, f] = max_k vals[k, f]`` over row ``i`` (0 and ``arg = -1`` for an empty row)."""
    F = vals.shape[1]
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            start = indptr[i]
            end = indptr[i + 1]
            if start == end:
                for f in range(F):
                    out[i, f] = 0
                    arg[i, f] = -1
                continue
            for f in range(F):
                out[i, f] = vals[start, f]
                arg[i, f] = start
            for k in range(start + 1, end):
                for f in range(F):
                    v = vals[k, f]
                    if v > out[i, f]:
                        out[i, f] = v
                        arg[i, f] = k


@njit(**_JIT)
def softmax_fwd(lo, hi, bounds, indptr, logits, out):  # pragma: no cover
    """Per row and head: ``out[k] = exp(l[k] - max) / sum exp(l - max)`` (stable; rows are edge segments)."""
    H = logits.shape[1]
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            start = indptr[i]
            end = indptr[i + 1]
            if start == end:
                continue
            for h in range(H):
                m = logits[start, h]
                for k in range(start + 1, end):
                    if logits[k, h] > m:
                        m = logits[k, h]
                s = logits[start, h] * 0
                for k in range(start, end):
                    v = np.exp(logits[k, h] - m)
                    out[k, h] = v
                    s += v
                inv = 1 / s
                for k in range(start, end):
                    out[k, h] *= inv


@njit(**_JIT)
def softmax_bwd(lo, hi, bounds, indptr, a, g, one, out):  # pragma: no cover
    """Backward of :func:`softmax_fwd`: ``out[k] = a[k] (g[k] - sum_row a g)`` per head."""
    H = a.shape[1]
    for c in range(lo, hi):
        for i in range(bounds[c], bounds[c + 1]):
            start = indptr[i]
            end = indptr[i + 1]
            for h in range(H):
                s = one - one
                for k in range(start, end):
                    s += a[k, h] * g[k, h]
                for k in range(start, end):
                    out[k, h] = a[k, h] * (g[k, h] - s)
