"""Lower a :class:`~trellis.nn.decl.LayerDecl` into a :class:`~trellis.plan.ir.LayerPlan`.

Rewrites (Lotan §4.2):

* **Pushdown** — an unparameterized message with its aggregate becomes one graph-engine SpMM; no per-edge
  tensor exists. Otherwise the general plan gathers per-edge rows, applies the message in the tensor
  engine and reduces.
* **Reordering** — a linear transform commutes with a sum/mean aggregation, so it is placed on the side that
  costs less: aggregating at ``min(d_in, d_out)`` width, weighed by the estimated seconds of each order
  (FLOPs and bytes). Max does not commute with a linear map, and attention needs transformed rows, so
  those keep transform-first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trellis.plan import cost as C
from trellis.plan.cost import GraphStats
from trellis.plan.ir import LayerPlan, Op

if TYPE_CHECKING:
    from trellis.nn.decl import LayerDecl


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
    notes: list[str] = []
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
    notes.append("parameterized message: per-edge rows are materialized (general plan)")
    ops = [Op("gather", f"source rows width {d.in_dim}", C.gather_cost(s, d.in_dim)),
           Op("apply_edge", f"message {d.in_dim + d.edge_dim}->{d.out_dim}",
              C.apply_edge_cost(s, d.in_dim + d.edge_dim, d.out_dim)),
           Op("segment_reduce", f"{d.aggregate} width {d.out_dim}", C.segment_reduce_cost(s, d.out_dim))]
    return LayerPlan(d.name, tuple(ops + _root_ops(d, s) + _update_ops(d, s)), pushdown=False,
                     aggregate_first=False, notes=tuple(notes))
