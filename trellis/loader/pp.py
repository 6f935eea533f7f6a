"""Loaders of pre-propagated rows: from a naive DataLoader to chunked storage reads (PP-GNN §4, §5).

Every loader yields ``(x, y)`` with ``x`` a ``[B, H, F]`` hop stack (``H`` = the hops the model uses) and
``y`` the labels, and every epoch yields each row of the split exactly once. The modes:

* ``naive`` — ``torch.utils.data.DataLoader`` over a ``TensorDataset``: one ``__getitem__`` per row and
  a collate that stacks them (the baseline PP-GNN §3.3 profiles).
* ``naive-batch`` — the same DataLoader fed whole index batches by a ``BatchSampler`` (one fancy index
  per batch, but a fresh tensor each time).
* ``index`` — index batch assembly (§4.1): one ``index_select`` per batch into a reused buffer, so no
  per-row work and no per-batch allocation (fresh 16 MiB tensors cost page faults every batch).
* ``prefetch`` — ``index`` plus a background thread that fills the second of two buffers while the
  model trains on the first (double buffering, §4.1).
* ``chunk`` — chunk reshuffling (§4.2): the split is cut into chunks of ``chunk_size`` contiguous rows,
  the chunk order is reshuffled every epoch and a batch is whole chunks. With ``chunk_size ==
  batch_size`` a batch is one contiguous slice, handed to the model without any copy; ``chunk_size = 1``
  is exact random reshuffling. Prefetched like ``prefetch``.
* ``storage`` — chunk reshuffling reading whole chunks from the per-hop files with ``preadv`` into
  the double buffers (§4.3): only two batches are ever in memory, and reads bypass memory maps so the
  process's RSS stays at its buffers.

Why hop-major buffers ``[H, B, F]`` (yielded as the ``[B, H, F]`` view): that is the file layout, so a
chunk read is one ``preadv`` per hop straight into place, and per-hop model weights run as one batched
matmul over contiguous per-hop slabs.

:func:`plan_placement` is the automatic configuration of §5 on a CPU: given a memory budget it keeps
the split rows in memory when they fit (exact reshuffling with prefetch, or chunk reshuffling when a
chunk size is given) and otherwise reads chunks from storage, and says why.
"""

from __future__ import annotations

import math
import os
import threading
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from trellis.errors import BudgetTooSmall, TrellisUserError
from trellis.loader.features import FeatureSource, expand_ranges, np_int64
from trellis.loader.ppcache import PPCache
from trellis.loader.source import iter_epoch
from trellis.utils.sizes import format_budget, format_size, parse_size

#: ``--loader`` choices (``auto`` resolves to one of the others through :func:`plan_placement`).
LOADERS = ("auto", "naive", "naive-batch", "index", "prefetch", "chunk", "storage")
MEMORY_LOADERS = ("naive", "naive-batch", "index", "prefetch", "chunk")
#: Fraction of available RAM used as the default budget.
DEFAULT_BUDGET_FRACTION = 0.8
#: Bytes per ``preadv`` when loading a hop into memory.
_READ_BLOCK = 64 * 1024 * 1024
#: Storage chunks smaller than this are gathered through the memory map instead of one read each.
_MIN_READ_BYTES = 64 * 1024


# ---------------------------------------------------------------------------------------------------
# bytes, budgets
# ---------------------------------------------------------------------------------------------------


def default_budget() -> tuple[int, str]:
    """``(bytes, why)``: 80% of the RAM psutil reports available."""
    import psutil

    avail = psutil.virtual_memory().available
    return int(avail * DEFAULT_BUDGET_FRACTION), f"{int(DEFAULT_BUDGET_FRACTION * 100)}% of available RAM"


# ---------------------------------------------------------------------------------------------------
# row sources
# ---------------------------------------------------------------------------------------------------


def _preadv_all(fd: int, dst: np.ndarray, offset: int) -> None:
    """Fill the contiguous array ``dst`` from ``fd`` at ``offset`` (loops over short reads)."""
    mv = memoryview(dst).cast("B")  # type: ignore[arg-type]  # numpy arrays export the buffer protocol
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got <= 0:
            raise OSError(f"unexpected end of file at offset {offset + done}")
        done += got


class RowSource(FeatureSource):
    """Rows ``[a, b)`` of some hops of a cache: a feature source whose rows are hop stacks ``(H, F)``.

    Rows are assembled hop-major (``[H, n, F]``, the file layout, so a chunk read is one ``preadv`` per
    hop straight into place) and returned as the ``[n, H, F]`` view. Row ids passed to the methods are
    relative to ``a``. Subclasses implement the hop-major :meth:`_gather` and :meth:`_read_ranges`.
    """

    def __init__(self, cache: PPCache, hops: Sequence[int], row_range: tuple[int, int]) -> None:
        self.cache = cache
        self.hops = tuple(int(h) for h in hops)
        for h in self.hops:
            if not 0 <= h <= cache.hops:
                raise TrellisUserError(f"hop {h} is not in the cache {cache.path} (hops 0..{cache.hops})")
        self.a, self.b = int(row_range[0]), int(row_range[1])
        self.num_rows = self.b - self.a
        self.dim = cache.num_features
        self.dtype = torch.float32
        y = cache.y
        self.y: torch.Tensor | None = None if y is None else torch.from_numpy(np.array(y[self.a:self.b]))

    @property
    def num_features(self) -> int:
        """Features per hop (``dim``)."""
        return self.dim

    @property
    def row_shape(self) -> tuple[int, int]:
        """``(hops, features)``."""
        return len(self.hops), self.dim

    def _view(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        return buf[: len(self.hops) * n * self.dim].view(len(self.hops), n, self.dim)

    def gather(self, ids: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``ids`` (any order) as ``[n, H, F]`` (a view of the hop-major ``out``)."""
        idx = np_int64(ids)
        return self._gather(idx, self.new_buffer(idx.shape[0]) if out is None else out).transpose(0, 1)

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the ranges ``[starts[i], stops[i])`` in order, as ``[n, H, F]`` (``out`` may be unused)."""
        return self._read_ranges(starts, stops, out).transpose(0, 1)

    @abstractmethod
    def _gather(self, idx: np.ndarray, buf: torch.Tensor) -> torch.Tensor:
        """Rows ``idx`` as hop-major ``[H, n, F]`` in ``buf``."""

    @abstractmethod
    def _read_ranges(self, starts: np.ndarray, stops: np.ndarray, buf: torch.Tensor | None) -> torch.Tensor:
        """Rows of the ranges as hop-major ``[H, n, F]`` (in ``buf``, or a view when no copy is needed)."""


class MemorySource(RowSource):
    """The rows loaded once into one hop-major tensor ``[H, n, F]``.

    Loading reads each hop with ``preadv`` into its slab (no memory map left behind, so RSS is the
    data itself). A single range is returned as a view of the data, without a copy.
    """

    range_views = True

    def __init__(self, cache: PPCache, hops: Sequence[int], row_range: tuple[int, int]) -> None:
        super().__init__(cache, hops, row_range)
        n, f = self.num_rows, self.num_features
        self.data = torch.empty((len(self.hops), n, f), dtype=torch.float32)
        arr = self.data.numpy()
        rb = cache.row_bytes
        step = max(1, _READ_BLOCK // max(1, rb))
        for k, h in enumerate(self.hops):
            fd = os.open(cache.hop_path(h), os.O_RDONLY)
            try:
                base = cache.hop_offset(h) + self.a * rb
                for s in range(0, n, step):
                    e = min(s + step, n)
                    _preadv_all(fd, arr[k, s:e], base + s * rb)
            finally:
                os.close(fd)

    def _gather(self, idx: np.ndarray, buf: torch.Tensor) -> torch.Tensor:
        out = self._view(buf, idx.shape[0])
        torch.index_select(self.data, 1, torch.from_numpy(idx), out=out)
        return out

    def _read_ranges(self, starts: np.ndarray, stops: np.ndarray, buf: torch.Tensor | None) -> torch.Tensor:
        if starts.shape[0] == 1:  # one contiguous chunk: a view, no copy
            return self.data[:, int(starts[0]):int(stops[0])]
        idx = expand_ranges(starts, stops)
        return self._gather(idx, self.new_buffer(idx.shape[0]) if buf is None else buf)


class StorageSource(RowSource):
    """Rows read from the hop files on demand: whole chunks with ``preadv``, many reads in flight.

    Why ``preadv`` and not the memory map: reads land directly in the batch buffer and leave no mapped
    pages in the process (its RSS stays at two batches). Why many threads: one synchronous reader keeps a
    single request in flight, and SSDs and virtual disks deliver their bandwidth only at queue depth; the
    hop files are separate (PP-GNN §4.3) and every chunk read is split into pieces of ``piece_bytes``, all
    issued at once to ``io_threads`` threads (``preadv`` releases the GIL). Chunks below
    ``min_read_bytes`` (``chunk_size`` near 1, i.e. exact reshuffling from storage) are gathered through
    the memory map in one vectorized call per hop instead.

    Args:
        cache: The cache.
        hops: Hops to read.
        row_range: ``[a, b)`` cache rows covered.
        io_threads: Threads issuing reads (default: 8).
        piece_bytes: Largest single read (default: 1 MiB).
        min_read_bytes: Chunks smaller than this are gathered through the memory map (default: 64 KiB).
    """

    on_storage = True

    def __init__(self, cache: PPCache, hops: Sequence[int], row_range: tuple[int, int], *,
                 io_threads: int = 8, piece_bytes: int = 1 << 20, min_read_bytes: int = _MIN_READ_BYTES) -> None:
        super().__init__(cache, hops, row_range)
        self.min_read_bytes = int(min_read_bytes)
        rb = cache.row_bytes
        self.row_bytes = rb
        self.piece_rows = max(1, int(piece_bytes) // rb)
        self.fds = [os.open(cache.hop_path(h), os.O_RDONLY) for h in self.hops]
        self.bases = [cache.hop_offset(h) + self.a * rb for h in self.hops]
        self.pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="trellis-pp-io") \
            if io_threads > 1 else None

    def _per_hop(self, fn: Any) -> None:
        if self.pool is None:
            for k in range(len(self.hops)):
                fn(k)
        else:
            for fut in [self.pool.submit(fn, k) for k in range(len(self.hops))]:
                fut.result()

    def _gather(self, idx: np.ndarray, buf: torch.Tensor) -> torch.Tensor:
        out = self._view(buf, idx.shape[0])
        arr = out.numpy()

        def one(k: int) -> None:
            mm = self.cache.hop(self.hops[k])
            np.take(mm[self.a:self.b], idx, axis=0, out=arr[k], mode="clip")  # "raise" would buffer out

        self._per_hop(one)
        return out

    def _read_ranges(self, starts: np.ndarray, stops: np.ndarray, buf: torch.Tensor | None) -> torch.Tensor:
        lens = stops - starts
        n = int(lens.sum())
        if buf is None:
            buf = self.new_buffer(n)
        if n and int(lens.max()) * self.row_bytes < self.min_read_bytes and starts.shape[0] > 1:
            return self._gather(expand_ranges(starts, stops), buf)
        out = self._view(buf, n)
        arr = out.numpy()
        rb, step = self.row_bytes, self.piece_rows
        pos = np.concatenate([[0], np.cumsum(lens)])
        pieces = [(k, int(pos[i]) + d, int(starts[i]) + d, min(step, int(lens[i]) - d))
                  for i in range(starts.shape[0])  # per chunk and piece, never per row
                  for d in range(0, int(lens[i]), step) for k in range(len(self.hops))]

        def one(p: tuple[int, int, int, int]) -> None:
            k, at, row, m = p
            _preadv_all(self.fds[k], arr[k, at:at + m], self.bases[k] + row * rb)

        if self.pool is None:
            for p in pieces:
                one(p)
        else:
            for fut in [self.pool.submit(one, p) for p in pieces]:
                fut.result()
        return out

    def drop_cache(self) -> None:
        """Evict these files from the page cache (``POSIX_FADV_DONTNEED``) so the next reads hit storage."""
        for fd in self.fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Stop the reader threads and close the hop files."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


# ---------------------------------------------------------------------------------------------------
# epoch plans and loaders
# ---------------------------------------------------------------------------------------------------


def epoch_batches(n: int, batch_size: int, chunk_size: int, *, shuffle: bool,
                  rng: np.random.Generator | None) -> list[np.ndarray]:
    """Chunk ids of each batch of one epoch: ``⌊batch/chunk⌋`` whole chunks per batch (at least one).

    Chunk ``k`` holds rows ``[k c, min((k+1) c, n))``; with ``chunk_size = 1`` chunk ids are row ids and
    this is exact random reshuffling. Every row is in exactly one batch.
    """
    c = max(1, int(chunk_size))
    n_chunks = -(-n // c)
    order = rng.permutation(n_chunks) if shuffle and rng is not None else np.arange(n_chunks, dtype=np.int64)
    k = max(1, int(batch_size) // c)
    batches = [order[i:i + k] for i in range(0, n_chunks, k)]
    if c == 1 and k > 1 and len(batches) > 1 and batches[-1].shape[0] == 1:
        # a last batch of one row joins the one before: batch normalization cannot train on one row (SIGN crashed
        # with 200 training rows and --batch-size 199, or on a rank whose share left one over)
        batches[-2:] = [order[-(k + 1):]]
    return batches


def batches_per_epoch(n: int, batch_size: int, chunk_size: int) -> int:
    """How many batches :func:`epoch_batches` makes of ``n`` rows."""
    c = max(1, int(chunk_size))
    k = max(1, int(batch_size) // c)
    n_chunks = -(-n // c)
    full = -(-n_chunks // k)
    return full - 1 if c == 1 and k > 1 and full > 1 and n_chunks % k == 1 else full


@dataclass
class RowPlan:
    """One epoch of a :class:`PPLoader`: the chunk ids of each batch.

    Attributes:
        batches: Chunk ids of each batch (row ids when ``chunk_size == 1``).
        epoch: The epoch seed the shuffle was drawn from.
    """

    batches: list[np.ndarray]
    epoch: int

    def __len__(self) -> int:
        """Number of batches."""
        return len(self.batches)


class RowBatch(NamedTuple):
    """One batch of pre-propagated rows (unpacks as ``x, y``).

    Attributes:
        x: ``[B, H, F]`` hop stacks (a view of a hop-major buffer).
        y: Labels of the rows, or None.
    """

    x: torch.Tensor
    y: torch.Tensor | None


class PPLoader:
    """Index, prefetch, chunk and storage modes over a :class:`RowSource` (see the module docstring).

    A :class:`~trellis.loader.source.BatchSource` of :class:`RowBatch`: ``plan(epoch_seed)`` shuffles the
    chunks, ``get(plan, i)`` assembles batch ``i``; iterating the loader runs the epoch chosen by
    :meth:`set_epoch` through :func:`~trellis.loader.source.iter_epoch`, one batch ahead when
    prefetching. The tensors of a batch stay valid until the next batch is requested (their buffer is
    then reused: batch ``i`` fills buffer ``i % 2`` when prefetching, the one buffer otherwise).

    Args:
        source: Where rows come from.
        batch_size: Rows per batch (the last batch of an epoch may be smaller).
        chunk_size: Rows per chunk (1 = exact random reshuffling) (default: 1).
        shuffle: Reshuffle every epoch (default: True; evaluation passes use False).
        prefetch: Assemble the next batch in a background thread into the second of two buffers.
        seed: Base seed; epoch ``e`` shuffles with ``default_rng([seed, e])`` (default: 0).
        row_range: ``[a, b)`` rows of the source this loader covers (default: all of it).
        name: Mode name reported by :meth:`describe`.
        buffers: Batch buffers to use (shared between evaluation passes); grown when too small.
    """

    def __init__(self, source: RowSource, batch_size: int, *, chunk_size: int = 1, shuffle: bool = True,
                 prefetch: bool = False, seed: int = 0, row_range: tuple[int, int] | None = None,
                 name: str = "index", buffers: list[torch.Tensor] | None = None) -> None:
        if batch_size < 1:
            raise TrellisUserError(f"--batch-size {batch_size} must be >= 1")
        if chunk_size < 1:
            raise TrellisUserError(f"--chunk-size {chunk_size} must be >= 1 (1 = exact random reshuffling)")
        if chunk_size > batch_size:
            raise TrellisUserError(
                f"--chunk-size {chunk_size} is larger than --batch-size {batch_size}; a batch is made of whole "
                "chunks, so use a chunk size <= the batch size (PP-GNN uses chunk = batch)"
            )
        self.source = source
        self.batch_size = int(batch_size)
        self.chunk_size = int(chunk_size)
        self.shuffle = shuffle
        self.prefetch = prefetch
        self.seed = int(seed)
        self.epoch = 0
        self.lo, self.hi = row_range if row_range is not None else (0, source.num_rows)
        self.num_rows = self.hi - self.lo
        self.name = name
        k = max(1, self.batch_size // self.chunk_size)
        # one row more: a last batch of one row joins the one before (epoch_batches)
        self._buf_rows = min(k * self.chunk_size + (self.chunk_size == 1), max(1, self.num_rows))
        self._buffers: list[torch.Tensor] = buffers if buffers is not None else []
        self._buffer_lock = threading.Lock()

    def __len__(self) -> int:
        """Batches per epoch."""
        return batches_per_epoch(self.num_rows, self.batch_size, self.chunk_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of epoch ``epoch`` (deterministic given the seed)."""
        self.epoch = int(epoch)

    def _buffer(self, i: int) -> torch.Tensor:
        need = math.prod(self.source.row_shape) * self._buf_rows
        with self._buffer_lock:
            while len(self._buffers) <= i:
                self._buffers.append(self.source.new_buffer(self._buf_rows))
            if self._buffers[i].numel() < need:
                self._buffers[i] = self.source.new_buffer(self._buf_rows)
            return self._buffers[i]

    def _assemble(self, chunk_ids: np.ndarray, buf: torch.Tensor | None) -> RowBatch:
        c, lo, y = self.chunk_size, self.lo, self.source.y
        if c == 1:
            idx = chunk_ids.astype(np.int64) + lo
            if self.source.on_storage:
                idx.sort()  # the batch is a set: read it in file order
            assert buf is not None
            x = self.source.gather(idx, buf)
            yb = None if y is None else y[torch.from_numpy(idx)]
        else:
            starts = chunk_ids.astype(np.int64) * c
            stops = np.minimum(starts + c, self.num_rows) + lo
            starts = starts + lo
            x = self.source.read_ranges(starts, stops, buf)
            if y is None:
                yb = None
            elif starts.shape[0] == 1:
                yb = y[int(starts[0]):int(stops[0])]
            else:
                yb = y[torch.from_numpy(expand_ranges(starts, stops))]
        return RowBatch(x, yb)

    def _needs_buffer(self, chunk_ids: np.ndarray) -> bool:
        return self.chunk_size == 1 or chunk_ids.shape[0] > 1 or not self.source.range_views

    def plan(self, epoch_seed: int) -> RowPlan:
        """The chunks of each batch of the epoch seeded by ``epoch_seed`` (``default_rng([seed, epoch_seed])``)."""
        rng = np.random.default_rng([self.seed, epoch_seed]) if self.shuffle else None
        return RowPlan(epoch_batches(self.num_rows, self.batch_size, self.chunk_size, shuffle=self.shuffle, rng=rng),
                       epoch_seed)

    def get(self, plan: RowPlan, i: int) -> RowBatch:
        """Assemble batch ``i`` of ``plan`` into buffer ``i % 2`` (prefetching) or the one buffer."""
        ids = plan.batches[i]
        return self._assemble(ids, self._buffer(i % (2 if self.prefetch else 1)) if self._needs_buffer(ids) else None)

    def __iter__(self) -> Iterator[RowBatch]:
        """The batches of the epoch set by :meth:`set_epoch`, one prepared ahead when prefetching."""
        with iter_epoch(self, self.epoch, prefetch=1 if self.prefetch else 0, workers=1) as batches:
            yield from batches

    def describe(self) -> str:
        """One line naming the mode."""
        parts = [self.name, f"batch {self.batch_size}"]
        parts.append("exact reshuffling" if self.chunk_size == 1 else f"chunk reshuffling (chunk {self.chunk_size})")
        if self.prefetch:
            parts.append("double-buffered prefetch")
        return ", ".join(parts)


class NaiveLoader:
    """The baselines: ``torch.utils.data.DataLoader`` over a ``TensorDataset`` of ``[n, H, F]`` rows.

    ``batch_sampler=False`` is the textbook loader (per-row ``__getitem__`` + collate);
    ``batch_sampler=True`` feeds whole index batches through a ``BatchSampler`` (NOTES #5's stronger
    baseline). The dataset tensor is a contiguous row-major copy, as a user would build it with
    ``torch.stack(hops, 1)``.
    """

    def __init__(self, source: MemorySource, batch_size: int, *, batch_sampler: bool = False, seed: int = 0,
                 row_range: tuple[int, int] | None = None) -> None:
        from torch.utils.data import TensorDataset

        lo, hi = row_range if row_range is not None else (0, source.num_rows)
        x = source.data[:, lo:hi].transpose(0, 1).contiguous()
        y = source.y[lo:hi] if source.y is not None else torch.zeros(hi - lo, dtype=torch.int64)
        self.dataset = TensorDataset(x, y)
        self.batch_size = int(batch_size)
        self.batch_sampler = batch_sampler
        self.seed = int(seed)
        self.epoch = 0
        self.num_rows = hi - lo
        self.name = "naive-batch" if batch_sampler else "naive"

    def __len__(self) -> int:
        return -(-self.num_rows // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of epoch ``epoch``."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from torch.utils.data import BatchSampler, DataLoader, RandomSampler

        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + self.epoch)
        if self.batch_sampler:
            sampler = BatchSampler(RandomSampler(self.dataset, generator=g), self.batch_size, drop_last=False)
            loader = DataLoader(self.dataset, sampler=sampler, batch_size=None)
        else:
            loader = DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, generator=g)
        yield from loader

    def describe(self) -> str:
        """One line naming the baseline."""
        how = "BatchSampler index batches" if self.batch_sampler else "per-row __getitem__ + collate"
        return f"{self.name}, batch {self.batch_size}, torch DataLoader over TensorDataset ({how})"


# ---------------------------------------------------------------------------------------------------
# automatic placement
# ---------------------------------------------------------------------------------------------------


@dataclass
class Placement:
    """The resolved data placement and loading mode, with the reason it was chosen.

    Attributes:
        loader: Concrete mode (one of :data:`LOADERS` except ``auto``).
        placement: ``memory`` or ``storage``.
        chunk_size: Rows per chunk (1 = exact random reshuffling).
        prefetch: Whether a background thread double-buffers batches.
        budget: Memory budget in bytes.
        budget_source: Where the budget came from.
        data_bytes: Bytes of the split rows of the used hops.
        batch_bytes: Bytes of one batch.
        reason: Why this choice (printed for the user).
    """

    loader: str
    placement: str
    chunk_size: int
    prefetch: bool
    budget: int
    budget_source: str
    data_bytes: int
    batch_bytes: int
    reason: str

    @property
    def reshuffling(self) -> str:
        """``exact``, or ``chunk (N rows)``."""
        return "exact" if self.chunk_size == 1 else f"chunk ({self.chunk_size} rows)"

    def describe(self) -> str:
        """The line printed before training."""
        return (f"placement: {self.placement}, loader {self.loader}, {self.reshuffling} reshuffling"
                f"{', double-buffered prefetch' if self.prefetch else ''} — {self.reason}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (for the run's summary)."""
        return {**asdict(self), "reshuffling": self.reshuffling}


def split_rows(cache: PPCache) -> tuple[int, int]:
    """``[0, S)``: the cache rows of all splits (train, val, test are contiguous at the front)."""
    hi = max((cache.split_range(s)[1] for s in ("train", "val", "test")), default=0)
    return 0, hi


def spare_compute(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether a background assembly thread has something to overlap with, and why.

    On an accelerator the host thread assembles while the device computes. On a CPU it overlaps only
    when torch's intra-op threads leave a core free; otherwise the prefetch thread takes cycles from the
    matmuls it waits for (measured on a 2-core machine: prefetch was 5-8% slower than plain index assembly).
    """
    if torch.device(device).type != "cpu":
        return True, f"{torch.device(device).type} computes while the host assembles"
    cores, threads = os.cpu_count() or 1, torch.get_num_threads()
    if cores > threads:
        return True, f"torch uses {threads} of {cores} cores, one is free for assembly"
    return False, f"torch's {threads} threads use all {cores} cores, so a prefetch thread would only compete"


#: What a pre-propagation run takes beside its rows and batch buffers under ``--memory-budget`` (the model, its
#: activations and gradients, the optimizer, the allocator's slack): the rows get the budget less this and the
#: process's own memory. Measured: about 10 MiB on Cora (SIGN, 3 hops, hidden 64); the rest is head-room.
PP_MARGIN_BYTES = 48 * 2**20


def plan_placement(cache: PPCache, hops: Sequence[int], batch_size: int, *, loader: str = "auto",
                   chunk_size: int | None = None, memory_budget: int | str | None = None,
                   device: str | torch.device = "cpu", baseline: int = 0) -> Placement:
    """Choose in-memory vs storage-backed loading and the reshuffling mode (PP-GNN §5, on a CPU).

    Rules: two batch buffers must fit the budget (else there is no way to train: error). With
    ``loader="auto"``, the split rows of the used hops go in memory when they and the buffers fit, with
    exact reshuffling and index assembly — prefetched when there is compute to overlap with
    (:func:`spare_compute`) — or chunk reshuffling when ``chunk_size > 1`` is given; otherwise they stay
    in the files and whole chunks are read, always prefetched (reads wait on storage, not the CPU), with
    chunk size default the batch size (PP-GNN §6.2), since row-granular reads from storage would be random
    512-byte reads. An explicit in-memory loader whose data does not fit is refused rather than left to
    swap.

    ``memory_budget`` caps the process's peak ``RssAnon``, as it does for every strategy: the data get what is
    left after ``baseline``, what the process takes before loading them (interpreter, torch, the model). The
    default, 80% of the memory available now, already leaves out what the process holds.

    Raises:
        TrellisUserError: Budget below one double-buffered batch; an explicit loader that does not fit;
            conflicting flags.
    """
    if loader not in LOADERS:
        raise TrellisUserError(f"unknown --pp-loader {loader!r}; use one of {', '.join(LOADERS)}")
    if batch_size < 1:
        raise TrellisUserError(f"--batch-size {batch_size} must be >= 1")
    if chunk_size is not None and chunk_size < 1:
        raise TrellisUserError(f"--chunk-size {chunk_size} must be >= 1 (1 = exact random reshuffling)")
    given = taken = 0
    if memory_budget is None:
        budget, source = default_budget()
    else:
        given = parse_size(memory_budget, flag="--memory-budget")
        taken = baseline + PP_MARGIN_BYTES if baseline else 0
        budget = given - taken
        source = (f"--memory-budget {format_budget(given)} less {format_size(taken)}: what the process takes itself "
                  "and head-room" if baseline else "--memory-budget")
    h = len(hops)
    a, b = split_rows(cache)
    row = h * cache.row_bytes
    data = (b - a) * row
    # a batch buffer holds at most a split's rows (and one more: a last batch of one row joins the one before)
    largest = max(hi - lo for lo, hi in (cache.split_range(s) for s in ("train", "val", "test")))
    rows = min(batch_size + 1, max(1, largest))
    batch = rows * row
    buffers = 2 * batch
    if taken and budget < buffers:  # a process's budget: name the smallest that holds it and one batch
        raise BudgetTooSmall(
            f"--memory-budget {format_budget(given)} is too small for one batch beside the process itself and "
            f"head-room ({format_size(taken)}): {rows} rows × {h} hops × {cache.num_features} features × 4 B, "
            f"double-buffered = {format_size(buffers)}; the smallest budget is {format_size(taken + buffers)} "
            "(raise --memory-budget, or lower --batch-size)", taken + buffers)
    if budget < buffers:
        raise TrellisUserError(
            f"memory budget {format_size(budget)} ({source}) is too small for one batch: {rows} rows × "
            f"{h} hops × {cache.num_features} features × 4 B, double-buffered = {format_size(buffers)}; raise "
            "--memory-budget or lower --batch-size"
        )
    train = cache.split_range("train")
    naive_extra = (train[1] - train[0]) * row  # the baselines' contiguous TensorDataset copy
    fits = data + buffers <= budget
    if loader == "auto":
        if fits:
            c = chunk_size or 1
            spare, spare_why = spare_compute(device)
            mode = ("prefetch" if spare else "index") if c == 1 else "chunk"
            why = (f"the {b - a:,} split rows of {h} hop(s) take {format_size(data)}, which fits the budget "
                   f"{format_size(budget)} ({source}); ")
            why += (f"exact reshuffling with one gather per batch, {'' if spare else 'not '}prefetched "
                    f"({spare_why}); give --chunk-size to trade shuffling for zero-copy chunks" if c == 1 else
                    f"--chunk-size {c} asks for chunk reshuffling")
            return Placement(mode, "memory", c, mode != "index", budget, source, data, batch, why)
        c = chunk_size or batch_size
        why = (f"the {b - a:,} split rows of {h} hop(s) take {format_size(data)}, more than the budget "
               f"{format_size(budget)} ({source}) minus two batch buffers; reading whole chunks of {c} rows from "
               "the hop files")
        if c * cache.row_bytes < _MIN_READ_BYTES:
            why += " (chunks this small make storage reads nearly random: expect it to be slow)"
        return Placement("storage", "storage", c, True, budget, source, data, batch, why)
    if loader in MEMORY_LOADERS:
        need = data + buffers + (naive_extra if loader.startswith("naive") else 0)
        if need > budget:
            raise TrellisUserError(
                f"--pp-loader {loader} keeps {format_size(need)} in memory but the budget is {format_size(budget)} "
                f"({source}); use --pp-loader storage (or auto), fewer hops, or a larger --memory-budget"
            )
    if loader in ("naive", "naive-batch", "index", "prefetch"):
        if chunk_size not in (None, 1):
            raise TrellisUserError(
                f"--chunk-size applies to --pp-loader chunk, storage or auto, not {loader} (exact reshuffling)")
        return Placement(loader, "memory", 1, loader == "prefetch", budget, source, data, batch,
                         f"--pp-loader {loader} asked for; the split rows take {format_size(data)}")
    c = chunk_size or batch_size
    where = "memory" if loader == "chunk" else "storage"
    return Placement(loader, where, c, True, budget, source, data, batch,
                     f"--pp-loader {loader} asked for; the split rows take {format_size(data)}")


class PPData:
    """The training loader and evaluation passes for one placement (what a trainer holds).

    Args:
        cache: The pre-propagated cache.
        hops: Hops the model reads (e.g. ``(R,)`` for SGC, ``0..R`` for SIGN/HOGA).
        placement: From :func:`plan_placement`.
        batch_size: Training batch size.
        seed: Base shuffle seed.
        eval_batch_size: Batch size of evaluation passes (default: ``max(batch_size, 8192)``, capped to
            the budget).
    """

    def __init__(self, cache: PPCache, hops: Sequence[int], placement: Placement, batch_size: int, *,
                 seed: int = 0, eval_batch_size: int | None = None) -> None:
        self.cache = cache
        self.hops = tuple(hops)
        self.placement = placement
        rows = split_rows(cache)
        if placement.placement == "memory":
            self.source: RowSource = MemorySource(cache, hops, rows)
        else:
            self.source = StorageSource(cache, hops, rows)
        train = cache.split_range("train")
        if train[1] <= train[0]:
            raise TrellisUserError(f"{cache.path}: the store has no training rows (empty train split)")
        if placement.loader in ("naive", "naive-batch"):
            assert isinstance(self.source, MemorySource)
            self.train: PPLoader | NaiveLoader = NaiveLoader(
                self.source, batch_size, batch_sampler=placement.loader == "naive-batch", seed=seed, row_range=train)
        else:
            self.train = PPLoader(self.source, batch_size, chunk_size=placement.chunk_size, shuffle=True,
                                  prefetch=placement.prefetch, seed=seed, row_range=train, name=placement.loader)
        eb = eval_batch_size or max(batch_size, 8192)
        if placement.placement == "storage":  # its two buffers beside the training loader's (which stay)
            room = placement.budget - 2 * placement.batch_bytes
            eb = max(1, min(eb, room // max(1, 2 * len(self.hops) * cache.row_bytes)))
        self.eval_batch_size = eb
        self._eval_buffers: list[torch.Tensor] = []

    def iter_split(self, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Sequential batches of ``split`` (no shuffle; whole contiguous slices)."""
        rng = self.cache.split_range(split)
        if rng[1] <= rng[0]:
            return iter(())
        loader = PPLoader(self.source, self.eval_batch_size, chunk_size=self.eval_batch_size, shuffle=False,
                          prefetch=self.source.on_storage, row_range=rng, name="eval",
                          buffers=self._eval_buffers)
        return iter(loader)

    def close(self) -> None:
        """Release the source's files and threads."""
        self.source.close()
