"""The planner: lowers a declared layer (:class:`LayerDecl`) into graph-engine and tensor ops.

Lotan §4.2: the most general plan collects per-edge tensors and runs message and aggregate in the tensor
engine; when message and aggregate are unparameterized they are *pushed down* into the graph engine as one
SpMM. A linear transform commutes with a linear aggregation, so the planner also orders transform and
aggregate by cost (aggregate at the narrower width). Every op carries FLOPs, bytes moved and the bytes of
the tensor it produces, so a memory budget can be planned against the same numbers ``--explain`` prints.

Planner v2 plans whole models — one configuration, or K configurations batched into one model (Lotan
§5.2) — for a training step (with backward costs) or an evaluation pass (:func:`plan_model`), applies the
rewrites of :mod:`trellis.plan.rewrites` (a constant first-layer aggregation computed once and shared;
fused epilogues) and chooses K from the cost model and a memory budget (:mod:`trellis.plan.batching`).
"""

from trellis.plan.cost import GraphStats
from trellis.plan.decl import LayerDecl
from trellis.plan.ir import LayerPlan, ModelDecl, ModelPlan, Op
from trellis.plan.planner import plan_layer, plan_layer_step, plan_model

__all__ = ["GraphStats", "LayerDecl", "LayerPlan", "ModelDecl", "ModelPlan", "Op", "plan_layer", "plan_layer_step",
           "plan_model"]
