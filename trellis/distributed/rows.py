"""Rows by global id from the ranks that own them: the feature fetch of data-parallel mini-batch training.

Why a collective and not RPC: every rank takes part in every fetch (a rank without a batch in a step asks
for nothing and still serves its peers), so a fetch is three ``all_to_all_single`` calls in the same order
on every rank — the counts, the ids, the rows — with no server thread, no RPC agent and nothing that can
hang on a peer that has finished its batches early. Rows this rank owns are read locally and never sent, and so
are the remote rows of its cache (:meth:`RowFetch.fill_cache`: fetched once, ranked by the caller).
In a world of one, the fetch is a local gather, so one rank's batches equal one process's bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from trellis.distributed.comm import Comm


@dataclass
class FetchStats:
    """What this rank's fetches moved since the last :meth:`take`: rows and bytes received from peers."""

    remote_rows: int = 0
    local_rows: int = 0
    cache_rows: int = 0
    recv_bytes: int = 0

    def take(self) -> dict[str, int]:
        """The counters as metrics; then reset."""
        out = {"fetch_remote_rows": self.remote_rows, "fetch_local_rows": self.local_rows,
               "fetch_cache_rows": self.cache_rows, "fetch_recv_bytes": self.recv_bytes}
        self.remote_rows = self.local_rows = self.cache_rows = self.recv_bytes = 0
        return out


class RowFetch:
    """Fetches rows of any node from its owning rank (collective: every rank calls :meth:`fetch` together).

    Args:
        comm: The job's groups (the fetch runs on the gloo control group, so it works beside NCCL too).
        owner: ``[N]`` rank that owns each node.
        serve: Rows of node ids this rank owns (``[n, F]`` float tensor on the CPU).
        dim: Row width ``F``.
        dtype: Row dtype.
    """

    def __init__(self, comm: Comm, owner: np.ndarray, serve: Callable[[np.ndarray], Tensor], dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.comm = comm
        self.owner = owner
        self.serve = serve
        self.dim = int(dim)
        self.dtype = dtype
        self.stats = FetchStats()
        self._slot: np.ndarray | None = None  # [N] row of a cached remote node in _cache, -1 if not cached
        self._cache = torch.empty((0, self.dim), dtype=dtype)

    def fill_cache(self, ids: np.ndarray) -> int:
        """Fetch the rows of remote nodes ``ids`` once and serve them locally from then on (collective).

        Every rank calls this together (with its own ids, possibly none). Returns the bytes the cache holds.
        """
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        ids = ids[self.owner[ids] != self.comm.rank]
        rows = self.fetch(ids)
        self.stats = FetchStats()  # filling is not an epoch's traffic
        slot = np.full(self.owner.shape[0], -1, dtype=np.int64)
        slot[ids] = np.arange(ids.shape[0])
        self._slot, self._cache = slot, rows
        return int(rows.numel() * rows.element_size())

    def fetch(self, ids: np.ndarray, serve: Callable[[np.ndarray], Tensor] | None = None, dim: int | None = None,
              *, cached: bool = True) -> Tensor:
        """``[len(ids), F]`` rows of ``ids`` (any order, repeats allowed), in ``ids``' order.

        ``serve`` and ``dim`` replace the constructor's for this call (every rank passes its own, of the same
        width: e.g. a layer's outputs during layer-wise inference); ``cached=False`` ignores the cache, whose
        rows are the constructor's.
        """
        ids = np.asarray(ids, dtype=np.int64)
        serve = self.serve if serve is None else serve
        width = self.dim if dim is None else int(dim)
        world, me = self.comm.world_size, self.comm.rank
        if world == 1:
            self.stats.local_rows += int(ids.shape[0])
            return serve(ids)
        owners = self.owner[ids].astype(np.int64, copy=False)
        slot = self._slot[ids] if self._slot is not None and cached else None
        away = owners != me
        hits = np.flatnonzero(away & (slot >= 0)) if slot is not None else np.empty(0, dtype=np.int64)
        remote = np.flatnonzero(away & (slot < 0)) if slot is not None else np.flatnonzero(away)
        local = np.flatnonzero(~away)
        order = remote[np.argsort(owners[remote], kind="stable")]
        send_counts = np.bincount(owners[order], minlength=world).astype(np.int64)
        group = self.comm.control
        counts_in = torch.empty(world, dtype=torch.int64)
        dist.all_to_all_single(counts_in, torch.from_numpy(send_counts), group=group)
        asked = torch.empty(int(counts_in.sum()), dtype=torch.int64)
        dist.all_to_all_single(asked, torch.from_numpy(ids[order]), output_split_sizes=counts_in.tolist(),
                               input_split_sizes=send_counts.tolist(), group=group)
        served = serve(asked.numpy()).cpu() if asked.numel() else torch.empty((0, width), dtype=self.dtype)
        got = torch.empty((order.shape[0], width), dtype=self.dtype)
        dist.all_to_all_single(got, served.contiguous(), output_split_sizes=send_counts.tolist(),
                               input_split_sizes=counts_in.tolist(), group=group)
        out = torch.empty((ids.shape[0], width), dtype=self.dtype)
        if local.shape[0]:
            out[torch.from_numpy(local)] = serve(ids[local]).cpu()
        if hits.shape[0]:
            assert slot is not None
            out[torch.from_numpy(hits)] = self._cache[torch.from_numpy(slot[hits])]
        if order.shape[0]:
            out[torch.from_numpy(order)] = got
        self.stats.remote_rows += int(order.shape[0])
        self.stats.local_rows += int(local.shape[0])
        self.stats.cache_rows += int(hits.shape[0])
        self.stats.recv_bytes += int(got.numel() * got.element_size() + 8 * order.shape[0])
        return out


__all__ = ["FetchStats", "RowFetch"]
