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

from trellis.distributed.comm import RankEnv
from trellis.loader.blocks import parse_fanouts
from trellis.loader.cluster import ClusterLoader, cluster_assignment
from trellis.loader.sampler import NeighborLoader, NeighborSampler
from trellis.train.config import TrainConfig
from trellis.train.strategies.batches import BatchStrategy
from trellis.train.strategies.buffered import BufferedCluster, BufferedMini
from trellis.train.strategies.dist_cluster import DistributedCluster
from trellis.train.strategies.dist_mini import DistributedMini
from trellis.train.strategy import Strategy, register_strategy


@register_strategy("mini")
class MiniBatch(BatchStrategy):
    """Neighbour-sampled mini-batches (``--strategy mini``)."""

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> type[Strategy]:
        """This class; with ``--parts-dir``, a partition buffer in one process or data-parallel ranks.

        :class:`~trellis.train.strategies.dist_mini.DistributedMini` across ranks (``--nproc`` > 1, or a process
        started as a rank), else :class:`~trellis.train.strategies.buffered.BufferedMini`.
        """
        if cfg.parts_dir is None:
            return cls
        ranked = RankEnv.from_environ() is not None or (cfg.nproc or 1) > 1
        return DistributedMini if ranked else BufferedMini

    def make_loader(self) -> NeighborLoader:
        """A sampler over the memory-mapped CSR and a loader over the training ids."""
        cfg, d = self.cfg, self.data
        fanouts = parse_fanouts(cfg.fanouts, cfg.layers)
        sampler = NeighborSampler(self.indptr, self.indices, fanouts, labor=cfg.labor)
        # The preparing thread keeps numba's thread count (all cores): measured against one thread beside the
        # trainer (benchmarks/ and docs/minibatch.md), two were faster per epoch even on a loaded 2-core machine.
        y, ew, ef = self.loader_tensors()
        return NeighborLoader(sampler, d.splits["train"].cpu().numpy(), cfg.batch_size, x=self.loader_rows(), y=y,
                              device=self.device, prefetch=cfg.prefetch, edge_weight=ew, edge_feat=ef)


@register_strategy("cluster")
class ClusterBatch(BatchStrategy):
    """Cluster-batches (``--strategy cluster``): Cluster-GCN with GraphTheta's optional boundary."""

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> type[Strategy]:
        """This class; with ``--parts-dir``, a partition buffer in one process or hybrid-parallel ranks.

        :class:`~trellis.train.strategies.dist_cluster.DistributedCluster` across ranks (``--nproc`` > 1, or a
        process started as a rank), else :class:`~trellis.train.strategies.buffered.BufferedCluster`.
        """
        if cfg.parts_dir is None:
            return cls
        ranked = RankEnv.from_environ() is not None or (cfg.nproc or 1) > 1
        return DistributedCluster if ranked else BufferedCluster

    def make_loader(self) -> ClusterLoader:
        """Cluster the graph once and load groups of clusters."""
        cfg, d = self.cfg, self.data
        parts = cluster_assignment(d.store, cfg.clusters, cfg.cluster_method, seed=cfg.seed)
        y, ew, ef = self.loader_tensors()
        return ClusterLoader(self.indptr, self.indices, parts, cfg.clusters_per_batch, num_layers=cfg.layers,
                             boundary_hops=cfg.boundary_hops, x=self.loader_rows(), y=y,
                             loss_nodes=d.splits["train"].cpu().numpy(), edge_weight=ew, edge_feat=ef,
                             device=self.device, prefetch=cfg.prefetch)
