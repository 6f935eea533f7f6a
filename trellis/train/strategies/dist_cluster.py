"""Hybrid-parallel cluster-batch across ranks: ``--strategy cluster --parts-dir PART_DIR --nproc P`` (or torchrun).

GraphTheta §4.2-4.3: one batch is computed by the group of workers that own its nodes. The batches are one
process's cluster-batches (``--clusters`` by ``--cluster-method``, ``--clusters-per-batch`` of them per batch,
``--boundary-hops``); the layout's parts only say which rank owns which rows (part ``p`` to rank ``p mod P``,
its feature rows in that rank's memory). Every rank builds the same batch from the store's memory-mapped CSR
(its structure only: an ``O(batch edges)`` induced subgraph), takes the rows it owns, and the batch's
subgraph is trained as a partition-parallel full-batch graph is (:mod:`trellis.train.strategies.partitioned`):
each layer's halo rows are pulled from their owners (:class:`~trellis.distributed.ownership.PullExchange`,
routes agreed per batch), the gradients are summed. What makes a step one process's step on the same batch:

* **the same batches**: the clustering is rank 0's, sent to every rank; the epoch seed is shared, so every rank
  draws the same groups of clusters;
* **the same normalization**: degrees are the batch subgraph's (Cluster-GCN's), handed to every rank's part;
* **the same masks**: dropout masks are keyed by each row's position in the batch, and every rank's generator
  makes the same draws (all ranks run every batch);
* **the same loss**: each rank's mean over its loss rows is scaled by its share of the batch's loss rows,
  which every rank knows, so the summed gradient is the batch mean's.

With ``--boundary-hops h`` the batch's hop-ordered rows train as one square graph whose rows past the input
layer's block have no in-edges: those rows feed no target, and every row a target depends on is computed
from exactly the edges of one process's per-layer blocks. GCN, SAGE and GIN run (their aggregation is the
exchange's), and GAT on each rank's pull graph, with the halo rows of every layer's input appended and its
attention masks keyed by each edge's place in the batch's self-looped CSR (GAT-E with the batch's edge
features); ``--edge-weight`` and ``--norm batch`` are refused. Evaluation, predictions and
the fetch of other ranks' input rows are data-parallel mini-batch's (exact layer-wise inference split over
the ranks).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from trellis.distributed.attention import edge_keys, self_loop_eids
from trellis.distributed.ownership import RankGraph, build_rank_graph
from trellis.errors import TrellisUserError
from trellis.loader.blocks import Batch
from trellis.loader.cluster import ClusterLoader, cluster_assignment
from trellis.nn.batched import BatchedGNN
from trellis.ops.dropout import keyed_rows
from trellis.partition.layout import LocalGraph
from trellis.plan.cost import GraphStats
from trellis.train.config import TrainConfig
from trellis.train.strategies.batches import WaitedBatches
from trellis.train.strategies.dist_mini import DistributedMini, rank_of_part
from trellis.train.tasks import Task
from trellis.utils.memory import trim_heap

#: Models whose aggregation the pull exchange completes, and GAT and GAT-E, which run on the pull graph with its
#: halo rows appended per layer (attention masks keyed by each edge's place in the batch's self-looped CSR).
EXCHANGED_MODELS = ("gcn", "sage", "gin")
ATTENTION = ("gat", "gate")

#: Plans a rank keeps: one per batch shape, so an epoch of distinct batches must not grow them for ever.
PLAN_CACHE = 64


def batch_part(indptr: np.ndarray, indices: np.ndarray, degree: np.ndarray, owner: np.ndarray,
               rank: int, edge_feat: Tensor | None = None) -> LocalGraph:
    """Rank ``rank``'s part of one batch's square subgraph, as a destination-owned layout part.

    Args:
        indptr: ``int64 [n+1]`` the batch's in-edge CSR over its ``n`` rows (batch-local ids).
        indices: ``int64 [e]`` sources (batch-local ids).
        degree: ``[n]`` in-degree of every batch row (the normalization's).
        owner: ``int64 [n]`` rank owning each batch row.
        rank: This rank.
        edge_feat: ``[e, D]`` features of the batch's edges, in its order (GAT-E), or None.

    Returns:
        A part whose "global" ids are batch-local ids: the owned rows ascending, then the halo sources of their
        in-edges ascending, each row's in-edges in the batch's order (so every sum is one process's).
    """
    n = owner.shape[0]
    own = np.flatnonzero(owner == rank)
    counts = indptr[own + 1] - indptr[own]
    local_indptr = np.zeros(own.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=local_indptr[1:])
    pos = np.repeat(indptr[own] - local_indptr[:-1], counts) + np.arange(int(local_indptr[-1]), dtype=np.int64)
    src = indices[pos]
    halo = np.unique(src[owner[src] != rank])
    local_of = np.empty(n, dtype=np.int64)
    local_of[own] = np.arange(own.shape[0])
    local_of[halo] = own.shape[0] + np.arange(halo.shape[0])
    ids = np.concatenate([own, halo])
    return LocalGraph(part=rank, ownership="dst", num_local=int(own.shape[0]), local_to_global=ids,
                      halo_owner=owner[halo].astype(np.int32), indptr=local_indptr, indices=local_of[src],
                      edge_ids=pos, in_degree=np.asarray(degree)[ids].astype(np.int64),
                      out_degree=np.zeros(ids.shape[0], dtype=np.int64),
                      mirror_indptr=np.zeros(own.shape[0] + 1, dtype=np.int64), mirror_parts=np.empty(0, np.int32),
                      edge_feat=None if edge_feat is None else edge_feat.cpu().numpy()[pos])


def square_of(batch: Batch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch's rows as one square CSR ``(indptr, indices, degree)`` over all its ``n`` input rows.

    The input layer's block holds the in-edges of every row any target depends on (all rows without a
    boundary); the rows past it get none. ``degree`` is the subgraph's in-degree of every row.
    """
    g = batch.blocks[0]
    n = int(g.num_src)
    rows = int(g.num_dst)
    indptr = np.empty(n + 1, dtype=np.int64)
    indptr[: rows + 1] = g.indptr.cpu().numpy()
    indptr[rows + 1:] = indptr[rows]
    degree = g.src_degree.cpu().numpy() if g.src_degree is not None else np.diff(indptr)
    return indptr, g.indices.cpu().numpy(), degree


class DistributedCluster(DistributedMini):
    """Cluster-batches computed by the ranks that own their rows (see the module docstring)."""

    name = "cluster"

    @classmethod
    def check_options(cls, cfg: TrainConfig) -> None:
        """Refuse models and options whose result would depend on how a batch is split across ranks."""
        super().check_options(cfg)
        if cfg.model not in EXCHANGED_MODELS + ATTENTION:
            raise TrellisUserError(f"--model {cfg.model} is not available for cluster-batch across ranks (it trains "
                                   f"{', '.join(EXCHANGED_MODELS + ATTENTION)}): pick one of them, or train in one "
                                   "process (--nproc 1 without --parts-dir)")
        if cfg.edge_weight:
            raise TrellisUserError("--edge-weight is not available across ranks (each rank's weighted degrees would "
                                   "be local); train in one process, or drop --edge-weight")

    def make_loader(self) -> ClusterLoader:  # type: ignore[override]
        """One process's cluster loader (rank 0's clustering on every rank), building structure only."""
        cfg, comm = self.cfg, self.comm
        assert comm is not None
        n = self.store.num_nodes
        parts = torch.empty(n, dtype=torch.int64)
        if comm.rank == 0:
            parts.copy_(torch.from_numpy(cluster_assignment(self.store, cfg.clusters, cfg.cluster_method,
                                                            seed=cfg.seed).astype(np.int64)))
        if comm.world_size > 1:
            dist.broadcast(parts, src=0, group=comm.control)
        train = self.data.splits["train"].cpu().numpy()
        _, _, edge_feat = self.loader_tensors(on_cpu=True)  # GAT-E's; --edge-weight is refused across ranks
        return ClusterLoader(self.indptr, self.indices, parts.numpy(), cfg.clusters_per_batch, num_layers=cfg.layers,
                             boundary_hops=cfg.boundary_hops, loss_nodes=train, edge_feat=edge_feat,
                             prefetch=cfg.prefetch)

    def _fill_cache(self, owner: np.ndarray) -> int:
        return 0  # rows a batch needs from other ranks travel per layer, as the exchange's halo

    # ---- training -------------------------------------------------------------------------------
    def _batched(self, model: nn.Module) -> BatchedGNN:
        """The model run as the planner's executor (what the exchange hooks into), one per model."""
        cached = getattr(self, "_runner", None)
        if cached is None or cached[0] is not model:
            cached = (model, BatchedGNN([model]))
            self._runner = cached
        return cached[1]

    def _forward(self, model: nn.Module, batch: Batch) -> tuple[Tensor, np.ndarray, RankGraph]:
        """Logits of this rank's rows of ``batch`` (every rank runs every batch), their batch rows, its graph.

        Collective: the routes of the batch's halo rows are agreed, and every layer exchanges them.
        """
        assert self.comm is not None
        indptr, indices, degree = square_of(batch)
        ids = batch.node_ids.cpu().numpy()
        part = batch_part(indptr, indices, degree, self.owner[ids], self.comm.rank, batch.blocks[0].edge_feat)
        rg = build_rank_graph(part, self.comm, self.device)
        mine = part.local_to_global[: part.num_local]
        x = self.local_rows.gather(ids[mine]).to(self.device)
        if self.cfg.model in ATTENTION:  # the pull graph, whose view appends each layer's halo rows
            pull, view = rg.pull_graph, rg.pull_view
            assert pull is not None and view is not None
            view.constant = x
            keys = edge_keys(self.comm, pull.with_self_loops(), self_loop_eids(pull), indptr)
            with keyed_rows(nodes=mine, edges=keys):
                return model(pull, x, view=view), mine, rg
        if self.first_input is not None:  # bag-of-words rows sparse, as one process's cluster-batch takes them
            x = self.first_input(x)
        batched = self._batched(model)
        if len(batched._plans) > PLAN_CACHE:
            batched._plans.clear()
        n = int(ids.shape[0])
        batched.stats = GraphStats(n, n, int(indices.shape[0]))
        batched.train(model.training)
        with keyed_rows(nodes=mine):
            return batched(rg.graph, x, view=rg.view)[0], mine, rg

    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """One epoch of one process's cluster-batches, each computed by every rank on its rows."""
        comm = self.comm
        assert comm is not None
        model.train()
        t0 = time.perf_counter()
        batches = self._open_epoch(self._shared_seed())
        params: list[Tensor] = [p for p in model.parameters() if p.requires_grad]
        y = self.data.y
        assert y is not None
        total, count, steps, exchanged = 0.0, 0, 0, 0
        for batch in WaitedBatches(batches, self._starving_check()):
            optimizer.zero_grad(set_to_none=True)
            logits, mine, rg = self._forward(model, batch)  # even a batch without loss rows draws its masks
            targets = mine < batch.num_targets
            if batch.loss_mask is not None:
                targets[targets] = batch.loss_mask.numpy()[mine[targets]]
                batch_n = int(batch.loss_mask.sum())
            else:
                batch_n = batch.num_targets
            if batch_n == 0:
                rg.traffic.take()
                continue  # one process skips it too: no loss anywhere
            rows = np.flatnonzero(targets)
            n = int(rows.shape[0])
            if n:
                gid = torch.from_numpy(batch.node_ids.cpu().numpy()[mine[rows]]).to(y.device)
                loss = task.loss(logits[torch.from_numpy(rows).to(logits.device)], y.index_select(0, gid))
                total += float(loss.detach().to(torch.float64)) * n
                (loss if n == batch_n else loss * (n / batch_n)).backward()
            else:  # no loss rows here: a zero that keeps every exchange of the backward pass in step
                (logits.sum() * 0.0).backward()
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            comm.all_reduce_grads(params)
            optimizer.step()
            exchanged += int(rg.traffic.take()["exchange_bytes"])
            steps += 1
            count += n
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        self._close_epoch(time.perf_counter() - t0)
        total, count_all, exchanged_all = (comm.sum([total, float(count), float(exchanged)]) if comm.world_size > 1
                                           else (total, float(count), float(exchanged)))
        self._epoch = {"batches": steps, "targets": int(count_all), "epoch_s": time.perf_counter() - t0,
                       "exchange_bytes": int(exchanged_all), **self._job_fetch()}
        trim_heap()
        return torch.tensor(total / max(count_all, 1.0), dtype=torch.float32)

    # ---- reporting ------------------------------------------------------------------------------
    def summary_info(self) -> dict[str, Any]:
        """The ranks' figures, less the data-parallel mini-batch's (a batch is a cluster here, not a batch share)."""
        info = super().summary_info()
        for key in ("rank_batch_size", "feature_cache_bytes", "rank_targets"):
            info.pop(key, None)
        return info

    def explain(self, model: nn.Module) -> str:
        """The ranks' parts and the batches every rank computes its rows of, then the plan."""
        assert self.comm is not None
        cfg = self.cfg
        world = cfg.nproc or self.comm.world_size  # --explain plans the job from one process
        node_part = np.asarray(np.load(self.layout.path / "node_parts.npy"), dtype=np.int64)
        rows = np.bincount(rank_of_part(self.layout.num_parts, world)[node_part], minlength=world).tolist()
        lines = [f"distributed cluster-batch: {world} rank(s) over {cfg.parts_dir}; each of the {len(self.loader)} "
                 f"batches per epoch ({cfg.clusters_per_batch} of {cfg.clusters} {cfg.cluster_method} clusters, "
                 f"boundary hops {cfg.boundary_hops}) computed by every rank on the rows it owns, halo rows "
                 "pulled per layer"]
        lines += [f"  rank {r}: {c:,} rows" for r, c in enumerate(rows)]
        return "\n".join(lines) + "\n" + super(DistributedMini, self).explain(model)

    def banner(self) -> str:
        """Ranks, rows and batches."""
        assert self.comm is not None
        rows = np.bincount(self.owner, minlength=self.comm.world_size).tolist()
        return (f"distributed cluster-batch: {self.comm.world_size} rank(s) over {self.cfg.parts_dir} "
                f"({self.comm.backend}); rows per rank {rows}, {len(self.loader)} batches per epoch")


__all__ = ["DistributedCluster", "batch_part", "square_of"]
