"""The memory plan of out-of-core full-batch training: what is resident, spilled or recomputed, and tile sizes.

Lotan spills because its graph engine runs out of memory; its planner never sees the spills (§6). Here the
budget is an input of the plan: given the process's own baseline (the interpreter, torch and the compiled
kernels, measured at start), the ``O(N)`` vectors that stay resident (degrees, labels, split ids), the
parameters with their gradients and optimizer state, the plan sizes the row tiles so that the largest
pass's tile — its inputs, outputs, autograd intermediates and one coefficient per edge — fits in what is
left. Every ``[N, d]`` tensor of the model (layer inputs and outputs, aggregations, their gradients) is
spilled to a memory-mapped file; per-tile intermediates of the dense epilogue are recomputed in backward
instead of stored. The per-layer order (aggregate or transform first) is the in-memory plan's, so the
arithmetic is the same and only where the rows live changes.

The storage term: bytes written and read per epoch, and the time they cost at the storage's measured
sequential read rate when they do not stay in the page cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trellis.utils.sizes import format_size

#: Bytes per float32 element.
F32 = 4
#: Bytes per edge a tile allocates (one float32 coefficient; the CSR itself is a memory map).
EDGE_BYTES = 8.0
#: Fixed head-room for allocator slack and small temporaries, plus a fraction of the budget.
MARGIN_BYTES = 48 * 2**20
MARGIN_FRACTION = 0.05
#: Float32-sized words a tile holds per stored value of sparse input rows: its column id (two) and value, the
#: dropped-out value, and the transposed structure the first weight's gradient is summed over (four), doubled
#: for the allocator as the dense rows' figures are.
SPARSE_VALUE_FLOATS = 14


def sparse_row_floats(density: float, width: int) -> float:
    """Float32 words a tile holds per row of sparse input rows with ``density`` non-zeros of ``width`` columns."""
    return SPARSE_VALUE_FLOATS * density * width + 2  # and the row's int64 offset


@dataclass(frozen=True)
class LayerShape:
    """One layer as the memory plan sees it.

    Attributes:
        w_in: Input width.
        w_out: Output width.
        aggregate_first: The training plan's order (the aggregation reads ``w_in`` columns, else ``w_out``).
        root: The epilogue reads the layer's input rows (SAGE's ``W_r x_i``, GIN's ``(1 + eps) x_i``).
        sparse_in: Float32 words per input row when the input is sparse rows (:func:`sparse_row_floats`; the
            first layer of a bag-of-words graph, transformed first); 0: dense rows of ``w_in`` values.
    """

    w_in: int
    w_out: int
    aggregate_first: bool
    root: bool
    sparse_in: float = 0.0

    @property
    def in_row(self) -> float:
        """Float32 words of one input row in a tile (``w_in`` dense)."""
        return self.sparse_in or self.w_in

    @property
    def w_agg(self) -> int:
        """Width of the aggregated tensor."""
        return self.w_in if self.aggregate_first else self.w_out

    @property
    def row_floats(self) -> int:
        """Float32 values per tile row in this layer's busiest pass (forward, dense backward, source backward).

        Dense backward holds the leaves (aggregation, input rows, pre-transformed rows; views of the spill
        maps, so only their gradients are allocated), the epilogue's saved intermediates and their
        gradients (about four output-wide rows) and the input gradient. Calibrated on 1M and 2M nodes
        (GCN, hidden 256): the measured peaks stayed below half of the plan's tile allowance with twice
        these figures.
        """
        leaves = self.w_agg + (self.in_row if self.root else 0) + (self.w_out if self.root else 0)
        return int(2 * leaves + 4 * self.w_out + self.in_row)

    @property
    def input_width(self) -> int:
        """Columns of the first layer's input array (the features): one array, however many read it."""
        return self.w_in

    @property
    def reads_whole_input(self) -> bool:
        """Whether the layer's input is read whole, not only tile by tile (it aggregates it).

        A first layer's dropped-out input must then be spilled rather than recomputed per tile.
        """
        return self.aggregate_first


@dataclass(frozen=True)
class JointShape(LayerShape):
    """One layer of K configurations trained in shared passes (:func:`joint_shape`)."""

    agg: int = 0
    busiest: int = 0
    any_aggregate_first: bool = False
    #: The first layer's: the features' width, read by every configuration from one array (0: not first).
    features: int = 0

    @property
    def input_width(self) -> int:
        """The features' width in the first layer (shared, not side by side), else the inputs' side by side."""
        return self.features or self.w_in

    @property
    def reads_whole_input(self) -> bool:
        """Whether some configuration aggregates its input (its dropped-out features then sit in a spill)."""
        return self.any_aggregate_first

    @property
    def w_agg(self) -> int:
        """Width of the configurations' aggregations side by side."""
        return self.agg

    @property
    def row_floats(self) -> int:
        """Float32 values per tile row in the busiest shared pass (see :func:`joint_shape`)."""
        return self.busiest


def joint_shape(group: Sequence[LayerShape], first: bool) -> JointShape:
    """One layer of K configurations trained in shared passes, as the memory plan sees it.

    Their spills sit side by side, so widths add. A tile's memory does not add up K solo tiles: the passes
    hold the configurations' aggregation rows and their queued output rows side by side (each written once
    per tile, through one concatenation), while each configuration's own dense work -- its input rows, its
    epilogue's intermediates and their gradients, a solo tile's row -- runs one configuration at a time.
    The first layer also keeps the feature tile and one dropped-out copy of it, shared by the
    configurations that draw the same mask.
    """
    shared = 2 * sum(s.w_agg + s.w_out for s in group)
    busiest = int(max(s.row_floats for s in group) + shared + (max(s.in_row for s in group) if first else 0))
    return JointShape(sum(s.w_in for s in group), sum(s.w_out for s in group),
                      all(s.aggregate_first for s in group), any(s.root for s in group),
                      agg=sum(s.w_agg for s in group), busiest=busiest,
                      any_aggregate_first=any(s.aggregate_first for s in group),
                      features=max(s.w_in for s in group) if first else 0)


@dataclass(frozen=True)
class Placement:
    """Where one tensor lives: ``resident`` (RAM), ``spilled`` (file), ``recomputed`` (per tile, in backward)."""

    name: str
    shape: tuple[int, int]
    where: str
    note: str = ""
    #: Bytes when not ``shape``'s float32 values (sparse rows: their CSR arrays).
    size: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.size or self.shape[0] * self.shape[1] * F32


@dataclass(frozen=True)
class OutOfCorePlan:
    """The plan (see the module docstring); sizes in bytes."""

    budget: int
    baseline: int
    resident: int
    margin: int
    row_bytes: float
    edge_bytes: float
    min_budget: int
    placements: tuple[Placement, ...]
    spill_bytes: int
    written_per_epoch: int
    read_per_epoch: int

    @property
    def tile_bytes(self) -> int:
        """What one tile may allocate."""
        return max(0, self.budget - self.baseline - self.resident - self.margin)

    def format(self, tiles: int, rows: tuple[int, int], edges: int, bandwidth: float | None = None,
               traffic: bool = True) -> str:
        """The plan as ``--explain`` prints it (``traffic``: with the per-epoch spill traffic line)."""
        mib = 2.0**20
        lines = [
            f"out-of-core plan: budget {self.budget / mib:.0f} MiB = baseline {self.baseline / mib:.0f} "
            f"+ resident {self.resident / mib:.0f} + margin {self.margin / mib:.0f} + tile {self.tile_bytes / mib:.0f}"
            f" MiB (smallest budget that runs: {self.min_budget / mib:.0f} MiB)",
            f"tiles: {tiles} row tiles of {rows[0]}..{rows[1]} rows (largest {edges} edges); "
            f"{self.row_bytes:.0f} B per row, {self.edge_bytes:.0f} B per edge",
            "tensors:",
        ]
        for p in self.placements:
            note = f"  ({p.note})" if p.note else ""
            lines.append(f"  {p.name:<14} [{p.shape[0]} x {p.shape[1]}]  {p.where:<10} "
                         f"{p.nbytes / mib:>9.1f} MiB{note}")
        if not traffic:
            return "\n".join(lines)
        io = (f"per epoch: spill writes {format_size(self.written_per_epoch, digits=1)}, reads "
              f"{format_size(self.read_per_epoch, digits=1)} (peak disk {self.spill_bytes / mib:.0f} MiB)")
        if bandwidth:
            io += (f"; {self.read_per_epoch / bandwidth:.1f} s of reads at the storage's "
                   f"{bandwidth / mib:.0f} MiB/s when the page cache does not hold them")
        lines.append(io)
        return "\n".join(lines)


def plan_out_of_core(*, num_nodes: int, max_degree: int, layers: Sequence[LayerShape], params: int,
                     budget: int, baseline: int, resident_vectors: int, input_spilled: bool,
                     dropout: bool, recompute_dropout: bool = True, sparse_input_bytes: int = 0) -> OutOfCorePlan:
    """Size the tiles of a model under ``budget`` (see the module docstring).

    Args:
        num_nodes: Rows of every ``[N, d]`` tensor.
        max_degree: Largest in- or out-degree (a one-row tile must hold that many coefficients).
        layers: The model's layers in order.
        params: Number of parameters (resident with gradient and two optimizer moments).
        budget: The cap on peak ``RssAnon``.
        baseline: The process's ``RssAnon`` before loading (interpreter, torch, kernels).
        resident_vectors: Bytes of the ``O(N)`` vectors kept in RAM (degrees, labels, splits, gathered logits).
        input_spilled: The first layer's input is a spill (normalized features) rather than the store's map.
        dropout: The first layer's input is dropped out during training.
        recompute_dropout: A first layer that transforms first recomputes its dropped-out input per tile
            (one process); False: it is spilled every epoch (a rank, whose halo rows come from other ranks).
        sparse_input_bytes: The input is spilled as sparse rows of this many bytes (0: dense rows).
    """
    n = num_nodes
    row_bytes = float(max(layer.row_floats for layer in layers) * F32)
    resident = resident_vectors + 4 * params * F32
    margin = MARGIN_BYTES + int(MARGIN_FRACTION * budget)
    one_row = row_bytes + max_degree * EDGE_BYTES
    min_budget = int(baseline + resident + MARGIN_BYTES + one_row) + 1
    min_budget = int(min_budget / (1 - MARGIN_FRACTION)) + 1
    placements: list[Placement] = []
    if sparse_input_bytes:
        placements.append(Placement("x", (n, layers[0].input_width), "spilled",
                                    "normalized features as sparse rows (CSR), written once", size=sparse_input_bytes))
    elif input_spilled:
        placements.append(Placement("x", (n, layers[0].input_width), "spilled", "normalized features, written once"))
    if dropout and (layers[0].reads_whole_input or not recompute_dropout):
        placements.append(Placement("h0", (n, layers[0].w_in), "spilled", "dropped-out input, every epoch"))
    elif dropout:  # transform first: only tiles of it are read, each recomputed from its counter-based mask
        placements.append(Placement("h0", (n, layers[0].input_width), "recomputed", "dropped-out input, per tile"))
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        if not layer.aggregate_first:
            placements.append(Placement(f"z{i}", (n, layer.w_out), "spilled", "transformed input (transform first)"))
        if i == 0 and layer.aggregate_first and not dropout:  # a constant input's aggregation: made once
            placements.append(Placement("a0c", (n, layer.w_agg), "spilled",
                                        "aggregation of the constant input, written in the first epoch"))
        else:
            placements.append(Placement(f"a{i}", (n, layer.w_agg), "spilled", "aggregation, read by backward"))
        if not last:
            placements.append(Placement(f"h{i + 1}", (n, layer.w_out), "spilled", "layer output after ReLU/dropout"))
        placements.append(Placement(f"epilogue{i}", (n, layer.w_out), "recomputed", "per tile in backward"))
    if dropout and layers[0].aggregate_first:  # evaluation aggregates the undropped features once, kept after
        placements.append(Placement("a0c", (n, layers[0].w_agg), "spilled",
                                    "first aggregation of the undropped input, for evaluation (written once)"))
    fwd = [p for p in placements if p.where == "spilled"]
    # the normalized features and the cached first aggregation are written once
    per_epoch = sum(p.nbytes for p in fwd if p.name not in ("x", "a0c"))
    grads = [Placement("grad out", (n, layers[-1].w_out), "spilled", "the logits' loss gradient")]
    for i, layer in reversed(list(enumerate(layers))):
        if i > 0 or not layer.aggregate_first:  # the features need no gradient: a first aggregation neither
            grads.append(Placement(f"grad a{i}", (n, layer.w_agg), "spilled", "aggregation gradient"))
        if i > 0:
            grads.append(Placement(f"grad h{i}", (n, layer.w_in), "spilled", "layer input gradient"))
    placements.extend(grads)
    grad_bytes = sum(p.nbytes for p in grads)
    written, read = per_epoch + grad_bytes, per_epoch + 2 * grad_bytes
    peak_disk = sum(p.nbytes for p in fwd) + grad_bytes  # gradient spills keep their files across epochs
    return OutOfCorePlan(budget=budget, baseline=baseline, resident=resident, margin=margin, row_bytes=row_bytes,
                         edge_bytes=EDGE_BYTES, min_budget=min_budget, placements=tuple(placements),
                         spill_bytes=int(peak_disk), written_per_epoch=int(written), read_per_epoch=int(read))


def in_memory_estimate(num_nodes: int, num_edges: int, widths: Sequence[int], edge_floats: int = 0) -> int:
    """About the peak ``RssAnon`` of an in-memory full-batch step (bytes), for refusals and warnings.

    The features and the CSR with its reverse and permutation, plus about three ``[N, width]`` tensors per
    layer kept for backward (input after dropout, aggregation, output), plus ``edge_floats`` float32 values
    per edge (attention's logits, coefficients and their saved copies); measured 7.9 GB against 7.5 GB
    estimated on 1M nodes / 10M edges / 256 features, GCN hidden 256.
    """
    base = 200 * 2**20  # interpreter, torch, kernels
    resident = 4 * num_nodes * widths[0] + 8 * (3 * num_edges + 2 * num_nodes)
    acts = sum(3 * 4 * num_nodes * max(a, b) for a, b in zip(widths[:-1], widths[1:]))
    return int(base + resident + acts + 4 * num_edges * edge_floats)
