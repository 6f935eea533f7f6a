"""Cost estimates of engine ops from graph statistics and widths.

Why explicit formulas: the planner's choices (pushdown, transform/aggregate order, and later model batching
and tiling under a memory budget) are decisions between costs, and the estimates are printed by
``--explain`` so a user can see why. Bytes assume float32 values and int64 indices.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

FLOAT = 4
INDEX = 8


@dataclass(frozen=True)
class GraphStats:
    """What the cost model needs to know about a graph (a full graph, a block or a cluster)."""

    num_src: int
    num_dst: int
    num_edges: int
    #: The share of stored values of a sparse input (bag-of-words rows, ``ops/sparse_rows.py``); None: dense. The
    #: executor transforms a sparse input first and touches only its stored values (dropout, the product), so a
    #: plan that assumed a dense ``[N, F]`` input (a cached aggregate-first evaluation, a 3.5 GB dropout on
    #: Coauthor CS) was not what ran, and the K it chose for a sweep was priced on it.
    sparse_input: float | None = None

    @classmethod
    def of(cls, graph: object) -> GraphStats:
        """Statistics of a :class:`trellis.ops.graph.CSRGraph`."""
        return cls(int(graph.num_src), int(graph.num_dst), int(graph.num_edges))  # type: ignore[attr-defined]

    @property
    def avg_degree(self) -> float:
        """Edges per destination."""
        return self.num_edges / max(self.num_dst, 1)


@dataclass(frozen=True)
class Cost:
    """FLOPs, bytes read+written, bytes of the op's output tensor (what stays alive for backward).

    ``accesses`` counts random row accesses of the graph engine (one per edge for a gather or SpMM): a
    random row costs a cache miss whatever its width, which is what model batching amortizes (K models
    read each edge's source row once, as one wide row). ``draws`` counts random numbers drawn (dropout
    masks; PyTorch draws them serially on CPU, one generator stream per tensor). Both enter the time
    model, not the FLOP or byte counts.
    """

    flops: float
    bytes: float
    out_bytes: float
    accesses: float = 0.0
    draws: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes, self.out_bytes + other.out_bytes,
                    self.accesses + other.accesses, self.draws + other.draws)

    def scale(self, factor: float) -> Cost:
        """This cost ``factor`` times (e.g. a backward pass that repeats the forward's work)."""
        return Cost(self.flops * factor, self.bytes * factor, self.out_bytes * factor, self.accesses * factor,
                    self.draws * factor)


ZERO = Cost(0.0, 0.0, 0.0)


def total(costs: Iterable[Cost]) -> Cost:
    """The sum of ``costs``, added left to right from :data:`ZERO`."""
    out = ZERO
    for c in costs:
        out = out + c
    return out


def spmm_cost(s: GraphStats, width: int, weighted: bool) -> Cost:
    """Fused gather + aggregate: each edge reads one source row; each destination row is written once."""
    e, n = s.num_edges, s.num_dst
    read = e * width * FLOAT + e * INDEX + (n + 1) * INDEX + (e * FLOAT if weighted else 0)
    return Cost(2.0 * e * width, read + n * width * FLOAT, n * width * FLOAT, float(e))


def linear_cost(rows: int, d_in: int, d_out: int) -> Cost:
    """Dense ``[rows, d_in] @ [d_in, d_out]``."""
    return Cost(2.0 * rows * d_in * d_out, FLOAT * (rows * d_in + d_in * d_out + rows * d_out), rows * d_out * FLOAT)


def sparse_linear_cost(rows: int, d_in: int, d_out: int, share: float) -> Cost:
    """Sparse ``[rows, d_in]`` (``share`` of it stored, CSR) ``@ [d_in, d_out]``: a weight row per stored value."""
    nnz = rows * d_in * share
    return Cost(2.0 * nnz * d_out, nnz * (FLOAT + INDEX) + FLOAT * (nnz * d_out + rows * d_out), rows * d_out * FLOAT,
                float(nnz))


def gather_cost(s: GraphStats, width: int) -> Cost:
    """Materialize one row per edge (the general, un-pushed-down plan)."""
    return Cost(0.0, 2 * s.num_edges * width * FLOAT + s.num_edges * INDEX, s.num_edges * width * FLOAT,
                float(s.num_edges))


def apply_edge_cost(s: GraphStats, d_in: int, d_out: int) -> Cost:
    """A per-edge dense transform."""
    return linear_cost(s.num_edges, d_in, d_out)


def segment_reduce_cost(s: GraphStats, width: int) -> Cost:
    """Reduce materialized per-edge rows into destinations."""
    return Cost(float(s.num_edges * width), FLOAT * (s.num_edges + s.num_dst) * width, s.num_dst * width * FLOAT)


def sddmm_cost(s: GraphStats, heads: int) -> Cost:
    """Per-edge logits from per-node scalars: ``a[src] + b[dst]`` per head."""
    e = s.num_edges
    return Cost(float(e * heads), FLOAT * 3 * e * heads + 2 * e * INDEX, e * heads * FLOAT, float(e))


def edge_softmax_cost(s: GraphStats, heads: int) -> Cost:
    """Max, exp, sum and divide over each destination's in-edges."""
    e = s.num_edges
    return Cost(5.0 * e * heads, FLOAT * 4 * e * heads, e * heads * FLOAT)


def elementwise_cost(rows: int, width: int, flops_per: float = 1.0) -> Cost:
    """An elementwise op (activation, dropout, bias) over ``[rows, width]``."""
    return Cost(flops_per * rows * width, 2 * FLOAT * rows * width, rows * width * FLOAT)


def dropout_cost(rows: int, width: int) -> Cost:
    """Dropout as eager PyTorch runs it: draw a Bernoulli mask, scale it, multiply (three passes).

    The mask is kept for backward besides the output, so the op keeps two tensors alive.
    """
    n = rows * width
    return Cost(3.0 * n, 7 * FLOAT * n, 2 * FLOAT * n, draws=float(n))


def backward_cost(kind: str, forward: Cost, input_grad: bool = True) -> Cost:
    """Estimated backward cost of an op from its forward cost.

    Why per kind: a linear map's backward computes the weight gradient always and the input gradient only
    when its input needs one (2x or 1x the forward); an SpMM with fixed edge weights needs a backward SpMM
    on the reverse graph only when its input needs a gradient — which is why aggregating the raw features
    first (layer 1, features never need gradients) saves a whole graph pass per step. Elementwise and
    attention ops repeat roughly their forward work. Backward outputs are transient (not kept).

    Args:
        kind: The op kind (see :class:`trellis.plan.ir.Op`).
        forward: The op's forward cost.
        input_grad: Whether the op's input needs a gradient (default: True).
    """
    if kind in ("spmm", "gather"):
        c = forward if input_grad else ZERO
    elif kind in ("linear", "apply_edge"):
        c = forward.scale(2.0 if input_grad else 1.0)
    elif kind in ("elementwise", "fused", "concat"):
        c = forward if input_grad else ZERO
    else:
        c = forward
    return Cost(c.flops, c.bytes, 0.0, c.accesses)


#: Rough sustained rates of a 2-core CPU (dense GEMM and random-row memory traffic), used only to weigh
#: FLOPs against bytes when two plans differ in both. Measured on the development machine: a
#: 100k x 256 x 256 GEMM at ~80 GFLOP/s, a row-gather SpMM at ~10 GB/s.
FLOPS_PER_S = 8e10
BYTES_PER_S = 1e10
#: Seconds per random row access of the graph engine (a cache miss, overlapped with others): the
#: width-independent part of an SpMM's time per edge. Fitted on the development machine as
#: ``t(width) = E * (ACCESS_S + 4 * width / BYTES_PER_S)`` over SpMMs of width 16..1536 on a 100k-node /
#: 2M-edge graph: the intercept is worth about 10 feature columns.
ACCESS_S = 4e-9
#: Seconds per random number of a dropout mask (``bernoulli_`` runs serially on CPU; measured ~1e-8).
RNG_S = 1e-8
#: Fixed cost of launching one tensor op (dispatch, allocation): Lotan §7.2.3's intercept.
OP_OVERHEAD_S = 2e-5


def seconds(c: Cost) -> float:
    """Estimated time of a cost: compute and memory traffic, whichever dominates, plus a share of the other.

    Random row accesses (``c.accesses``) add their latency on top of the streamed bytes, random numbers
    (``c.draws``) their serial generation.
    """
    a, b = c.flops / FLOPS_PER_S, c.bytes / BYTES_PER_S
    return max(a, b) + 0.25 * min(a, b) + c.accesses * ACCESS_S + c.draws * RNG_S


def graph_bytes(s: GraphStats) -> float:
    """Resident bytes of a graph in the engine.

    CSR, reverse CSR with its edge permutation, and the normalized edge weights in both orders.
    """
    return float(INDEX * (s.num_dst + 1 + s.num_src + 1 + 3 * s.num_edges) + 2 * FLOAT * s.num_edges)


def linear_params(d_in: int, d_out: int, bias: bool = True) -> int:
    """Number of parameters of a ``d_in -> d_out`` linear map."""
    return d_in * d_out + (d_out if bias else 0)
