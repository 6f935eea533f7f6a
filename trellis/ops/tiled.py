"""Aggregation over row tiles of a memory-mapped CSR: the graph engine of out-of-core full-batch training.

Why tiles of the *same* kernels: a tiled run must train exactly what the in-memory run trains. Every
aggregation here is :func:`trellis.ops.kernels.spmm_sum_1` — the kernel :func:`trellis.ops.spmm` runs —
over rows ``[r0, r1)`` of the store's in-edge CSR (forward: rows are destinations) or of its cached reverse
CSR (backward: rows are sources). Each output row is one row of the untiled result, computed by the same
instructions in the same edge order, so tiling changes no bit of it. The kernel reads source rows straight
from a memory map (features or a spill file), so the only memory a tile allocates is its output rows and
one coefficient per edge of the tile.

No edge-length array is built for the whole graph: per-edge coefficients are computed per tile from the
``O(N)`` degree vectors, with the rounding :func:`trellis.ops.norm.gcn_norm` and
:func:`trellis.ops.norm.inv_degree` use (a float64 product rounded to float32), so they equal the in-memory
run's weights (and the reverse graph's permuted weights) bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trellis.ops import kernels as K
from trellis.ops.norm import _safe_inv
from trellis.utils.numba import WITH_NUMBA, njit

#: Aggregations the tiled engine runs: GCN's normalized sum with self loop, mean, plain sum.
TILED_AGGREGATIONS = ("gcn", "mean", "sum")


@dataclass
class CSRTile:
    """Rows ``[r0, r1)`` of a CSR, rebased so a kernel sees rows ``0 .. r1 - r0 - 1``.

    ``indices`` is a view of the (memory-mapped) column array, so it costs no memory of the process;
    ``cache`` holds the kernel launcher's row chunks of this tile.
    """

    r0: int
    r1: int
    indptr: Tensor
    indices: np.ndarray
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_dst(self) -> int:
        """Rows of the tile."""
        return self.r1 - self.r0

    @property
    def num_edges(self) -> int:
        """Edges of the tile."""
        return int(self.indices.shape[0])


if WITH_NUMBA:

    @njit(nogil=True, cache=True)
    def _scaled_coef(lo, hi, bounds, indptr, indices, r0, row_scale, col_scale, out):  # pragma: no cover
        """``out[k] = float32(row_scale[r0 + i] * col_scale[indices[k]])`` over the row chunks ``[lo, hi)``."""
        for c in range(lo, hi):
            for i in range(bounds[c], bounds[c + 1]):
                a = row_scale[r0 + i]
                for k in range(indptr[i], indptr[i + 1]):
                    out[k] = np.float32(a * col_scale[indices[k]])


class MappedCSR:
    """A square graph's in-edge CSR and its reverse, memory-mapped, with the ``O(N)`` vectors of its norms.

    Args:
        indptr: ``int64 [N + 1]`` in-edge row pointers (destinations).
        indices: ``[E]`` sources.
        rev_indptr: ``int64 [N + 1]`` reverse row pointers (sources), the store's cached reverse CSR.
        rev_indices: ``[E]`` destinations of the reverse edges (ascending edge id per row).
        degree: The whole graph's in-degree of every *source* row, when the CSR is a rank's part: ``L``
            destination rows over ``L + H`` source rows, the first ``L`` being the destinations (default:
            None, a square graph's own in-degrees).
    """

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, rev_indptr: np.ndarray,
                 rev_indices: np.ndarray, degree: np.ndarray | None = None) -> None:
        self.indptr, self.indices = indptr, indices
        self.rev_indptr, self.rev_indices = rev_indptr, rev_indices
        self.num_nodes = int(indptr.shape[0] - 1)
        #: Source rows (the reverse CSR's rows): ``N``, or ``L + H`` for a rank's part (see ``degree``).
        self.num_src = int(rev_indptr.shape[0] - 1)
        self.num_edges = int(indices.shape[0])
        if degree is None:
            degree = np.diff(np.asarray(indptr))
        deg = torch.from_numpy(np.array(degree)).to(torch.float32)  # as CSRGraph.in_degree
        d64 = deg.to(torch.float64)
        inv_sqrt = _safe_inv(d64 + 1.0).sqrt()
        #: ``float64 [N]``: ``1/sqrt(in-degree + 1)`` (GCN's ``D^-1/2`` with the self loop).
        self.gcn_scale = inv_sqrt.numpy()
        #: ``float32 [N]``: GCN's self-loop weight ``1/(in-degree + 1)`` as gcn_norm rounds it.
        self.gcn_self = (inv_sqrt * inv_sqrt).to(torch.float32).numpy()
        #: ``float32 [N]``: ``1/in-degree`` (mean), 0 for isolated rows.
        self.inv_degree = _safe_inv(d64).to(torch.float32).numpy()
        self.max_degree = int(deg.max().item()) if self.num_nodes else 0
        rdeg = np.diff(np.asarray(rev_indptr))
        self.max_out_degree = int(rdeg.max()) if rdeg.size else 0

    @property
    def nbytes_resident(self) -> int:
        """Bytes this object keeps in the process (the ``O(N)`` vectors)."""
        return int(self.gcn_scale.nbytes + self.gcn_self.nbytes + self.inv_degree.nbytes)

    def tile(self, r0: int, r1: int, reverse: bool = False) -> CSRTile:
        """Rows ``[r0, r1)`` of the CSR (``reverse``: of the reverse CSR)."""
        ip_all, ix = (self.rev_indptr, self.rev_indices) if reverse else (self.indptr, self.indices)
        ip = np.asarray(ip_all[r0:r1 + 1], dtype=np.int64)
        e0, e1 = int(ip[0]), int(ip[-1])
        return CSRTile(r0, r1, torch.from_numpy(ip - e0), ix[e0:e1])

    def tile_bounds(self, row_bytes: float, edge_bytes: float, tile_bytes: float, *,
                    max_rows: int | None = None) -> np.ndarray:
        """Row boundaries of tiles whose rows x ``row_bytes`` + edges x ``edge_bytes`` stay within ``tile_bytes``.

        A tile is bounded in both directions: its in-edges (forward pass) and its out-edges (backward pass
        over the reverse CSR). A row that alone exceeds ``tile_bytes`` still gets a tile of its own (the
        plan's minimum budget covers the largest row). ``max_rows`` caps the rows of a tile (tests force
        one-row and seven-row tiles with it). Greedy over tiles, two binary searches each.
        """
        n = self.num_nodes
        rows = np.arange(n + 1, dtype=np.float64) * row_bytes
        costs = [np.asarray(self.indptr, dtype=np.float64) * edge_bytes + rows]
        if self.num_src == n:  # square: the backward pass runs over the same tiles of the reverse CSR
            costs.append(np.asarray(self.rev_indptr, dtype=np.float64) * edge_bytes + rows)
        del rows
        return _greedy(costs, n, tile_bytes, max_rows)

    def source_bounds(self, row_bytes: float, edge_bytes: float, tile_bytes: float, *,
                      max_rows: int | None = None) -> np.ndarray:
        """Tiles of the reverse CSR's ``num_src`` rows (a rank's backward pass over its ``L + H`` sources)."""
        cost = np.asarray(self.rev_indptr, dtype=np.float64) * edge_bytes + \
            np.arange(self.num_src + 1, dtype=np.float64) * row_bytes
        return _greedy([cost], self.num_src, tile_bytes, max_rows)

    # ---- coefficients ---------------------------------------------------------------------------
    def coefficients(self, kind: str, tile: CSRTile, reverse: bool) -> np.ndarray | None:
        """Per-edge coefficients of the tile for aggregation ``kind`` (None for an unweighted sum).

        ``gcn``: ``float32(d_i^-1/2 d_j^-1/2)`` (the product is symmetric, so the reverse tile's values equal
        the forward weights permuted to it); ``mean`` backward: ``1/deg`` of each reverse edge's
        destination (the forward pass scales rows instead); ``sum``: none.
        """
        if kind == "gcn":
            out = np.empty(tile.num_edges, dtype=np.float32)
            s = self.gcn_scale
            if WITH_NUMBA:
                # on the kernels' threads, by row chunks (a tile of 17M edges: 150 ms on one core)
                K.launch(_scaled_coef, tile, tile.num_edges, torch.from_numpy(out), K.np_(tile.indptr), tile.indices,
                         tile.r0, s, s, out)
            else:
                rows = np.repeat(np.arange(tile.r0, tile.r1), np.diff(tile.indptr.numpy()))
                np.multiply(s[rows], s[np.asarray(tile.indices)], out=out, casting="same_kind")
            return out
        if kind == "mean" and reverse:
            return self.inv_degree[np.asarray(tile.indices)]
        return None

    def aggregate(self, kind: str, tile: CSRTile, x: np.ndarray, *, reverse: bool = False) -> Tensor:
        """Rows ``[tile.r0, tile.r1)`` of the aggregation of ``x`` (``[N, F]`` float32, a memory map or array).

        Forward (``reverse=False``): ``out[i] = sum_j w_ij x[j]`` over destination ``i``'s in-edges (mean:
        scaled by ``1/deg(i)``; gcn: plus ``x[i] / (deg(i) + 1)``). Backward (``reverse=True``), ``x`` being a
        gradient: the transposed aggregation over the reverse CSR, as :func:`trellis.ops.spmm`'s backward.
        """
        if kind not in TILED_AGGREGATIONS:
            raise ValueError(f"no tiled aggregation {kind!r}; choose one of {', '.join(TILED_AGGREGATIONS)}")
        coef = self.coefficients(kind, tile, reverse)
        r0, r1 = tile.r0, tile.r1
        rscale = self.inv_degree[r0:r1] if kind == "mean" and not reverse else None
        # the self loop's term belongs to destination rows only (a rank's halo sources have theirs at the owner)
        sw = self.gcn_self[r0:min(r1, self.num_nodes)] if kind == "gcn" else None
        out = torch.empty((tile.num_dst, x.shape[1]), dtype=torch.float32)
        if K.enabled():
            e32 = K.empty(np.float32)
            K.launch(K.spmm_sum_1, tile, tile.num_edges, out, K.np_(tile.indptr), tile.indices,
                     e32 if coef is None else coef, x, e32 if rscale is None else rscale,
                     e32 if sw is None else sw, r0, out.numpy())
            return out
        # Pure torch (numba off): the same sums, as the in-memory torch path computes them.
        msg = torch.from_numpy(np.asarray(x[np.asarray(tile.indices)]))
        if coef is not None:
            msg = msg * torch.from_numpy(coef)[:, None]
        dst = torch.repeat_interleave(torch.arange(tile.num_dst), tile.indptr[1:] - tile.indptr[:-1])
        out = torch.zeros_like(out).index_add_(0, dst, msg)
        if rscale is not None:
            out = out * torch.from_numpy(rscale)[:, None]
        if sw is not None:
            out[: sw.shape[0]] += torch.from_numpy(sw)[:, None] * torch.from_numpy(np.asarray(x[r0:r0 + sw.shape[0]]))
        return out


def _greedy(costs: list[np.ndarray], n: int, tile_bytes: float, max_rows: int | None) -> np.ndarray:
    """Row boundaries of tiles within ``tile_bytes`` of every cumulative cost in ``costs`` (at least one row)."""
    bounds, r = [0], 0
    while r < n:
        j = min(int(np.searchsorted(c, c[r] + tile_bytes, side="right")) for c in costs) - 1
        j = max(j, r + 1)
        if max_rows is not None:
            j = min(j, r + max_rows)
        r = min(j, n)
        bounds.append(r)
    return np.asarray(bounds, dtype=np.int64)


def iter_tiles(bounds: np.ndarray) -> Iterator[tuple[int, int]]:
    """``(r0, r1)`` of every tile of ``bounds``."""
    b = bounds.tolist()
    return zip(b[:-1], b[1:])
