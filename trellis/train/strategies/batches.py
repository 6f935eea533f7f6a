"""The shared part of every batch strategy: data without an in-memory graph, the epoch loop, exact evaluation.

Apart from :mod:`trellis.train.strategies.batch` (which registers ``mini`` and ``cluster``) so that variants
of those strategies -- the partition buffer -- build on it without importing the registry module back.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trellis.loader.blocks import Batch
from trellis.loader.features import (
    ArrayRows,
    FeatureSource,
    NormalizedRows,
    SparseRows,
    as_feature_source,
    copy_rows,
)
from trellis.loader.inference import layerwise_inference
from trellis.loader.producer import BatchProducer, ProducerOptions
from trellis.ops.graph import CSRGraph
from trellis.ops.sparse_rows import is_sparse, to_sparse_rows
from trellis.plan.residency import feature_residency
from trellis.train.build import ModelSpec
from trellis.train.config import TrainConfig
from trellis.train.data import load_graph_data, sparse_rows_density, sparse_rows_of
from trellis.train.strategies.full import GraphStrategy
from trellis.train.tasks import Task, split_metrics
from trellis.utils.numba import get_num_threads, launch_threads, set_threads
from trellis.utils.priority import PriorityTrial
from trellis.utils.sizes import format_size


def _epoch_seed() -> int:
    """One draw from torch's global generator (saved in checkpoints) that seeds an epoch's batches."""
    return int(torch.randint(0, 2**62, (1,)).item())


def leave_cores(busy: int) -> tuple[int, int] | None:
    """Train on ``busy`` fewer threads (torch and numba) while sampler processes run, on 4 cores or more.

    Why: a parallel region waits for its slowest thread, and a trainer that keeps one thread per core beside
    running samplers has a thread sharing a core with a sampler at every region. Measured on the 1M graph with
    one sampler process (docs/benchmarks.md): the epoch was 1.51x the training alone on 16 cores as on 2, and
    with exclusive cores (one trainer thread, numba's too, and the sampler on 2 cores) 0.99x the trainer's
    time alone. On fewer than 4 cores every thread with the sampler beside them is still faster, so nothing
    changes there. Returns the previous ``(torch, numba)`` threads to restore, or None when unchanged.
    """
    launch_threads()  # numba's start would undo torch's count set here
    have = torch.get_num_threads()
    if busy <= 0 or have - busy < 3:
        return None
    before = (have, get_num_threads())
    set_threads(have - busy, min(before[1], have - busy))
    return before


def _as_sparse_rows(x: Tensor) -> Tensor:
    """A CPU batch's input rows as sparse rows, whatever their density (the run decided; see ``sparse_input``)."""
    return to_sparse_rows(x, max_density=1.0) if x.device.type == "cpu" else x


class WaitedBatches:
    """An epoch's batches, with the seconds the trainer spent waiting for them (any source, any producer).

    ``starving(wait_s, elapsed_s)``: told after each batch and, while builders run in the background, every quarter
    second by a watcher thread while the trainer waits (the priority trial gives up mid-wait: a builder starved by
    other processes may take minutes for one batch).
    """

    def __init__(self, batches: Any, starving: Any = None) -> None:
        self._it = iter(batches)
        self._starving = starving
        self._t0 = time.perf_counter()
        self._since: float | None = None  # when the current wait began
        self._done = threading.Event()
        self.wait_s = 0.0
        if starving is not None:
            threading.Thread(target=self._watch, name="trellis-starving", daemon=True).start()

    def _watch(self) -> None:
        while not self._done.wait(0.25):
            since = self._since
            if since is not None:
                now = time.perf_counter()
                self._starving(self.wait_s + (now - since), now - self._t0)

    def __iter__(self) -> WaitedBatches:
        return self

    def __del__(self) -> None:
        self._done.set()  # the watcher stops with the epoch, however the epoch ended

    def __next__(self) -> Batch:
        t0 = self._since = time.perf_counter()
        try:
            return next(self._it)
        except BaseException:
            self._done.set()
            raise
        finally:
            now = time.perf_counter()
            self._since = None
            self.wait_s += now - t0
            if self._starving is not None:
                self._starving(self.wait_s, now - self._t0)


class BatchStrategy(GraphStrategy):
    """Shared parts: loading without an in-memory graph, the epoch loop over batches, exact evaluation."""

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self._wait_shares: list[float] = []  # per epoch: the share spent waiting for batches
        self.residency: str | None = None  # where the loader's input rows live (in-memory mini and cluster)
        self.resident_rows: Tensor | None = None  # their dense copy with --feature-residency device
        self.sparse_source: SparseRows | None = None  # their CSR copy when the run takes bag-of-words rows sparse

    def load(self) -> None:
        """Load inputs, labels and edge data; keep the CSR memory-mapped; build the batch loader."""
        cfg = self.cfg
        self.data = d = load_graph_data(str(cfg.store), device=self.device, task=cfg.task,
                                        feature_norm=cfg.feature_norm, features=cfg.features,
                                        split_seed=cfg.split_seed, in_memory_graph=False, mapped_features=True)
        assert d.task is not None
        self.store, self.task, self.feature_norm = d.store, d.task, d.feature_norm
        self.spec = ModelSpec(d.in_dim, d.task.num_outputs, d.edge_dim, d.store.num_nodes, d.embedding_dim)
        self.indptr = np.asarray(d.store.indptr)
        self.indices = np.asarray(d.store.indices)
        self.last_epoch: dict[str, float] = {}
        self.loader = self.make_loader()
        features = getattr(self.loader, "features", None)
        if features is not None and (self.residency == "device" or self.sparse_source is not None):
            features.consumer = True  # sampler processes only sample: the trainer gathers from its copy

    def make_loader(self) -> Any:
        """The loader whose ``epoch(seed)`` yields this strategy's batches."""
        raise NotImplementedError

    def loader_rows(self) -> Tensor | FeatureSource:
        """The input rows the loader gathers, where ``--feature-residency`` puts them.

        ``host``: the loaded rows (the store's memory map, normalized at gather). ``device``: one dense copy on
        the training device, made through the same gather (so the batches are the same), from which the trainer
        gathers each batch's rows; sampler processes then only sample (:class:`BatchProducer`). Evaluation
        reads that copy too (:meth:`_infer`).
        """
        x = self.data.x
        assert x is not None
        src = as_feature_source(x)
        free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        self.residency = feature_residency(self.cfg.feature_residency, src.nbytes, self.device.type, free)
        if self.residency == "host":
            self.sparse_source = self._sparse_source(x)
            return x if self.sparse_source is None else self.sparse_source
        dense = isinstance(x, Tensor) and x.device == self.device and x.layout == torch.strided
        rows = x if isinstance(x, Tensor) and dense else copy_rows(src, self.device)
        self.resident_rows = rows
        return rows

    def _sparse_source(self, x: Tensor | FeatureSource) -> SparseRows | None:
        """The input rows as one CSR matrix when the run takes them sparse and they fit (else None).

        Built a block of rows at a time from the store's memory map (normalized as the gather would), so the
        dense rows are never held. Skipped when the non-zeros would take more than a quarter of the available
        memory: the batches are then converted one at a time, into the same CSR, so the run's results do not
        depend on which way was taken.
        """
        if not self.sparse_input:
            return None
        import psutil

        density = self.store.feature_density or 0.0
        need = 12 * density * self.store.num_nodes * max(1, self.store.num_features) + 8 * self.store.num_nodes
        if need > psutil.virtual_memory().available / 4:
            return None
        if isinstance(x, NormalizedRows) and isinstance(x.source, ArrayRows):
            csr = sparse_rows_of(x.source.x, x.mode, max_density=1.0)
        elif isinstance(x, Tensor):
            csr = to_sparse_rows(x, max_density=1.0)
        else:
            return None
        return SparseRows(csr) if csr is not None and is_sparse(csr) else None

    def loader_tensors(self, on_cpu: bool | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """Labels, edge weights and edge features where the loader reads them.

        On the training device, unless ``on_cpu`` (default: whether ``--samplers K`` builds batches in worker
        processes): those gather on the CPU and the batch moves to the device whole when it arrives (these are
        ``O(N + E)`` copies; the features are already a CPU source). Evaluation keeps reading the device's copies.
        """
        d = self.data
        if on_cpu is None:
            on_cpu = int(getattr(self.cfg, "samplers", 0) or 0) > 0
        return tuple(t.cpu() if on_cpu and t is not None else t  # type: ignore[return-value]
                     for t in (d.y, d.edge_weight, d.edge_feat))

    @property
    def sparse_input(self) -> bool:
        """Whether a batch's input rows reach the model as sparse rows (:mod:`trellis.ops.sparse_rows`).

        Bag-of-words stores (at most :data:`~trellis.ops.sparse_rows.MAX_DENSITY` non-zeros) with a built-in
        message-passing model on the CPU, as full-batch keeps them. Why: the first layer's dropout and
        transform over dense rows were most of a batch's step (Coauthor Physics, cluster-batch: 8,415 words
        per row, 0.4% of them non-zero). Decided once per run from the store, so every batch, every producer
        mode and every evaluation of the run takes the same path.
        """
        cached = getattr(self, "_sparse_input", None)
        if cached is None:
            cached = sparse_rows_density(self.store, self.cfg, self.device) is not None
            self._sparse_input = cached
        return cached

    @property
    def first_input(self) -> Callable[[Tensor], Tensor] | None:
        """What turns a batch's (or an evaluation chunk's) input rows into the first layer's: sparse rows or None."""
        return _as_sparse_rows if self.sparse_input else None

    def _loss(self, model: nn.Module, batch: Batch, task: Task) -> tuple[Tensor | None, int]:
        x, first = batch.x, self.first_input
        logits = model(batch.graph, x if first is None or x is None else first(x))
        y = batch.y
        assert y is not None  # the loader was given the labels
        if batch.loss_mask is not None:
            mask = batch.loss_mask.to(logits.device)
            count = int(mask.sum())
            if count == 0:
                return None, 0
            logits, y = logits[mask], y[mask]
        else:
            count = int(logits.shape[0])
        return task.loss(logits, y), count

    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """One epoch over all batches; returns the mean training loss over the loss-carrying targets."""
        model.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        steps = 0
        t0 = time.perf_counter()
        batches = self._open_epoch(_epoch_seed())
        open_step = False  # gradients were zeroed for the step in progress
        backed = False  # some batch of the step in progress back-propagated a loss
        waited = WaitedBatches(batches, self._starving_check())
        for batch in waited:
            if not open_step:
                optimizer.zero_grad(set_to_none=True)
                open_step = True
            loss, n = self._loss(model, batch, task)
            if loss is not None:
                (loss if batch.step_weight == 1.0 else loss * batch.step_weight).backward()
                backed = True
                if not batch.replay:  # a rehearsed batch is not one of the epoch's targets
                    total += loss.detach().to(torch.float64) * n
                    count += n
            if batch.step_end:  # a partition buffer's step may span batches of two buffer states
                if backed:
                    optimizer.step()
                    steps += 1
                open_step = backed = False
        self.last_epoch = {"batches": steps, "targets": count, "wait_s": waited.wait_s}  # counts, as ranks record
        elapsed = time.perf_counter() - t0
        self._wait_shares.append(waited.wait_s / elapsed if elapsed > 0 else 0.0)
        self._close_epoch(elapsed)
        if self._producer is not None:
            self.last_epoch["sampler_read_bytes"] = float(getattr(batches, "read_bytes", 0))
        return (total / max(count, 1)).to(torch.float32)

    _producer: BatchProducer[Any] | None = None
    _threads: tuple[int, int] | None = None
    _priority: PriorityTrial | None = None

    def _open_epoch(self, epoch_seed: int) -> Any:
        """The epoch's batches (:meth:`_epoch_batches`), their builders at the priority the run's trial gives."""
        if self._priority is None:
            self._priority = PriorityTrial()
        background = self._priority.before()
        batches = self._epoch_batches(epoch_seed)
        if self._producer is not None:  # its processes already run: they take this epoch's priority now
            self._producer.set_background(background)
        return batches

    def _starving_check(self) -> Any:
        """:meth:`_starving` where sampler processes run in the background this epoch, else None (no watcher)."""
        producer, trial = self._producer, self._priority
        background = producer is not None and producer.background and trial is not None and trial.on
        return self._starving if background else None

    def _starving(self, wait_s: float, elapsed_s: float) -> None:
        """Builders in the background starve the trainer this epoch: all of them to the normal priority now."""
        if self._priority is not None and self._priority.starving(wait_s, elapsed_s) and self._producer is not None:
            self._producer.set_background(False)

    def summary_info(self) -> dict[str, Any]:
        """The median share of an epoch the trainer spent waiting for batches.

        Where it is large the loader's own thread cannot keep up, and the CLI suggests ``--samplers``.
        """
        shares = self._wait_shares
        return {**super().summary_info(), **({"feature_residency": self.residency} if self.residency else {}),
                **({"batch_wait_share": statistics.median(shares)} if shares else {})}

    def _close_epoch(self, seconds: float) -> None:
        """The epoch's training took ``seconds`` (the priority trial's measurement)."""
        assert self._priority is not None
        self._priority.after(seconds)

    def _epoch_batches(self, epoch_seed: int) -> Any:
        """The epoch's batches: from the loader's own threads, or from ``--samplers K`` worker processes.

        Both give the same batches (each is a pure function of the epoch's plan and its index); the worker
        processes start once and serve every epoch.
        """
        samplers = int(getattr(self.cfg, "samplers", 0))
        if samplers <= 0:
            return self.loader.epoch(epoch_seed)
        if self._producer is None:
            # Cores the trainer keeps are shared with the samplers: they run in the trainer's idle time
            self._threads = leave_cores(samplers)  # (one thread each, the producer's default)
            opts = ProducerOptions.from_flags(samplers, prefetch=self.cfg.prefetch, recycle=True,
                                              background=self._threads is None)
            self._producer = BatchProducer(self.loader, opts).start()
        return self._producer.epoch(epoch_seed)

    def close(self) -> None:
        """Stop the sampler processes, if any."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        if self._threads is not None:  # the caller's thread counts again
            set_threads(*self._threads)
            self._threads = None
        super().close()

    def _infer(self, model: nn.Module, rows: np.ndarray | None = None) -> Tensor:
        """Exact outputs for ``rows``: from the device copy of the rows when there is one.

        Why the copy: it is a whole matrix on the compute device, so the first layer runs over the whole
        graph at once instead of gathering each chunk's rows from the host and copying them over.
        """
        d = self.data
        x: Tensor | FeatureSource | None = self.resident_rows if self.resident_rows is not None else self.sparse_source
        if x is None:
            assert d.x is not None
            x = d.x
        return layerwise_inference(model, self.indptr, self.indices, x, edge_weight=d.edge_weight,
                                   edge_feat=d.edge_feat, device=self.device, rows=rows,
                                   first_input=self.first_input)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """``<split>_<metric>`` for every split plus ``val_loss``, from exact layer-wise inference."""
        d = self.data
        assert d.y is not None
        splits = d.splits
        rows = torch.cat([splits[s] for s in splits]).cpu().numpy()
        rows_u, inverse = np.unique(rows, return_inverse=True)
        logits = self._infer(model, rows_u)
        inv = torch.from_numpy(inverse).to(logits.device)
        ends = np.cumsum([idx.shape[0] for idx in splits.values()])
        where = {s: inv[end - idx.shape[0]:end] for (s, idx), end in zip(splits.items(), ends)}
        return split_metrics(task, lambda s: logits.index_select(0, where[s]), d.y, splits)

    def _explain_batch(self) -> Any:
        """The first batch of an epoch, built in this thread (None: the epoch has none, or the loader has none yet).

        A partition buffer's batches exist only once their parts are read: the plan is then the graph's.
        """
        if len(self.loader) == 0 or not hasattr(self.loader, "get"):
            return None
        return self.loader.get(self.loader.plan(0), 0)

    def explain_graph(self) -> Any:
        """One step's graphs: the blocks (or cluster subgraph) of an epoch's first batch.

        Why a batch, not the store's graph: a step computes on its sampled blocks, and the whole graph's plan
        (every node's rows, every edge) overstated a mini-batch step's FLOPs and bytes by the graph's size over
        the batch's (2,708 rows per layer on Cora, where a batch of 140 targets reads 1,200 input rows).
        """
        batch = self._explain_batch()
        return CSRGraph.from_store(self.store) if batch is None else batch.graph

    def explain(self, model: nn.Module) -> str:
        """The epoch's batches, then the model's plan of one of them (its first)."""
        cfg = self.cfg
        n = len(self.loader)
        head = f"{cfg.strategy}: {n} batch{'es' if n != 1 else ''} per epoch"
        if cfg.strategy == "mini":
            head += f" of {cfg.batch_size} targets, fanouts {cfg.fanouts}"
        batch = self._explain_batch()
        if batch is not None and isinstance(batch.graph, CSRGraph):  # a cluster's subgraph
            g = batch.graph
            head += f"; the plan below is of the first batch: {g.num_dst:,} nodes, {g.num_edges:,} edges"
        elif batch is not None:  # a sampled batch's blocks, input layer first
            blocks = batch.graph
            head += (f"; the plan below is of the first batch: {blocks[-1].num_dst:,} targets, "
                     f"{blocks[0].num_src:,} input rows, {sum(b.num_edges for b in blocks):,} sampled edges")
        elif n:
            head += "; the plan below is of the whole graph (a step computes on a batch's share of it)"
        if self.sparse_input:
            density = self.store.feature_density or 0.0
            held = f", held as CSR ({format_size(self.sparse_source.nbytes)})" if self.sparse_source is not None else ""
            head += (f"\ninput rows: sparse (bag-of-words, {100 * density:.2f}% non-zero){held}; the first layer's "
                     "dropout and transform run over the non-zeros (the plan below prices them dense)")
        return head + "\n" + super().explain(model)

    @torch.no_grad()
    def predict(self, model: nn.Module) -> Tensor:
        """Logits of every node by exact layer-wise inference."""
        model.eval()
        return self._infer(model)


__all__ = ["BatchStrategy", "WaitedBatches"]
