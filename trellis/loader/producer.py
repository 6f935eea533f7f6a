"""Batch producers: an epoch's batches built on threads (``--workers``) or in worker processes (``--samplers K``).

Why processes at all: the sampling and gather kernels release the GIL, but everything around them -- the
plan slicing, building the :class:`~trellis.ops.graph.CSRGraph` objects, the label and edge-data lookups --
is Python that holds it, and it competes with the trainer's own Python for the one interpreter. A worker
*process* has its own interpreter, so batch preparation scales with cores instead of with GIL-free work.
What it costs is moving the batch back; this module keeps that to one memory copy and no pickling of tensor
data:

* **One flat message per batch.** :func:`encode_batch` lays every tensor of a batch (every block's CSR,
  reverse CSR, edge ids, degrees, edge data; ``node_ids``, ``x``, ``y``, ``loss_mask``) into ONE byte buffer
  and describes them in an ``int64`` header; the small rest (the dataclasses, ``num_targets``, ``stats``,
  which block objects are shared, the block classes) is a pickle of a few hundred bytes inside the same
  buffer, with tensors replaced by their header index. Tensors that alias each other in the batch (the
  prefix views of ``node_ids`` every block holds, ``dst_degree`` as a prefix of ``src_degree``, a cluster
  batch's one graph used by every layer) are stored once and alias each other again after
  :func:`decode_batch`, which returns views of the buffer -- no copy on the consumer's side.
* **The buffer lives in shared memory.** A worker allocates it in an anonymous memory file (``memfd``),
  encodes the batch straight into it and passes the file descriptor over its pipe (``SCM_RIGHTS``); the
  consumer maps it. No named segment exists at any time, so nothing can be left in ``/dev/shm`` even when a
  worker is killed, and the memory is freed when the consumer drops the batch's last tensor.
* **A persistent pool.** A worker process starts once per :class:`BatchProducer` (seconds with torch
  imported) and serves every epoch: per epoch only the plan is sent. Workers start from a ``forkserver``
  that has imported this module (so each worker is a cheap fork of a process that never started a thread:
  forking the trainer itself after torch's or numba's thread pools started is unsafe), or by ``spawn``.
* **The source is sent once, without copying its data needlessly.** Arrays that are memory maps of files
  (the store's CSR and features) are reopened by file name and offset in each worker instead of pickled
  (``np.memmap`` would pickle as a full copy); large in-memory arrays and tensors (features or labels
  loaded into RAM, degree tables) are copied once into shared memory that every worker maps.

Contract, shared with :class:`~trellis.loader.prefetch.Prefetcher`: batches come out in index order and
identical to ``source.get(plan, i)`` called sequentially (``get`` is a pure function of ``(plan, i)``, see
:mod:`trellis.loader.source`); a bounded number is in flight; the first exception of a ``get`` is re-raised
in the consumer, with the worker's traceback as its cause; leaving the loop early or calling ``close`` stops
everything; ``wait_s`` counts the seconds the consumer waited. Faults a thread pool cannot have are turned
into errors, never hangs: a worker that dies (killed, out of memory) raises a :class:`RuntimeError` naming it
within the poll interval, one that stays silent longer than ``timeout_s`` too.

Example -- a strategy's epoch loop, workers started once and reused::

    from trellis.loader.producer import BatchProducer, ProducerOptions

    producer = BatchProducer(loader, ProducerOptions.from_flags(samplers=4, prefetch=4))
    for epoch in range(epochs):
        with producer.epoch(epoch_seed()) as batches:
            for batch in batches:
                step(batch)
        storage_reads = own_reads + batches.read_bytes  # the workers' reads are not in /proc/self/io
    producer.close()
"""

from __future__ import annotations

import io
import math
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import socket
import struct
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import torch
from torch import Tensor

from trellis.errors import ProcessFailure, TrellisUserError
from trellis.loader.blocks import Batch
from trellis.loader.features import FeatureGather
from trellis.loader.prefetch import Prefetcher
from trellis.loader.source import BatchSource, iter_epoch
from trellis.utils.memory import proc_io
from trellis.utils.numba import set_threads
from trellis.utils.priority import set_background

T = TypeVar("T")

#: ``ProducerOptions.mode`` choices.
MODES = ("threads", "processes")
#: ``ProducerOptions.start_method`` choices (``fork`` is left out on purpose: see the module docstring).
START_METHODS = ("forkserver", "spawn")

# ---- options -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProducerOptions:
    """How an epoch's batches are produced.

    Attributes:
        mode: ``threads`` (batches built on threads of this process, :func:`~trellis.loader.source.iter_epoch`)
            or ``processes`` (built in worker processes, ``--samplers``).
        workers: Threads (``threads``) or worker processes (``processes``) building batches; at least 1.
        prefetch: Batches prepared ahead of the consumer. In ``processes`` mode at least ``workers`` are in
            flight whatever this says (a worker without a batch to build would sit idle); in ``threads`` mode
            0 builds each batch in the caller's thread when asked for.
        threads_per_worker: torch and numba threads of each worker process (default 1: K workers beside a
            trainer that uses every core already oversubscribe them).
        start_method: ``forkserver`` (default: each worker a fork of a clean server process that has imported
            torch once) or ``spawn`` (each worker a fresh interpreter).
        timeout_s: Seconds a live worker may stay silent while the consumer waits for its batch before it is
            declared hung (None = wait as long as it lives). The first batch of a worker includes loading its
            compiled kernels.
        recycle: Reuse each worker's shared-memory buffers: a batch's memory goes back to its worker when the
            consumer asks for the next batch, the contract of the loaders' rotating feature buffers (a consumer
            holds one batch at a time; copy what it keeps). Default off: every batch gets its own memory.
            Why: a fresh buffer per batch is tens of MB of pages allocated by a worker, faulted in by the
            trainer's threads and freed by the consumer. On 16 cores that capped the producer at about 20
            batches per second whatever the number of workers, and training on such memory took 1.8x as long
            (docs/benchmarks.md). Training loops turn it on.
        background: Workers run at the lowest CPU priority (:mod:`trellis.utils.priority`): they take only the
            CPU time the trainer leaves idle (:meth:`BatchProducer.set_background` switches). Training loops turn
            it on when the trainer keeps every core (``leave_cores`` freed none) and then choose by measurement.
    """

    mode: str = "threads"
    workers: int = 1
    prefetch: int = 2
    threads_per_worker: int = 1
    start_method: str = "forkserver"
    timeout_s: float | None = 600.0
    recycle: bool = False
    background: bool = False

    def __post_init__(self) -> None:
        """Validate, naming the flag a user would change."""
        if self.mode not in MODES:
            raise TrellisUserError(f"producer mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "processes":
            if int(self.workers) < 1:
                raise TrellisUserError(f"--samplers {self.workers}: give the number of sampler processes (1 or "
                                       "more), or --samplers 0 to prepare batches on threads")
            if os.name != "posix":
                raise TrellisUserError("--samplers needs a POSIX system (batches are passed as shared-memory file "
                                       "descriptors); use --samplers 0 to prepare batches on threads")
        elif int(self.workers) < 1:
            raise TrellisUserError(f"--workers {self.workers}: give the number of preparing threads (1 or more)")
        if int(self.prefetch) < 0:
            raise TrellisUserError(f"--prefetch {self.prefetch}: give the number of batches prepared ahead "
                                   "(0 or more)")
        if int(self.threads_per_worker) < 1:
            raise TrellisUserError(f"threads_per_worker {self.threads_per_worker}: each sampler process needs at "
                                   "least 1 thread")
        if self.start_method not in START_METHODS:
            raise TrellisUserError(f"start method {self.start_method!r} is not one of {', '.join(START_METHODS)} "
                                   "(fork is unsafe once torch or numba started threads)")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise TrellisUserError(f"timeout_s {self.timeout_s}: give a positive number of seconds, or None")

    @classmethod
    def from_flags(cls, samplers: int = 0, *, prefetch: int = 2, workers: int = 1,
                   threads_per_worker: int = 1, recycle: bool = False,
                   background: bool = False) -> ProducerOptions:
        """Options from command-line flags: ``--samplers K`` > 0 selects K worker processes, 0 threads.

        Raises:
            TrellisUserError: A negative ``--samplers`` or an invalid other value.
        """
        if int(samplers) < 0:
            raise TrellisUserError(f"--samplers {samplers}: give the number of sampler processes (1 or more), or 0 "
                                   "to prepare batches on threads")
        if int(samplers) > 0:
            return cls("processes", int(samplers), int(prefetch), int(threads_per_worker), recycle=recycle,
                       background=background)
        return cls("threads", int(workers), int(prefetch), int(threads_per_worker), recycle=recycle)

    @property
    def in_flight(self) -> int:
        """Batches requested ahead of the consumer in ``processes`` mode (``max(prefetch, workers)``)."""
        return max(int(self.prefetch), int(self.workers))


# ---- the flat message ---------------------------------------------------------------------------------

#: Element types a message carries in its buffer (their index is the header's dtype code).
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_CODE = {dt: k for k, dt in enumerate(_DTYPES)}
_MAGIC = 0x5452454C4C4953  # "TRELLIS"
_VERSION = 1
_ALIGN = 64  # every stored span starts on a cache line (and on any element size)
_HEAD = 6  # magic, version, buffer bytes, pickle offset, pickle length, tensor count
_REC = 4  # per tensor: dtype code, ndim, byte offset, requires_grad; then shape and strides


class BatchMessage(NamedTuple):
    """A batch as one flat message: an ``int64`` header and one byte buffer.

    Attributes:
        header: ``int64 [H]``: magic, version, buffer size, where the pickled skeleton lies in the buffer,
            the tensor count, then per tensor its dtype code, ndim, byte offset, requires_grad flag, shape
            and strides (in elements).
        payload: ``uint8 [B]``: the tensors' bytes (each aliasing group once, 64-byte aligned), then the
            skeleton: the batch pickled with every tensor replaced by its index in the header.
    """

    header: Tensor
    payload: Tensor


def _packable(t: Tensor) -> bool:
    """Whether the buffer can carry ``t``; anything else is left to pickle (copied into the skeleton).

    Carried: dense CPU tensors of a known dtype whose elements do not overlap beyond broadcast dimensions.
    """
    if type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout != torch.strided:
        return False
    if t.dtype not in _DTYPE_CODE or t.is_conj() or t.is_neg() or t.is_quantized:
        return False
    if t.numel() == 0:
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1 and st != 0)
    reach = 1
    for st, sz in dims:  # non-broadcast dims must not overlap each other (any dense or sliced view)
        if st < reach:
            return False
        reach = st * sz
    return True


def _collapse_broadcast(t: Tensor) -> Tensor:
    """``t`` with broadcast (stride-0) dimensions cut to length 1: the elements actually stored."""
    for d, (st, sz) in enumerate(zip(t.stride(), t.shape)):
        if st == 0 and sz > 1:
            t = t.narrow(d, 0, 1)
    return t


class _TensorPickler(pickle.Pickler):
    """Pickles an object with every packable tensor replaced by its index (same object -> same index)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:  # noqa: D102 - pickle hook
        if isinstance(obj, Tensor) and _packable(obj):
            k = self._index.get(id(obj))
            if k is None:
                k = self._index[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return k
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Tensor]) -> None:
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Tensor:  # noqa: D102 - pickle hook
        return self.tensors[int(pid)]


def _extent(t: Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the bytes of memory ``t`` reads (``numel > 0``)."""
    last = sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return lo, lo + (last + 1) * t.element_size()


def _layout(tensors: list[Tensor]) -> tuple[list[int], int]:
    """Byte offset in the buffer of each tensor's first element, and the bytes the tensors take.

    Tensors whose memory overlaps (views of one storage) are merged into one span, stored once, so they
    alias again after decoding. Spans are grouped by dtype and by address modulo the element size, so every
    tensor's offset is a whole number of its elements from a 64-byte aligned start.
    """
    groups: dict[tuple[torch.dtype, int], list[tuple[int, int, int]]] = {}
    for k, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        lo, hi = _extent(t)
        groups.setdefault((t.dtype, lo % t.element_size()), []).append((lo, hi, k))
    offsets = [0] * len(tensors)
    pos = 0
    for items in groups.values():
        items.sort()
        spans: list[list[tuple[int, int, int]]] = []
        end = -1
        for item in items:
            if spans and item[0] < end:  # overlaps the open span: the same memory, stored once
                spans[-1].append(item)
                end = max(end, item[1])
            else:
                spans.append([item])
                end = item[1]
        for span in spans:
            start = -(-pos // _ALIGN) * _ALIGN
            span_lo = span[0][0]
            for lo, _, k in span:
                offsets[k] = start + lo - span_lo
            pos = start + max(hi for _, hi, _ in span) - span_lo
    return offsets, pos


def _typed(payload: Tensor, dtype: torch.dtype, cache: dict[torch.dtype, Tensor]) -> Tensor:
    view = cache.get(dtype)
    if view is None:
        view = cache[dtype] = payload.view(dtype)
    return view


def encode_batch(batch: Any, alloc: Callable[[int], Tensor] | None = None,
                 fill: dict[int, Callable[[Tensor], None]] | None = None) -> BatchMessage:
    """Encode a batch (or any picklable object holding tensors) as one flat :class:`BatchMessage`.

    Every dense CPU tensor goes into the buffer (aliasing tensors once); everything else -- the dataclasses,
    which block objects are shared, a block's class (:class:`~trellis.loader.sampler.LazyReverseBlock` stays
    lazy), a prebuilt reverse CSR and its ``perm`` (cycles included), ``stats`` -- into the small pickled
    skeleton. :func:`decode_batch` restores it exactly: same values, dtypes, shapes and strides, same object
    sharing. A tensor the buffer cannot hold (sparse, on an accelerator) is pickled into the skeleton.

    Args:
        batch: The batch.
        alloc: Returns a ``uint8`` tensor of exactly the given number of bytes to encode into (e.g. shared
            memory); default: a new tensor.
        fill: Tensors (by ``id``) whose bytes are not copied but written by the function given, into their
            place in the message: a placeholder a batch's rows are gathered straight into (no second copy).

    Returns:
        The message; its ``payload`` is the tensor ``alloc`` returned.
    """
    skel_io = io.BytesIO()
    pickler = _TensorPickler(skel_io)
    pickler.dump(batch)
    skeleton = skel_io.getbuffer()
    tensors = pickler.tensors
    offsets, data_end = _layout(tensors)
    skel_off = -(-data_end // _ALIGN) * _ALIGN
    total = max(_ALIGN, -(-(skel_off + len(skeleton)) // _ALIGN) * _ALIGN)
    payload = torch.empty(total, dtype=torch.uint8) if alloc is None else alloc(total)
    if payload.dtype != torch.uint8 or payload.numel() != total or not payload.is_contiguous():
        raise ValueError(f"alloc must return a contiguous uint8 tensor of {total} bytes")
    header: list[int] = [_MAGIC, _VERSION, total, skel_off, len(skeleton), len(tensors)]
    views: dict[torch.dtype, Tensor] = {}
    # [lo, hi) of the contiguous tensors copied so far, per span group (dtype, address modulo element size)
    written: dict[tuple[torch.dtype, int], list[tuple[int, int]]] = {}
    for k in sorted(range(len(tensors)), key=lambda k: -tensors[k].numel()):  # big first: views inside are free
        t = tensors[k]
        if t.numel() == 0:
            continue
        lo, hi = _extent(t)
        done = written.setdefault((t.dtype, lo % t.element_size()), [])
        if any(a <= lo and hi <= b for a, b in done):
            continue  # a view inside memory already copied (e.g. a block's prefix of node_ids)
        src = _collapse_broadcast(t)
        dst = _typed(payload, t.dtype, views).as_strided(src.shape, src.stride(), offsets[k] // t.element_size())
        writer = None if fill is None else fill.get(id(t))
        if writer is not None:
            writer(dst)
        else:
            dst.copy_(src)
        if t.is_contiguous():
            done.append((lo, hi))
    for k, t in enumerate(tensors):
        header += [_DTYPE_CODE[t.dtype], t.dim(), offsets[k], int(t.requires_grad), *t.shape, *t.stride()]
    payload[skel_off: skel_off + len(skeleton)].numpy()[:] = np.frombuffer(skeleton, dtype=np.uint8)
    return BatchMessage(torch.tensor(header, dtype=torch.int64), payload)


def decode_batch(message: BatchMessage) -> Any:
    """The batch (or object) encoded in ``message``; its tensors are views of ``message.payload``.

    Raises:
        ValueError: Not a message of this format or version.
    """
    h = message.header.tolist()
    payload = message.payload
    if len(h) < _HEAD or h[0] != _MAGIC or h[1] != _VERSION:
        raise ValueError("not a trellis batch message (or one of another version)")
    total, skel_off, skel_len, count = h[2:_HEAD]
    if payload.dtype != torch.uint8 or payload.numel() != total:
        raise ValueError(f"batch message payload must be {total} uint8 bytes, got {payload.numel()} {payload.dtype}")
    views: dict[torch.dtype, Tensor] = {}
    tensors: list[Tensor] = []
    pos = _HEAD
    for _ in range(count):
        code, ndim, off, grad = h[pos:pos + _REC]
        shape = h[pos + _REC: pos + _REC + ndim]
        stride = h[pos + _REC + ndim: pos + _REC + 2 * ndim]
        pos += _REC + 2 * ndim
        dtype = _DTYPES[code]
        if math.prod(shape) == 0:
            t = torch.empty_strided(shape, stride, dtype=dtype)
        else:
            t = _typed(payload, dtype, views).as_strided(shape, stride, off // dtype.itemsize)
        if grad:
            t.requires_grad_(True)
        tensors.append(t)
    skeleton = payload[skel_off: skel_off + skel_len].numpy().tobytes()
    return _TensorUnpickler(io.BytesIO(skeleton), tensors).load()


# ---- shared memory by file descriptor -------------------------------------------------------------------


def _anon_fd(size: int) -> int:
    """A file descriptor of ``size`` bytes of anonymous shared memory (no name anywhere once returned)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("trellis-batch", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux POSIX: an unlinked temporary file, in RAM where /dev/shm exists
        fd, path = tempfile.mkstemp(prefix="trellis-batch-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map_fd(fd: int, size: int) -> Tensor:
    """The ``uint8 [size]`` tensor of a shared-memory descriptor (the mapping lives as long as the tensor).

    On Linux the memory is mapped through ``/proc/self/fd`` by torch, which keeps no descriptor open (a
    Python ``mmap`` keeps a duplicate per mapping: a consumer holding many batches would run out of them).
    """
    path = f"/proc/self/fd/{fd}"
    if os.path.exists(path):
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)  # pragma: no cover - no /proc


def _page_lock(t: Tensor) -> int | None:
    """Page-lock ``t``'s memory for the GPU (``cudaHostRegister``): its address, or None where it cannot be.

    Why: a batch's bytes are tens of MB; copied to the GPU from pageable memory they go through the driver's
    staging buffer on the consumer's thread (about 9 ms per 1M-graph batch on an H200, which capped the sampler
    processes at about 105 batches per second whatever their number). From page-locked memory the copy is a DMA
    that runs while the consumer goes on. Only recycled slots are locked: the cost is paid once per slot.
    """
    if not torch.cuda.is_available() or t.numel() == 0:
        return None
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return t.data_ptr() if int(getattr(rc, "value", rc)) == 0 else None


def _page_unlock(ptr: int) -> None:
    """Undo :func:`_page_lock` (before the memory is unmapped)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _shared_buffer(size: int) -> tuple[int, Tensor]:
    """A new shared-memory buffer: its descriptor (to send) and its bytes (to fill)."""
    fd = _anon_fd(size)
    try:
        return fd, _map_fd(fd, size)
    except BaseException:
        os.close(fd)
        raise


#: Arrays and tensors at least this large are shared through memory, not pickled (smaller: pickled).
SHARE_MIN_BYTES = 1 << 16


def _mapped_file(a: np.ndarray) -> tuple[str, str, int] | None:
    """``(file, mode, byte offset)`` of a C-contiguous array that is a view of a file memory map, else None."""
    if not a.flags.c_contiguous or a.dtype.hasobject:
        return None
    base: Any = a
    while isinstance(base, np.ndarray):
        if (isinstance(base, np.memmap) and isinstance(base.base, mmap.mmap) and base.filename
                and os.path.isfile(base.filename)):  # (a deleted file cannot be reopened: its data is copied)
            offset = int(base.offset) + a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            mode = {"w+": "r+", "write": "r+", "readwrite": "r+", "readonly": "r", "copyonwrite": "c"}.get(
                str(base.mode), str(base.mode))
            return str(base.filename), mode, offset
        base = base.base
    return None


def _reopen(filename: str, mode: str, offset: int, dtype: str, shape: tuple[int, ...], as_memmap: bool,
            writeable: bool) -> np.ndarray:
    """The memory map an array was a view of, reopened (in a worker) at the same place."""
    count = math.prod(shape)
    if count == 0:
        return np.empty(shape, dtype=np.dtype(dtype))
    mm = np.memmap(filename, dtype=np.dtype(dtype), mode=mode, offset=offset, shape=shape)  # type: ignore[call-overload]
    out = mm if as_memmap else mm.view(np.ndarray)
    if not writeable and out.flags.writeable:
        out.flags.writeable = False
    return out


def _copy_into(dst: Tensor, src: Tensor) -> None:
    dst.copy_(src)


class _SharePickler(pickle.Pickler):
    """Pickles a batch source (or plan) for worker processes without copying its bulk data into the pickle.

    File memory maps become a reference to reopen; large in-memory arrays and tensors are copied once into
    shared-memory regions (one per distinct memory range: a tensor and its numpy view share one) whose
    descriptors travel beside the pickle.
    """

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.regions: list[tuple[int, int]] = []  # (fd, bytes)
        self._region_of: dict[tuple[int, int], int] = {}
        self._keep: list[Any] = []  # the objects whose addresses key _region_of stay alive until done

    def _region(self, ptr: int, nbytes: int, fill: Callable[[Tensor], None], obj: Any) -> int:
        key = (ptr, nbytes)
        k = self._region_of.get(key)
        if k is None:
            fd = _anon_fd(nbytes)
            try:
                buf = _map_fd(fd, nbytes)
                fill(buf)
                del buf
            except BaseException:
                os.close(fd)
                raise
            k = self._region_of[key] = len(self.regions)
            self.regions.append((fd, nbytes))
            self._keep.append(obj)
        return k

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:  # noqa: D102 - pickle hook
        if isinstance(obj, FeatureGather) and obj.consumer:
            return ("omitted",)  # the consumer gathers these rows; a worker's batches carry node ids only
        if isinstance(obj, np.ndarray) and type(obj) in (np.ndarray, np.memmap):
            mapped = _mapped_file(obj)
            if mapped is not None:
                return ("file", *mapped, obj.dtype.str, obj.shape, type(obj) is np.memmap, obj.flags.writeable)
            if obj.nbytes >= SHARE_MIN_BYTES and obj.flags.c_contiguous and not obj.dtype.hasobject:
                flat = obj.reshape(-1).view(np.uint8)
                k = self._region(obj.__array_interface__["data"][0], obj.nbytes,
                                 lambda buf: buf.numpy().__setitem__(slice(None), flat), obj)
                return ("array", k, obj.dtype.str, obj.shape, obj.flags.writeable)
            return None
        if isinstance(obj, Tensor):
            if obj.device.type != "cpu":
                raise TrellisUserError(
                    f"--samplers: the batch source holds a tensor on {obj.device} (features, labels or edge data); "
                    "sampler processes build batches on the CPU: keep the source's data on the CPU (batches are "
                    "moved to the device after they arrive), or use --samplers 0")
            if (type(obj) is torch.Tensor and obj.layout == torch.strided and obj.is_contiguous()
                    and obj.dtype in _DTYPE_CODE and not obj.requires_grad and not obj.is_conj()
                    and not obj.is_neg() and obj.numel() * obj.element_size() >= SHARE_MIN_BYTES):
                nbytes = obj.numel() * obj.element_size()
                flat_t = obj.reshape(-1).view(torch.uint8)
                k = self._region(obj.data_ptr(), nbytes, lambda buf: _copy_into(buf, flat_t), obj)
                return ("tensor", k, _DTYPE_CODE[obj.dtype], tuple(obj.shape))
        return None

    def close(self) -> None:
        """Close the regions' descriptors here (the workers that received them keep theirs)."""
        for fd, _ in self.regions:
            os.close(fd)
        self.regions.clear()
        self._keep.clear()


class _ShareUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, regions: list[Tensor]) -> None:
        super().__init__(file)
        self.regions = regions

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - pickle hook
        kind = pid[0]
        if kind == "omitted":
            return None
        if kind == "file":
            return _reopen(*pid[1:])
        if kind == "array":
            _, k, dtype, shape, writeable = pid
            arr = self.regions[k].numpy().view(np.dtype(dtype)).reshape(shape)
            if not writeable:
                arr.flags.writeable = False
            return arr
        if kind == "tensor":
            _, k, code, shape = pid
            return self.regions[k].view(_DTYPES[code]).view(shape)
        raise pickle.UnpicklingError(f"unknown shared object {kind!r}")


@dataclass
class _Shared:
    """A pickle and the shared-memory regions it refers to (sent to each worker, then closed)."""

    skeleton: bytes
    regions: list[tuple[int, int]]
    pickler: _SharePickler

    @classmethod
    def dump(cls, obj: Any) -> _Shared:
        out = io.BytesIO()
        p = _SharePickler(out)
        try:
            p.dump(obj)
        except BaseException:
            p.close()
            raise
        return cls(out.getvalue(), list(p.regions), p)

    def send(self, conn: Connection, head: tuple[Any, ...], pid: int) -> None:
        conn.send((*head, self.skeleton, [n for _, n in self.regions]))
        for fd, _ in self.regions:
            send_handle(conn, fd, pid)

    def close(self) -> None:
        self.pickler.close()


def _load_shared(conn: Connection, skeleton: bytes, sizes: list[int]) -> Any:
    regions = []
    for size in sizes:
        fd = recv_handle(conn)
        try:
            regions.append(_map_fd(fd, size))
        finally:
            os.close(fd)
    return _ShareUnpickler(io.BytesIO(skeleton), regions).load()


# ---- the worker process --------------------------------------------------------------------------------


def _read_bytes() -> int:
    return int(proc_io().get("read_bytes", 0))


def _limit_threads(n: int) -> None:
    try:
        set_threads(n)
    except Exception:  # noqa: BLE001 - thread limits are an optimization, never a reason to fail
        pass


def _build_on_cpu(source: Any) -> None:
    """Make a worker's copy of a loader deliver CPU batches (the consumer moves them to the device)."""
    device = getattr(source, "device", None)
    if isinstance(device, torch.device) and device.type != "cpu":
        source.device = torch.device("cpu")
    features = getattr(source, "features", None)
    if features is not None and getattr(features, "pin", False):
        features.pin = False  # pinned memory belongs to one process (and needs CUDA here)


def _exc_message(exc: BaseException) -> tuple[bytes, str]:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # some exceptions pickle but do not unpickle (required init args)
    except Exception:  # noqa: BLE001 - replaced by a RuntimeError with the same text
        data = pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
    return data, tb


def build_message(source: Any, plan: Any, i: int, alloc: Callable[[int], Tensor] | None = None) -> BatchMessage:
    """Batch ``i`` of ``plan`` encoded as :func:`encode_batch` encodes ``source.get(plan, i)``.

    Why: a batch's input rows are most of its bytes (77 MB for 1024 targets with fanouts 15,10 and 128
    features). Gathered into the loader's buffer and then copied into the message, they cross memory twice;
    here, when the source gathers through a :class:`~trellis.loader.features.FeatureGather` on the CPU and can
    fill a batch without its rows (``fill(batch, features=False)``), they are gathered straight into their
    place in the message. The message is the same, byte for byte.
    """
    feats = getattr(source, "features", None)
    if not isinstance(feats, FeatureGather) or feats.device.type != "cpu" or not hasattr(source, "fill"):
        return encode_batch(source.get(plan, i), alloc)
    batch = source.fill(source.get(plan, i, gather=False), features=False)
    ids, rows = batch.node_ids, feats.source
    batch.x = stub = torch.empty((int(ids.shape[0]), *rows.row_shape), dtype=rows.dtype)  # never touched

    def gather_into(dst: Tensor) -> None:
        got = rows.gather(ids, dst)
        if got.data_ptr() != dst.data_ptr():  # a source that did not use ``out``
            dst.copy_(got)

    return encode_batch(batch, alloc, fill={id(stub): gather_into})


class _Slots:
    """A worker's shared-memory buffers: one per batch, or (``recycle``) reused once the consumer frees them."""

    def __init__(self, recycle: bool) -> None:
        self.recycle = recycle
        self.buffers: dict[int, tuple[int, Tensor]] = {}  # slot -> (descriptor, mapping)
        self.free: list[int] = []
        self.next_id = 0

    def take(self, size: int) -> tuple[int, Tensor, bool]:
        """``(slot, buffer of exactly size bytes, whether the slot's descriptor is new to the consumer)``."""
        if not self.recycle:
            fd, buf = _shared_buffer(size)
            self.buffers[-1] = (fd, buf)
            return -1, buf, True
        fits = [k for k in self.free if self.buffers[k][1].numel() >= size]
        if fits:
            k = min(fits, key=lambda k: self.buffers[k][1].numel())
            self.free.remove(k)
            return k, self.buffers[k][1][:size], False
        if self.free:  # too small: a larger buffer under the same slot (the consumer replaces its mapping)
            k = self.free.pop()
            self.drop(k)
        else:
            k, self.next_id = self.next_id, self.next_id + 1
        cap = -(-int(size * 1.25) // 4096) * 4096  # room for the next batches' growth
        self.buffers[k] = _shared_buffer(cap)
        return k, self.buffers[k][1][:size], True

    def give(self, slot: int) -> None:
        """The consumer is done with ``slot`` (``-1``: the batch's own buffer, closed here)."""
        if slot < 0:
            self.drop(slot)
        elif slot in self.buffers and slot not in self.free:
            self.free.append(slot)

    def drop(self, slot: int) -> None:
        fd, _ = self.buffers.pop(slot)
        os.close(fd)


def _worker_main(rank: int, conn: Connection, threads: int, recycle: bool = False, background: bool = False) -> None:
    """A worker process: load the source, then build the batches it is asked for until told to stop."""
    # Ctrl-C and SIGTERM are the consumer's to handle (it checkpoints, then stops us): `timeout`, Slurm and systemd
    # signal the whole process group, and a worker that died of it mid-epoch failed the consumer's stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    try:
        if background:  # before any thread pool starts, so that its threads inherit the policy
            set_background(True)
        _limit_threads(threads)
        _, skeleton, sizes = conn.recv()
        source = _load_shared(conn, skeleton, sizes)
        _build_on_cpu(source)
        io0 = _read_bytes()
        conn.send(("ready", 0))
    except BaseException as exc:  # noqa: BLE001 - reported, then this worker ends
        try:
            conn.send(("fatal", *_exc_message(exc)))
        except OSError:
            pass
        return
    plan: Any = None
    plan_id = -1
    plan_error: BaseException | None = None
    slots = _Slots(recycle)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the consumer is gone
        kind = msg[0]
        if kind == "free":
            for k in msg[1]:
                slots.give(int(k))
            continue
        if kind == "plan":
            plan, plan_error = None, None  # drop the previous plan's shared memory first
            plan_id = msg[1]
            try:
                plan = _load_shared(conn, msg[2], msg[3])
            except BaseException as exc:  # noqa: BLE001 - reported with each batch of the epoch
                plan_error = exc
            continue
        _, epoch_id, i = msg
        took: list[tuple[int, bool]] = []

        def alloc(size: int, took: list[tuple[int, bool]] = took) -> Tensor:
            k, buf, new = slots.take(size)
            took.append((k, new))
            return buf

        try:
            try:
                if plan_error is not None:
                    raise plan_error
                if epoch_id != plan_id:
                    raise RuntimeError(f"batch {i} of epoch {epoch_id} asked for, but the worker holds plan {plan_id}")
                message = build_message(source, plan, i, alloc)
                header = message.header.numpy().tobytes()
                nbytes = int(message.payload.numel())
                del message  # unmaps the buffer here; the descriptor keeps it for the consumer
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                for k, _ in took:
                    slots.give(k)
                conn.send(("error", epoch_id, i, *_exc_message(exc), _read_bytes() - io0))
            else:
                k, new = took[0]
                cap = int(slots.buffers[k][1].numel())
                conn.send(("batch", epoch_id, i, header, nbytes, k, cap, new, _read_bytes() - io0))
                if new:
                    send_handle(conn, slots.buffers[k][0], parent)
        except OSError:
            return  # the pipe broke: the consumer is gone
        finally:
            if -1 in slots.buffers:  # a batch's own buffer: the consumer's mapping holds it from here
                slots.drop(-1)


# ---- the pool ------------------------------------------------------------------------------------------

_FORKSERVER_PRELOAD = ["trellis.loader._forkserver", "trellis.loader.producer"]


def _context(method: str) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Workers fork from a server that imported torch, numpy, numba and the loaders once (no threads
        # started): a worker then starts in milliseconds. Takes effect when the server starts.
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


class _RemoteTraceback(Exception):
    """The worker's traceback, attached as the cause of an exception re-raised in the consumer."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def _remote_exception(data: bytes, tb: str) -> BaseException:
    exc: BaseException = pickle.loads(data)
    exc.__cause__ = _RemoteTraceback(tb)
    return exc


@dataclass(eq=False)
class _Worker:
    rank: int
    process: Any  # multiprocessing.process.BaseProcess
    conn: Connection
    pid: int
    outstanding: int = 0
    read_bytes: int = 0  # since the worker loaded the source
    last_heard: float = 0.0
    stopped: bool = False
    maps: dict[int, Tensor] = field(default_factory=dict)  # recycled slot -> its mapping here
    locked: dict[int, int] = field(default_factory=dict)  # recycled slot -> its mapping's page-locked address

    def describe(self, count: int) -> str:
        return f"sampler worker {self.rank} of {count} (pid {self.pid})"


def _stop_workers(workers: list[_Worker]) -> None:
    """Stop and join every worker: close its pipe (it exits), then terminate, then kill. Idempotent."""
    workers = [w for w in workers if not w.stopped]
    for w in workers:
        try:
            w.conn.close()  # the worker's next read sees EOF and it returns; queued descriptors are released
        except OSError:
            pass
    deadline = time.monotonic() + 1.0
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.stopped:
            continue
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(1.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join(1.0)
        if not w.process.is_alive():
            w.process.close()  # releases its sentinel descriptor
            w.stopped = True
    for w in workers:
        for ptr in w.locked.values():
            _page_unlock(ptr)
        w.locked.clear()


def _send_timeout(conn: Connection, seconds: float | None) -> None:
    """Make sends on ``conn`` fail after ``seconds`` instead of blocking forever on a worker that stopped reading."""
    if seconds is None:
        return
    sec = int(seconds)
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the same socket: the option applies to conn
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def _exit_status(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Pool:
    """K worker processes with a pipe each; owned and driven by the consumer's thread (no threads here)."""

    def __init__(self, source: Any, options: ProducerOptions) -> None:
        self.options = options
        self.workers: list[_Worker] = []
        self.broken: str | None = None
        #: Whether the workers run in the background now (:meth:`set_background`).
        self.background = bool(options.background)
        ctx = _context(options.start_method)
        try:
            shared = _Shared.dump(source)
        except (TypeError, AttributeError, pickle.PicklingError) as exc:
            raise TypeError(f"--samplers: the batch source ({type(source).__name__}) cannot be sent to sampler "
                            f"processes ({exc}); use --samplers 0 to prepare its batches on threads") from exc
        try:
            for rank in range(options.workers):
                here, there = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_main,
                                   args=(rank, there, options.threads_per_worker, options.recycle,
                                         self.background),
                                   name=f"trellis-sampler-{rank}", daemon=True)
                try:
                    proc.start()
                finally:
                    there.close()
                _send_timeout(here, options.timeout_s)
                self.workers.append(_Worker(rank, proc, here, int(proc.pid), last_heard=time.monotonic()))
            # Every worker stops at interpreter exit too, even if nobody calls close().
            self._finalizer = weakref.finalize(self, _stop_workers, self.workers)
            for w in self.workers:
                shared.send(w.conn, ("source",), w.pid)
        except BaseException:
            _stop_workers(self.workers)
            raise
        finally:
            shared.close()

    def fail(self, message: str) -> ProcessFailure:
        """Stop every worker and return the error to raise (the pool is unusable afterwards)."""
        self.broken = message
        self.close()
        return ProcessFailure(message)

    def send_plan(self, epoch_id: int, plan: Any) -> None:
        shared = _Shared.dump(plan)
        try:
            for w in self.workers:
                try:
                    shared.send(w.conn, ("plan", epoch_id), w.pid)
                except OSError as exc:
                    raise self.fail(f"{w.describe(len(self.workers))} {_exit_status(w.process.exitcode)} "
                                    "before it received the epoch's plan") from exc
        finally:
            shared.close()

    def set_background(self, on: bool) -> None:
        """Workers in the background (``on``, only with ``ProducerOptions.background``) or at normal priority."""
        on = bool(on and self.options.background)
        if on == self.background:
            return
        self.background = on
        for w in self.workers:
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{w.pid}/task")]  # every thread of the worker
            except OSError:
                tids = [w.pid]
            for tid in tids:
                set_background(on, tid)

    def lock(self, w: _Worker, slot: int) -> bool:
        """Page-lock recycled ``slot``'s mapping for GPU copies (once per mapping): whether it is locked."""
        if slot not in w.locked and slot in w.maps:
            ptr = _page_lock(w.maps[slot])
            if ptr is not None:
                w.locked[slot] = ptr
        return slot in w.locked

    def release(self, w: _Worker, slots: list[int]) -> None:
        """Hand ``slots`` back to ``w`` (``recycle``); a worker that is gone needs nothing back."""
        if slots and self.options.recycle and not w.conn.closed:
            try:
                w.conn.send(("free", slots))
            except OSError:
                pass  # its death is reported by the next poll

    def request(self, w: _Worker, epoch_id: int, i: int) -> None:
        if w.outstanding == 0:
            w.last_heard = time.monotonic()
        try:
            w.conn.send(("get", epoch_id, i))
        except OSError as exc:
            raise self.fail(f"{w.describe(len(self.workers))} {_exit_status(w.process.exitcode)}; "
                            f"could not send it batch {i}") from exc
        w.outstanding += 1

    def poll(self, timeout: float) -> list[tuple[_Worker, tuple[Any, ...], Tensor | None]]:
        """Messages that arrived within ``timeout`` seconds (batches with their mapped buffer).

        Raises:
            RuntimeError: A worker died (its last messages are read first) or failed to load the source.
        """
        conns = {w.conn: w for w in self.workers}
        sentinels = {w.process.sentinel: w for w in self.workers}
        ready = wait([*conns, *sentinels], timeout)
        out: list[tuple[_Worker, tuple[Any, ...], Tensor | None]] = []
        dead = [sentinels[r] for r in ready if r in sentinels]
        for w in [conns[r] for r in ready if r in conns] + dead:
            while not w.conn.closed and w.conn.poll(0):
                try:
                    out.append(self._receive(w))
                except (EOFError, OSError) as exc:
                    if w not in dead:
                        w.process.join(1.0)  # a broken pipe is most often a worker on its way out
                        if w.process.is_alive():
                            raise self.fail(f"{w.describe(len(self.workers))}: its pipe broke ({exc})") from exc
                        dead.append(w)
                    break
        for w in dead:
            w.process.join(0.1)
            raise self.fail(f"{w.describe(len(self.workers))} {_exit_status(w.process.exitcode)} "
                            f"with {w.outstanding} batch(es) outstanding")
        return out

    def _receive(self, w: _Worker) -> tuple[_Worker, tuple[Any, ...], Tensor | None]:
        msg = w.conn.recv()
        w.last_heard = time.monotonic()
        kind = msg[0]
        if kind == "fatal":
            exc = _remote_exception(msg[1], msg[2])
            raise self.fail(f"{w.describe(len(self.workers))} could not load the batch source: "
                            f"{type(exc).__name__}: {exc}") from exc
        if kind == "ready":  # the source is loaded (it only refreshes last_heard)
            return w, msg, None
        w.outstanding -= 1
        w.read_bytes = int(msg[-1])
        if kind == "batch":
            nbytes, slot, cap, new = int(msg[4]), int(msg[5]), int(msg[6]), bool(msg[7])
            if new:
                try:
                    fd = recv_handle(w.conn)
                except RuntimeError as exc:  # the descriptor never came: the worker died between the two sends
                    raise EOFError(str(exc)) from exc
                try:
                    mapped = _map_fd(fd, cap)
                finally:
                    os.close(fd)
                if slot >= 0:
                    if slot in w.locked:  # a larger buffer replaces the slot's (its last copy has completed)
                        _page_unlock(w.locked.pop(slot))
                    w.maps[slot] = mapped
            else:
                mapped = w.maps[slot]
            return w, msg, mapped if cap == nbytes else mapped[:nbytes]
        return w, msg, None

    def close(self) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()  # _stop_workers, once
        else:
            _stop_workers(self.workers)


# ---- epochs --------------------------------------------------------------------------------------------


class EpochBatches(Iterator[T], Generic[T]):
    """One epoch's batches in index order: iterate, or use as a context manager so an early exit stops work.

    Attributes:
        wait_s: Seconds the consumer spent waiting for batches.
    """

    wait_s: float

    def __iter__(self) -> EpochBatches[T]:
        return self

    def __next__(self) -> T:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def read_bytes(self) -> int:
        """Bytes the batch workers read from storage this epoch (their ``/proc/<pid>/io`` ``read_bytes``).

        0 on threads: their reads are in the consumer's own counter already.
        """
        return 0

    def close(self) -> None:
        """Stop preparing batches; idempotent."""

    def __enter__(self) -> EpochBatches[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _ThreadEpoch(EpochBatches[T]):
    """Today's thread prefetcher behind the epoch interface."""

    def __init__(self, prefetcher: Prefetcher[T]) -> None:
        self._p = prefetcher
        self.wait_s = 0.0

    def __next__(self) -> T:
        try:
            return next(self._p)
        finally:
            self.wait_s = self._p.wait_s

    def __len__(self) -> int:
        return len(self._p)

    def close(self) -> None:
        self._p.close()


class _ProcessEpoch(EpochBatches[T]):
    """Requests batches from the pool's workers (least loaded first) and yields them in index order."""

    def __init__(self, producer: BatchProducer[T], pool: _Pool, epoch_id: int, n: int, label: str) -> None:
        self._producer = producer
        self._pool = pool
        self._id = epoch_id
        self._n = n
        self._label = label
        self._next = 0
        self._submitted = 0
        self._ready: dict[int, T] = {}
        self._errors: dict[int, BaseException] = {}
        self._owner_of: dict[int, _Worker] = {}
        self._slot_of: dict[int, tuple[_Worker, int]] = {}  # recycled slot of each batch received
        self._held: tuple[_Worker, int] | None = None  # the slot of the batch the consumer holds
        self._copies: dict[int, Any] = {}  # batch -> CUDA event after its copy from a page-locked slot
        self._held_copy: Any = None
        self._io0 = [w.read_bytes for w in pool.workers]
        self._closed = False
        self.wait_s = 0.0
        self.own_producer = False

    def __len__(self) -> int:
        return self._n

    @property
    def read_bytes(self) -> int:
        """Bytes the workers read from storage since the epoch began."""
        return sum(w.read_bytes - b for w, b in zip(self._pool.workers, self._io0))

    def _fill(self) -> None:
        limit = self._producer.options.in_flight
        workers = self._pool.workers
        while self._submitted < self._n and self._submitted - self._next < limit:
            w = min(workers, key=lambda w: (w.outstanding, (w.rank - self._submitted) % len(workers)))
            self._pool.request(w, self._id, self._submitted)
            self._owner_of[self._submitted] = w
            self._submitted += 1

    def accept(self, w: _Worker, msg: tuple[Any, ...], payload: Tensor | None) -> None:
        """A message of this epoch: keep the batch (decoded, on the loader's device) or the error."""
        i = int(msg[2])
        if msg[0] == "batch":
            assert payload is not None
            if int(msg[5]) >= 0:
                self._slot_of[i] = (w, int(msg[5]))
            header = torch.frombuffer(bytearray(msg[3]), dtype=torch.int64)
            item = decode_batch(BatchMessage(header, payload))
            device = self._producer.device
            if device is not None and isinstance(item, Batch):
                locked = device.type == "cuda" and i in self._slot_of and self._pool.lock(w, int(msg[5]))
                item = item.to(device, non_blocking=True)  # asynchronous from a locked slot
                if locked:  # the slot goes back to its worker only once the copy has read it
                    self._copies[i] = torch.cuda.Event()
                    self._copies[i].record()
            rows = self._producer.rows
            if rows is not None and isinstance(item, Batch):
                item.x = rows.gather(item.node_ids)
            self._ready[i] = item
        elif msg[0] == "error":
            self._errors[i] = _remote_exception(msg[3], msg[4])

    def _release_held(self) -> None:
        """The consumer asked for the next batch: the one it held goes back to its worker (``recycle``)."""
        if self._held_copy is not None:
            self._held_copy.synchronize()
            self._held_copy = None
        if self._held is not None:
            w, k = self._held
            self._held = None
            self._pool.release(w, [k])

    def __next__(self) -> T:
        self._release_held()
        if self._closed or self._next >= self._n:
            self.close()
            raise StopIteration
        i = self._next
        t0 = time.perf_counter()
        try:
            self._fill()
            while i not in self._ready and i not in self._errors:
                self._producer._dispatch(self._pool.poll(0.1))
                w = self._owner_of[i]
                timeout = self._producer.options.timeout_s
                if timeout is not None and time.monotonic() - w.last_heard > timeout and i not in self._ready:
                    raise self._pool.fail(f"{w.describe(len(self._pool.workers))} sent nothing for {timeout:g} s "
                                          f"while building batch {i} of epoch {self._label}; it looks hung")
        except BaseException:
            self.close()
            raise
        self.wait_s += time.perf_counter() - t0
        if i in self._errors:
            exc = self._errors.pop(i)
            self.close()
            raise exc
        self._next += 1
        item = self._ready.pop(i)
        self._owner_of.pop(i, None)
        self._held = self._slot_of.pop(i, None)
        self._held_copy = self._copies.pop(i, None)
        try:
            self._fill()  # the consumer has taken batch i, so batch i + in_flight may start now
        except BaseException:
            self.close()
            raise
        return item

    def close(self) -> None:
        """Stop requesting batches; those still being built are dropped when they arrive. Idempotent."""
        if not self._closed:
            self._closed = True
            self._ready.clear()
            self._release_held()
            for event in self._copies.values():
                event.synchronize()
            self._copies.clear()
            for w, k in self._slot_of.values():  # received but never taken
                self._pool.release(w, [k])
            self._slot_of.clear()
            self._producer._epoch_closed(self)
        if self.own_producer:
            self._producer.close()


# ---- the producer --------------------------------------------------------------------------------------


class BatchProducer(Generic[T]):
    """Produces the epochs of one batch source on threads or on a persistent pool of worker processes.

    Args:
        source: A :class:`~trellis.loader.source.BatchSource`. In ``processes`` mode it is pickled once to
            each worker (file memory maps reopened there, large arrays shared, see the module docstring), its
            tensors must be on the CPU, and a loader with an accelerator ``device`` builds CPU batches in the
            workers that this producer moves to the device when they arrive.
        options: How (default: ``ProducerOptions()``, one thread, prefetch 2).

    Workers start with the first :meth:`epoch` (or :meth:`start`) and serve every epoch until :meth:`close`
    (also at interpreter exit). After a worker fault the producer is closed; make a new one to go on.

    Attributes:
        read_bytes: Bytes the workers read from storage during the latest epoch (0 on threads).
    """

    def __init__(self, source: BatchSource[Any, T], options: ProducerOptions | None = None) -> None:
        self.source = source
        self.options = options if options is not None else ProducerOptions()
        self.read_bytes = 0
        #: Rows the consumer gathers into each arriving batch (a device-resident table: the workers only sample).
        self.rows: FeatureGather | None = None
        device = getattr(source, "device", None)
        self.device: torch.device | None = device if isinstance(device, torch.device) and device.type != "cpu" \
            else None
        self._pool: _Pool | None = None
        self._epoch: _ProcessEpoch[T] | None = None
        self._epochs = 0
        self._closed = False
        if self.options.mode == "threads":
            slots = getattr(getattr(source, "features", None), "slots", None)
            if slots is not None and self.options.prefetch + self.options.workers + 2 > int(slots):
                raise ValueError(f"the source's feature buffers ({slots} slots) are too few for prefetch "
                                 f"{self.options.prefetch} on {self.options.workers} thread(s): build the loader "
                                 "with the same prefetch and workers")
        else:
            features = getattr(source, "features", None)
            if isinstance(features, FeatureGather) and features.consumer:
                self.rows = features

    @property
    def pids(self) -> list[int]:
        """Process ids of the running workers (empty on threads or before start)."""
        return [] if self._pool is None else [w.pid for w in self._pool.workers if not w.stopped]

    def start(self) -> BatchProducer[T]:
        """Start the worker processes now (else the first :meth:`epoch` does); a no-op on threads."""
        if self._closed or self._broken:
            raise RuntimeError("this batch producer is closed" + (f" after a worker failure: {self._broken}"
                                                                  if self._broken else ""))
        if self.options.mode == "processes" and self._pool is None:
            self._pool = _Pool(self.source, self.options)
        return self

    @property
    def _broken(self) -> str | None:
        return None if self._pool is None else self._pool.broken

    def epoch(self, epoch_seed: int) -> EpochBatches[T]:
        """The batches of the epoch seeded by ``epoch_seed``, in order; an unfinished previous epoch is closed."""
        if self.options.mode == "threads":
            if self._closed:
                raise RuntimeError("this batch producer is closed")
            p = iter_epoch(self.source, epoch_seed, prefetch=self.options.prefetch, workers=self.options.workers)
            self.read_bytes = 0
            return _ThreadEpoch(p)
        self.start()
        pool = self._pool
        assert pool is not None
        if self._epoch is not None:
            self._epoch.close()
        plan = self.source.plan(epoch_seed)
        self._epochs += 1
        pool.send_plan(self._epochs, plan)
        self._epoch = _ProcessEpoch(self, pool, self._epochs, len(plan), str(epoch_seed))
        return self._epoch

    def _dispatch(self, messages: list[tuple[_Worker, tuple[Any, ...], Tensor | None]]) -> None:
        for w, msg, payload in messages:
            if msg[0] in ("batch", "error") and self._epoch is not None and msg[1] == self._epoch._id:
                self._epoch.accept(w, msg, payload)
            elif msg[0] == "batch" and int(msg[5]) >= 0 and self._pool is not None:
                self._pool.release(w, [int(msg[5])])  # a batch of an epoch closed early: its slot goes back
            # else: a worker's "ready", or a batch of an epoch closed early: dropped (its memory with it)
        if self._epoch is not None:
            self.read_bytes = self._epoch.read_bytes

    def set_background(self, on: bool) -> None:
        """Sampler processes in the background (``on``; only with ``ProducerOptions.background``) or not.

        Why: a training loop chooses the sampler processes' priority by measurement (:class:`trellis.utils
        .priority.PriorityTrial`), and running processes take each epoch's choice here.
        """
        if self._pool is not None:
            self._pool.set_background(on)

    @property
    def background(self) -> bool:
        """Whether the sampler processes run in the background now."""
        return self._pool is not None and self._pool.background

    def _epoch_closed(self, epoch: _ProcessEpoch[T]) -> None:
        if self._epoch is epoch:
            self.read_bytes = epoch.read_bytes
            self._epoch = None

    def close(self) -> None:
        """Stop and join every worker process (their shared memory goes with them). Idempotent."""
        self._closed = True
        if self._epoch is not None:
            self._epoch.close()
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> BatchProducer[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def produce(source: BatchSource[Any, T], epoch_seed: int, options: ProducerOptions | None = None) -> EpochBatches[T]:
    """One epoch of ``source``'s batches in index order, produced as ``options`` say (one-shot).

    ``mode="threads"`` is :func:`~trellis.loader.source.iter_epoch`; ``mode="processes"`` starts a
    :class:`BatchProducer`'s workers for this epoch alone and stops them when the epoch ends or is closed.
    Training loops over many epochs keep one :class:`BatchProducer` instead (workers start once).
    """
    producer: BatchProducer[T] = BatchProducer(source, options)
    if producer.options.mode == "threads":
        return _ThreadEpoch(iter_epoch(source, epoch_seed, prefetch=producer.options.prefetch,
                                       workers=producer.options.workers))
    try:
        batches = producer.epoch(epoch_seed)
    except BaseException:
        producer.close()
        raise
    assert isinstance(batches, _ProcessEpoch)
    batches.own_producer = True
    return batches


__all__ = ["MODES", "SHARE_MIN_BYTES", "START_METHODS", "BatchMessage", "BatchProducer", "EpochBatches",
           "ProducerOptions", "decode_batch", "encode_batch", "produce"]
