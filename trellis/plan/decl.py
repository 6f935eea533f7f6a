"""How a layer declares itself to the planner: message, aggregate, update, and which carry parameters.

Why declarations instead of code the planner must read: the planner can only move an op it understands.
A layer that says "my message is a copy of the source row scaled by a fixed edge weight, my aggregate is a
sum, my transform is one linear map" lets the planner fuse message+aggregate into one SpMM and place the
linear map on whichever side of the SpMM is narrower (Lotan §4.2). A layer whose message carries
parameters gets the general plan: gather per-edge rows, apply the message, reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

MESSAGES = ("copy", "weighted", "attention", "edge_attention", "custom")
AGGREGATES = ("sum", "mean", "max")
ROOTS = ("none", "self_loop", "linear", "eps")
UPDATES = ("none", "mlp")


@dataclass(frozen=True)
class LayerDecl:
    """A layer in message / aggregate / update form.

    Attributes:
        name: Display name.
        in_dim: Input width.
        out_dim: Output width (all heads together).
        heads: Attention heads (1 otherwise).
        message: ``copy`` (source row), ``weighted`` (source row times a fixed, unparameterized edge weight),
            ``attention`` (weights from learned attention), ``edge_attention`` (attention and message use edge
            features), ``custom`` (a parameterized per-edge function).
        message_params: The message function itself has trainable parameters.
        aggregate: ``sum``, ``mean`` or ``max``.
        transform: A linear map applies to every neighbor's message (and to the root term); it commutes with
            a linear aggregate, so the planner may run it before or after the aggregation.
        root: How the node's own row enters: ``none``, ``self_loop`` (folded into the SpMM as a diagonal),
            ``linear`` (a separate root transform, GraphSAGE), ``eps`` (``(1 + eps) x_i``, GIN).
        update: ``mlp`` when a parameterized update follows the aggregation (GIN), else ``none``.
        edge_dim: Width of edge features the layer reads (0 = none).
        widths_known: The layer states its widths (a transform, or ``in_dim``/``out_dim``); a user layer with
            neither is priced at width 1, and its plan says so.
    """

    name: str
    in_dim: int
    out_dim: int
    heads: int = 1
    message: str = "copy"
    message_params: bool = False
    aggregate: str = "sum"
    transform: bool = True
    root: str = "none"
    update: str = "none"
    edge_dim: int = 0
    widths_known: bool = True

    def __post_init__(self) -> None:
        for value, allowed, what in ((self.message, MESSAGES, "message"), (self.aggregate, AGGREGATES, "aggregate"),
                                     (self.root, ROOTS, "root"), (self.update, UPDATES, "update")):
            if value not in allowed:
                raise ValueError(f"{self.name}: {what} {value!r} is not one of {allowed}")

    @property
    def unparameterized_message(self) -> bool:
        """Message and aggregate can be pushed down into the graph engine."""
        return self.message in ("copy", "weighted") and not self.message_params
