"""Halo rows between ranks: which rows go where (:class:`Route`), and the two exchanges as autograd operations.

A rank's local ids are its ``L`` owned nodes (ascending global id) then its ``H`` halo nodes (ascending
global id), as the partitioned layout writes them. Every exchange moves whole rows along a route between
the owner of a node and the parts that hold it as a halo node:

* :class:`Fetch` (owner -> holders): the halo rows a rank's edges read as *sources* (pull, and the
  masters-to-mirrors half of mirror-reduce). Its backward sends the holders' gradient sums back to the
  owners, which add them.
* :class:`Reduce` (holders -> owner): partial aggregations a rank computed for halo *destinations* (push,
  and the mirrors-to-master half of mirror-reduce); the owner adds them to its own rows. Its backward sends
  the owners' gradient rows to the parts that hold them.

A route is built once by a handshake (each holder tells each owner which of its nodes it holds, in
ascending global id), so both sides agree on the order of rows without any per-epoch metadata; per layer
an exchange is one ``all_to_all_single`` of the rows at the layer's width. Only halo nodes that are in
use move (GraphTheta §4.1: masters in use are synchronized, not every mirror).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from trellis.distributed.comm import Comm


@dataclass
class Traffic:
    """Bytes this rank sent, per ``(layer, direction)``; ``direction`` is ``fwd`` or ``bwd``.

    Attributes:
        layer: The layer now running (the graph view sets it before each layer; exchanges record it
            at forward time, so their backward is charged to the same layer).
    """

    layer: int = 0
    sent: dict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))

    def add(self, layer: int, direction: str, nbytes: int) -> None:
        """Count ``nbytes`` sent by ``layer`` in ``direction``."""
        self.sent[(layer, direction)] += int(nbytes)

    def take(self) -> dict[str, int]:
        """``{"exchange_l<i>_<dir>_bytes": n}`` since the last call, and their total; then reset."""
        out = {f"exchange_l{layer}_{d}_bytes": n for (layer, d), n in sorted(self.sent.items())}
        out["exchange_bytes"] = sum(self.sent.values())
        self.sent.clear()
        return out


class Pending:
    """An exchange in flight: its received rows land in :attr:`out`, which :meth:`wait` returns once they are there.

    The exchange is done when the transport is done (a callback on the collective's future records when) and,
    under an emulated link (:class:`~trellis.distributed.comm.Link`), no earlier than its start plus the link's
    delay, exchanges in flight taking the link one after another; :meth:`wait` sleeps for what remains. Time
    blocked and the exchange's duration go to the rank's :class:`~trellis.distributed.comm.CommClock`.
    """

    def __init__(self, comm: Comm, out: Tensor, work: Any, payload: Tensor | None, delay_s: float) -> None:
        self.comm, self.out, self.work, self.payload = comm, out, work, payload  # payload: alive until done
        self.started = time.perf_counter()
        # one link per rank: an exchange starts on it when the previous one has left it
        self.began = max(self.started, comm.clock.link_free_at)
        self.deadline = self.began + delay_s
        if delay_s > 0:
            comm.clock.link_free_at = self.deadline
        self._done_at: list[float] = []
        self._result: Tensor | None = None
        if work is not None:
            try:
                work.get_future().then(lambda _: self._done_at.append(time.perf_counter()))
            except RuntimeError:  # a backend without futures: completion is known at wait
                pass

    def wait(self) -> Tensor:
        """The received rows (waits for the transport and the emulated link; idempotent)."""
        if self._result is not None:
            return self._result
        t0 = time.perf_counter()
        already = self.work is None or bool(self.work.is_completed())
        if self.work is not None:
            self.work.wait()
        now = time.perf_counter()
        done = self._done_at[0] if self._done_at else (t0 if already else now)
        if self.deadline > now:
            time.sleep(self.deadline - now)
        clock = self.comm.clock
        clock.blocked_s += time.perf_counter() - t0
        # the exchange's own time on the link (waiting for an earlier one to leave it is not its time)
        clock.comm_s += max(self.deadline, done) - self.began if self.work is not None else 0.0
        self._result, self.payload, self.work = self.out, None, None
        return self.out


class Route:
    """Rows this rank sends to every rank and where the rows it receives go.

    Args:
        comm: The rank's groups (the halo group carries the rows).
        send_idx: ``int64``: local rows to send, grouped by destination rank in rank order.
        send_counts: Rows sent to each rank.
        recv_idx: ``int64``: local rows the received rows belong to, grouped by source rank in rank order.
        recv_counts: Rows received from each rank.
    """

    def __init__(self, comm: Comm, send_idx: Tensor, send_counts: list[int], recv_idx: Tensor,
                 recv_counts: list[int]) -> None:
        self.comm = comm
        self.send_idx, self.send_counts = send_idx, send_counts
        self.recv_idx, self.recv_counts = recv_idx, recv_counts
        self._block: int | None | bool = False  # not computed yet

    def reversed(self) -> Route:
        """The same pairs of rows, travelling the other way."""
        return Route(self.comm, self.recv_idx, self.recv_counts, self.send_idx, self.send_counts)

    @property
    def rows_sent(self) -> int:
        """Rows this rank sends per exchange."""
        return int(sum(self.send_counts))

    def to(self, device: torch.device) -> Route:
        """This route with its index tensors on ``device``."""
        return Route(self.comm, self.send_idx.to(device), self.send_counts, self.recv_idx.to(device),
                     self.recv_counts)

    @property
    def recv_block(self) -> int | None:
        """First row of the received rows when they are one ascending block of local rows, else None."""
        if self._block is False:
            idx = self.recv_idx
            n = int(idx.shape[0])
            first = int(idx[0]) if n else 0
            contiguous = n == 0 or bool(torch.equal(idx, torch.arange(first, first + n, device=idx.device)))
            self._block = first if contiguous else None
        return self._block

    def start(self, x: Tensor, out: Tensor | None = None) -> Pending:
        """Start sending rows ``x[send_idx]``; :meth:`Pending.wait` gives the received rows.

        The received rows are ``[sum(recv_counts), ...]`` in ``recv_idx`` order; ``out`` (shaped like the
        result) receives them in place. Every rank starts its exchanges in the same order (they are
        collectives on the halo group).
        """
        if self.comm.world_size == 1:
            return Pending(self.comm, x.new_empty((sum(self.recv_counts), *x.shape[1:])) if out is None else out,
                           None, None, 0.0)
        return self.start_rows(x.index_select(0, self.send_idx).contiguous(), out)

    def start_rows(self, payload: Tensor, out: Tensor | None = None) -> Pending:
        """:meth:`start` with the rows to send already gathered (``payload``: ``x[send_idx]``)."""
        out = payload.new_empty((sum(self.recv_counts), *payload.shape[1:])) if out is None else out
        if self.comm.world_size == 1:
            return Pending(self.comm, out, None, None, 0.0)
        link = self.comm.link
        row = payload[:1].numel() * payload.element_size() if payload.shape[0] else out[:1].numel() * out.element_size()
        delay = 0.0 if link is None else link.delay(row * max(int(payload.shape[0]), int(out.shape[0])))
        work = dist.all_to_all_single(out, payload, output_split_sizes=self.recv_counts,
                                      input_split_sizes=self.send_counts, group=self.comm.halo, async_op=True)
        return Pending(self.comm, out, work, payload, delay)

    def send(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """:meth:`start` and wait: the received rows."""
        return self.start(x, out).wait()

    @classmethod
    def owner_to_holders(cls, comm: Comm, node_ids: np.ndarray, num_local: int, halo_rows: np.ndarray,
                         owners: np.ndarray) -> Route:
        """The route that carries owned rows to the ranks holding them as the halo rows ``halo_rows``.

        Args:
            comm: The rank's groups.
            node_ids: ``int64 [L + H]`` global id of every local row (owned rows ascending first).
            num_local: ``L``.
            halo_rows: Local ids (``>= L``) of the halo rows this rank needs along the route, ascending.
            owners: Owner rank of each of ``halo_rows``.

        The handshake: every rank sends each owner the global ids of the halo rows it needs from it (in
        ascending global id), so the owner's send list and the holder's receive list pair row for row.
        """
        world = comm.world_size
        halo_rows = np.asarray(halo_rows, dtype=np.int64)
        owners = np.asarray(owners, dtype=np.int64)
        order = np.argsort(owners, kind="stable")  # by owner, ascending global id within each
        recv_idx = halo_rows[order]
        recv_counts = np.bincount(owners, minlength=world).astype(np.int64)
        want = torch.from_numpy(np.ascontiguousarray(node_ids[recv_idx]))
        counts_in = torch.from_numpy(recv_counts.copy())
        counts_out = torch.empty(world, dtype=torch.int64)
        if world > 1:
            dist.all_to_all_single(counts_out, counts_in, group=comm.control)
            asked = torch.empty(int(counts_out.sum()), dtype=torch.int64)
            dist.all_to_all_single(asked, want, output_split_sizes=counts_out.tolist(),
                                   input_split_sizes=counts_in.tolist(), group=comm.control)
        else:
            counts_out.copy_(counts_in)
            asked = want
        owned = node_ids[:num_local]
        send_idx = np.searchsorted(owned, asked.numpy())
        if send_idx.size and (send_idx.max() >= num_local or not np.array_equal(owned[send_idx], asked.numpy())):
            raise RuntimeError(f"rank {comm.rank}: a peer asked for rows this rank does not own (the parts of "
                               "the partitioned layout disagree; re-run `trellis partition`)")
        return cls(comm, torch.from_numpy(send_idx.astype(np.int64)), counts_out.tolist(),
                   torch.from_numpy(recv_idx), recv_counts.tolist())


def reduce_rows(partial: Tensor, route: Route, num_local: int, traffic: Traffic, layer: int,
                direction: str) -> Tensor:
    """``partial[:L]`` plus the rows that the holders on ``route`` computed for this rank's nodes (no autograd)."""
    back = route.reversed()  # holders -> owner
    partial = partial.contiguous()
    traffic.add(layer, direction, back.rows_sent * partial[:1].numel() * partial.element_size())
    got = back.send(partial)
    out = partial[:num_local].clone()
    if got.shape[0]:
        out.index_add_(0, back.recv_idx, got)
    return out


def spread_rows(x: Tensor, route: Route, num_rows: int, traffic: Traffic, layer: int, direction: str) -> Tensor:
    """``[L, ...]`` owned rows -> ``[num_rows, ...]`` with the halo rows on ``route`` filled by their owners.

    Halo rows not on the route are zero (no autograd).
    """
    x = x.contiguous()
    traffic.add(layer, direction, route.rows_sent * x[:1].numel() * x.element_size())
    n, block = int(route.recv_idx.shape[0]), route.recv_block
    if block is not None and block == x.shape[0] and n == num_rows - block:  # every halo row, grouped by owner
        out = x.new_empty((num_rows, *x.shape[1:]))
        out[:block] = x
        route.send(x, out=out[block:])
        return out
    got = route.send(x)
    out = x.new_zeros((num_rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    if got.shape[0]:
        out.index_copy_(0, route.recv_idx, got)
    return out


class Fetch(torch.autograd.Function):
    """``[L, ...]`` owned rows -> ``[L + H, ...]``: halo rows on the route filled by their owners (pull)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, route: Route, num_rows: int, traffic: Traffic) -> Tensor:
        """Send owned rows to their holders; receive this rank's halo rows."""
        ctx.route, ctx.traffic, ctx.layer, ctx.num_local = route, traffic, traffic.layer, x.shape[0]
        return spread_rows(x, route, num_rows, traffic, traffic.layer, "fwd")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        """Halo rows' gradients go back to their owners, which add them."""
        return reduce_rows(g, ctx.route, ctx.num_local, ctx.traffic, ctx.layer, "bwd"), None, None, None


class Reduce(torch.autograd.Function):
    """``[L + H, ...]`` partial rows -> ``[L, ...]``: halo rows on the route are added at their owners (push)."""

    @staticmethod
    def forward(ctx: Any, partial: Tensor, route: Route, num_local: int, traffic: Traffic) -> Tensor:
        """Send halo rows' partial sums to their owners; add the ones received."""
        ctx.route, ctx.traffic, ctx.layer, ctx.num_rows = route, traffic, traffic.layer, partial.shape[0]
        return reduce_rows(partial, route, num_local, traffic, traffic.layer, "fwd")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        """Owners' gradient rows go to the ranks that hold those nodes."""
        return spread_rows(g, ctx.route, ctx.num_rows, ctx.traffic, ctx.layer, "bwd"), None, None, None


class MappedHalo:
    """A rank's halo rows for the out-of-core engine: rows of memory-mapped ``[L + H, d]`` spill files.

    The tiled engine (:class:`trellis.nn.tiled.TiledGNN`) writes a layer's ``L`` owned rows tile by tile; then
    :meth:`fill` sends the rows peers hold as halo rows (gathered from the map) and writes the rows received
    into rows ``L..L+H``. In the backward pass :meth:`add_back` sends the gradients of the halo rows to their
    owners, which add them to their own rows. Both run in rounds of at most :attr:`chunk_rows` rows per peer,
    so an exchange holds ``2 x P x chunk_rows`` rows in memory whatever the halo's size.

    Args:
        route: Owner -> holder route of the halo rows (local ids: ``L`` owned rows, then ``H`` halo rows).
        num_local: ``L``.
        keys: ``int64 [L]`` global id of each owned row (dropout masks are keyed by them).
        traffic: Byte counter.

    Collective: the ranks agree on the largest per-peer row count (one all-gather), so that every rank runs
    the same number of rounds.
    """

    def __init__(self, route: Route, num_local: int, keys: np.ndarray, traffic: Traffic) -> None:
        self.route = route
        self.num_local, self.keys, self.traffic = num_local, keys, traffic
        self._send = route.send_idx.cpu().numpy()
        self._recv = route.recv_idx.cpu().numpy()
        mine = max([0, *route.send_counts, *route.recv_counts])
        self._most = int(max(int(t[0]) for t in route.comm.all_gather_rows(torch.tensor([mine]))))
        #: Rows per peer and round (:meth:`set_chunk_rows`); all ranks must use the same.
        self.chunk_rows = max(1, self._most)

    def set_chunk_rows(self, rows: int) -> None:
        """Exchange at most ``rows`` rows per peer per round (every rank must pass the same value)."""
        self.chunk_rows = max(1, int(rows))

    @property
    def rounds(self) -> int:
        """Rounds of one exchange."""
        return max(1, -(-self._most // self.chunk_rows))

    def fill(self, arr: np.ndarray, layer: int = 0) -> None:
        """``arr[L:]``: the halo rows, from their owners' rows ``arr[:L]`` (collective)."""
        def put(rows: np.ndarray, got: Tensor) -> None:
            arr[rows] = got.numpy()

        self._exchange(arr, self._send, self.route.send_counts, self._recv, self.route.recv_counts, put, layer, "fwd")

    def add_back(self, arr: np.ndarray, layer: int = 0) -> None:
        """``arr[:L] +=`` every holder's gradient rows of this rank's nodes, ``arr[L:]`` of each (collective)."""
        target = torch.from_numpy(arr)

        def add(rows: np.ndarray, got: Tensor) -> None:
            target.index_add_(0, torch.from_numpy(rows), got)  # a row may come from several holders

        self._exchange(arr, self._recv, self.route.recv_counts, self._send, self.route.send_counts, add, layer, "bwd")

    def _exchange(self, arr: np.ndarray, send_rows: np.ndarray, send_counts: list[int], recv_rows: np.ndarray,
                  recv_counts: list[int], apply: Any, layer: int, direction: str) -> None:
        """Send ``arr[send_rows]`` (grouped by peer) in rounds; ``apply(rows, got)`` the rows each round brings."""
        c = self.chunk_rows
        s_off = np.concatenate([[0], np.cumsum(send_counts)]).astype(np.int64)
        r_off = np.concatenate([[0], np.cumsum(recv_counts)]).astype(np.int64)
        for k in range(self.rounds):
            s_sel = [np.arange(s_off[p] + min(k * c, n), s_off[p] + min((k + 1) * c, n))
                     for p, n in enumerate(send_counts)]
            r_sel = [np.arange(r_off[p] + min(k * c, n), r_off[p] + min((k + 1) * c, n))
                     for p, n in enumerate(recv_counts)]
            rows_out = send_rows[np.concatenate(s_sel)] if s_sel else send_rows[:0]
            payload = torch.from_numpy(np.ascontiguousarray(arr[rows_out], dtype=np.float32))
            self.traffic.add(layer, direction, payload.numel() * 4)
            step = Route(self.route.comm, self.route.send_idx[:0], [len(x) for x in s_sel], self.route.recv_idx[:0],
                         [len(x) for x in r_sel])
            got = step.start_rows(payload).wait()
            if got.shape[0]:
                apply(recv_rows[np.concatenate(r_sel)], got)
