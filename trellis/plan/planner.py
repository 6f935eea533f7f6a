"""Lower a :class:`~trellis.plan.decl.LayerDecl` into a :class:`~trellis.plan.ir.LayerPlan`.

Rewrites (Lotan §4.2):

* **Pushdown** — an unparameterized message with its aggregate becomes one graph-engine SpMM; no per-edge
  tensor exists. Otherwise the general plan gathers per-edge rows, applies the message in the tensor
  engine and reduces.
* **Reordering** — a linear transform commutes with a sum/mean aggregation, so it is placed on the side that
  costs less: aggregating at ``min(d_in, d_out)`` width, weighed by the estimated seconds of each order
  (FLOPs and bytes). Max does not commute with a linear map, and attention needs transformed rows, so
  those keep transform-first.

Planner v2 (:func:`plan_model`) plans whole models — one configuration or K configurations batched into one
model — for a training step (forward and backward) or an evaluation pass, and applies the rewrites of
:mod:`trellis.plan.rewrites` (a constant first-layer aggregation computed once; fused epilogues).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from trellis.errors import TrellisUserError
from trellis.plan import cost as C
from trellis.plan.cost import GraphStats
from trellis.plan.decl import LayerDecl
from trellis.plan.ir import ConfigLayer, LayerPlan, ModelDecl, ModelPlan, Op
from trellis.plan.rewrites import DEFAULT_REWRITES, FUSE, SHARE, fuse_elementwise, share_constant_aggregation


def _root_ops(d: LayerDecl, s: GraphStats) -> list[Op]:
    if d.root == "linear":
        return [Op("linear", f"root {d.in_dim}->{d.out_dim}", C.linear_cost(s.num_dst, d.in_dim, d.out_dim))]
    return []


def _update_ops(d: LayerDecl, s: GraphStats) -> list[Op]:
    if d.update == "mlp":
        return [Op("elementwise", f"relu [{d.out_dim}]", C.elementwise_cost(s.num_dst, d.out_dim)),
                Op("linear", f"mlp {d.out_dim}->{d.out_dim}", C.linear_cost(s.num_dst, d.out_dim, d.out_dim))]
    return []


def _pushdown_orders(d: LayerDecl, s: GraphStats) -> tuple[list[Op], list[Op]]:
    weighted = d.message == "weighted" or d.root == "self_loop"
    red = d.aggregate
    agg_first = [Op("spmm", f"{red} width {d.in_dim}{' weighted' if weighted else ''}",
                    C.spmm_cost(s, d.in_dim, weighted)),
                 Op("linear", f"{d.in_dim}->{d.out_dim} on {s.num_dst} rows",
                    C.linear_cost(s.num_dst, d.in_dim, d.out_dim))]
    tr_first = [Op("linear", f"{d.in_dim}->{d.out_dim} on {s.num_src} rows",
                   C.linear_cost(s.num_src, d.in_dim, d.out_dim)),
                Op("spmm", f"{red} width {d.out_dim}{' weighted' if weighted else ''}",
                   C.spmm_cost(s, d.out_dim, weighted))]
    return agg_first, tr_first


def _attention_ops(d: LayerDecl, s: GraphStats) -> list[Op]:
    h = d.heads
    ops = [Op("linear", f"{d.in_dim}->{d.out_dim} ({h} heads)", C.linear_cost(s.num_src, d.in_dim, d.out_dim)),
           Op("elementwise", f"attention scores [{h}]", C.elementwise_cost(s.num_src, d.out_dim, 2.0)),
           Op("sddmm", f"a_src[src] + a_dst[dst] [{h}]", C.sddmm_cost(s, h))]
    if d.message == "edge_attention":
        ops.append(Op("apply_edge", f"edge logits {d.edge_dim}->{h}", C.apply_edge_cost(s, d.edge_dim, h)))
    ops += [Op("elementwise", f"leaky_relu [E,{h}]", C.elementwise_cost(s.num_edges, h)),
            Op("edge_softmax", f"per destination [{h}]", C.edge_softmax_cost(s, h)),
            Op("spmm", f"sum width {d.out_dim} weighted per head", C.spmm_cost(s, d.out_dim, True))]
    if d.message == "edge_attention":
        ops += [Op("segment_reduce", f"sum alpha*edge_feat [{h}x{d.edge_dim}]",
                   C.segment_reduce_cost(s, h * d.edge_dim)),
                Op("linear", f"edge embed {h}x{d.edge_dim}->{d.out_dim}",
                   C.linear_cost(s.num_dst, h * d.edge_dim, d.out_dim // h))]
    return ops


def plan_layer(d: LayerDecl, s: GraphStats) -> LayerPlan:
    """Choose the plan of layer ``d`` on a graph with statistics ``s``."""
    notes: list[str] = [] if d.widths_known else [
        "the layer states no widths (no transform, no in_dim/out_dim attributes): priced at width 1"]
    if d.message in ("attention", "edge_attention"):
        notes.append("attention needs transformed rows: transform first; only [E, heads] per-edge tensors")
        if d.message == "edge_attention":
            notes.append("edge features are aggregated at their own width, then embedded (no [E, heads, D] tensor)")
        ops = _attention_ops(d, s) + _root_ops(d, s) + _update_ops(d, s)
        return LayerPlan(d.name, tuple(ops), pushdown=True, aggregate_first=False, notes=tuple(notes))
    if d.unparameterized_message:
        notes.append("message and aggregate are unparameterized: pushed down to one SpMM")
        agg_first, tr_first = _pushdown_orders(d, s)
        if not d.transform:
            ops, first = agg_first[:1], True
        elif d.aggregate == "max":
            ops, first = tr_first, False
            notes.append("max does not commute with the linear transform: transform first")
        else:
            t_agg = sum(C.seconds(o.cost) for o in agg_first)
            t_tr = sum(C.seconds(o.cost) for o in tr_first)
            first = t_agg <= t_tr
            ops = agg_first if first else tr_first
            notes.append(f"aggregate-first est. {t_agg * 1e3:.2f} ms vs transform-first {t_tr * 1e3:.2f} ms")
        return LayerPlan(d.name, tuple(ops + _root_ops(d, s) + _update_ops(d, s)), pushdown=True,
                         aggregate_first=first, notes=tuple(notes))
    if not d.message_params:  # a copy (or weighted) message under a non-linear aggregate: no per-edge matmul
        notes.append(f"{d.aggregate} is not linear: the message is gathered per edge and reduced (general plan)"
                     + ("; transform first" if d.transform else ""))
        width = d.out_dim if d.transform else d.in_dim
        ops = ([Op("linear", f"{d.in_dim}->{d.out_dim} on {s.num_src} rows",
                   C.linear_cost(s.num_src, d.in_dim, d.out_dim))] if d.transform else [])
        ops += [Op("gather", f"source rows width {width}", C.gather_cost(s, width)),
                Op("segment_reduce", f"{d.aggregate} width {width}", C.segment_reduce_cost(s, width))]
        return LayerPlan(d.name, tuple(ops + _root_ops(d, s) + _update_ops(d, s)), pushdown=False,
                         aggregate_first=False, notes=tuple(notes))
    notes.append("parameterized message: per-edge rows are materialized (general plan)")
    ops = [Op("gather", f"source rows width {d.in_dim}", C.gather_cost(s, d.in_dim)),
           Op("apply_edge", f"message {d.in_dim + d.edge_dim}->{d.out_dim}",
              C.apply_edge_cost(s, d.in_dim + d.edge_dim, d.out_dim)),
           Op("segment_reduce", f"{d.aggregate} width {d.out_dim}", C.segment_reduce_cost(s, d.out_dim))]
    return LayerPlan(d.name, tuple(ops + _root_ops(d, s) + _update_ops(d, s)), pushdown=False,
                     aggregate_first=False, notes=tuple(notes))


# ---- planner v2: whole models, one or K configurations ------------------------------------------------
def choose_order(d: LayerDecl, s: GraphStats, *, input_grad: bool = True, training: bool = True) -> tuple[bool, str]:
    """Aggregate-first or transform-first for one pushed-down layer, by estimated step time.

    Unlike :func:`plan_layer` (forward cost only), this weighs the backward pass too: when the layer's
    input needs no gradient (the features), aggregate-first has no backward SpMM at all, while
    transform-first must send the gradient of ``X W`` back through the graph.

    Returns:
        ``(aggregate_first, reason)``.
    """
    if not d.transform:
        return True, "no transform"
    if d.aggregate == "max":
        return False, "max does not commute with the linear transform"
    agg_first, tr_first = _pushdown_orders(d, s)
    agg_first = [replace(o, input_grad=input_grad) for o in agg_first]
    tr_first = [replace(tr_first[0], input_grad=input_grad), tr_first[1]]
    t_agg = sum(o.seconds(training) for o in agg_first)
    t_tr = sum(o.seconds(training) for o in tr_first)
    return t_agg <= t_tr, f"aggregate-first est. {t_agg * 1e3:.2f} ms vs transform-first {t_tr * 1e3:.2f} ms"


def plan_layer_step(d: LayerDecl, s: GraphStats, *, input_grad: bool = True, training: bool = True) -> LayerPlan:
    """The plan one layer runs in a training step or an evaluation pass (what a layer's ``forward`` executes).

    A pushed-down layer's order is :func:`choose_order`'s (step time, backward included), the same choice
    :func:`plan_model` makes for that layer as one configuration of a model-batched sweep, so a layer called
    on its own performs the floating-point operations of its configuration in the sweep. A layer with a
    parameterized message gets :func:`plan_layer`'s general plan.

    Args:
        d: The layer's declaration.
        s: Statistics of the graph the layer runs on.
        input_grad: The layer's input needs a gradient (every layer but a first one fed with features)
            (default: True).
        training: Plan a training step (backward included) or an evaluation pass (default: True).
    """
    if not d.unparameterized_message:
        return plan_layer(d, s)
    first = choose_order(d, s, input_grad=input_grad, training=training)[0]
    row = [ConfigLayer(d, 0.0, input_constant=False, input_grad=input_grad, aggregate_first=first)]
    return replace(_lower(row, s, 0), layer=d.name)


def check_batchable(models: Sequence[ModelDecl]) -> None:
    """Raise :class:`TrellisUserError` unless ``models`` can run as one model-batched model.

    Configurations share a batch only within one model family and depth: their layers must line up so
    that each layer's aggregations can be one SpMM. Layers with parameterized messages (attention) have
    per-configuration edge tensors and are not batched.
    """
    if not models:
        raise TrellisUserError("a model batch needs at least one configuration")
    families = sorted({m.family for m in models})
    if len(families) > 1:
        raise TrellisUserError(
            f"configurations of different model families cannot share a batch ({', '.join(families)}); "
            "run one sweep per --model")
    depths = sorted({m.depth for m in models})
    if len(depths) > 1:
        raise TrellisUserError(
            f"configurations of different depths cannot share a batch (layers {depths}); batch them by depth")
    for i in range(depths[0]):
        kinds = {(m.layers[i].message, m.layers[i].aggregate, m.layers[i].root, m.layers[i].update) for m in models}
        if len(kinds) > 1:
            raise TrellisUserError(
                f"layer {i} differs in kind between configurations ({sorted(kinds)}); only the widths, dropout and "
                "training hyperparameters may differ within a batch")
    if len(models) > 1:
        for d in models[0].layers:
            if not d.unparameterized_message:
                raise TrellisUserError(
                    f"model family {families[0]!r} cannot be model-batched: its {d.name} layer has a parameterized "
                    "message (per-configuration edge tensors); use --batch-models 1")


def plan_model(models: Sequence[ModelDecl], stats: GraphStats, *, training: bool = True,
               rewrites: Sequence[str] = DEFAULT_REWRITES, input_grad: bool = False) -> ModelPlan:
    """Plan one configuration, or K configurations batched into one model, for a step or an evaluation.

    Each configuration keeps its own transforms (and the order that suits its widths); every layer's
    aggregations of all configurations become one SpMM over their concatenated inputs, so the graph is read
    once per layer for all K (model batching, Lotan §5.2). Then the rewrites run: the constant first-layer
    aggregation is shared and cached, and each layer's epilogue is fused.

    Args:
        models: The configurations (same family and depth, see :func:`check_batchable`).
        stats: Statistics of the graph the model runs on.
        training: Plan a training step (dropout on, backward pass) or an evaluation pass (default: True).
        rewrites: Rewrites to apply (default: all of :data:`trellis.plan.rewrites.DEFAULT_REWRITES`).
        input_grad: The input features need gradients (learned features): nothing about them is constant
            (default: False).
    """
    check_batchable(models)
    depth = models[0].depth
    layers: list[list[ConfigLayer]] = []
    for i in range(depth):
        row = []
        for m in models:
            d = m.layers[i]
            p = m.dropout if training else 0.0
            ig = input_grad if i == 0 else True
            agg = choose_order(d, stats, input_grad=ig, training=training)[0] if d.unparameterized_message else False
            if i == 0 and stats.sparse_input is not None:
                agg = False  # a sparse input is transformed first (an aggregate-first result would be dense [N, F])
            constant = i == 0 and not input_grad and p == 0.0 and stats.sparse_input is None  # a sparse one: no cache
            row.append(ConfigLayer(d, p, input_constant=constant, input_grad=ig,
                                   aggregate_first=agg, activation=m.activation and i < depth - 1,
                                   next_dropout=p if i < depth - 1 else 0.0))
        layers.append(row)
    applied: list[str] = []
    if SHARE in rewrites and share_constant_aggregation(layers):
        applied.append(SHARE)
    plans = [_lower(row, stats, i) for i, row in enumerate(layers)]
    if FUSE in rewrites:
        fused = [fuse_elementwise(lp) for lp in plans]
        if any(f is not p for f, p in zip(fused, plans)):
            applied.append(FUSE)
        plans = fused
    in_dim = models[0].layers[0].in_dim
    resident = C.graph_bytes(stats) + stats.num_src * in_dim * C.FLOAT
    params = sum(_param_count(d) for m in models for d in m.layers) * C.FLOAT * 4  # value, grad, 2 moments
    return ModelPlan(tuple(plans), len(models), training, tuple(applied), float(resident), float(params))


def _param_count(d: LayerDecl) -> int:
    n = C.linear_params(d.in_dim, d.out_dim)
    if d.root == "linear":
        n += C.linear_params(d.in_dim, d.out_dim, bias=False)
    if d.update == "mlp":
        n += C.linear_params(d.out_dim, d.out_dim)
    return n


def _separate_bias(d: LayerDecl) -> bool:
    """GCN adds its bias after the aggregation; SAGE and GIN carry it inside a linear map."""
    return d.root != "linear" and d.update == "none" and d.transform


def _lower(row: list[ConfigLayer], s: GraphStats, index: int) -> LayerPlan:
    """Lower one layer's per-configuration decisions to ops (one SpMM for all configurations)."""
    k = len(row)
    d = row[0].decl
    name = f"{d.name}[{index}]" + (f" x{k} configurations" if k > 1 else "")
    n_src, n_dst = s.num_src, s.num_dst
    ops: list[Op] = []
    notes: list[str] = []
    drop = [c for c in row if c.dropout > 0.0 and index == 0]
    share = s.sparse_input if index == 0 else None
    if drop:  # of a sparse input: its stored values only
        cost = C.total(C.dropout_cost(n_src, c.decl.in_dim).scale(1.0 if share is None else share) for c in drop)
        ops.append(Op("elementwise", f"dropout input x{len(drop)} [{d.in_dim}]", cost,
                      input_grad=any(c.input_grad for c in drop), launches=len(drop)))
    if not d.unparameterized_message:  # a single configuration (check_batchable refuses more)
        base = plan_layer(d, s)
        ops += base.ops
        ops += _epilogue(row, s)
        return replace(base, layer=name, ops=tuple(ops))
    weighted = d.message == "weighted" or d.root == "self_loop"
    tr = [c for c in row if not c.aggregate_first]
    ag = [c for c in row if c.aggregate_first and not c.cached]
    ca = [c for c in row if c.cached]
    if tr:
        ops.append(Op("linear", f"{_dims(tr)} on {n_src} rows" + ("" if share is None else
                                                                     f" (sparse input, {share:.2%} stored)"),
                      C.total(C.linear_cost(n_src, c.decl.in_dim, c.decl.out_dim) if share is None else
                              C.sparse_linear_cost(n_src, c.decl.in_dim, c.decl.out_dim, share) for c in tr),
                      input_grad=any(c.input_grad for c in tr),
                      launches=1 if all(c.input_constant for c in tr) else len(tr)))
    const_ag = [c for c in ag if c.input_constant]
    slots = [c.decl.in_dim for c in ag if not c.input_constant] + [c.decl.out_dim for c in tr]
    if const_ag:
        slots.append(d.in_dim)  # configurations with the same constant input aggregate it once
    width = sum(slots)
    grad = any(c.input_grad for c in ag) or bool(tr)
    if len(slots) > 1:
        ops.append(Op("concat", f"{len(slots)} inputs -> width {width}",
                      C.Cost(0.0, 2.0 * C.FLOAT * n_src * width, float(C.FLOAT * n_src * width)), input_grad=grad))
    if width:
        what = f" ({len(slots)} configurations, graph read once)" if len(slots) > 1 else ""
        ops.append(Op("spmm", f"{d.aggregate} width {width}{' weighted' if weighted else ''}{what}",
                      C.spmm_cost(s, width, weighted), input_grad=grad))
    if ca:
        ops.append(Op("spmm", f"{d.aggregate} width {d.in_dim} of the features, shared by {len(ca)}",
                      C.spmm_cost(s, d.in_dim, weighted), input_grad=False, cached=True))
        notes.append(f"input is constant: its aggregation is computed once and shared by {len(ca)} "
                     "configuration(s)")
    if (ag or ca) and d.transform:  # a layer without a transform (a user's) has nothing to apply here
        ops.append(Op("linear", f"{_dims(ag + ca)} on {n_dst} rows",
                      C.total(C.linear_cost(n_dst, c.decl.in_dim, c.decl.out_dim) for c in ag + ca),
                      input_grad=any(c.input_grad for c in ag), launches=len(ag) + (1 if ca else 0)))
    if d.root == "linear":
        ops.append(Op("linear", f"root {_dims(row)}", C.total(C.linear_cost(n_dst, c.decl.in_dim, c.decl.out_dim)
                                                          for c in row), input_grad=row[0].input_grad, launches=k))
    if d.root == "eps":
        ops.append(Op("elementwise", "(1+eps) root add",
                      C.total(C.elementwise_cost(n_dst, c.decl.in_dim if c.aggregate_first else c.decl.out_dim, 2.0)
                           for c in row), launches=k))
    if d.update == "mlp":
        width_out = sum(c.decl.out_dim for c in row)
        ops.append(Op("elementwise", f"relu (update) [{width_out}]", C.elementwise_cost(n_dst, width_out),
                      launches=k))
        ops.append(Op("linear", f"mlp {_dims(row, square=True)}",
                      C.total(C.linear_cost(n_dst, c.decl.out_dim, c.decl.out_dim) for c in row), launches=k))
    ops += _epilogue(row, s)
    orders = tuple(c.aggregate_first for c in row)
    if k == 1:
        notes.append("aggregate first" if orders[0] else "transform first")
    else:
        notes.append(f"{k} configurations aggregate in one SpMM; {sum(orders)} aggregate first, "
                     f"{k - sum(orders)} transform first (each by its own widths)")
    return LayerPlan(name, tuple(ops), pushdown=True, aggregate_first=all(orders), notes=tuple(notes),
                     config_aggregate_first=orders if k > 1 else (), cached=tuple(c.cached for c in row))


def _epilogue(row: list[ConfigLayer], s: GraphStats) -> list[Op]:
    n = s.num_dst
    d = row[0].decl
    width = sum(c.decl.out_dim for c in row)
    ops = []
    if d.unparameterized_message and _separate_bias(d):
        ops.append(Op("elementwise", f"bias [{width}]", C.elementwise_cost(n, width), fusable=True,
                      launches=len(row)))
    if any(c.activation for c in row):
        ops.append(Op("elementwise", f"activation [{width}]", C.elementwise_cost(n, width), fusable=True,
                      launches=len(row)))
    drop = [c for c in row if c.activation and c.next_dropout > 0.0]
    if drop:
        w = sum(c.decl.out_dim for c in drop)
        ops.append(Op("elementwise", f"dropout [{w}]", C.dropout_cost(n, w), fusable=True,
                      launches=len(drop)))
    return ops


def _dims(row: list[ConfigLayer], square: bool = False) -> str:
    dims = [(c.decl.in_dim if not square else c.decl.out_dim, c.decl.out_dim) for c in row]
    uniq = sorted(set(dims))
    text = ", ".join(f"{a}->{b}" for a, b in uniq)
    return f"{len(row)}x transform {text}" if len(row) > 1 else f"transform {text}"
