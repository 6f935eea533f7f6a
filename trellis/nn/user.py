"""User-defined layers: Lotan's message φ, aggregate Γ and update ψ written in torch, planned like built-ins.

A user subclasses :class:`trellis.nn.MessagePassing` and writes

* ``message(self, x_j, [x_i], [edge_weight], [edge_attr]) -> [E, d]`` (φ, per edge: the source row ``x_j``,
  the destination row ``x_i``, the edge's fixed weight and its features),
* ``aggregate = "sum" | "mean" | "max"`` (Γ, a class attribute),
* ``update(self, aggr, [x]) -> [n, out]`` (ψ, per destination, given its own input row ``x``; default: ``aggr``),
* optionally ``transform = "lin"``: the name of a bias-free :class:`torch.nn.Linear` applied to every source row
  before the message, and ``edge_weights(self, graph)``: fixed (unparameterized) per-edge weights, or
  ``(edge weights, self-loop weights)`` — :func:`trellis.ops.gcn_norm` returns exactly that pair. The self
  loop joins **after** the reduction, as GCN's normalized self term does: ``aggr_i = Γ_j(message) + s_i · x_i``.
  With ``sum`` that is a self loop as an edge; with ``mean`` and ``max`` it is not one of the reduced edges
  (``mean_j(x_j) + x_i``, ``max_j(x_j) + x_i``): store the loops as edges instead when they must be reduced.

Why read the code instead of asking for a declaration: the planner can move only what it understands, and a
user should not have to know the planner. :func:`declare` probes ``message`` numerically: a message that reads
only ``x_j`` (and ``edge_weight``), touches no parameter, and returns ``x_j`` (or ``edge_weight * x_j``) on
random probes of several scales, in training and in evaluation mode, and whose output does not move with the
layer's buffers or frozen parameters (they may change later, and a pushed-down message is never called again), is
a copy (weighted) message (a layer sets ``general_plan = True`` to opt out, for example when its message reads a
plain Python attribute that will change); with a linear aggregate (sum, mean) the layer is then pushed down
into one SpMM, and the transform may run before or after it (Lotan §4.2), exactly like the built-in GCN — so it
is also model-batchable. Anything else gets the general plan (:func:`run_general`): gather the rows per edge,
apply the message, segment-reduce to the destinations, one layer's edges at a time; autograd supplies the
backward (the segment reduction's own backward, the gathers' scatter-adds).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.ops import segment_reduce
from trellis.ops.graph import Aggregation, CSRGraph
from trellis.ops.sparse_rows import head_rows, is_sparse, linear
from trellis.plan.decl import AGGREGATES, LayerDecl

#: A layer (``trellis.nn.layers.MessagePassing``; not imported: that module builds on this one).
MessagePassing = Any

#: What ``message`` may read.
MESSAGE_ARGS = ("x_j", "x_i", "edge_weight", "edge_attr")


def _params(fn: Any) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def message_args(layer: MessagePassing) -> list[str]:
    """The arguments ``layer.message`` reads (refusing names the engine cannot supply); read once per layer."""
    cached = layer.__dict__.get("_user_message_args")
    if cached is not None:
        return cached
    names = _params(layer.message)
    unknown = [n for n in names if n not in MESSAGE_ARGS]
    if unknown:
        raise TrellisUserError(f"{type(layer).__name__}.message: unknown argument {unknown[0]!r}; a message reads "
                               f"{', '.join(MESSAGE_ARGS)}")
    if "x_j" not in names:
        raise TrellisUserError(f"{type(layer).__name__}.message must read the source rows x_j")
    layer.__dict__["_user_message_args"] = names
    return names


def transform_of(layer: MessagePassing) -> nn.Linear | None:
    """The layer's declared transform (a bias-free linear map applied to every source row), if any."""
    name = type(layer).transform
    if name is None:
        return None
    lin = getattr(layer, name, None)
    if not isinstance(lin, nn.Linear):
        raise TrellisUserError(f"{type(layer).__name__}.transform = {name!r} must name an nn.Linear submodule")
    if lin.bias is not None:
        raise TrellisUserError(f"{type(layer).__name__}.{name}: a transform that commutes with the aggregation has no "
                               "bias (nn.Linear(..., bias=False)); add a bias in update")
    return lin


#: Scales of the probes' values: a message that is the identity on unit normals but clips, saturates or rounds
#: larger or smaller values (``x_j.clamp(-5, 5)``, ``torch.tanh``) is told apart from a copy.
_PROBE_SCALES = (1.0, 1e-3, 1e3, 1e6)


def _probe(layer: MessagePassing, names: list[str]) -> str:
    """``copy``, ``weighted`` or ``custom``: what ``message`` computes on random probes.

    The probes run in training mode and in evaluation mode (a message with dropout copies in one only) and at
    several scales; the layer's modes are restored afterwards. A probe is evidence, not proof: a layer whose
    message must never be pushed down says so with ``general_plan = True``.
    """
    if "x_i" in names or "edge_attr" in names or type(layer).general_plan:
        return "custom"
    params = [p for p in layer.parameters() if p.requires_grad]
    modes = {m: m.training for m in layer.modules()}
    gen = torch.Generator().manual_seed(0)
    kind = None
    try:
        for training in (True, False):
            layer.train(training)
            for width, scale in zip((3, 5, 4, 6), _PROBE_SCALES):
                x_j = torch.randn(7, width, generator=gen) * scale
                w = torch.rand(7, generator=gen) + 0.5
                args = {"x_j": x_j, "edge_weight": w} if "edge_weight" in names else {"x_j": x_j}
                with torch.enable_grad():
                    try:
                        out = layer.message(**args)
                    except Exception:  # noqa: BLE001 - a message that needs more than a probe gives: the general plan
                        return "custom"
                    if not isinstance(out, Tensor) or out.shape != x_j.shape:
                        return "custom"
                    if params and out.requires_grad:
                        grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
                        if any(g is not None for g in grads):
                            return "custom"
                    if _reads_state(layer, args, out):
                        return "custom"
                tol = 1e-6 * scale
                if torch.allclose(out, x_j, rtol=0, atol=tol):
                    now = "copy"
                elif "edge_weight" in names and torch.allclose(out, w[:, None] * x_j, rtol=1e-6, atol=tol):
                    now = "weighted"
                else:
                    return "custom"
                if kind not in (None, now):
                    return "custom"
                kind = now
    finally:
        for m, training in modes.items():
            m.training = training
    return kind or "custom"


def _reads_state(layer: MessagePassing, args: dict[str, Tensor], out: Tensor) -> bool:
    """Whether ``message`` reads a buffer or a frozen parameter: its output moves when they do.

    Why: such state can change after the probe (a running statistic, a temperature schedule, a frozen scale that
    is 1 today), and a message pushed down into an SpMM is never called again, so the probe's verdict would hold
    for values it never saw. Every floating tensor of that kind is shifted for one more call and restored.
    """
    state = [t for t in layer.buffers() if t.is_floating_point()]
    state += [p for p in layer.parameters() if not p.requires_grad and p.is_floating_point()]
    if not state:
        return False
    kept = [t.detach().clone() for t in state]
    try:
        with torch.no_grad():
            for t in state:
                t.mul_(1.75).add_(0.25)
            moved = layer.message(**args)
        return not (isinstance(moved, Tensor) and moved.shape == out.shape and torch.equal(moved, out.detach()))
    except Exception:  # noqa: BLE001 - a message that fails on other values of its state: the general plan
        return True
    finally:
        with torch.no_grad():
            for t, k in zip(state, kept):
                t.copy_(k)


def declare(layer: MessagePassing) -> LayerDecl:
    """The layer's declaration, read from its code (cached on the layer)."""
    cached = layer.__dict__.get("_user_decl")
    if cached is not None:
        return cached
    cls = type(layer)
    if cls.aggregate not in AGGREGATES:
        raise TrellisUserError(f"{cls.__name__}.aggregate = {cls.aggregate!r}: the engine aggregates with "
                               f"{', '.join(AGGREGATES)}")
    names = message_args(layer)
    lin = transform_of(layer)
    kind = _probe(layer, names)
    pushdown = kind in ("copy", "weighted") and cls.aggregate in ("sum", "mean")
    in_dim = lin.in_features if lin is not None else int(getattr(layer, "in_dim", 1))
    out_dim = lin.out_features if lin is not None else int(getattr(layer, "out_dim", in_dim))
    decl = LayerDecl(cls.__name__.lower(), in_dim, out_dim, message=kind if pushdown else "custom",
                     message_params=kind == "custom", aggregate=cls.aggregate, transform=lin is not None,
                     root="none", update="none",  # ψ is opaque to the planner: costed as the epilogue
                     edge_dim=1 if "edge_attr" in names else 0,
                     widths_known=lin is not None or hasattr(layer, "in_dim"))
    layer.__dict__["_user_decl"] = decl
    return decl


def weights(layer: MessagePassing, graph: CSRGraph) -> tuple[Tensor | None, Tensor | None]:
    """``(edge weights, self-loop weights)`` from the layer's ``edge_weights`` hook (either may be None)."""
    got = layer.edge_weights(graph)
    if got is None:
        return None, None
    ew, sw = got if isinstance(got, tuple) and len(got) == 2 else (got, None)
    e, n = graph.num_edges, graph.num_dst
    if not isinstance(ew, Tensor) or ew.shape[:1] != (e,) or ew.dim() > 2 or not (
            sw is None or (isinstance(sw, Tensor) and tuple(sw.shape) == (n,))):
        shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (ew, sw) if t is not None]
        raise TrellisUserError(f"{type(layer).__name__}.edge_weights must return weights [E] or (weights [E], "
                               f"self-loop weights [n]) with E = {e}, n = {n} on this graph; got {shapes}")
    return ew, sw


def aggregation(layer: MessagePassing, graph: CSRGraph) -> Aggregation:
    """The pushed-down layer's aggregation on ``graph`` (:class:`trellis.nn.executor.PushdownLayer`)."""
    ew, sw = weights(layer, graph)
    if declare(layer).message == "copy":
        ew = None
    return Aggregation(ew, sw, type(layer).aggregate)


def root_rows(h: Tensor, n: int) -> Tensor:
    """The destinations' own input rows for ``update`` (dense: a user's update reads them as a tensor)."""
    rows = head_rows(h, n)
    return rows.to_dense() if is_sparse(rows) else rows


def finish(layer: MessagePassing, aggr: Tensor, h: Tensor, n: int) -> Tensor:
    """``update(aggr, x)`` with the shape checked (a wrong shape names the layer)."""
    update: Any = layer.update
    reads_x = layer.__dict__.get("_user_update_reads_x")
    if reads_x is None:  # read once per layer, not per call
        reads_x = layer.__dict__["_user_update_reads_x"] = "x" in _params(update)
    out = update(aggr, root_rows(h, n)) if reads_x else update(aggr)
    if not isinstance(out, Tensor) or out.dim() < 1 or out.shape[0] != n:
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise TrellisUserError(f"{type(layer).__name__}.update returned {shape}; expected one row per destination "
                               f"({n} rows)")
    return out


def run_general(layer: MessagePassing, graph: CSRGraph, x: Tensor) -> Tensor:
    """The general plan: per-edge messages, segment-reduced to the destinations, then ``update``."""
    if graph.exchange is not None:
        raise TrellisUserError(f"{type(layer).__name__}: a layer with a parameterized message needs every in-edge of "
                               "a destination on its rank (a destination-owned layout: `trellis partition` with the "
                               "default methods)")
    names = message_args(layer)
    lin = transform_of(layer)
    n = graph.num_dst
    h = linear(x, lin.weight) if lin is not None else (x.to_dense() if is_sparse(x) else x)
    ew, sw = weights(layer, graph)
    args: dict[str, Tensor | None] = {"x_j": h.index_select(0, graph.indices)}
    if "x_i" in names:
        args["x_i"] = h[:n].index_select(0, graph.dst_of_edges())
    if "edge_weight" in names:
        args["edge_weight"] = ew if ew is not None else h.new_ones(graph.num_edges)
    if "edge_attr" in names:
        if graph.edge_feat is None:
            raise TrellisUserError(f"{type(layer).__name__}.message reads edge_attr but the graph has no edge features")
        args["edge_attr"] = graph.edge_feat
    message: Any = layer.message
    msg = message(**args)
    if not isinstance(msg, Tensor) or msg.shape[0] != graph.num_edges:
        shape = tuple(msg.shape) if isinstance(msg, Tensor) else type(msg).__name__
        raise TrellisUserError(f"{type(layer).__name__}.message returned {shape}; expected one row per edge "
                               f"({graph.num_edges} rows)")
    aggr = segment_reduce(graph, msg, type(layer).aggregate)
    if sw is not None:  # the self loop joins after the reduction, as the SpMM's self weight does
        own = h[:n]
        self_args: dict[str, Tensor | None] = {"x_j": own}
        if "x_i" in names:
            self_args["x_i"] = own
        if "edge_weight" in names:
            self_args["edge_weight"] = sw
        if "edge_attr" in names:
            raise TrellisUserError(f"{type(layer).__name__}: self-loop weights and edge_attr together are not "
                                   "supported (a self loop has no edge features)")
        aggr = aggr + message(**self_args)
    return finish(layer, aggr, x, n)
