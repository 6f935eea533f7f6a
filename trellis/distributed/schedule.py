"""Schedules of a pull exchange: blocking, overlapped, and bounded-stale (Dorylus, PipeGCN) — policies, not engines.

A pull rank's aggregation of layer ``l`` reads its owned rows (interior edges: local sources) and its halo
rows (boundary edges: sources owned by peers). The blocking schedule fetches the halo rows, then runs one
SpMM. The two others split the rank's pull graph once, at build time, into an interior CSR over the ``L``
owned rows and a boundary CSR over the ``H`` halo rows (:class:`PullSplit`), and differ only in *which*
halo rows the boundary SpMM reads and *when* the rank waits for them:

* **overlap** (``--overlap``): the fetch starts asynchronously, the interior SpMM runs while the rows travel,
  then the boundary SpMM adds the arrived rows. Backward mirrors it: the halo rows' gradients are computed
  first and sent to their owners while the interior gradient is computed. Exact (the same sums, added in
  two parts: equal to the blocking schedule to float rounding).
* **stale** (``--staleness S``, ``S >= 1``): the fetch this epoch starts, and the boundary SpMM reads the rows
  fetched ``S`` epochs ago (fewer in the first ``S`` epochs: the oldest there is, fresh at epoch 0); the
  halo gradients sent this epoch are added at their owners ``S`` epochs later. The age of what each
  aggregation used is recorded per aggregation (``staleness_a<i>`` in ``metrics.jsonl``) and never exceeds
  ``S``. The buffers of rows and gradients in flight are state (:meth:`StaleBuffers.state_dict`), saved
  in the checkpoint, so ``--resume`` continues exactly.

Evaluation (no gradient) always runs the blocking schedule: metrics are the exact model's. Aggregations
whose edge or self weights are trained, and ``max``, run blocking too (a split max needs the argmax edge).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

from trellis.distributed.halo import Pending, Route, Traffic
from trellis.ops.graph import CSRGraph
from trellis.ops.spmm import prim_spmm_sum

#: Names of the schedules (``blocking`` is the exact engine).
SCHEDULES = ("blocking", "overlap", "stale")


class PullSplit:
    """A pull graph's edges split into interior (owned sources) and boundary (halo sources) CSRs.

    Args:
        graph: The rank's pull graph: ``L`` rows over ``L + H`` sources, halo rows grouped by owner.
        fetch: Its owner -> holder route of the halo rows.

    Attributes:
        interior: ``L`` rows over the ``L`` owned rows.
        boundary: ``L`` rows over the ``H`` halo rows (source ``j`` is local row ``L + j``).
        interior_eids, boundary_eids: Position of each of their edges in ``graph`` (to slice edge weights).
        back: The route carrying halo-row gradients (``[H]`` rows) to their owners.
    """

    def __init__(self, graph: CSRGraph, fetch: Route) -> None:
        num_local = graph.num_dst
        self.num_local, self.num_halo = num_local, graph.num_src - num_local
        indptr, indices = graph.indptr.cpu(), graph.indices.cpu()
        rows = torch.repeat_interleave(torch.arange(num_local), indptr[1:] - indptr[:-1])
        inner = indices < num_local
        device = graph.indptr.device

        def csr(mask: Tensor, shift: int, num_src: int) -> tuple[CSRGraph, Tensor]:
            counts = torch.bincount(rows[mask], minlength=num_local)
            ptr = torch.zeros(num_local + 1, dtype=torch.int64)
            ptr[1:] = torch.cumsum(counts, 0)
            eids = torch.nonzero(mask).view(-1)  # CSR order is kept: rows ascend, each row's edges in order
            return CSRGraph(ptr.to(device), (indices[mask] - shift).to(device), num_src), eids.to(device)

        self.interior, self.interior_eids = csr(inner, 0, num_local)
        self.boundary, self.boundary_eids = csr(~inner, num_local, self.num_halo)
        self.fetch = fetch
        self._weights: tuple[Tensor, int, Tensor, Tensor] | None = None
        self.back = Route(fetch.comm, fetch.recv_idx - num_local, fetch.recv_counts, fetch.send_idx,
                          fetch.send_counts)

    def halo_rows(self, pending: Pending, like: Tensor) -> Tensor:
        """The ``[H, ...]`` halo rows of a finished fetch (rows not on the route stay zero)."""
        got = pending.wait()
        route = self.fetch
        if route.recv_block == self.num_local and got.shape[0] == self.num_halo:
            return got
        out = like.new_zeros((self.num_halo, *like.shape[1:]))
        if got.shape[0]:
            out.index_copy_(0, route.recv_idx - self.num_local, got)
        return out

    def weights(self, w: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """The edge weights ``w`` (in the pull graph's edge order) of the interior and of the boundary edges.

        Memoized for the last weights seen: a layer's normalization is one cached tensor, used every epoch.
        """
        if w is None:
            return None, None
        m = self._weights  # holds ``w`` itself: its memory cannot be reused by another tensor while memoized
        if m is None or m[0] is not w or m[1] != w._version:
            m = self._weights = (w, w._version, w.index_select(0, self.interior_eids),
                                 w.index_select(0, self.boundary_eids))
        return m[2], m[3]


def _row_bytes(x: Tensor) -> int:
    return int(x[:1].numel() * x.element_size()) if x.shape[0] else 0


class StaleBuffers:
    """Halo rows and halo gradients in flight, per aggregation of a training step, at most ``S`` epochs old.

    Each training step's ``i``-th aggregation starts a fetch of its rows and (in backward) a send of its halo
    gradients, and uses the oldest of the ones still kept: the one started ``S`` steps before, or at the start
    of training the oldest there is. Ages used are recorded (:meth:`take_ages`).
    """

    def __init__(self, staleness: int) -> None:
        self.staleness = int(staleness)
        self.rows: dict[int, deque[Pending]] = {}
        self.grads: dict[int, deque[Pending]] = {}
        self.ages: dict[int, int] = {}
        self.call = 0

    def reset(self) -> None:
        """Forget every kept exchange (a new run starts from fresh rows); those in flight are waited for."""
        for queues in (self.rows, self.grads):
            for q in queues.values():
                for pending in q:
                    pending.wait()
        self.rows, self.grads, self.ages, self.call = {}, {}, {}, 0

    def begin_step(self) -> None:
        """A training step starts: its aggregations count from 0 again."""
        self.call = 0

    def next_key(self) -> int:
        """The key of the step's next aggregation."""
        key, self.call = self.call, self.call + 1
        return key

    def use(self, queues: dict[int, deque[Pending]], key: int, fresh: Pending) -> Pending:
        """Keep ``fresh`` and return the exchange to use now (its age recorded), dropping what is too old."""
        q = queues.setdefault(key, deque())
        q.append(fresh)
        used = q[0]
        self.ages[key] = max(self.ages.get(key, 0), len(q) - 1)
        if len(q) > self.staleness:
            q.popleft()
        return used

    def take_ages(self) -> dict[str, int]:
        """``{"staleness_a<i>": age}``: the oldest rows or gradients aggregation ``i`` used since the last call."""
        out = {f"staleness_a{k}": v for k, v in sorted(self.ages.items())}
        self.ages.clear()
        return out

    def state_dict(self) -> dict[str, Any]:
        """The rows and gradients kept, as tensors (waits for those still in flight)."""
        def dump(queues: dict[int, deque[Pending]]) -> dict[str, list[Tensor]]:
            return {str(k): [p.wait().detach().cpu() for p in q] for k, q in queues.items()}

        return {"staleness": self.staleness, "rows": dump(self.rows), "grads": dump(self.grads)}

    def load_state_dict(self, state: dict[str, Any], comm: Any, device: torch.device) -> None:
        """Restore the kept rows and gradients (as finished exchanges)."""
        def load(saved: dict[str, list[Tensor]]) -> dict[int, deque[Pending]]:
            return {int(k): deque(Pending(comm, t.to(device), None, None, 0.0) for t in ts) for k, ts in saved.items()}

        self.rows, self.grads = load(state.get("rows", {})), load(state.get("grads", {}))


class _SplitPull(torch.autograd.Function):
    """The overlapped (``buffers`` None) and stale schedules' aggregation (see the module docstring).

    Forward: start this step's fetch, run the interior SpMM, add the boundary SpMM of the halo rows in use
    (this fetch's when overlapped, the kept one's when stale). Backward: the halo rows' gradients first, sent
    to their owners while the interior gradient runs; the owners add the arrived (or kept) ones.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, w_in: Tensor | None, w_bd: Tensor | None, sw: Tensor | None,
                rscale: Tensor | None, split: PullSplit, traffic: Traffic, buffers: StaleBuffers | None,
                key: int) -> Tensor:
        x = x.contiguous()
        ctx.split, ctx.traffic, ctx.layer, ctx.buffers, ctx.key = split, traffic, traffic.layer, buffers, key
        traffic.add(traffic.layer, "fwd", split.fetch.rows_sent * _row_bytes(x))
        pending = split.fetch.start(x)
        used = pending if buffers is None else buffers.use(buffers.rows, key, pending)
        out = prim_spmm_sum(split.interior, x, w_in, rscale=rscale, sw=sw)  # while the halo rows travel
        out.add_(prim_spmm_sum(split.boundary, split.halo_rows(used, x), w_bd, rscale=rscale))
        ctx.save_for_backward(w_in, w_bd, sw, rscale)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        split: PullSplit = ctx.split
        buffers: StaleBuffers | None = ctx.buffers
        w_in, w_bd, sw, rscale = ctx.saved_tensors
        g = g.contiguous()
        g_halo = prim_spmm_sum(split.boundary.reverse(), g, w_bd, eid=split.boundary.perm, nscale=rscale)
        ctx.traffic.add(ctx.layer, "bwd", split.back.rows_sent * _row_bytes(g))
        pending = split.back.start(g_halo)
        used = pending if buffers is None else buffers.use(buffers.grads, ctx.key, pending)
        gx = prim_spmm_sum(split.interior.reverse(), g, w_in, eid=split.interior.perm, nscale=rscale, sw=sw)
        got = used.wait()
        if got.shape[0]:
            gx.index_add_(0, split.fetch.send_idx, got)
        return gx, None, None, None, None, None, None, None, None


def split_aggregate(x: Tensor, w: Tensor | None, sw: Tensor | None, rscale: Tensor | None, split: PullSplit,
                    traffic: Traffic, buffers: StaleBuffers | None) -> Tensor:
    """The overlapped (``buffers`` None) or stale aggregation of the owned rows ``x`` over ``split``."""
    w_in, w_bd = split.weights(w)
    key = -1 if buffers is None else buffers.next_key()
    return _SplitPull.apply(x, w_in, w_bd, sw, rscale, split, traffic, buffers, key)
