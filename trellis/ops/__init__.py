"""The graph engine: aggregation (SpMM), SDDMM, edge softmax, segmented reductions and normalizations.

Every op takes a :class:`~trellis.ops.graph.CSRGraph` (in-edge CSR, rows = destinations) and has its own
backward that runs as another CSR pass — on the cached reverse graph where the gradient flows to sources —
so no op needs atomics or an ``[E, F]`` message tensor on CPU. CPU float32/float64 tensors use numba
kernels (:data:`WITH_NUMBA`); CUDA tensors, other dtypes and ``TRELLIS_DISABLE_NUMBA=1`` use a pure-torch
path with the same semantics (``index_select`` + ``index_add_`` / ``scatter_reduce``).
"""

from trellis.ops.attention import SDDMM_OPS, edge_softmax, sddmm
from trellis.ops.graph import CSRGraph
from trellis.ops.kernels import WITH_NUMBA, use_numba
from trellis.ops.norm import gcn_norm, inv_degree, row_norm
from trellis.ops.segment import REDUCES, segment_reduce
from trellis.ops.spmm import spmm

__all__ = ["CSRGraph", "REDUCES", "SDDMM_OPS", "WITH_NUMBA", "edge_softmax", "gcn_norm", "inv_degree", "row_norm",
           "sddmm", "segment_reduce", "spmm", "use_numba"]
