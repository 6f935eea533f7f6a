"""Background batch preparation: batch ``i + 1`` is built while the trainer computes on batch ``i``.

Why: batch preparation (sampling + feature gather) and the model step take comparable time on a CPU
(Armada §2 measured preparation dominating); run back to back they add, overlapped they take the max.
The sampling kernels release the GIL, so a worker thread runs them beside torch's compute threads.

Two producers with the same contract -- ordered output, a bounded number of batches in flight, the
first exception re-raised in the consumer, and a clean shutdown (no thread left running) when the
consumer stops early, breaks out of the loop or the worker fails:

* :class:`Prefetcher` builds batches by index (``make(i)``) on ``workers`` threads. Batch builders in
  :mod:`trellis.loader` are pure functions of ``(epoch, i)``, so any number of workers yields exactly the
  batches of a sequential pass, in the same order.
* :func:`prefetch_iter` wraps any iterator on one thread with a bounded queue.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Iterate ``make(0), ..., make(n - 1)`` with up to ``depth`` batches prepared ahead.

    Args:
        make: Builds item ``i``; must be safe to call from worker threads for distinct ``i`` concurrently.
        n: Number of items.
        depth: Items in flight ahead of the consumer; 0 builds each item in the caller's thread when it is
            asked for (no thread) (default: 2).
        workers: Threads building items (default: 1). Items are always yielded in index order.

    Use it as an iterator; leaving a ``for`` loop early or calling :meth:`close` cancels what has not
    started and waits for what has, so no worker outlives the iterator.
    """

    def __init__(self, make: Callable[[int], T], n: int, *, depth: int = 2, workers: int = 1) -> None:
        self.make = make
        self.n = int(n)
        self.depth = max(0, int(depth))
        self.workers = max(1, int(workers))
        self._next = 0
        self._submitted = 0
        self._pending: deque[Future[T]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        #: Seconds the consumer spent waiting for items (0 when preparation keeps ahead of the consumer).
        self.wait_s = 0.0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[T]:
        return self

    def _fill(self) -> None:
        assert self._pool is not None
        while self._submitted < self.n and len(self._pending) < self.depth:
            self._pending.append(self._pool.submit(self.make, self._submitted))
            self._submitted += 1

    def __next__(self) -> T:
        if self._closed or self._next >= self.n:
            self.close()
            raise StopIteration
        if self.depth == 0:
            t0 = time.perf_counter()
            item = self.make(self._next)
            self.wait_s += time.perf_counter() - t0
            self._next += 1
            return item
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="trellis-prefetch")
            self._fill()
        fut = self._pending.popleft()
        t0 = time.perf_counter()
        try:
            item = fut.result()
        except BaseException:
            self.close()
            raise
        self.wait_s += time.perf_counter() - t0
        self._next += 1
        self._fill()  # the consumer has taken item i, so item i + depth may start now
        return item

    def close(self) -> None:
        """Stop: cancel items not started, wait for running ones, shut the threads down. Idempotent."""
        self._closed = True
        while self._pending:
            self._pending.pop().cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def prefetch_iter(items: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Consume ``items`` on a background thread, at most ``depth`` ahead; yield them in order.

    The worker's exception is re-raised here; closing the generator (``break``, ``del``, an exception in
    the consumer) stops and joins the worker.
    """
    if depth <= 0:
        yield from items
        return
    q: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(obj: object) -> bool:
        while not stop.is_set():
            try:
                q.put(obj, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(_Failure(exc))

    thread = threading.Thread(target=work, name="trellis-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            obj = q.get()
            if obj is _DONE:
                return
            if isinstance(obj, _Failure):
                raise obj.exc
            yield obj  # type: ignore[misc]
    finally:
        stop.set()
        thread.join()
