"""The operator plan of a layer: a short sequence of graph-engine and tensor-engine ops with costs."""

from __future__ import annotations

from dataclasses import dataclass, field

from trellis.plan.cost import ZERO, Cost

#: Ops the graph engine runs (they read the graph); the rest are tensor-engine ops.
GRAPH_OPS = frozenset({"spmm", "gather", "segment_reduce", "sddmm", "edge_softmax"})


@dataclass(frozen=True)
class Op:
    """One op of a plan.

    Attributes:
        kind: ``spmm`` (pushed-down message+aggregate), ``gather`` (materialize per-edge rows),
            ``apply_edge`` (per-edge tensor op), ``segment_reduce``, ``sddmm``, ``edge_softmax``,
            ``linear`` (apply-vertex transform), ``elementwise``.
        detail: Human-readable arguments (reduce, widths, weights).
        cost: Estimated forward cost.
    """

    kind: str
    detail: str
    cost: Cost

    @property
    def engine(self) -> str:
        return "graph" if self.kind in GRAPH_OPS else "tensor"


@dataclass(frozen=True)
class LayerPlan:
    """The lowered form of one layer.

    Attributes:
        layer: Layer name for display.
        ops: Ops in execution order.
        pushdown: Message and aggregate run as one graph-engine SpMM (no per-edge tensors).
        aggregate_first: The linear transform runs after the aggregation (narrower SpMM).
        notes: Why the planner chose this plan.
    """

    layer: str
    ops: tuple[Op, ...]
    pushdown: bool
    aggregate_first: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def cost(self) -> Cost:
        total = ZERO
        for op in self.ops:
            total = total + op.cost
        return total

    @property
    def peak_intermediate_bytes(self) -> float:
        """Largest single tensor the plan produces (what a memory budget must leave room for)."""
        return max((op.cost.out_bytes for op in self.ops), default=0.0)

    def format(self) -> str:
        """A table of the ops with FLOPs and bytes, then the planner's reasons."""
        lines = [f"{self.layer}: pushdown={'yes' if self.pushdown else 'no'} "
                 f"order={'aggregate->transform' if self.aggregate_first else 'transform->aggregate'}"]
        for op in self.ops:
            lines.append(f"  [{op.engine:6s}] {op.kind:15s} {op.detail:42s} "
                         f"{_fmt(op.cost.flops, 'FLOP')} {_fmt(op.cost.bytes, 'B')} out {_fmt(op.cost.out_bytes, 'B')}")
        c = self.cost
        lines.append(f"  total {_fmt(c.flops, 'FLOP')}, {_fmt(c.bytes, 'B')} moved, "
                     f"peak intermediate {_fmt(self.peak_intermediate_bytes, 'B')}")
        lines.extend(f"  why: {n}" for n in self.notes)
        return "\n".join(lines)


def _fmt(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:7.2f} {prefix}{unit}"
    return f"{x:7.0f} {unit}"


def format_plans(plans: list[LayerPlan]) -> str:
    """All layers' plans plus the model total."""
    total = ZERO
    for p in plans:
        total = total + p.cost
    peak = max((p.peak_intermediate_bytes for p in plans), default=0.0)
    body = "\n".join(p.format() for p in plans)
    return (f"{body}\nmodel forward: {_fmt(total.flops, 'FLOP')}, {_fmt(total.bytes, 'B')} moved, "
            f"activations {_fmt(total.out_bytes, 'B')}, peak intermediate {_fmt(peak, 'B')}")
