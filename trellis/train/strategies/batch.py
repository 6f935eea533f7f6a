"""Mini-batch (neighbour sampling) and cluster-batch training: one training step is an epoch of batches.

* ``mini``: the training ids are shuffled and cut into ``--batch-size`` targets; each batch's blocks are
  sampled with ``--fanouts`` (optionally ``--labor``), its input features gathered, and the model runs on
  the blocks. Batches are prepared ``--prefetch`` ahead on a background thread.
* ``cluster``: the graph is clustered once (``--clusters`` by ``--cluster-method``); every batch is a random
  group of ``--clusters-per-batch`` clusters with the edges among them (plus ``--boundary-hops`` of boundary
  sources); the loss is taken on the training nodes among the targets.

Both read the store's CSR through its memory maps (no in-memory copy of the graph). Evaluation is exact
(:func:`trellis.loader.inference.layerwise_inference`): every node's output over its full neighbourhood,
layer by layer, equal to the full-batch forward pass.

Reproducibility and resume: each epoch's shuffle and samples derive from one number drawn from torch's
global generator at the start of the epoch; the trainer saves and restores that generator with its
checkpoints, so a resumed run draws the same epochs as one that was never interrupted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trellis.loader.blocks import Batch, parse_fanouts
from trellis.loader.cluster import ClusterLoader, cluster_assignment
from trellis.loader.inference import layerwise_inference
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.train.build import ModelSpec
from trellis.train.data import load_graph_data
from trellis.train.strategies.full import GraphStrategy
from trellis.train.strategy import register_strategy
from trellis.train.tasks import Task, split_metrics


def _epoch_seed() -> int:
    """One draw from torch's global generator (saved in checkpoints) that seeds an epoch's batches."""
    return int(torch.randint(0, 2**62, (1,)).item())


class BatchStrategy(GraphStrategy):
    """Shared parts: loading without an in-memory graph, the epoch loop over batches, exact evaluation."""

    def load(self) -> None:
        """Load inputs, labels and edge data; keep the CSR memory-mapped; build the batch loader."""
        cfg = self.cfg
        self.data = d = load_graph_data(str(cfg.store), device=self.device, task=cfg.task,
                                        feature_norm=cfg.feature_norm, features=cfg.features,
                                        split_seed=cfg.split_seed, in_memory_graph=False)
        assert d.task is not None
        self.store, self.task, self.feature_norm = d.store, d.task, d.feature_norm
        self.spec = ModelSpec(d.in_dim, d.task.num_outputs, d.edge_dim, d.store.num_nodes, d.embedding_dim)
        self.indptr = np.asarray(d.store.indptr)
        self.indices = np.asarray(d.store.indices)
        self.last_epoch: dict[str, float] = {}
        self.loader = self.make_loader()

    def make_loader(self) -> Any:
        """The loader whose ``epoch(seed)`` yields this strategy's batches."""
        raise NotImplementedError

    def _loss(self, model: nn.Module, batch: Batch, task: Task) -> tuple[Tensor | None, int]:
        logits = model(batch.graph, batch.x)
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
        batches = self.loader.epoch(_epoch_seed())
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            loss, n = self._loss(model, batch, task)
            if loss is None:
                continue
            loss.backward()
            optimizer.step()
            total += loss.detach().to(torch.float64) * n
            count += n
            steps += 1
        self.last_epoch = {"batches": float(steps), "targets": float(count),
                           "wait_s": float(getattr(batches, "wait_s", 0.0))}
        return (total / max(count, 1)).to(torch.float32)

    def _infer(self, model: nn.Module, rows: np.ndarray | None = None) -> Tensor:
        d = self.data
        return layerwise_inference(model, self.indptr, self.indices, d.x, edge_weight=d.edge_weight,
                                   edge_feat=d.edge_feat, device=self.device, rows=rows)

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

    @torch.no_grad()
    def predict(self, model: nn.Module) -> Tensor:
        """Logits of every node by exact layer-wise inference."""
        model.eval()
        return self._infer(model)


@register_strategy("mini")
class MiniBatch(BatchStrategy):
    """Neighbour-sampled mini-batches (``--strategy mini``)."""

    options = frozenset({"labor", "prefetch"})

    def make_loader(self) -> NeighborLoader:
        """A sampler over the memory-mapped CSR and a loader over the training ids."""
        cfg, d = self.cfg, self.data
        fanouts = parse_fanouts(cfg.fanouts, cfg.layers)
        sampler = NeighborSampler(self.indptr, self.indices, fanouts, labor=cfg.labor)
        # The preparing thread keeps numba's thread count (all cores): measured against one thread beside the
        # trainer (benchmarks/ and docs/minibatch.md), two were faster per epoch even on a loaded 2-core machine.
        return NeighborLoader(sampler, d.splits["train"].cpu().numpy(), cfg.batch_size, x=d.x, y=d.y,
                              device=self.device, prefetch=cfg.prefetch, edge_weight=d.edge_weight,
                              edge_feat=d.edge_feat)


@register_strategy("cluster")
class ClusterBatch(BatchStrategy):
    """Cluster-batches (``--strategy cluster``): Cluster-GCN with GraphTheta's optional boundary."""

    options = frozenset({"clusters", "clusters_per_batch", "boundary_hops", "cluster_method", "prefetch"})

    def make_loader(self) -> ClusterLoader:
        """Cluster the graph once and load groups of clusters."""
        cfg, d = self.cfg, self.data
        parts = cluster_assignment(d.store, cfg.clusters, cfg.cluster_method, seed=cfg.seed)
        return ClusterLoader(self.indptr, self.indices, parts, cfg.clusters_per_batch, num_layers=cfg.layers,
                             boundary_hops=cfg.boundary_hops, x=d.x, y=d.y,
                             loss_nodes=d.splits["train"].cpu().numpy(), edge_weight=d.edge_weight,
                             edge_feat=d.edge_feat, device=self.device, prefetch=cfg.prefetch)
