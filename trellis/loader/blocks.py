"""The batch every strategy hands the model: GraphTheta's GraphView over one subgraph type.

A mini-batch (sampled blocks), a cluster-batch (an induced subgraph, optionally with boundary rows) and
a chunk of layer-wise inference are all the same thing: *target nodes*, a stack of per-layer
:class:`~trellis.ops.graph.CSRGraph` blocks over local ids, and the local -> global id map. Keeping
that one shape (GraphTheta §4.2) is what lets one model implementation run under every strategy.

The blocks are *nested*: the local ids of every block are prefixes of one id list, ``node_ids``.
Block ``l`` (input layer first) has ``num_dst`` destinations that are the first ``num_dst`` of its
``num_src`` sources, and its ``num_dst`` equals the next block's ``num_src``. So the model feeds
``x[node_ids]`` to the first layer, each layer returns one row per destination, and the last layer's
rows are the targets ``node_ids[:num_targets]`` -- no re-indexing between layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from trellis.errors import TrellisUserError
from trellis.ops.graph import CSRGraph


@dataclass(eq=False)
class Batch:
    """One training or inference step's subgraph (the GraphView).

    Attributes:
        blocks: Per-layer blocks, input layer first. ``blocks[l].num_dst == blocks[l + 1].num_src`` and the
            last block's destinations are the targets. A cluster-batch without boundary uses the same
            square graph for every layer.
        node_ids: ``int64 [num_inputs]`` global id of every local input node; ``node_ids[:num_targets]``
            are the targets and every block's local ids index a prefix of it.
        num_targets: Number of target nodes (the last block's ``num_dst``).
        x: Input features of ``node_ids`` (``[num_inputs, F]``), or None before the feature gather.
        y: Labels of the targets (``[num_targets]`` or ``[num_targets, C]``), or None.
        loss_mask: Bool ``[num_targets]``: which targets the loss is taken on (None = all of them). A
            cluster batch holds every node of its clusters but only training nodes carry the loss.
        index: Position of the batch in its epoch.
        seed: The per-batch seed its random choices were drawn from (reproduces the batch).
        stats: Free-form counts (sampled edges per layer, ...) for benchmarks and logs.
        step_end: The last batch of its optimizer step (a partition buffer builds a step that spans two
            buffer states as one batch per state, and the trainer accumulates their gradients).
        step_weight: The batch's share of its step's targets (1 for a whole step).
    """

    blocks: list[CSRGraph]
    node_ids: Tensor
    num_targets: int
    x: Tensor | None = None
    y: Tensor | None = None
    loss_mask: Tensor | None = None
    index: int = 0
    seed: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    step_end: bool = True
    step_weight: float = 1.0
    replay: bool = False

    @property
    def targets(self) -> Tensor:
        """Global ids of the target nodes (``node_ids[:num_targets]``)."""
        return self.node_ids[: self.num_targets]

    @property
    def num_inputs(self) -> int:
        """Number of input nodes whose features the first layer reads."""
        return int(self.node_ids.shape[0])

    @property
    def num_layers(self) -> int:
        """Number of blocks (model layers)."""
        return len(self.blocks)

    @property
    def num_edges(self) -> int:
        """Edges over all blocks (a shared block is counted once per layer that uses it)."""
        return sum(b.num_edges for b in self.blocks)

    @property
    def graph(self) -> CSRGraph | list[CSRGraph]:
        """What ``model(graph, x)`` takes: the single graph when every layer shares it, else the block list."""
        first = self.blocks[0]
        if all(b is first for b in self.blocks):
            return first
        return list(self.blocks)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """A copy with blocks and tensors on ``device`` (shared blocks stay shared)."""
        device = torch.device(device)
        moved: dict[int, CSRGraph] = {}
        blocks = []
        for b in self.blocks:
            if id(b) not in moved:
                moved[id(b)] = b.to(device, non_blocking=non_blocking)  # typed fields (degrees, edge ids) too
            blocks.append(moved[id(b)])

        def mv(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(self, blocks=blocks, node_ids=self.node_ids.to(device, non_blocking=non_blocking),
                       x=mv(self.x), y=mv(self.y), loss_mask=mv(self.loss_mask))


def attach_edge_data(blocks: Sequence[CSRGraph], edge_weight: Tensor | None = None,
                     edge_feat: Tensor | None = None) -> None:
    """Give each block the weights/features of its edges, looked up by ``edge_ids`` (global edge ids).

    Why: per-edge data must follow its edge into every subgraph, or GAT-E and weighted aggregations would
    compute something else on a batch than on the full graph. Shared blocks are filled once.
    """
    if edge_weight is None and edge_feat is None:
        return
    for b in {id(b): b for b in blocks}.values():
        eid = b.edge_ids
        if eid is None:
            raise ValueError("a block without edge_ids cannot be given edge data (the loader sets them)")
        if edge_weight is not None:
            b.edge_weight = edge_weight.index_select(0, eid.to(edge_weight.device))
        if edge_feat is not None:
            b.edge_feat = edge_feat.index_select(0, eid.to(edge_feat.device))


def check_nested(blocks: Sequence[CSRGraph]) -> None:
    """Raise ``ValueError`` unless consecutive blocks chain (``num_dst`` of one is ``num_src`` of the next).

    Why: a block stack that does not chain silently feeds the wrong rows to a layer; this is the cheap
    structural check (O(layers)) run by tests and by loaders in debug paths.
    """
    for i, b in enumerate(blocks):
        if b.num_src < b.num_dst:
            raise ValueError(f"block {i}: num_src {b.num_src} < num_dst {b.num_dst}")
        if i + 1 < len(blocks) and blocks[i + 1].num_src != b.num_dst:
            raise ValueError(f"block {i + 1}: num_src {blocks[i + 1].num_src} != block {i} num_dst {b.num_dst}")


def parse_fanouts(spec: str | Sequence[int], num_layers: int | None = None) -> list[int]:
    """Parse ``"15,10"`` (or a list) into per-layer fanouts, outermost (target) layer first.

    Args:
        spec: Comma-separated integers; ``-1`` takes every neighbour.
        num_layers: When given, the number of fanouts must equal it.

    Raises:
        TrellisUserError: Not integers, a fanout of 0 or below -1, or the wrong count.
    """
    if isinstance(spec, str):
        try:
            fanouts = [int(s) for s in spec.replace(" ", "").split(",") if s != ""]
        except ValueError as exc:
            raise TrellisUserError(f"--fanouts {spec!r}: give comma-separated integers such as 15,10 "
                                   "(-1 = all neighbours)") from exc
    else:
        fanouts = [int(f) for f in spec]
    if not fanouts:
        raise TrellisUserError("--fanouts: give one fanout per layer, e.g. 15,10")
    for f in fanouts:
        if f == 0 or f < -1:
            raise TrellisUserError(f"--fanouts: {f} is not a fanout; use a positive count or -1 for all neighbours")
    if num_layers is not None and len(fanouts) != num_layers:
        raise TrellisUserError(f"--fanouts {','.join(map(str, fanouts))} has {len(fanouts)} value(s) but the model "
                               f"has --layers {num_layers}; give one fanout per layer")
    return fanouts
