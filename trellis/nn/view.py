"""The graph view: where a layer's input rows come from.

A model runs layer after layer; layer ``i`` reads one row per *source* node of its graph
(``graph.num_src`` rows) and writes one row per destination (``graph.num_dst``). On a whole graph or a
sampled block the previous layer already produced every source row (destinations first, then the rest, as
blocks order them), so the view is the identity. Elsewhere it is not:

* distributed training (a partition with halo nodes): a rank owns its destinations' rows; the view appends
  the halo rows received from the peers that own them, so it returns ``graph.num_src`` rows from the
  ``graph.num_dst`` owned rows it was given (local rows first, then halo rows, in the graph's local source
  order);
* out-of-core training: the view reads the tile of rows a layer needs from a spill file.

The models (:class:`trellis.nn.models.GNN`, the GAT stacks, :class:`trellis.nn.batched.BatchedGNN`) ask the
view right before each layer, after that layer's input dropout, so a node's row is dropped once, by whoever
produces it, and every consumer reads the same values.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from trellis.ops.graph import CSRGraph


@runtime_checkable
class GraphView(Protocol):
    """Supplies each layer's input rows (see the module docstring)."""

    def layer_input(self, layer: int, graph: CSRGraph, x: Tensor) -> Tensor:
        """The rows layer ``layer`` reads on ``graph``, given the rows ``x`` this process holds.

        Args:
            layer: Index of the layer about to run (0 = the first).
            graph: The graph that layer runs on (its sources are the rows to return).
            x: The rows held locally: the layer's input after dropout.

        Returns:
            ``[graph.num_src, ...]`` rows in the graph's local source order. The gradient flows back through
            whatever the view did (an exchange's backward sends halo gradients to their owners).
        """
        ...


class IdentityView:
    """The view of a whole graph or a sampled block: the rows held are the rows the layer reads."""

    def layer_input(self, layer: int, graph: CSRGraph, x: Tensor) -> Tensor:
        """Return ``x`` itself (no copy, so caches keyed on the tensor keep working)."""
        return x


#: The default view.
IDENTITY = IdentityView()
