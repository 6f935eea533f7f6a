"""Cost estimates of engine ops from graph statistics and widths.

Why explicit formulas: the planner's choices (pushdown, transform/aggregate order, and later model batching
and tiling under a memory budget) are decisions between costs, and the estimates are printed by
``--explain`` so a user can see why. Bytes assume float32 values and int64 indices.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT = 4
INDEX = 8


@dataclass(frozen=True)
class GraphStats:
    """What the cost model needs to know about a graph (a full graph, a block or a cluster)."""

    num_src: int
    num_dst: int
    num_edges: int

    @classmethod
    def of(cls, graph: object) -> GraphStats:
        """Statistics of a :class:`trellis.ops.graph.CSRGraph`."""
        return cls(int(graph.num_src), int(graph.num_dst), int(graph.num_edges))  # type: ignore[attr-defined]

    @property
    def avg_degree(self) -> float:
        return self.num_edges / max(self.num_dst, 1)


@dataclass(frozen=True)
class Cost:
    """FLOPs, bytes read+written, and bytes of the op's output tensor (what stays alive for backward)."""

    flops: float
    bytes: float
    out_bytes: float

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.out_bytes + other.out_bytes)


ZERO = Cost(0.0, 0.0, 0.0)


def spmm_cost(s: GraphStats, width: int, weighted: bool) -> Cost:
    """Fused gather + aggregate: each edge reads one source row; each destination row is written once."""
    e, n = s.num_edges, s.num_dst
    read = e * width * FLOAT + e * INDEX + (n + 1) * INDEX + (e * FLOAT if weighted else 0)
    return Cost(2.0 * e * width, read + n * width * FLOAT, n * width * FLOAT)


def linear_cost(rows: int, d_in: int, d_out: int) -> Cost:
    """Dense ``[rows, d_in] @ [d_in, d_out]``."""
    return Cost(2.0 * rows * d_in * d_out, FLOAT * (rows * d_in + d_in * d_out + rows * d_out), rows * d_out * FLOAT)


def gather_cost(s: GraphStats, width: int) -> Cost:
    """Materialize one row per edge (the general, un-pushed-down plan)."""
    return Cost(0.0, 2 * s.num_edges * width * FLOAT + s.num_edges * INDEX, s.num_edges * width * FLOAT)


def apply_edge_cost(s: GraphStats, d_in: int, d_out: int) -> Cost:
    """A per-edge dense transform."""
    return linear_cost(s.num_edges, d_in, d_out)


def segment_reduce_cost(s: GraphStats, width: int) -> Cost:
    """Reduce materialized per-edge rows into destinations."""
    return Cost(float(s.num_edges * width), FLOAT * (s.num_edges + s.num_dst) * width, s.num_dst * width * FLOAT)


def sddmm_cost(s: GraphStats, heads: int) -> Cost:
    """Per-edge logits from per-node scalars: ``a[src] + b[dst]`` per head."""
    e = s.num_edges
    return Cost(float(e * heads), FLOAT * 3 * e * heads + 2 * e * INDEX, e * heads * FLOAT)


def edge_softmax_cost(s: GraphStats, heads: int) -> Cost:
    """Max, exp, sum and divide over each destination's in-edges."""
    e = s.num_edges
    return Cost(5.0 * e * heads, FLOAT * 4 * e * heads, e * heads * FLOAT)


def elementwise_cost(rows: int, width: int, flops_per: float = 1.0) -> Cost:
    """An elementwise op (activation, dropout, bias) over ``[rows, width]``."""
    return Cost(flops_per * rows * width, 2 * FLOAT * rows * width, rows * width * FLOAT)


#: Rough sustained rates of a 2-core CPU (dense GEMM and random-row memory traffic), used only to weigh
#: FLOPs against bytes when two plans differ in both. Measured on the development machine: a
#: 100k x 256 x 256 GEMM at ~80 GFLOP/s, a row-gather SpMM at ~10 GB/s.
FLOPS_PER_S = 8e10
BYTES_PER_S = 1e10


def seconds(c: Cost) -> float:
    """Estimated time of a cost: compute and memory traffic, whichever dominates, plus a share of the other."""
    a, b = c.flops / FLOPS_PER_S, c.bytes / BYTES_PER_S
    return max(a, b) + 0.25 * min(a, b)
