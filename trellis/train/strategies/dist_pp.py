"""Pre-propagation training data-parallel over rows: ``--strategy pp --pp-dir PP_DIR --nproc P`` (or ``torchrun``).

PP-GNN §5 and §6.4: after preprocessing there is no graph left, only rows, so data parallelism is a split of
the rows. The cache keeps each split's rows contiguous; rank ``r`` of ``P`` holds the ``r``-th contiguous
slice of the training rows (in memory or read from storage, as the placement planner decides for a slice)
and trains on them, and each evaluation reads its slices of the validation and test rows. What makes it one
run:

* **a step is the same at any rank count**: ``--batch-size`` is the step's, each rank's batch is its share (in
  proportion to its rows), its mean loss is scaled by that share and the gradients are summed
  (:func:`~trellis.train.strategies.dist_mini.lockstep`), so a step's gradient is that of the mean over the
  step's rows;
* **every training row once per epoch**: the epoch runs as many steps as the rank with the most batches, and a
  rank out of batches adds zero gradients;
* **metrics of the whole splits**: the ranks' logits of their validation and test slices are gathered, and
  every rank computes the same metrics (equal to one process's evaluation of the same weights);
* **exact resume**: each epoch reseeds every rank's generator from (run seed, epoch, rank), and the shuffles
  follow (run seed, rank, epoch).

Memory per rank is its slice of the training rows plus one evaluation batch. One process (no ``--nproc``)
is :class:`~trellis.train.strategies.pp.PrePropagation`. Not for model-batched sweeps (one configuration).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from trellis.distributed.comm import Comm
from trellis.errors import TrellisUserError
from trellis.loader.pp import MemorySource, Placement, PPData, PPLoader, RowSource, StorageSource
from trellis.loader.ppcache import PPCache
from trellis.loader.sampler import mix64
from trellis.train.config import TrainConfig
from trellis.train.strategies.dist_mini import join_job, lockstep, rank_env, rank_share
from trellis.train.strategies.pp import PrePropagation
from trellis.train.tasks import Task


def rank_slice(rows: tuple[int, int], rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous part of the rows ``[a, b)`` (sizes differ by at most one)."""
    a, b = int(rows[0]), int(rows[1])
    n = b - a
    return a + n * rank // world, a + n * (rank + 1) // world


class RankPPData(PPData):
    """A rank's rows: its slice of the training rows for training and its slices of the others for evaluation.

    The training slice sits where the placement put one process's rows (memory or storage); evaluation reads
    the rank's slices of the validation and test rows from storage, one batch at a time.
    """

    def __init__(self, cache: PPCache, hops: Sequence[int], placement: Placement, batch_size: int, *,
                 seed: int, rank: int, world: int) -> None:
        self.cache = cache
        self.hops = tuple(hops)
        self.placement = placement
        self.rank, self.world = rank, world
        train = rank_slice(cache.split_range("train"), rank, world)
        if train[1] <= train[0]:
            raise TrellisUserError(f"{cache.path}: rank {rank} of {world} would have no training rows; use --nproc "
                                   f"{max(1, cache.split_range('train')[1] - cache.split_range('train')[0])} "
                                   "or fewer")
        kind = MemorySource if placement.placement == "memory" else StorageSource
        self.source: RowSource = kind(cache, hops, train)
        n = train[1] - train[0]
        self.train = PPLoader(self.source, batch_size, chunk_size=min(placement.chunk_size, batch_size),
                              shuffle=True, prefetch=placement.prefetch, seed=seed, row_range=(0, n),
                              name=placement.loader)
        self.eval_batch_size = max(batch_size, 8192)
        self._eval_buffers: list[Tensor] = []
        self._eval_sources: dict[str, RowSource] = {}

    def iter_split(self, split: str) -> Iterator[tuple[Tensor, Tensor | None]]:
        """This rank's slice of ``split``, in order (read from storage)."""
        rows = rank_slice(self.cache.split_range(split), self.rank, self.world)
        if rows[1] <= rows[0]:
            return iter(())
        if split not in self._eval_sources:
            self._eval_sources[split] = StorageSource(self.cache, self.hops, rows)
        source = self._eval_sources[split]
        return iter(PPLoader(source, self.eval_batch_size, chunk_size=self.eval_batch_size, shuffle=False,
                             prefetch=True, row_range=(0, rows[1] - rows[0]), name="eval",
                             buffers=self._eval_buffers))

    def close(self) -> None:
        """Release every source's files and threads."""
        for source in self._eval_sources.values():
            source.close()
        self._eval_sources.clear()
        super().close()


class DistributedPP(PrePropagation):
    """SGC/SIGN/HOGA over a pre-propagated cache, data-parallel over rows (see the module docstring)."""

    batches_models = False  # one configuration per run: a sweep trains in one process

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.comm: Comm | None = None

    def load(self) -> None:
        """Join the job, then open the cache and this rank's rows."""
        env = rank_env()
        check_pp_ranks(self.cfg, env.world_size)
        self.comm = join_job(self.cfg, env, self)
        super().load()

    def _make_data(self, cache: PPCache, placement: Placement, seed: int) -> PPData:
        comm = self.comm
        assert comm is not None
        n = cache.split_range("train")[1] - cache.split_range("train")[0]
        counts = [hi - lo for lo, hi in (rank_slice((0, n), r, comm.world_size) for r in range(comm.world_size))]
        self.rank_rows = counts
        self.rank_batch = rank_share(int(self.cfg.batch_size), counts, comm.rank)
        return RankPPData(cache, self.hops, placement, self.rank_batch, seed=self._rank_seed(seed),
                          rank=comm.rank, world=comm.world_size)

    def _rank_seed(self, seed: int) -> int:
        assert self.comm is not None
        return int(mix64(seed, self.comm.rank, 0x9797) >> 1)

    def begin_run(self, seed: int) -> None:
        """This run's shuffles follow (seed, rank)."""
        self.run_seed = seed
        self.data.train.seed = self._rank_seed(seed)

    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """One epoch: the ranks' batches in lockstep; returns the mean loss over every training row."""
        comm = self.comm
        assert comm is not None
        loader = self.data.train
        loader.set_epoch(epoch)
        steps = len(loader)
        if comm.world_size > 1:
            steps = int(max(comm.all_gather_rows(torch.tensor([steps]))).item())
            torch.manual_seed(mix64(getattr(self, "run_seed", self.cfg.seed), epoch, comm.rank) >> 1)
        model.train()
        params: list[Tensor] = [p for p in model.parameters() if p.requires_grad]
        batches = iter(loader)
        total, count = 0.0, 0
        for _ in range(steps):
            item = next(batches, None)
            optimizer.zero_grad(set_to_none=True)
            loss: Tensor | None = None
            n = 0
            if item is not None:
                x, y = item
                assert y is not None  # training rows are labelled
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                loss, n = task.loss(model(x), y), int(y.shape[0])
            if lockstep(comm, params, optimizer, loss, n) and loss is not None:
                total += float(loss.detach().to(torch.float64)) * n
                count += n
        comm.average_buffers(model)  # one model: every rank's normalization statistics the same
        total, count_all = comm.sum([total, float(count)]) if comm.world_size > 1 else (total, float(count))
        self._epoch = {"batches": steps, "rows": int(count_all)}
        return torch.tensor(total / max(count_all, 1.0), dtype=torch.float64)

    def _split_logits(self, models: Sequence[nn.Module], split: str) -> tuple[list[Tensor], Tensor]:
        """Every rank's slice of the split, gathered: the whole split's logits and labels on every rank."""
        comm = self.comm
        assert comm is not None
        mine, ys = self._rows_logits(models, split)
        every_y = torch.cat(comm.all_gather_rows(ys.cpu())).to(self.device)
        if every_y.shape[0] == 0:
            raise TrellisUserError(f"{self.cache.path}: the {split} split has no rows; --strategy pp needs them")
        return [torch.cat(comm.all_gather_rows(lg.cpu())).to(self.device) for lg in mine], every_y

    def explain(self, model: nn.Module) -> str:
        """The ranks' rows and batch shares (as ``--nproc`` would start them), then the model and placement."""
        world = int(self.cfg.nproc or (self.comm.world_size if self.comm is not None else 1))
        a, b = self.cache.split_range("train")
        counts = [hi - lo for lo, hi in (rank_slice((a, b), r, world) for r in range(world))]
        shares = [rank_share(int(self.cfg.batch_size), counts, r) for r in range(world)]
        return (f"pre-propagation data-parallel over {world} rank(s): training rows per rank {counts}, batch per "
                f"rank {shares} (the step's {self.cfg.batch_size}); each rank reads its slices of the validation "
                "and test rows from storage to evaluate\n" + super().explain(model))

    def epoch_info(self) -> dict[str, Any]:
        """Steps and rows trained in the epoch (the job's)."""
        return dict(getattr(self, "_epoch", {}))

    def banner(self) -> str:
        """Ranks, their rows and batch shares, then the placement."""
        assert self.comm is not None
        return (f"pre-propagation data-parallel over {self.comm.world_size} rank(s) ({self.comm.backend}): "
                f"training rows per rank {self.rank_rows}, batch per rank {self.rank_batch} here\n"
                + super().banner())

    def summary_info(self) -> dict[str, Any]:
        """The single process's summary plus the ranks' rows and batch shares."""
        assert self.comm is not None
        return {**super().summary_info(), "world_size": self.comm.world_size, "backend": self.comm.backend,
                "rank_rows": self.rank_rows, "rank_batch_size": self.rank_batch}

    def close(self) -> None:
        """Close the rows' files, then leave the job."""
        super().close()
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def check_pp_ranks(cfg: TrainConfig, world: int) -> None:
    """Refuse what pp ranks cannot train, before any starts: more ranks than training rows, a naive loader.

    Raises:
        TrellisUserError: One line naming the flag and the fix.
    """
    from trellis.loader.ppcache import open_pp

    if cfg.pp_loader in ("naive", "naive-batch"):
        raise TrellisUserError(f"--pp-loader {cfg.pp_loader} with --nproc {world}: ranks read their slices with "
                               "the index, chunk, prefetch or storage loaders; drop it")
    cache = open_pp(str(cfg.pp_dir))
    a, b = cache.split_range("train")
    if world > b - a:
        raise TrellisUserError(f"--nproc {world} is more ranks than the {b - a} training rows of {cfg.pp_dir}; pass "
                               f"--nproc {max(1, b - a)} or fewer")


PrePropagation.ranked = DistributedPP

__all__ = ["DistributedPP", "RankPPData", "check_pp_ranks", "rank_slice"]
