"""Feature sources: rows of a feature table by id, whether they sit in memory, in a memory map or in files.

Why one interface: every loader ends its batch the same way -- "give me the rows of these ids" -- but the
rows live in different places. A neighbour or cluster batch gathers input features from a tensor or the
store's memory map; a pre-propagated batch gathers hop stacks from RAM or reads whole chunks from the
hop files. Behind :class:`FeatureSource` the loaders do not care which, and training beyond memory (a
tile reader) or distributed training (a peer's rows) adds a source, not a loader.

The contract (:meth:`FeatureSource.gather`): rows ``ids`` as a ``[len(ids), *row_shape]`` tensor. With
``out`` -- a flat buffer from :meth:`FeatureSource.new_buffer` -- the rows land in it (no allocation per
batch: batches are tens of MB, and fresh tensors cost page faults every time); a source may ignore
``out`` when it has something cheaper (a device tensor's ``index_select``, a view of one contiguous
range). The result may be a non-contiguous view (hop-major buffers are yielded as ``[n, H, F]``).

Implementations: :class:`ArrayRows` (a numpy array or memory map, read in place by a ``nogil`` numba
gather), :class:`TensorRows` (a torch tensor on any device), and the pre-propagated hop stacks of
:mod:`trellis.loader.pp` (``MemorySource`` loaded into RAM, ``StorageSource`` read with ``preadv``).
:class:`FeatureGather` puts any source behind the rotating buffers that prefetching loaders need.
"""

from __future__ import annotations

import math
import threading
import warnings
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from trellis.utils.numba import njit, prange

#: Rows x (features / 32) below which the serial gather runs (a thread team costs more than the copy).
GATHER_PARALLEL_MIN_WORK = 5_000


def _gather_rows_py(src, ids, out):  # pragma: no cover - compiled
    """``out[i] = src[ids[i]]`` for every row."""
    for i in prange(ids.shape[0]):
        out[i, :] = src[ids[i], :]


_gather_par = njit(nogil=True, parallel=True, cache=True)(_gather_rows_py)
_gather_seq = njit(nogil=True, cache=True)(_gather_rows_py)


def gather_rows(src: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = src[ids[i]]`` for every row, in parallel when large (the input-feature gather)."""
    work = ids.shape[0] * max(1, src.shape[1] // 32)
    f = _gather_par if work >= GATHER_PARALLEL_MIN_WORK else _gather_seq
    f(src, ids, out)


def np_int64(a: np.ndarray | Tensor) -> np.ndarray:
    """A contiguous ``int64`` numpy array of ``a`` (a CPU copy of a tensor; arrays are converted only if needed)."""
    if isinstance(a, Tensor):
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(a), dtype=np.int64)


def expand_ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, e)`` for each pair, vectorized."""
    lens = stops - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.cumsum(lens) - lens
    return np.repeat(starts - offs, lens) + np.arange(total, dtype=np.int64)


class FeatureSource(ABC):
    """Rows of a feature table by id: ``gather(ids) -> Tensor``, plus the table's shape and size.

    Subclasses set ``num_rows``, ``dim`` and ``dtype`` (and ``row_shape`` when a row is more than one
    vector, e.g. ``(hops, dim)`` for a pre-propagated hop stack).

    Attributes:
        num_rows: Rows in the table (valid ids are ``0..num_rows-1``).
        dim: Features per row (per hop for a hop stack).
        dtype: Element type of the gathered rows.
        on_storage: Rows are read from files on demand: reading ids in ascending order is faster, and
            reads wait on storage rather than the CPU, so loaders prefetch them (class constant).
        range_views: :meth:`read_ranges` of a single range returns a view without copying (class constant).
        gathers_sparse: :meth:`gather` returns a CSR tensor (:class:`SparseRows`) and takes no ``out`` buffer
            (class constant).
    """

    num_rows: int
    dim: int
    dtype: torch.dtype
    on_storage: ClassVar[bool] = False
    range_views: ClassVar[bool] = False
    gathers_sparse: ClassVar[bool] = False

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one gathered row (default: ``(dim,)``)."""
        return (self.dim,)

    @property
    def device(self) -> torch.device:
        """Where gathered rows are delivered (default: the CPU)."""
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes of the whole table (what holding it in memory would cost)."""
        return self.num_rows * math.prod(self.row_shape) * torch.empty((), dtype=self.dtype).element_size()

    def new_buffer(self, rows: int, *, pin: bool = False) -> Tensor:
        """A flat buffer with room for ``rows`` gathered rows (pinned for fast host->GPU copies when ``pin``)."""
        return torch.empty(rows * math.prod(self.row_shape), dtype=self.dtype, pin_memory=pin)

    @abstractmethod
    def gather(self, ids: np.ndarray | Tensor, out: Tensor | None = None) -> Tensor:
        """Rows ``ids`` (any order) as ``[len(ids), *row_shape]``, in ``out`` when given and used."""

    def read_ranges(self, starts: np.ndarray, stops: np.ndarray, out: Tensor | None = None) -> Tensor:
        """Rows of the ranges ``[starts[i], stops[i])`` in order (a source may read whole ranges at once)."""
        return self.gather(expand_ranges(starts, stops), out)

    def close(self) -> None:  # noqa: B027 - optional hook: only storage sources hold files
        """Release files and threads."""


class ArrayRows(FeatureSource):
    """A numpy array or memory map, gathered in place by the numba kernel (a memory map is never copied).

    Args:
        x: ``[N, F]`` rows (other shapes are flattened to ``[N, -1]``).
    """

    def __init__(self, x: np.ndarray) -> None:
        arr = np.asarray(x)
        self.x = arr.reshape(arr.shape[0], -1) if arr.ndim != 2 else arr
        self.num_rows = int(self.x.shape[0])
        self.dim = int(self.x.shape[1])
        self.dtype = torch.from_numpy(np.empty(0, dtype=self.x.dtype)).dtype

    def gather(self, ids: np.ndarray | Tensor, out: Tensor | None = None) -> Tensor:
        """Rows ``x[ids]`` as ``[len(ids), dim]``, written into ``out`` when given."""
        ids_np = np_int64(ids)
        n = ids_np.shape[0]
        rows = torch.empty((n, self.dim), dtype=self.dtype) if out is None else out[: n * self.dim].view(n, self.dim)
        if n:
            gather_rows(self.x, ids_np, rows.numpy())
        return rows


class TensorRows(FeatureSource):
    """A torch tensor as a feature source.

    A CPU tensor is gathered like an array (through its numpy view), a device tensor by ``index_select``
    on its device (``out`` is then unused).

    Args:
        x: ``[N, F]`` rows.
    """

    def __init__(self, x: Tensor) -> None:
        self.x = x
        self._cpu = ArrayRows(x.detach().numpy()) if x.device.type == "cpu" else None
        self.num_rows = int(x.shape[0])
        self.dim = self._cpu.dim if self._cpu is not None else math.prod(x.shape[1:])
        self.dtype = x.dtype

    @property
    def device(self) -> torch.device:
        """The tensor's device."""
        return self.x.device

    def gather(self, ids: np.ndarray | Tensor, out: Tensor | None = None) -> Tensor:
        """Rows ``x[ids]`` as ``[len(ids), dim]`` on the tensor's device."""
        if self._cpu is not None:
            return self._cpu.gather(ids, out)
        idx = ids if isinstance(ids, Tensor) else torch.from_numpy(np_int64(ids))
        return self.x.index_select(0, idx.to(self.x.device))


class NormalizedRows(FeatureSource):
    """Another source's rows divided by their L1 (``row``) or L2 (``l2``) norm as they are gathered.

    Why at gather: a row's normalization depends on that row only, so a memory-mapped table is normalized
    on the rows a batch reads instead of being copied whole into memory to normalize it once. The arithmetic
    is :func:`trellis.train.data.normalize_features`'s, row for row, so batches equal the in-memory ones.

    Args:
        source: The raw rows.
        mode: ``row``, ``l2`` or ``none``.
    """

    def __init__(self, source: FeatureSource, mode: str) -> None:
        self.source = source
        self.mode = mode
        self.num_rows, self.dim, self.dtype = source.num_rows, source.dim, source.dtype
        self.on_storage = source.on_storage  # type: ignore[misc]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The source's row shape."""
        return self.source.row_shape

    @property
    def device(self) -> torch.device:
        """The source's device."""
        return self.source.device

    def gather(self, ids: np.ndarray | Tensor, out: Tensor | None = None) -> Tensor:
        """The source's rows ``ids``, normalized."""
        rows = self.source.gather(ids, out)
        normalize_rows_(rows, self.mode)
        return rows

    def close(self) -> None:
        """Close the source."""
        self.source.close()


#: Elements of rows :func:`normalize_rows_` normalizes at a time.
NORMALIZE_CHUNK = 1 << 22


class SparseRows(FeatureSource):
    """Mostly-zero rows (bag-of-words) held as one CSR matrix; :meth:`gather` returns the rows as a CSR tensor.

    Why: a batch strategy's first layer takes bag-of-words rows sparse (:mod:`trellis.ops.sparse_rows`), and
    gathering them dense, normalizing and converting each batch cost more than the training step (Coauthor
    Physics, 8,415 words per row, 0.4% non-zero: 1.16 GB of dense rows per exact evaluation). Gathered here, a
    batch's rows are its rows' non-zeros. The gathered CSR is exactly what converting the dense gathered rows
    gives (each row's non-zeros in column order, the values normalized by the same arithmetic), so a run's
    batches and evaluations do not depend on which of the two built them.

    Args:
        x: ``[N, F]`` CSR tensor of the (normalized) rows.
    """

    gathers_sparse: ClassVar[bool] = True

    def __init__(self, x: Tensor) -> None:
        self.crow = np_int64(x.crow_indices())
        self.col = np_int64(x.col_indices())
        self.val = x.values().numpy()
        self.num_rows, self.dim = int(x.shape[0]), int(x.shape[1])
        self.dtype = x.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the CSR arrays (what the rows take in memory)."""
        return int(self.crow.nbytes + self.col.nbytes + self.val.nbytes)

    def new_buffer(self, rows: int, *, pin: bool = False) -> Tensor:
        """No buffer: gathered rows are as large as their non-zeros."""
        return torch.empty(0, dtype=self.dtype)

    def gather(self, ids: np.ndarray | Tensor, out: Tensor | None = None) -> Tensor:
        """Rows ``ids`` as a ``[len(ids), dim]`` CSR tensor (``out`` is not used)."""
        idx = np_int64(ids)
        starts, stops = self.crow[idx], self.crow[idx + 1]
        crow = np.zeros(idx.shape[0] + 1, dtype=np.int64)
        np.cumsum(stops - starts, out=crow[1:])
        pos = expand_ranges(starts, stops)
        with warnings.catch_warnings():  # "sparse CSR support is in beta" (trellis.ops.sparse_rows)
            warnings.simplefilter("ignore", UserWarning)
            return torch.sparse_csr_tensor(torch.from_numpy(crow), torch.from_numpy(self.col[pos]),
                                           torch.from_numpy(self.val[pos]), size=(idx.shape[0], self.dim))


def normalize_rows_(x: np.ndarray | Tensor, mode: str, chunk: int = NORMALIZE_CHUNK) -> None:
    """Divide each row by its L1 (``row``) or L2 (``l2``) norm in place; ``none`` leaves it (all-zero rows stay).

    A few MB of rows at a time: the L1 norm's ``abs()`` is a copy, which for a whole batch or evaluation chunk of
    bag-of-words rows was a second copy of them (Coauthor Physics: 1.16 GB beside the 1.16 GB of rows gathered
    for an exact evaluation, and half a second). Each row's norm is the same reduction whatever rows surround
    it, so the values are the whole-tensor version's bits (tested).
    """
    if mode not in ("row", "l2") or x.shape[0] == 0:
        return
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    t = t.reshape(t.shape[0], -1)
    step = max(1, chunk // max(1, t.shape[1]))
    for a in range(0, t.shape[0], step):
        rows = t[a:a + step]
        norm = rows.abs().sum(dim=1, keepdim=True) if mode == "row" else rows.norm(dim=1, keepdim=True)
        rows.div_(norm.clamp_(min=torch.finfo(t.dtype).tiny))


def as_feature_source(x: np.ndarray | Tensor | FeatureSource) -> FeatureSource:
    """``x`` as a :class:`FeatureSource` (a source is returned as is)."""
    if isinstance(x, FeatureSource):
        return x
    if isinstance(x, Tensor):
        return TensorRows(x)
    return ArrayRows(x)


def copy_rows(x: np.ndarray | Tensor | FeatureSource, device: torch.device, chunk_bytes: int = 64 * 2**20) -> Tensor:
    """All rows of ``x`` as one dense ``[N, *row_shape]`` tensor on ``device``, about ``chunk_bytes`` at a time.

    Why through the source's own gather: the copy then holds exactly the rows a batch would have gathered
    (a bag-of-words store's rows normalized by the same code), so batches gathered from it equal the host's,
    and the host never holds more than one chunk beside the source.
    """
    src = as_feature_source(x)
    out = torch.empty((src.num_rows, *src.row_shape), dtype=src.dtype, device=device)
    chunk_rows = max(1, chunk_bytes * src.num_rows // max(1, src.nbytes))
    for lo in range(0, src.num_rows, chunk_rows):
        hi = min(src.num_rows, lo + chunk_rows)
        out[lo:hi].copy_(src.read_ranges(np.array([lo]), np.array([hi])).reshape(hi - lo, *src.row_shape))
    return out


class FeatureGather:
    """Gathers rows of a :class:`FeatureSource` by node id into reused, rotating buffers.

    Why reused buffers: a batch's input rows are tens of MB; allocating (and on CUDA, pinning) them per
    batch costs more than the copy. Buffers rotate over ``slots``: batch ``i`` writes slot ``i % slots``,
    so with a prefetch depth ``d`` and ``slots >= d + 2`` no buffer is overwritten while the trainer still
    reads it (the trainer holds one batch, ``d`` wait in the queue, one is being filled).

    Args:
        x: The rows: a :class:`FeatureSource`, or an array, memory map or tensor (:func:`as_feature_source`).
        slots: Number of rotating buffers (default: 4).
        pin: Allocate pinned buffers for fast host->GPU copies (default: False; the loader sets it for CUDA).

    Attributes:
        consumer: The consumer of the batches gathers these rows, not sampler processes (default: rows on an
            accelerator; ``--feature-residency device`` sets it for rows held in the trainer's memory too). A
            :class:`~trellis.loader.producer.BatchProducer` leaves such a gather out of its workers' copy of
            the loader and fills each arriving batch's rows itself.
    """

    def __init__(self, x: np.ndarray | Tensor | FeatureSource, *, slots: int = 4, pin: bool = False) -> None:
        self.source = as_feature_source(x)
        self.device = self.source.device
        self.consumer = self.device.type != "cpu"
        self.slots = max(1, int(slots))
        self.pin = pin and torch.cuda.is_available()
        self._buffers: dict[int, Tensor] = {}
        self._lock = threading.Lock()

    @property
    def num_features(self) -> int:
        """Features per row."""
        return self.source.dim

    def _buffer(self, slot: int, rows: int) -> Tensor:
        with self._lock:
            buf = self._buffers.get(slot)
            need = rows * math.prod(self.source.row_shape)
            if buf is None or buf.numel() < need:
                cap = max(rows, int(rows * 1.25) if buf is not None else rows)
                buf = self.source.new_buffer(cap, pin=self.pin)
                self._buffers[slot] = buf
            return buf

    def gather(self, ids: np.ndarray | Tensor, slot: int | None = None) -> Tensor:
        """Rows ``x[ids]``; with ``slot`` they land in (a view of) that reused buffer, else in a new tensor."""
        out = None
        if slot is not None and self.device.type == "cpu" and not self.source.gathers_sparse:
            out = self._buffer(slot % self.slots, int(ids.shape[0]))
        return self.source.gather(ids, out)

    def __getstate__(self) -> dict[str, object]:
        """Pickle without the lock and buffers (a worker process builds its own)."""
        state = self.__dict__.copy()
        state["_buffers"] = {}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        """Restore a pickled gather with a fresh lock."""
        self.__dict__.update(state)
        self._lock = threading.Lock()


__all__ = ["ArrayRows", "FeatureGather", "FeatureSource", "NormalizedRows", "SparseRows", "normalize_rows_",
           "TensorRows", "as_feature_source", "copy_rows", "expand_ranges",
           "gather_rows", "np_int64"]
