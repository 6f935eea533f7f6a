"""Where a run's rows live, and how many partitions a partition buffer holds under a memory budget.

Why a plan: mini-batch training beyond memory has one knob that matters -- how much of the graph is
resident -- and the budget has to pay for everything else first: the process itself, the ``O(N)`` vectors
(labels, degrees, the node -> part and node -> buffer-row maps, the state's sampling CSR), the model with its
optimizer state, and the batches in flight. What is left buys ``K + 1`` part slots (``K`` resident, one being
read) and, after them, a cache of the rows most likely to be sampled. The plan prints as one residency table
(``--explain``) so a user sees why K is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis.errors import BudgetTooSmall, TrellisUserError
from trellis.utils.sizes import format_budget, format_size

#: Bytes of ``O(N)`` state the buffer keeps per node (maps, degrees, labels, masks, two state CSRs' row
#: pointers and the sampler's scratch map).
NODE_BYTES = 80
#: Fixed head-room for the allocator and small temporaries.
MARGIN_BYTES = 64 * 2**20
#: Working memory of one chunk of evaluation over the buffer (``loader.buffer_inference.chunk_cuts``).
EVAL_CHUNK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class BufferCosts:
    """What the buffer's plan needs to know about a layout, a model and the batches.

    Attributes:
        num_nodes: ``N``.
        num_parts: ``P``.
        part_rows: Rows of the largest part.
        part_edges: In-edges of the largest part.
        row_bytes: Bytes of one feature row.
        model_bytes: Parameters, gradients and optimizer state.
        batch_bytes: Feature rows and activations of the batches in flight.
        baseline: The process's ``RssAnon`` before any of it (interpreter, torch, compiled kernels).
        batch_bytes_per_slot: What a batch costs per resident part (cluster-batches hold every resident row).
        eval_bytes: What scoring holds at its peak: the scored rows' logits, one split's copy of them and the
            metrics' per-row temporaries (on a graph of 24M nodes, 16 classes: about 3 GiB).
    """

    num_nodes: int
    num_parts: int
    part_rows: int
    part_edges: int
    row_bytes: int
    model_bytes: int
    batch_bytes: int
    baseline: int
    batch_bytes_per_slot: int = 0
    eval_bytes: int = 0

    @property
    def slot_bytes(self) -> int:
        """One part slot: its rows, its in-edges (source and edge id) and their share of the state CSR."""
        return (self.part_rows * self.row_bytes + self.part_edges * 32 + self.part_rows * 16
                + self.batch_bytes_per_slot)

    @property
    def fixed_bytes(self) -> int:
        """Everything but the slots and the cache."""
        return (self.baseline + self.num_nodes * NODE_BYTES + self.model_bytes + self.batch_bytes + self.eval_bytes
                + MARGIN_BYTES)

    def cache_row_bytes(self, avg_degree: float) -> int:
        """One cached row: its features and its in-edges."""
        return int(self.row_bytes + avg_degree * 32 + 16)


@dataclass(frozen=True)
class BufferPlan:
    """The buffer's residency: ``capacity`` parts resident (plus one being read) and ``cache_rows`` cached rows."""

    capacity: int
    cache_rows: int
    budget: int | None
    costs: BufferCosts

    def table(self) -> str:
        """The residency table ``--explain`` prints."""
        c = self.costs
        slots = min(self.capacity + 1, c.num_parts)
        rows = [("process baseline", c.baseline), (f"O(N) maps and vectors ({c.num_nodes:,} nodes)",
                                                   c.num_nodes * NODE_BYTES),
                ("model + optimizer", c.model_bytes), ("batches in flight", c.batch_bytes),
                ("evaluation (a chunk's rows; scored rows' logits, a split's copy, metrics)", c.eval_bytes),
                (f"part slots: {self.capacity} resident + {slots - self.capacity} reading "
                 f"(of {c.num_parts} parts)", slots * c.slot_bytes),
                (f"cache ({self.cache_rows:,} rows by inclusion probability)", self.cache_rows * c.row_bytes),
                ("head-room (the allocator, small temporaries)", MARGIN_BYTES)]
        width = max(len(r[0]) for r in rows)
        lines = ["residency (partition buffer):"]
        lines += [f"  {name:<{width}}  {format_size(b):>10}" for name, b in rows]
        total = sum(b for _, b in rows)
        lines.append(f"  {'total':<{width}}  {format_size(total):>10}"
                     + ("" if self.budget is None else f"  of --memory-budget {format_budget(self.budget)}"))
        return "\n".join(lines)


def plan_buffer(costs: BufferCosts, budget: int | None, *, buffer_parts: int | None = None,
                cache_bytes: int | None = None, avg_degree: float = 10.0) -> BufferPlan:
    """How many parts stay resident and how many rows are cached.

    Args:
        costs: The layout's, model's and batches' sizes.
        budget: ``--memory-budget`` in bytes (None: every part resident unless ``buffer_parts`` says otherwise).
        buffer_parts: ``--buffer-parts`` (None: as many as fit).
        cache_bytes: ``--buffer-cache`` in bytes (None: what the budget leaves after the slots; 0: no cache).
        avg_degree: In-edges per cached row (their adjacency is cached with them).

    Raises:
        TrellisUserError: The budget does not hold one part and the rest (naming the smallest that does), or
            ``--buffer-parts`` does not fit it.
    """
    p = costs.num_parts
    if buffer_parts is not None and not 1 <= buffer_parts <= p:
        raise TrellisUserError(f"--buffer-parts {buffer_parts}: give 1 to {p} (the layout has {p} parts)")
    if budget is None:
        k = p if buffer_parts is None else buffer_parts
        rows = 0 if not cache_bytes else cache_bytes // costs.cache_row_bytes(avg_degree)
        return BufferPlan(k, int(min(rows, costs.num_nodes)), None, costs)
    smallest = costs.fixed_bytes + min(2, p) * costs.slot_bytes
    if budget < smallest:
        raise BudgetTooSmall(f"--memory-budget {format_budget(budget)} holds less than one partition and the rest of "
                             f"the run (the largest part needs {format_size(costs.slot_bytes)} per slot, two slots, "
                             f"plus {format_size(costs.fixed_bytes)}); the smallest budget that works is "
                             f"{format_size(smallest)} (--memory-budget {-(-smallest // 2**20)}MiB) -- or partition "
                             "into more parts", smallest)
    free = budget - costs.fixed_bytes
    fit = min(p, int(free // costs.slot_bytes) - 1) if p > 1 else 1
    if buffer_parts is not None:
        need = costs.fixed_bytes + min(buffer_parts + 1, p) * costs.slot_bytes
        if need > budget:
            raise BudgetTooSmall(f"--buffer-parts {buffer_parts} needs {format_size(need)} but --memory-budget is "
                                 f"{format_budget(budget)}; use --buffer-parts {max(1, fit)} or a larger budget", need)
        k = buffer_parts
    else:
        k = max(1, fit)
    left = free - min(k + 1, p) * costs.slot_bytes
    if cache_bytes is not None:
        if cache_bytes > left:
            raise TrellisUserError(f"--buffer-cache {format_budget(cache_bytes)} does not fit: --memory-budget "
                                   f"{format_budget(budget)} leaves {format_size(max(0, left))} after {k} part(s)")
        left = cache_bytes
    rows = 0 if k >= p else max(0, left) // costs.cache_row_bytes(avg_degree)
    return BufferPlan(k, int(min(rows, costs.num_nodes)), budget, costs)


#: ``--feature-residency auto`` puts the rows on a GPU when its free memory holds this many times them (the rest
#: pays for the model, the batches' activations and the allocator's slack).
DEVICE_ROWS_SHARE = 4


def feature_residency(choice: str, rows_bytes: int, device_type: str, free_bytes: int | None) -> str:
    """Where a batch strategy's input rows live: ``host`` or ``device`` (``--feature-residency``).

    Why a device copy: with the rows on the CPU every batch gathers them there and copies them over (77 MB per
    batch of 1024 targets at fanouts 15,10 and 128 features); sampler processes then spend most of their time
    gathering, and the consumer copying. With them on the GPU a batch carries its node ids and the gather runs
    at the GPU's memory bandwidth. ``device`` on the CPU holds the rows in the trainer's memory (the trainer
    gathers; sampler processes only sample).

    Args:
        choice: ``host``, ``device`` or ``auto``.
        rows_bytes: Bytes of the dense rows (``N x F x 4``).
        device_type: The training device's type (``cpu``, ``cuda``).
        free_bytes: The device's free memory (None: unknown, e.g. the CPU).
    """
    if choice == "host" or (choice == "auto" and device_type == "cpu"):
        return "host"
    fits = free_bytes is None or rows_bytes * (DEVICE_ROWS_SHARE if choice == "auto" else 1) <= free_bytes
    if choice == "auto":
        return "device" if fits else "host"
    if not fits:
        raise TrellisUserError(f"--feature-residency device: the input rows take {format_size(rows_bytes)} and the "
                               f"{device_type} device has {format_size(free_bytes or 0)} free; use "
                               "--feature-residency host (the rows stay on the CPU)")
    return "device"


__all__ = ["BufferCosts", "BufferPlan", "DEVICE_ROWS_SHARE", "NODE_BYTES", "feature_residency", "plan_buffer"]
