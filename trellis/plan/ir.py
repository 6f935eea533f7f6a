"""The operator plan of a layer (and of a whole, possibly model-batched, model) with costs.

A layer's plan is a short sequence of graph-engine ops (gather / SpMM / segment reduce / SDDMM / edge
softmax) and tensor-engine ops (apply-edge, linear = apply-vertex, elementwise). A :class:`ModelPlan` strings
the layers of one or K batched configurations together and adds what only a whole model shows: which
inputs are constant across epochs (so their aggregation is computed once), backward costs (a graph op
whose input needs no gradient has no backward pass), activation memory and the rewrites applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trellis.plan import cost as C
from trellis.plan.cost import ZERO, Cost
from trellis.plan.decl import LayerDecl

#: Ops the graph engine runs (they read the graph); the rest are tensor-engine ops.
GRAPH_OPS = frozenset({"spmm", "gather", "segment_reduce", "sddmm", "edge_softmax"})


@dataclass(frozen=True)
class Op:
    """One op of a plan.

    Attributes:
        kind: ``spmm`` (pushed-down message+aggregate), ``gather`` (materialize per-edge rows),
            ``apply_edge`` (per-edge tensor op), ``segment_reduce``, ``sddmm``, ``edge_softmax``,
            ``linear`` (apply-vertex transform), ``elementwise``, ``concat`` (K configurations' inputs copied
            side by side for one wide SpMM), ``fused`` (consecutive elementwise ops run as one pass).
        detail: Human-readable arguments (reduce, widths, weights).
        cost: Estimated forward cost.
        input_grad: The op's input needs a gradient, so its backward runs (see :func:`cost.backward_cost`).
        cached: The op's input is constant across epochs: it runs once and its output is reused (its cost
            is paid once, not per step).
        launches: Tensor-op launches this op stands for (K per-configuration matmuls grouped in one row).
        fusable: An elementwise op of a layer's epilogue (bias, activation, dropout) that the runtime can
            run fused with its neighbours (see :func:`trellis.plan.rewrites.fuse_elementwise`).
    """

    kind: str
    detail: str
    cost: Cost
    input_grad: bool = True
    cached: bool = False
    launches: int = 1
    fusable: bool = False

    @property
    def engine(self) -> str:
        """``graph`` for an op the graph engine runs, else ``tensor``."""
        return "graph" if self.kind in GRAPH_OPS else "tensor"

    @property
    def step_forward(self) -> Cost:
        """Forward cost paid every step (zero for a cached op)."""
        return ZERO if self.cached else self.cost

    @property
    def backward(self) -> Cost:
        """Estimated backward cost (zero for a cached op: its input is constant)."""
        return ZERO if self.cached else C.backward_cost(self.kind, self.cost, self.input_grad)

    def seconds(self, training: bool) -> float:
        """Estimated time of this op per step (forward, plus backward when training)."""
        if self.cached:
            return 0.0
        t = C.seconds(self.cost) + self.launches * C.OP_OVERHEAD_S
        if training:
            b = self.backward
            t += C.seconds(b) + (self.launches * C.OP_OVERHEAD_S if b.flops or b.bytes else 0.0)
        return t


@dataclass(frozen=True)
class LayerPlan:
    """The lowered form of one layer.

    Attributes:
        layer: Layer name for display.
        ops: Ops in execution order.
        pushdown: Message and aggregate run as one graph-engine SpMM (no per-edge tensors).
        aggregate_first: The linear transform runs after the aggregation (narrower SpMM).
        notes: Why the planner chose this plan.
        config_aggregate_first: For a model-batched layer, the order chosen per configuration (empty for
            a single configuration: ``aggregate_first`` holds).
        cached: For a model-batched layer, per configuration, whether its aggregation is the cached one.
    """

    layer: str
    ops: tuple[Op, ...]
    pushdown: bool
    aggregate_first: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    config_aggregate_first: tuple[bool, ...] = ()
    cached: tuple[bool, ...] = ()

    @property
    def configs(self) -> int:
        """Number of configurations this layer runs (1 unless model-batched)."""
        return max(len(self.config_aggregate_first), 1)

    def order(self, k: int) -> bool:
        """Whether configuration ``k`` aggregates before its transform."""
        return self.config_aggregate_first[k] if self.config_aggregate_first else self.aggregate_first

    def is_cached(self, k: int) -> bool:
        """Whether configuration ``k`` reads the cached aggregation of a constant input."""
        return bool(self.cached) and self.cached[k]

    @property
    def cost(self) -> Cost:
        """Summed forward cost of the ops."""
        return C.total(op.cost for op in self.ops)

    @property
    def peak_intermediate_bytes(self) -> float:
        """Largest single tensor the plan produces (what a memory budget must leave room for)."""
        return max((op.cost.out_bytes for op in self.ops), default=0.0)

    def format(self) -> str:
        """A table of the ops with FLOPs and bytes, then the planner's reasons."""
        if self.config_aggregate_first:
            n_agg = sum(self.config_aggregate_first)
            order = f"aggregate->transform for {n_agg} of {self.configs} configurations"
        else:
            order = "aggregate->transform" if self.aggregate_first else "transform->aggregate"
        lines = [f"{self.layer}: pushdown={'yes' if self.pushdown else 'no'} order={order}"]
        for op in self.ops:
            tag = " (cached: once)" if op.cached else ""
            lines.append(f"  [{op.engine:6s}] {op.kind:15s} {op.detail + tag:42s} "
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
    total = C.total(p.cost for p in plans)
    peak = max((p.peak_intermediate_bytes for p in plans), default=0.0)
    body = "\n".join(p.format() for p in plans)
    return (f"{body}\nmodel forward: {_fmt(total.flops, 'FLOP')}, {_fmt(total.bytes, 'B')} moved, "
            f"activations {_fmt(total.out_bytes, 'B')}, peak intermediate {_fmt(peak, 'B')}")


@dataclass(frozen=True)
class ModelDecl:
    """One configuration's model as the planner sees it.

    Attributes:
        family: Model family (``gcn``, ``sage``, ``gin``, ...); only one family can share a batch.
        layers: Each layer's declaration, input to output.
        dropout: Dropout rate on every layer's input (the GNN stack's dropout).
        activation: Whether an activation follows every layer but the last.
    """

    family: str
    layers: tuple[LayerDecl, ...]
    dropout: float = 0.0
    activation: bool = True

    @property
    def depth(self) -> int:
        """Number of layers."""
        return len(self.layers)


@dataclass(frozen=True)
class ModelPlan:
    """The plan of a whole model, or of K configurations batched into one model, for one mode.

    Attributes:
        layers: Each layer's plan (for a batched model, one plan covers all K configurations).
        configs: Number of configurations K.
        training: Plan of a training step (forward + backward) or of an evaluation forward pass.
        rewrites: Names of the rewrites applied (``share_constant_aggregation``, ``fuse_elementwise``).
        resident_bytes: Bytes that stay in memory whatever the plan: graph, reverse graph, features.
        param_bytes: Parameter, gradient and optimizer-state bytes of all K configurations.
    """

    layers: tuple[LayerPlan, ...]
    configs: int = 1
    training: bool = True
    rewrites: tuple[str, ...] = ()
    resident_bytes: float = 0.0
    param_bytes: float = 0.0

    @property
    def ops(self) -> tuple[Op, ...]:
        """Every layer's ops, in execution order."""
        return tuple(op for lp in self.layers for op in lp.ops)

    @property
    def forward_cost(self) -> Cost:
        """Forward cost of one step (cached ops excluded: they ran once)."""
        return C.total(op.step_forward for op in self.ops)

    @property
    def backward_cost(self) -> Cost:
        """Backward cost of one training step (zero for an evaluation plan)."""
        return C.total(op.backward for op in self.ops) if self.training else ZERO

    @property
    def once_cost(self) -> Cost:
        """Cost paid once for all epochs: the cached aggregations."""
        return C.total(op.cost for op in self.ops if op.cached)

    @property
    def cached_bytes(self) -> float:
        """Bytes of the cached aggregations (kept across epochs)."""
        return sum(op.cost.out_bytes for op in self.ops if op.cached)

    @property
    def activation_bytes(self) -> float:
        """Bytes of the tensors a training step keeps for its backward pass (every op's output)."""
        return sum(op.cost.out_bytes for op in self.ops if not op.cached)

    @property
    def peak_bytes(self) -> float:
        """Estimated peak memory of a step.

        Resident data, cache, parameters, activations and the largest transient (a backward gradient as
        wide as the widest activation).
        """
        widest = max((op.cost.out_bytes for op in self.ops), default=0.0)
        kept = self.activation_bytes if self.training else 2 * widest
        return self.resident_bytes + self.cached_bytes + self.param_bytes + kept + widest

    def seconds(self) -> float:
        """Estimated seconds of one step (per-op time model plus launch overheads)."""
        return sum(op.seconds(self.training) for op in self.ops)

    def format(self) -> str:
        """Every layer's ops, then the per-step totals, the one-time work and the memory estimate."""
        mode = "training step" if self.training else "evaluation pass"
        head = f"{mode}, {self.configs} configuration(s) in one model"
        if self.rewrites:
            head += f"; rewrites: {', '.join(self.rewrites)}"
        f, b, once = self.forward_cost, self.backward_cost, self.once_cost
        lines = [head, *(lp.format() for lp in self.layers)]
        lines.append(f"per step: forward {_fmt(f.flops, 'FLOP')} {_fmt(f.bytes, 'B')}"
                     + (f"; backward {_fmt(b.flops, 'FLOP')} {_fmt(b.bytes, 'B')}" if self.training else "")
                     + f"; est. {self.seconds() * 1e3:.1f} ms")
        if once.flops or once.bytes:
            lines.append(f"once (cached across epochs): {_fmt(once.flops, 'FLOP')} {_fmt(once.bytes, 'B')}, "
                         f"cache {_fmt(self.cached_bytes, 'B')}")
        lines.append(f"memory: resident {_fmt(self.resident_bytes, 'B')}, activations "
                     f"{_fmt(self.activation_bytes if self.training else 0.0, 'B')}, est. peak "
                     f"{_fmt(self.peak_bytes, 'B')}")
        return "\n".join(lines)


def total_seconds(plans: Sequence[ModelPlan]) -> float:
    """Summed estimated seconds of several step plans (e.g. a training step and an evaluation pass)."""
    return sum(p.seconds() for p in plans)


@dataclass
class ConfigLayer:
    """What the planner decides for one configuration at one layer before lowering it to ops.

    Rewrites (:mod:`trellis.plan.rewrites`) edit these decisions; :func:`trellis.plan.planner.plan_model`
    then lowers every layer's decisions to one :class:`LayerPlan`.

    Attributes:
        decl: The layer's declaration.
        dropout: Dropout rate applied to this layer's input in this mode (0 in evaluation).
        input_constant: The input is the same tensor every step (the features, undropped), so anything
            computed from it alone can be computed once.
        input_grad: The input needs a gradient (any layer after the first; the first when features are
            learned).
        aggregate_first: Aggregate, then transform (else transform, then aggregate).
        cached: Read the aggregation of the constant input from the cache (set by a rewrite).
        activation: An activation follows this layer (every layer but the last).
        next_dropout: Dropout rate of the next layer's input, applied right after this layer's activation.
    """

    decl: LayerDecl
    dropout: float
    input_constant: bool
    input_grad: bool
    aggregate_first: bool
    cached: bool = False
    activation: bool = False
    next_dropout: float = 0.0
