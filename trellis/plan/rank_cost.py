"""What a partition-parallel training step should cost on P ranks: Lotan's Eq. 3 plus a bandwidth term.

Lotan (§6, Eq. 3) prices an execution plan over ``P`` partitions on ``M`` machines of ``L`` cores as

    W_P = W / P * max(P / (M L), 1) + f_overhead(P / (M L))

``W`` is the total work (in time), ``W / P`` one partition's share, ``max(P / (M L), 1)`` the rounds a core
runs when there are more partitions than cores, and ``f_overhead`` a cost that grows with ``P``. Its graph
engine runs one thread per partition. This module keeps that shape and names the parts Trellis can measure
(:func:`predict`)::

    compute = max_r f_r * W / s(t) * max(P_m / L, 1)
    comm    = X * (P - 1) * alpha + max_r B_r / beta
              + R * (2 (P - 1) alpha + 2 (P - 1) / P * G / beta)      (zero when P = 1)
    total   = compute + comm

* ``W``: the step's work on one core, ``W = T_ref * s(t_ref)``, from a measured one-process step time
  ``T_ref`` that ran on ``t_ref`` threads;
* ``f_r``: rank ``r``'s share of the work: its part's edges, nodes and halo rows (weighted, see
  :func:`work_shares`) over the whole graph's edges and nodes. Halo rows are work the single process does
  not do (packing, unpacking and summing exchanged rows), so the shares of ``P > 1`` ranks can add up to
  more than 1. The slowest rank sets the pace, since every exchange waits for all ranks: with balanced
  parts and no halo ``max_r f_r = 1 / P`` and the first term is Eq. 3's ``W / P * max(P / (M L), 1)``;
* ``s(t) = 1 + e (t - 1)``: the speedup of a rank on ``t`` intra-op threads, with ``e`` the threads'
  efficiency (0: threads beyond the first add nothing, Lotan's one thread per partition; 1: perfect).
  A rank gets ``t = max(1, L // P_m)`` threads (:func:`trellis.distributed.comm.rank_threads`), ``P_m =
  ceil(P / M)`` ranks per machine; ``max(P_m / L, 1)`` is Eq. 3's rounds when ranks share cores;
* ``B_r``: bytes rank ``r`` sends in a step, ``beta`` the bandwidth of a rank's link (bytes/s) and
  ``alpha`` the latency of one message (s). Each of the step's ``X`` halo exchanges is one all-to-all in
  which a rank sends ``P - 1`` messages; the ``R`` all-reduces of ``G`` bytes (gradients, the loss) are
  rings. These latency terms are Eq. 3's ``f_overhead``: they grow with ``P``.

Assumptions (each one a way the prediction can be wrong): the exchanges are synchronous and nothing
overlaps (so step time is compute plus communication, as in :mod:`trellis.distributed.ownership`); compute is linear
in edges, nodes and halo rows; bytes leave each rank at the full ``beta`` whatever the other ranks send (a switch with
full bisection bandwidth, or loopback); ranks sharing cores are scheduled fairly; memory bandwidth is not
a bottleneck; no part of a step is a fixed cost that does not shrink with a rank's share (Python and
optimizer overheads do not, so small graphs scale worse than predicted).

Pure Python, no torch: the benchmark (:mod:`benchmarks.scaling`) and the docs' extrapolation use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trellis.plan.price import Price, run_value

#: Bytes of one float32 value (the exchanged rows' dtype).
FLOAT_BYTES = 4


@dataclass(frozen=True)
class CostInputs:
    """What :func:`predict` needs: the measured reference, the partition's shape, the network, the cores.

    Attributes:
        ranks: Number of ranks ``P`` (one part each).
        compute_s: Measured step time of the whole graph in one process, without any exchange (seconds).
        compute_threads: Threads (cores) that measurement ran on (default: 1).
        thread_efficiency: ``e`` of a rank's speedup ``1 + e (t - 1)`` on ``t`` threads, in [0, 1]
            (default: 0, one useful thread per rank as in Lotan's Eq. 3).
        work: Each rank's work in any unit, e.g. edges + nodes (+ halo rows) of its part
            (:func:`work_shares`); empty means balanced with no halo (default: empty).
        total_work: The single process's work in the same unit (edges + nodes of the graph); 0 takes
            ``sum(work)``, so only the ratios between the ranks matter (default: 0).
        sent_bytes: Bytes each rank sends per step, one entry per rank; empty means none (default: empty).
        exchanges: Halo exchanges (all-to-alls) per step (default: 0).
        bandwidth: Bytes per second out of one rank (default: 1.25e9, 10 Gb/s).
        latency_s: Seconds per message (default: 5e-5).
        cores: Cores per machine ``L`` (default: 1).
        machines: Machines ``M``; ranks are spread evenly over them (default: 1).
        allreduces: All-reduces per step (gradients, loss) (default: 0).
        allreduce_bytes: Bytes each all-reduce sums, e.g. 4 x parameters for the gradients (default: 0).
        stale: Halo exchanges hidden behind compute (``--staleness 1``): a step takes the larger of compute
            and communication instead of their sum (default: False, the blocking engine).
    """

    ranks: int
    compute_s: float
    compute_threads: int = 1
    thread_efficiency: float = 0.0
    work: Sequence[float] = field(default_factory=tuple)
    total_work: float = 0.0
    sent_bytes: Sequence[float] = field(default_factory=tuple)
    exchanges: int = 0
    bandwidth: float = 1.25e9
    latency_s: float = 5e-5
    cores: int = 1
    machines: int = 1
    allreduces: int = 0
    allreduce_bytes: float = 0.0
    stale: bool = False

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.cores < 1 or self.machines < 1 or self.compute_threads < 1:
            raise ValueError("ranks, cores, machines and compute_threads must be at least 1")
        if self.compute_s < 0 or self.latency_s < 0 or self.exchanges < 0 or self.allreduces < 0:
            raise ValueError("compute_s, latency_s, exchanges and allreduces must be non-negative")
        if self.allreduce_bytes < 0 or self.total_work < 0:
            raise ValueError("allreduce_bytes and total_work must be non-negative")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be positive (got {self.bandwidth})")
        if not 0.0 <= self.thread_efficiency <= 1.0:
            raise ValueError(f"thread_efficiency must lie in [0, 1] (got {self.thread_efficiency})")
        for name in ("work", "sent_bytes"):
            values = getattr(self, name)
            if values and len(values) != self.ranks:
                raise ValueError(f"{name} has {len(values)} entries for {self.ranks} ranks")
            if any(v < 0 for v in values):
                raise ValueError(f"{name} must be non-negative")
        if self.work and sum(self.work) <= 0:
            raise ValueError("work must not be all zero")


@dataclass(frozen=True)
class CostBreakdown:
    """A predicted step, in seconds, with the figures it came from.

    Attributes:
        compute_s: The slowest rank's compute.
        comm_s: Latency plus bandwidth of the exchanges and all-reduces.
        latency_s: The part of ``comm_s`` that is per-message latency.
        bandwidth_s: The part of ``comm_s`` that is bytes over bandwidth.
        total_s: ``compute_s + comm_s``.
        serial_work_s: ``W``, the step on one core.
        max_share: The largest rank's share of the work (``1 / P`` when balanced, without halo).
        threads_per_rank: Intra-op threads a rank gets.
        rounds: How many ranks share one core (at least 1).
    """

    compute_s: float
    comm_s: float
    latency_s: float
    bandwidth_s: float
    total_s: float
    serial_work_s: float
    max_share: float
    threads_per_rank: int
    rounds: float

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready."""
        return asdict(self)


def speedup(threads: int, efficiency: float) -> float:
    """Speedup of one process on ``threads`` intra-op threads: ``1 + efficiency * (threads - 1)``."""
    return 1.0 + efficiency * (max(1, threads) - 1)


def thread_efficiency(one_core_s: float, many_s: float, threads: int) -> float:
    """``e`` from one step time on one core and one on ``threads`` cores, clipped to [0, 1]."""
    if threads <= 1 or many_s <= 0:
        return 0.0
    return min(1.0, max(0.0, (one_core_s / many_s - 1.0) / (threads - 1)))


def predict(inp: CostInputs) -> CostBreakdown:
    """The predicted step time of ``inp.ranks`` ranks (module docstring for the formula)."""
    p = inp.ranks
    per_machine = math.ceil(p / inp.machines)
    threads = max(1, inp.cores // per_machine)
    rounds = max(per_machine / inp.cores, 1.0)
    serial = inp.compute_s * speedup(inp.compute_threads, inp.thread_efficiency)
    share = max(inp.work) / (inp.total_work or sum(inp.work)) if inp.work else 1.0 / p
    compute = share * serial / speedup(threads, inp.thread_efficiency) * rounds
    if p == 1:
        lat = bw = 0.0
    else:
        lat = inp.exchanges * (p - 1) * inp.latency_s + inp.allreduces * 2 * (p - 1) * inp.latency_s
        most = max(inp.sent_bytes) if inp.sent_bytes else 0.0
        bw = (most + inp.allreduces * 2 * (p - 1) / p * inp.allreduce_bytes) / inp.bandwidth
    total = max(compute, lat + bw) if inp.stale else compute + lat + bw
    return CostBreakdown(compute, lat + bw, lat, bw, total, serial, share, threads, rounds)


def priced(b: CostBreakdown, inp: CostInputs, price: Price, gib_per_machine: float = 0.0) -> dict[str, Any]:
    """Cost per step and Dorylus's value of a prediction, its ``inp.machines`` machines priced by ``price``."""
    hourly = price.machine_hourly(inp.cores, gib_per_machine)
    return run_value(b.total_s, [hourly] * inp.machines)


def work_shares(part_edges: Sequence[int], part_nodes: Sequence[int], part_halo: Sequence[int] = (), *,
                node_weight: float = 1.0, halo_weight: float = 0.0) -> list[float]:
    """Each part's work, ``edges + node_weight * nodes + halo_weight * halo``, from a layout's per-part counts.

    Args:
        part_edges: Edges each part holds (``quality["part_edges"]`` or ``parts[i]["num_edges"]``).
        part_nodes: Nodes each part owns (``quality["part_nodes"]`` or ``parts[i]["num_local"]``).
        part_halo: Halo nodes of each part (``quality["part_halo"]``); empty counts none (default: empty).
        node_weight: Cost of a node's dense work relative to an edge's aggregation (default: 1).
        halo_weight: Cost of a halo row (packed, sent, unpacked, its gradient summed) relative to an edge
            (default: 0).
    """
    if len(part_edges) != len(part_nodes) or (part_halo and len(part_halo) != len(part_edges)):
        raise ValueError("part_edges, part_nodes and part_halo differ in length")
    halo = list(part_halo) or [0] * len(part_edges)
    return [float(e) + node_weight * float(n) + halo_weight * float(h)
            for e, n, h in zip(part_edges, part_nodes, halo)]


def halo_sent_bytes(part_halo: Sequence[int], row_floats: float) -> list[float]:
    """Bytes each rank sends per step when each halo row costs ``row_floats`` floats per step.

    ``row_floats`` is the sum of the widths of the step's exchanges: under pull, every layer fetches its
    halo rows at the width the planner aggregates at and, when that tensor needs a gradient, sends the
    gradient back at the same width (:func:`exchange_row_floats` reads it off a measured run). A rank
    receives its halo rows forward and sends their gradients back; what it sends forward is its own rows
    that other parts hold, whose total over the ranks equals the total halo. Taking a rank's own halo
    count for both is exact in total and close per rank for balanced parts.
    """
    return [float(h) * row_floats * FLOAT_BYTES for h in part_halo]


def exchange_row_floats(step_bytes: float, total_halo: int) -> float:
    """Floats per halo row per step: a measured step's bytes (all ranks) over ``4 x`` the layout's halo rows.

    The exchange widths are the model's and the planner's, not the partition's, so one multi-rank run gives
    them for every P and every layout of the same model (the partition report's exchange estimate is the
    same bytes per layer at its ``width``).
    """
    return float(step_bytes) / (FLOAT_BYTES * total_halo) if total_halo else 0.0
