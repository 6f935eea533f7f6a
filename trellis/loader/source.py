"""The batch-source contract: what an epoch's batches are (a plan), and how to build batch ``i`` of it.

Why split an epoch into ``plan`` and ``get``: the plan is the cheap, random part (the shuffled target ids,
the cluster groups, the row order) and fixes every batch of the epoch; ``get(plan, i)`` is the expensive,
deterministic part (sampling with a per-batch seed, the induced subgraph, the feature gather). Because
``get`` is a pure function of ``(plan, i)``, batches can be prepared out of order by any number of worker
threads -- or worker processes, or remote workers (Armada's disaggregated batch preparation) -- and still
come out identical to a sequential pass, and a resumed run can rebuild batch ``i`` without replaying the
batches before it.

Implemented by :class:`~trellis.loader.sampler.NeighborLoader` (sampled blocks),
:class:`~trellis.loader.cluster.ClusterLoader` (cluster subgraphs) and :class:`~trellis.loader.pp.PPLoader`
(pre-propagated rows). Each also keeps its own entry point (``epoch(seed)``, or iteration for the pp
loader), which is :func:`iter_epoch` over itself.

Example -- a strategy's training epoch over any source, batches prepared ahead on background threads::

    from trellis.loader.source import BatchSource, iter_epoch

    def train_epoch(source: BatchSource, epoch_seed: int, step) -> None:
        with iter_epoch(source, epoch_seed) as batches:  # the source's prefetch and workers
            for batch in batches:  # same batches, same order, for any prefetch and workers
                step(batch)

    plan = source.plan(epoch_seed)          # or by hand: the epoch's batches, cheap
    batch_7 = source.get(plan, 7)           # any one of them, from any thread
    assert len(plan) == len(source)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar, runtime_checkable

from trellis.loader.prefetch import Prefetcher


@runtime_checkable
class EpochPlan(Protocol):
    """What one epoch's batches are (the shuffled order they are built from); ``len`` = number of batches."""

    @property
    def epoch(self) -> int:
        """The epoch seed the plan was drawn from."""
        ...

    def __len__(self) -> int:
        """Number of batches in the epoch."""
        ...


PlanT = TypeVar("PlanT", bound=EpochPlan)
BatchT = TypeVar("BatchT")
BatchT_co = TypeVar("BatchT_co", covariant=True)


@runtime_checkable
class BatchSource(Protocol[PlanT, BatchT_co]):
    """A producer of an epoch's batches by index.

    ``plan(epoch_seed)`` draws the epoch's random order (cheap, deterministic in the seed);
    ``get(plan, i)`` builds batch ``i`` of it -- deterministic given ``(plan, i)`` and safe to call from
    worker threads concurrently for distinct ``i``; ``len(source)`` is the number of batches per epoch.

    A batch may live in one of the source's rotating buffers (tens of MB are not allocated per batch):
    the buffers are sized for the source's own ``prefetch`` and ``workers`` settings, which
    :func:`iter_epoch` uses by default; a consumer that keeps batches longer clones them.
    """

    def plan(self, epoch_seed: int, /) -> PlanT:
        """The batches of the epoch seeded by ``epoch_seed``."""
        ...

    def get(self, plan: PlanT, i: int, /) -> BatchT_co:
        """Batch ``i`` of ``plan``."""
        ...

    def __len__(self) -> int:
        """Batches per epoch."""
        ...


def iter_epoch(source: BatchSource[PlanT, BatchT], epoch_seed: int, *, prefetch: int | None = None,
               workers: int | None = None, get: Callable[[PlanT, int], BatchT] | None = None) -> Prefetcher[BatchT]:
    """The batches of one epoch in order, ``prefetch`` prepared ahead on ``workers`` threads.

    Args:
        source: The batch source.
        epoch_seed: Seed of the epoch's plan.
        prefetch: Batches prepared ahead (0 = each built in the caller's thread when asked for) (default: the
            source's ``prefetch`` attribute, else 2). More than the source's buffers are sized for would
            overwrite a batch still in use.
        workers: Threads preparing batches (default: the source's ``workers`` attribute, else 1); the order
            and content never depend on it.
        get: Builds batch ``i`` of the plan instead of ``source.get`` (e.g. a variant with options).

    Returns:
        A :class:`~trellis.loader.prefetch.Prefetcher`: iterate it, or use it as a context manager so an
        early exit stops its threads.
    """
    depth = int(getattr(source, "prefetch", 2)) if prefetch is None else prefetch
    threads = int(getattr(source, "workers", 1)) if workers is None else workers
    plan = source.plan(epoch_seed)
    make = source.get if get is None else get
    return Prefetcher(lambda i: make(plan, i), len(plan), depth=depth, workers=threads)


__all__ = ["BatchSource", "EpochPlan", "iter_epoch"]
