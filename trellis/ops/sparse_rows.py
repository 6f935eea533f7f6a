"""Sparse input features: bag-of-words rows kept as a CSR tensor, dropped out and transformed without densifying.

Why: the Shchur et al. and Planetoid graphs have bag-of-words features with 1-2% non-zeros (Coauthor CS:
18,333 x 6,805, 45 words per row). A GCN's first layer on dense rows multiplies 125M mostly-zero values
by its weights, forward and backward, and drops out all 125M: 1.1 s of a 1.4 s epoch on 2 cores. As a
CSR matrix the same layer is an SpMM over the 1.1M non-zeros — the graph kernel every layer already runs,
with the word ids as "sources" and the values as edge weights (:func:`sparse_linear`) — and dropout draws
one mask value per non-zero (:func:`sparse_dropout`), which is dense dropout's distribution: a zero stays
zero whether it is dropped or not.

The carrier is a ``torch.sparse_csr`` tensor, so ``x.shape``, ``x.device`` and ``x.dtype`` read as before;
the two operations above are the only ones a sparse input meets (the first layer's dropout and its
transform, which the executor runs first for a sparse input).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from trellis.ops.graph import CSRGraph
from trellis.ops.spmm import spmm
from trellis.utils.numba import WITH_NUMBA, njit, prange

#: Inputs at most this dense are kept sparse (CSR costs ~3 index/value words per non-zero; at 10% the
#: SpMM already does a tenth of the dense work).
MAX_DENSITY = 0.10

_GRAPHS: OrderedDict[tuple[int, int, tuple[int, ...]], CSRGraph] = OrderedDict()


def is_sparse(x: Tensor) -> bool:
    """Whether ``x`` is a sparse-rows input (a CSR tensor)."""
    return x.layout == torch.sparse_csr


if WITH_NUMBA:

    @njit(parallel=True, cache=True, nogil=True)
    def _row_counts(x):  # pragma: no cover - compiled
        n = x.shape[0]
        counts = np.zeros(n + 1, dtype=np.int64)
        for r in prange(n):
            row = x[r]
            c = 0
            for j in range(row.shape[0]):
                if row[j] != 0:
                    c += 1
            counts[r + 1] = c
        return counts

    @njit(parallel=True, cache=True, nogil=True)
    def _fill_csr(x, crow, col, val):  # pragma: no cover - compiled
        for r in prange(x.shape[0]):
            row = x[r]
            k = crow[r]
            for j in range(row.shape[0]):
                if row[j] != 0:
                    col[k] = j
                    val[k] = row[j]
                    k += 1


def to_sparse_rows(x: Tensor, max_density: float = MAX_DENSITY) -> Tensor:
    """``x`` as a CSR tensor when it is a 2-D CPU float matrix with at most ``max_density`` non-zeros.

    The CSR is ``x.to_sparse_csr()``'s (each row's non-zeros in column order), built by two parallel passes
    that also count the non-zeros: torch's conversion took 154 ms for a 4,300 x 8,415 batch of bag-of-words
    rows, this 29 ms.
    """
    if is_sparse(x) or x.dim() != 2 or x.device.type != "cpu" or not x.numel() \
            or x.dtype not in (torch.float32, torch.float64) or x.requires_grad:
        return x
    with warnings.catch_warnings():  # "sparse CSR support is in beta": the two ops used here are tested
        warnings.simplefilter("ignore", UserWarning)
        if not WITH_NUMBA or not x.is_contiguous():
            return x if int(torch.count_nonzero(x)) > max_density * x.numel() else x.to_sparse_csr()
        a = x.numpy()
        crow = np.cumsum(_row_counts(a))
        if int(crow[-1]) > max_density * x.numel():
            return x
        col = np.empty(int(crow[-1]), dtype=np.int64)
        val = np.empty(int(crow[-1]), dtype=a.dtype)
        _fill_csr(a, crow, col, val)
        return torch.sparse_csr_tensor(torch.from_numpy(crow), torch.from_numpy(col), torch.from_numpy(val),
                                       size=tuple(x.shape))


def feature_graph(x: Tensor) -> CSRGraph:
    """The CSR structure of ``x`` as a graph (rows = nodes, sources = columns), memoized per structure.

    Dropout makes a new CSR tensor per step that shares the structure's index tensors, so the graph (and
    the reverse CSR the backward pass builds on first use) is made once.
    """
    crow, col = x.crow_indices(), x.col_indices()
    key = (crow.data_ptr(), col.data_ptr(), tuple(x.shape))
    g = _GRAPHS.get(key)
    if g is None:
        g = CSRGraph(indptr=crow.to(torch.int64), indices=col.to(torch.int64), num_src=x.shape[1])
        _GRAPHS[key] = g
        while len(_GRAPHS) > 4:
            _GRAPHS.popitem(last=False)
    else:
        _GRAPHS.move_to_end(key)
    return g


#: Whether :func:`sparse_linear` memoizes graphs (off while :func:`unmemoized` is in force).
_MEMO: ContextVar[bool] = ContextVar("trellis_sparse_memo", default=True)


@contextmanager
def unmemoized() -> Iterator[None]:
    """Sparse rows used once each (out-of-core tiles): :func:`sparse_linear` keeps no graph of them.

    :func:`feature_graph` would hold the last four tiles' index arrays, beside what the memory plan priced.
    """
    token = _MEMO.set(False)
    try:
        yield
    finally:
        _MEMO.reset(token)


def _once_graph(x: Tensor, backward: bool) -> CSRGraph:
    """``x``'s structure as a graph used once, with its reverse built now when a backward will need it.

    The reverse is made without the usual back-reference (``rev.rev``): a graph and its reverse pointing at
    each other are a reference cycle, which only Python's garbage collector frees, so every out-of-core tile's
    index arrays stayed in memory for a while (10 MB per tile on Coauthor CS, the budget overrun by 50 MB).
    """
    g = CSRGraph(indptr=x.crow_indices().to(torch.int64), indices=x.col_indices().to(torch.int64),
                 num_src=x.shape[1])
    if backward:
        g.reverse().rev = None
    return g


def sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T (+ bias)`` for a CSR ``x``: one SpMM, differentiable with respect to ``weight`` and ``bias``."""
    g = feature_graph(x) if _MEMO.get() else _once_graph(x, torch.is_grad_enabled() and weight.requires_grad)
    out = spmm(g, weight.t(), x.values())
    return out if bias is None else out + bias


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` that also takes a sparse-rows input."""
    return sparse_linear(x, weight, bias) if is_sparse(x) else F.linear(x, weight, bias)


def head_rows(x: Tensor, n: int) -> Tensor:
    """The first ``n`` rows (``x`` itself when it has ``n``).

    A sparse input is sliced through its CSR arrays (torch's CSR tensors take no slices): a sampled block's
    destinations are the first rows of its sources, and its root terms read them.
    """
    if x.shape[0] == n:
        return x
    if not is_sparse(x):
        return x[:n]
    crow = x.crow_indices()[: n + 1]
    nnz = int(crow[-1])
    with warnings.catch_warnings():  # "sparse CSR support is in beta" (see to_sparse_rows)
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, x.col_indices()[:nnz], x.values()[:nnz], size=(n, x.shape[1]))


#: Bytes per stored value of :class:`MappedSparseRows` (an int64 column id and a float32 value).
MAPPED_VALUE_BYTES = 12


class MappedSparseRows:
    """Sparse input rows as three memory-mapped CSR arrays: the out-of-core engine's bag-of-words input.

    Why: out of core, a tile of dense bag-of-words rows is read from the page cache or the disk, copied,
    dropped out and multiplied by the first weight value by value, and over 98% of those values are zero
    (Coauthor CS: 6,805 words per row, 60 of them present). Kept as CSR arrays, a tile reads its rows'
    stored values only and reaches the first layer as a CSR tensor, as in memory (:func:`sparse_linear`).

    Args:
        indptr: ``int64 [N + 1]`` row offsets.
        indices: ``int64 [nnz]`` column of each stored value (in column order within a row).
        values: ``float32 [nnz]`` the stored values.
        width: Columns of the dense matrix (the features' width).
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, width: int) -> None:
        self.indptr, self.indices, self.values, self.width = indptr, indices, values, int(width)

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, width)``, the dense matrix's shape."""
        return int(self.indptr.shape[0]) - 1, self.width

    @property
    def maps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The three arrays (their page cache is dropped with the engine's other maps)."""
        return self.indptr, self.indices, self.values

    def span(self, r0: int, r1: int) -> tuple[int, int]:
        """Positions ``[a, b)`` of rows ``[r0, r1)``'s stored values."""
        return int(self.indptr[r0]), int(self.indptr[r1])

    def rows(self, r0: int, r1: int) -> Tensor:
        """Rows ``[r0, r1)`` as a CSR tensor (copied out of the maps)."""
        a, b = self.span(r0, r1)
        crow = torch.from_numpy(np.asarray(self.indptr[r0:r1 + 1], dtype=np.int64) - a)
        col = torch.from_numpy(np.array(self.indices[a:b], dtype=np.int64))
        val = torch.from_numpy(np.array(self.values[a:b], dtype=np.float32))
        with warnings.catch_warnings():  # "sparse CSR support is in beta" (see to_sparse_rows)
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(crow, col, val, size=(r1 - r0, self.width))

    def rows_nbytes(self, r0: int, r1: int) -> int:
        """Bytes :meth:`rows` reads for rows ``[r0, r1)`` (one row offset per row: tiles add up to the whole)."""
        a, b = self.span(r0, r1)
        return (b - a) * MAPPED_VALUE_BYTES + (r1 - r0) * 8
