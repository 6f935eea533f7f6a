"""Feature propagation for pre-propagation GNNs: ``[X, BX, B²X, …, B^R X]`` computed out of core.

Operators ``B`` (PP-GNN §2.5; SIGN and GDC's diffusion kernels), over the store's in-edge CSR (row =
destination ``i``, column = source ``j``; ``Ã = A + I``, ``d_i = 1 + Σ_j a_ij`` with edge weights when
the store has them):

* ``sym``  — ``D̃^{-1/2} Ã D̃^{-1/2}`` (GCN/SGC normalization).
* ``rw``   — ``D̃^{-1} Ã`` (row-normalized: the mean over in-neighbours and the node itself).
* ``ppr``  — personalized PageRank ``α (I - (1-α) T)^{-1}`` with ``T`` the ``sym`` operator, applied by
  ``K`` power iterations ``Z ← (1-α) T Z + α H`` from ``Z = H`` (APPNP).
* ``heat`` — heat kernel ``exp(-t (I - T))`` as the truncated Taylor series ``e^{-t} Σ_{k≤K} t^k/k! T^k``.

Why row blocks: the expanded features are ``R+1`` times the input (PP-GNN §3.4), so nothing here holds
an ``N×F`` matrix in memory. Each pass streams the CSR block by block (``indptr``/``indices`` are read
sequentially from the memory-mapped store), gathers source rows from the previous hop — a memory map,
so the page cache holds what fits — and writes one output block at a time. Memory is ``O(N)`` scalars
(degrees) plus one block of rows and its edges.

The kernel is a numba row-block SpMM (parallel over destination rows); when numba is missing the same
block product runs through ``scipy.sparse`` (:data:`KERNEL` says which one is active).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trellis.errors import TrellisUserError
from trellis.utils.csr import row_ranges
from trellis.utils.diskmap import SPILL_FIX, new_map
from trellis.utils.numba import WITH_NUMBA, njit, prange

#: Operator names accepted by :class:`OperatorSpec` (and ``trellis preprocess --operator``).
OPERATORS = ("sym", "rw", "ppr", "heat")
#: Default power iterations (ppr) / Taylor terms (heat) when ``iters`` is not given.
DEFAULT_ITERS = {"ppr": 10, "heat": 20}
#: Target bytes of one output block when ``block_rows`` is not given.
DEFAULT_BLOCK_BYTES = 32 * 1024 * 1024


class ProgressLike(Protocol):
    """What the passes need from a progress bar (``tqdm`` satisfies it)."""

    def update(self, n: int = 1) -> Any:
        """Advance the bar by ``n`` steps (called once per finished block)."""


@dataclass(frozen=True)
class OperatorSpec:
    """One propagation operator and its parameters.

    Attributes:
        name: ``sym``, ``rw``, ``ppr`` or ``heat``.
        alpha: PPR teleport probability (default: 0.1, APPNP's value).
        t: Heat-kernel diffusion time (default: 3.0; GDC finds 2-5 best on citation graphs).
        iters: PPR power iterations or heat Taylor terms (default: 10 for ppr, 20 for heat).
    """

    name: str = "sym"
    alpha: float = 0.1
    t: float = 3.0
    iters: int | None = None

    def __post_init__(self) -> None:
        if self.name not in OPERATORS:
            raise TrellisUserError(f"unknown operator {self.name!r}; use one of {', '.join(OPERATORS)}")
        if self.name == "ppr" and not 0.0 < self.alpha <= 1.0:
            raise TrellisUserError(f"--alpha {self.alpha} must be in (0, 1] (the PPR teleport probability)")
        if self.name == "heat" and not (self.t > 0.0 and math.isfinite(self.t)):  # t = inf: an all-NaN cache
            raise TrellisUserError(f"--t {self.t} must be a finite number > 0 (the heat-kernel diffusion time)")
        if self.iters is not None and self.iters < 1:
            raise TrellisUserError(f"--iters {self.iters} must be >= 1")

    @property
    def num_iters(self) -> int:
        """Power iterations / Taylor terms actually used (1 for ``sym``/``rw``)."""
        if self.name in DEFAULT_ITERS:
            return int(self.iters if self.iters is not None else DEFAULT_ITERS[self.name])
        return 1

    def key(self) -> dict[str, Any]:
        """The parameters that change the result (a cache is keyed on exactly these)."""
        if self.name == "ppr":
            return {"operator": "ppr", "alpha": float(self.alpha), "iters": self.num_iters}
        if self.name == "heat":
            return {"operator": "heat", "t": float(self.t), "iters": self.num_iters}
        return {"operator": self.name}

    def passes_per_hop(self) -> int:
        """Sparse passes over the graph per hop (what the progress bar counts)."""
        return self.num_iters


# ---------------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------------

if WITH_NUMBA:

    @njit(parallel=True, cache=True, nogil=True)
    def _spmm_block_numba(indptr, indices, weights, has_w, row0, x, dst_scale, src_scale, out):  # noqa: ANN001
        """``out[ii] = dst_scale[i] (src_scale[i] x[i] + Σ_e w_e src_scale[j_e] x[j_e])``, ``i = row0 + ii``.

        ``indptr`` is the block's slice of the CSR (absolute offsets), ``indices``/``weights`` the
        block's edges (offsets relative to ``indptr[0]``). Parallel over destination rows; each row
        accumulates in float64 so that high-degree rows keep their precision.
        """
        n = out.shape[0]
        f = out.shape[1]
        base = indptr[0]
        for ii in prange(n):
            i = row0 + ii
            acc = np.empty(f, dtype=np.float64)
            si = src_scale[i]
            for c in range(f):
                acc[c] = si * x[i, c]
            for e in range(indptr[ii] - base, indptr[ii + 1] - base):
                j = indices[e]
                w = src_scale[j]
                if has_w:
                    w *= weights[e]
                for c in range(f):
                    acc[c] += w * x[j, c]
            d = dst_scale[i]
            for c in range(f):
                out[ii, c] = acc[c] * d

    @njit(parallel=True, cache=True, nogil=True)
    def _gather_rows_numba(x, idx, out):  # noqa: ANN001
        """``out[k] = x[idx[k]]`` in parallel (random reads from a memory map overlap)."""
        f = x.shape[1]
        for k in prange(idx.shape[0]):
            j = idx[k]
            for c in range(f):
                out[k, c] = x[j, c]


KERNEL = "numba" if WITH_NUMBA else "scipy"


def _spmm_block_scipy(indptr: np.ndarray, indices: np.ndarray, weights: np.ndarray | None, row0: int,
                      x: np.ndarray, dst_scale: np.ndarray, src_scale: np.ndarray, out: np.ndarray) -> None:
    """Same product as the numba kernel through ``scipy.sparse`` (one vectorized CSR @ dense)."""
    import scipy.sparse as sp

    n = out.shape[0]
    rel = (indptr - indptr[0]).astype(np.int64)
    w = src_scale[indices].astype(np.float64)
    if weights is not None:
        w *= weights
    block = sp.csr_matrix((w, indices, rel), shape=(n, x.shape[0]))
    rows = np.arange(row0, row0 + n)
    res = block @ x + src_scale[rows, None] * x[row0:row0 + n]
    np.multiply(res, dst_scale[rows, None], out=out, casting="unsafe")


def spmm_block(indptr: np.ndarray, indices: np.ndarray, weights: np.ndarray | None, row0: int,
               x: np.ndarray, dst_scale: np.ndarray, src_scale: np.ndarray, out: np.ndarray,
               *, kernel: str | None = None) -> np.ndarray:
    """One output block of ``diag(dst) (diag(src) + W diag(src)) x`` — every operator's sparse step.

    Args:
        indptr: ``int64 [n+1]`` CSR row pointers of rows ``row0 .. row0+n`` (absolute edge offsets).
        indices: ``int64`` source ids of those rows' edges (``indices[0]`` is edge ``indptr[0]``).
        weights: Edge weights aligned with ``indices`` or None for unweighted.
        row0: First destination row of the block.
        x: ``[N, F]`` input (any array numba/numpy can index; a memory map works).
        dst_scale: ``[N]`` scale of each destination row.
        src_scale: ``[N]`` scale of each source row (the self loop uses ``src_scale[i]``).
        out: ``float32 [n, F]`` output block, overwritten.
        kernel: ``numba`` or ``scipy`` (default: :data:`KERNEL`).

    Returns:
        ``out``.
    """
    kernel = kernel or KERNEL
    if kernel == "numba" and WITH_NUMBA:
        w = weights if weights is not None else _NO_WEIGHTS
        _spmm_block_numba(_ro(indptr, np.int64), _ro(indices, np.int64), _ro(w, np.float32), weights is not None,
                          row0, _ro(x, np.float32), _ro(dst_scale, np.float64), _ro(src_scale, np.float64), out)
    else:
        _spmm_block_scipy(indptr, indices, weights, row0, x, dst_scale, src_scale, out)
    return out


def _ro(a: np.ndarray, dtype: Any) -> np.ndarray:
    """A read-only C-contiguous ``dtype`` view (copy only if needed).

    Why: numba compiles one specialization per (dtype, layout, writeable) combination; funnelling every
    argument through one form keeps it to a single compilation per kernel (cached on disk).
    """
    v = np.ascontiguousarray(a, dtype=dtype).view()
    v.flags.writeable = False
    return v


_NO_WEIGHTS = np.empty(0, dtype=np.float32)


def gather_rows(x: np.ndarray, idx: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = x[idx]`` without a temporary (parallel when numba is present)."""
    if WITH_NUMBA and out.dtype == np.float32 and out.flags.c_contiguous:
        _gather_rows_numba(_ro(x, np.float32), _ro(idx, np.int64), out)
    else:
        np.take(x, idx, axis=0, out=out)
    return out


# ---------------------------------------------------------------------------------------------------
# normalization
# ---------------------------------------------------------------------------------------------------


def degrees(indptr: np.ndarray, edge_weight: np.ndarray | None = None, *, block_rows: int = 1 << 20) -> np.ndarray:
    """``d_i = 1 + Σ_j a_ij``: in-degree with the self loop (weighted sum when weights are given).

    Streams the weights in row blocks (``O(N)`` memory) so a memory-mapped edge array is read once.
    """
    indptr = np.asarray(indptr)
    n = indptr.shape[0] - 1
    if edge_weight is None:
        return np.diff(indptr).astype(np.float64) + 1.0
    deg = np.ones(n, dtype=np.float64)
    for a, b in row_ranges(n, block_rows):
        ptr = np.asarray(indptr[a:b + 1])
        w = np.asarray(edge_weight[ptr[0]:ptr[-1]], dtype=np.float64)
        cs = np.zeros(w.shape[0] + 1)
        np.cumsum(w, out=cs[1:])
        rel = ptr - ptr[0]
        deg[a:b] += cs[rel[1:]] - cs[rel[:-1]]
    return deg


def scales(op: str, deg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dst_scale, src_scale)`` of the base operator: ``sym`` for sym/ppr/heat, ``rw`` for rw."""
    if np.any(deg <= 0):
        i = int(np.flatnonzero(deg <= 0)[0])
        raise TrellisUserError(
            f"node {i} has degree {deg[i]:g} with its self loop; edge weights must be non-negative"
        )
    if op == "rw":
        return 1.0 / deg, np.ones_like(deg)
    s = 1.0 / np.sqrt(deg)
    return s, s


# ---------------------------------------------------------------------------------------------------
# feature normalization
# ---------------------------------------------------------------------------------------------------

#: ``feature_norm`` modes: row = divide each row by its L1 norm (Kipf & Welling's preprocessing of
#: bag-of-words features), l2 = by its L2 norm, none, auto = chosen from the features' content
#: (``GraphStore.preferred_feature_norm``).
FEATURE_NORMS = ("auto", "none", "row", "l2")


def normalize_rows(x: np.ndarray, out: np.ndarray, mode: str = "row", *, block_rows: int | None = None) -> np.ndarray:
    """``out[i] = x[i] / ||x[i]||`` (L1 for ``row``, L2 for ``l2``) block by block; all-zero rows stay zero.

    ``block_rows`` defaults to about 32 MiB of float32 rows (:func:`default_block_rows`), whatever the width.
    """
    for a, b in row_ranges(x.shape[0], block_rows or default_block_rows(int(np.prod(x.shape[1:])))):
        blk = np.asarray(x[a:b], dtype=np.float32)
        if mode == "row":
            norm = np.abs(blk).sum(axis=1, keepdims=True, dtype=np.float64)
        else:
            norm = np.sqrt(np.square(blk, dtype=np.float64).sum(axis=1, keepdims=True))
        norm[norm == 0] = 1.0
        out[a:b] = blk / norm
    return out


# ---------------------------------------------------------------------------------------------------
# streaming hop computation
# ---------------------------------------------------------------------------------------------------


class Scratch:
    """Allocates ``[N, F]`` float32 work arrays as memory-mapped files (or RAM when ``root`` is None).

    Why files: PPR and the heat kernel keep two or three ``N×F`` iterates; as memory maps they live in
    the page cache when it has room and on disk when it does not.
    """

    def __init__(self, root: str | os.PathLike[str] | None) -> None:
        self.root = None if root is None else Path(root)
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def new(self, shape: tuple[int, int]) -> np.ndarray:
        """A fresh writable ``float32`` array of ``shape``."""
        if self.root is None:
            return np.empty(shape, dtype=np.float32)
        fd, path = tempfile.mkstemp(prefix="scratch-", suffix=".f32", dir=self.root)  # unique per call
        os.close(fd)
        return new_map(path, shape, np.float32, SPILL_FIX, npy=False)

    def free(self, arr: np.ndarray | None) -> None:
        """Drop ``arr`` and delete its file (a no-op for RAM arrays)."""
        if isinstance(arr, np.memmap) and arr.filename is not None:
            # Unlinking a mapped file is safe on POSIX: its blocks are released when the last view goes.
            try:
                os.unlink(arr.filename)
            except FileNotFoundError:
                pass


class Propagator:
    """Applies an operator's base step ``T`` to ``[N, F]`` arrays, one CSR row block at a time.

    Args:
        indptr: ``int64 [N+1]`` in-edge CSR (a memory map is streamed, not loaded).
        indices: ``int64 [E]`` source ids.
        spec: The operator.
        edge_weight: Optional ``[E]`` weights.
        block_rows: Destination rows per block (default: about 32 MiB of output per block).
        kernel: ``numba`` or ``scipy`` (default: :data:`KERNEL`).
        progress: Optional progress bar advanced once per block.
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, spec: OperatorSpec, *,
                 edge_weight: np.ndarray | None = None, block_rows: int | None = None,
                 num_features: int = 1, kernel: str | None = None,
                 progress: ProgressLike | None = None) -> None:
        self.indptr = indptr
        self.indices = indices
        self.edge_weight = edge_weight
        self.spec = spec
        self.n = int(indptr.shape[0] - 1)
        self.block_rows = int(block_rows or default_block_rows(num_features))
        if self.block_rows < 1:
            raise TrellisUserError(f"--block-rows {self.block_rows} must be >= 1")
        self.kernel = kernel or KERNEL
        self.progress = progress
        deg = degrees(indptr, edge_weight)
        dst, src = scales("rw" if spec.name == "rw" else "sym", deg)
        self.dst_scale = dst
        self.src_scale = src

    def num_blocks(self) -> int:
        """Row blocks per pass."""
        return max(1, math.ceil(self.n / self.block_rows))

    def apply(self, x: np.ndarray, combine: Callable[[int, int, np.ndarray], None]) -> None:
        """Compute ``T x`` block by block and hand each block to ``combine(a, b, block)``."""
        f = x.shape[1]
        buf = np.empty((min(self.block_rows, self.n), f), dtype=np.float32)
        xs = np.asarray(x)
        for a, b in row_ranges(self.n, self.block_rows):
            ptr = np.ascontiguousarray(self.indptr[a:b + 1], dtype=np.int64)
            idx = np.asarray(self.indices[ptr[0]:ptr[-1]])
            w = None if self.edge_weight is None else np.asarray(self.edge_weight[ptr[0]:ptr[-1]])
            out = buf[: b - a]
            spmm_block(ptr, idx, w, a, xs, self.dst_scale, self.src_scale, out, kernel=self.kernel)
            combine(a, b, out)
            if self.progress is not None:
                self.progress.update(1)

    def step(self, h: np.ndarray, scratch: Scratch) -> np.ndarray:
        """One hop: ``B h`` for the spec's operator, as a new scratch array."""
        n, f = h.shape
        spec = self.spec
        if spec.name in ("sym", "rw"):
            out = scratch.new((n, f))

            def put(a: int, b: int, blk: np.ndarray) -> None:
                out[a:b] = blk

            self.apply(h, put)
            return out
        if spec.name == "ppr":
            alpha = float(spec.alpha)
            z = h
            for _ in range(spec.num_iters):
                nz = scratch.new((n, f))

                def ppr(a: int, b: int, blk: np.ndarray, nz: np.ndarray = nz) -> None:
                    nz[a:b] = (1.0 - alpha) * blk + alpha * np.asarray(h[a:b])

                self.apply(z, ppr)
                if z is not h:
                    scratch.free(z)
                z = nz
            return z
        # heat: e^{-t} Σ_{k=0..K} t^k/k! T^k h
        t = float(spec.t)
        acc = scratch.new((n, f))
        coef = math.exp(-t)
        for a, b in row_ranges(n, self.block_rows):
            acc[a:b] = coef * np.asarray(h[a:b])
        term = h
        for k in range(1, spec.num_iters + 1):
            coef *= t / k
            nt = scratch.new((n, f)) if k < spec.num_iters else None

            def heat(a: int, b: int, blk: np.ndarray, nt: np.ndarray | None = nt, c: float = coef) -> None:
                if nt is not None:
                    nt[a:b] = blk
                acc[a:b] += c * blk

            self.apply(term, heat)
            if term is not h:
                scratch.free(term)
            term = nt  # type: ignore[assignment]
        return acc


def default_block_rows(num_features: int) -> int:
    """Rows per block so that one float32 output block is about 32 MiB (at least 256 rows)."""
    return max(256, DEFAULT_BLOCK_BYTES // max(1, 4 * int(num_features)))


def iter_hops(indptr: np.ndarray, indices: np.ndarray, x: np.ndarray, spec: OperatorSpec, hops: int, *,
              edge_weight: np.ndarray | None = None, scratch_dir: str | os.PathLike[str] | None = None,
              block_rows: int | None = None, kernel: str | None = None,
              progress: ProgressLike | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(r, B^r X)`` for ``r = 0..hops`` in node order, each computed from the previous one.

    Hop ``r``'s array stays valid until the consumer asks for hop ``r+1``; then it is freed (scratch
    files are deleted), so at most two hops (plus the operator's iterates) exist at once. Hop 0 is
    ``x`` itself.

    Args:
        indptr: ``int64 [N+1]`` in-edge CSR.
        indices: ``int64 [E]`` source ids.
        x: ``[N, F]`` input features (a memory map is read, never loaded whole).
        spec: The operator.
        hops: ``R >= 1``.
        edge_weight: Optional ``[E]`` weights.
        scratch_dir: Where scratch files go (default: RAM arrays).
        block_rows: Rows per block (default: :func:`default_block_rows`).
        kernel: ``numba`` or ``scipy`` (default: :data:`KERNEL`).
        progress: Optional progress bar advanced once per block of every pass.
    """
    if hops < 1:
        raise TrellisUserError(f"--hops {hops} must be >= 1 (R = number of propagation steps)")
    if x.ndim != 2 or x.shape[0] != indptr.shape[0] - 1:
        raise TrellisUserError(f"features have shape {tuple(x.shape)} but the graph has {indptr.shape[0] - 1} nodes")
    scratch = Scratch(scratch_dir)
    prop = Propagator(indptr, indices, spec, edge_weight=edge_weight, block_rows=block_rows,
                      num_features=x.shape[1], kernel=kernel, progress=progress)
    h: np.ndarray = x
    yield 0, h
    for r in range(1, hops + 1):
        nh = prop.step(h, scratch)
        if isinstance(nh, np.memmap):
            nh.flush()
        if h is not x:
            scratch.free(h)
        h = nh
        yield r, h
    if h is not x:
        scratch.free(h)


def propagate(indptr: np.ndarray, indices: np.ndarray, x: np.ndarray, spec: OperatorSpec | str, hops: int, *,
              edge_weight: np.ndarray | None = None, block_rows: int | None = None,
              kernel: str | None = None) -> list[np.ndarray]:
    """In-memory convenience: ``[X, BX, …, B^R X]`` as float32 arrays (small graphs, tests)."""
    if isinstance(spec, str):
        spec = OperatorSpec(spec)
    return [np.array(h, dtype=np.float32, copy=True)
            for _, h in iter_hops(np.asarray(indptr, dtype=np.int64), np.asarray(indices, dtype=np.int64),
                                  np.asarray(x, dtype=np.float32), spec, hops, edge_weight=edge_weight,
                                  block_rows=block_rows, kernel=kernel)]


def spec_from_key(key: dict[str, Any]) -> OperatorSpec:
    """Rebuild an :class:`OperatorSpec` from :meth:`OperatorSpec.key` (e.g. a cache manifest)."""
    k = dict(key)
    name = k.pop("operator")
    return OperatorSpec(name=name, **k)


def default_scratch_dir(near: str | os.PathLike[str]) -> Path:
    """A fresh scratch directory beside ``near`` (same filesystem as the output)."""
    parent = Path(near).parent
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".pp-scratch-", dir=parent))
