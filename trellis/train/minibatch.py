"""Mini-batch (neighbour sampling) and cluster-batch training strategies for the trainer.

The trainer (:mod:`trellis.train.trainer`) owns everything around a training step -- runs over seeds,
early stopping, checkpoints, the run directory; a strategy owns what one "step" and one evaluation are.
For these two strategies a step is one *epoch* of batches:

* ``mini``: the training ids are shuffled and cut into ``--batch-size`` targets; each batch's blocks
  are sampled with ``--fanouts`` (optionally ``--labor``), its input features gathered, and the model
  runs on the blocks. Batches are prepared ``--prefetch`` ahead on a background thread.
* ``cluster``: the graph is clustered once (``--clusters`` by ``--cluster-method``); every batch is a
  random group of ``--clusters-per-batch`` clusters with the edges among them (plus ``--boundary-hops``
  of boundary sources); the loss is taken on the training nodes among the targets.

Evaluation is exact for both (:func:`trellis.loader.inference.layerwise_inference`): every node's output
over its full neighbourhood, layer by layer, equal to the full-batch forward pass.

Reproducibility and resume: each epoch's shuffle and samples derive from one number drawn from torch's
global generator at the start of the epoch. The trainer saves and restores that generator with its
checkpoints, so a resumed run draws the same epochs as one that was never interrupted, and runs with
different ``--seed`` values see different batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trellis.errors import TrellisUserError
from trellis.loader.blocks import Batch, parse_fanouts
from trellis.loader.cluster import ClusterLoader, cluster_assignment
from trellis.loader.inference import layerwise_inference
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.train.config import BATCH_MODELS, TrainConfig
from trellis.train.tasks import Task


def check_model(strategy: str, model: str) -> None:
    """Refuse a strategy/model combination that does not exist (exit 2 with the alternatives)."""
    if model not in BATCH_MODELS:
        raise TrellisUserError(f"--strategy {strategy} does not apply to --model {model}: it trains message-passing "
                               f"models ({', '.join(BATCH_MODELS)}); train {model} with its own strategy")


def _epoch_seed() -> int:
    """One draw from torch's global generator (saved in checkpoints) that seeds an epoch's batches."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _numpy(t: Tensor | np.ndarray) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, Tensor) else np.asarray(t)


class _BatchStrategy:
    """Shared parts: the epoch loop over batches and exact layer-wise evaluation."""

    name = ""
    #: The trainer passes the config to strategies that declare they need it.
    needs_config = True

    def __init__(self, data: Any, cfg: TrainConfig) -> None:
        check_model(cfg.strategy, cfg.model)
        self.data = data
        self.cfg = cfg
        self.device = data.x.device
        store = data.store
        self.indptr = np.asarray(store.indptr)
        self.indices = np.asarray(store.indices)
        g = data.graph
        self.edge_weight = g.edge_weight
        self.edge_feat = g.edge_feat
        self.last_epoch: dict[str, float] = {}

    def batches(self, epoch_seed: int) -> Any:
        raise NotImplementedError

    def _loss(self, model: nn.Module, batch: Batch, task: Task) -> tuple[Tensor | None, int]:
        logits = model(batch.graph, batch.x)
        y = batch.y
        if batch.loss_mask is not None:
            mask = batch.loss_mask.to(logits.device)
            count = int(mask.sum())
            if count == 0:
                return None, 0
            logits, y = logits[mask], y[mask]
        else:
            count = int(logits.shape[0])
        return task.loss(logits, y), count

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, task: Task) -> Tensor:
        """One epoch over all batches; returns the mean training loss over the loss-carrying targets."""
        model.train()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        steps = 0
        batches = self.batches(_epoch_seed())
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

    @torch.no_grad()
    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """``<split>_<metric>`` for every split plus ``val_loss``, from exact layer-wise inference."""
        d = self.data
        splits = d.splits
        rows = torch.cat([splits[s] for s in splits]).cpu().numpy()
        rows_u, inverse = np.unique(rows, return_inverse=True)
        logits = layerwise_inference(model, self.indptr, self.indices, d.x, edge_weight=self.edge_weight,
                                     edge_feat=self.edge_feat, device=self.device, rows=rows_u)
        out: dict[str, float] = {}
        start = 0
        inv = torch.from_numpy(inverse).to(logits.device)
        for split, idx in splits.items():
            sel = logits.index_select(0, inv[start:start + idx.shape[0]])
            start += idx.shape[0]
            for name, value in task.metrics(sel, d.y[idx]).items():
                out[f"{split}_{name}"] = value
            if split == "val":
                out["val_loss"] = float(task.loss(sel, d.y[idx]))
        return out


class MiniBatch(_BatchStrategy):
    """Neighbour-sampled mini-batches (``--strategy mini``)."""

    name = "mini"

    def __init__(self, data: Any, cfg: TrainConfig) -> None:
        super().__init__(data, cfg)
        fanouts = parse_fanouts(cfg.fanouts, cfg.layers)
        sampler = NeighborSampler(self.indptr, self.indices, fanouts, labor=cfg.labor)
        # The preparing thread keeps numba's thread count (all cores): measured against one thread beside the
        # trainer (benchmarks/ and docs/minibatch.md), two were faster per epoch even on a loaded 2-core machine.
        self.loader = NeighborLoader(sampler, _numpy(data.splits["train"]), cfg.batch_size, x=data.x, y=data.y,
                                     device=self.device, prefetch=cfg.prefetch, edge_weight=self.edge_weight,
                                     edge_feat=self.edge_feat)

    def batches(self, epoch_seed: int) -> Any:
        return self.loader.epoch(epoch_seed)


class ClusterBatch(_BatchStrategy):
    """Cluster-batches (``--strategy cluster``): Cluster-GCN with GraphTheta's optional boundary."""

    name = "cluster"

    def __init__(self, data: Any, cfg: TrainConfig) -> None:
        super().__init__(data, cfg)
        parts = cluster_assignment(data.store, cfg.clusters, cfg.cluster_method, seed=cfg.seed)
        self.loader = ClusterLoader(self.indptr, self.indices, parts, cfg.clusters_per_batch, num_layers=cfg.layers,
                                    boundary_hops=cfg.boundary_hops, x=data.x, y=data.y,
                                    loss_nodes=_numpy(data.splits["train"]), edge_weight=self.edge_weight,
                                    edge_feat=self.edge_feat, device=self.device, prefetch=cfg.prefetch)

    def batches(self, epoch_seed: int) -> Any:
        return self.loader.epoch(epoch_seed)


#: Strategies this module adds to the trainer's registry.
STRATEGIES = {"mini": MiniBatch, "cluster": ClusterBatch}
