"""Data-parallel mini-batch across ranks: ``--strategy mini --parts-dir PART_DIR --nproc P`` (or ``torchrun``).

The layout's parts are dealt to the ranks (part ``p`` to rank ``p mod P``); a rank holds its parts' feature rows
in memory and draws its targets from its parts' training nodes. Each step every rank samples its batch from
the graph (the store's CSR, memory-mapped), fetches the input rows other ranks own
(:class:`~trellis.distributed.rows.RowFetch`: three ``all_to_all`` calls, no RPC), trains, and the gradients are
summed. One model, one run directory (rank 0's), the metrics of the whole graph. What makes it correct:

* **every training node is a target exactly once per epoch**: a rank's targets are its own, and the epoch runs
  as many steps as the rank with the most batches; a rank out of batches keeps serving its peers' fetches and
  adds zero gradients, so uneven batch counts neither hang nor drop targets;
* **a step is the same at any rank count**: ``--batch-size`` is the step's, and each rank's batch is its share of
  it (in proportion to its targets), so an epoch takes about as many steps as one process's; the loss of a
  step is the mean over every rank's targets in it (a rank's batch mean is scaled by its share of the step's
  targets before the gradients are summed);
* **one epoch seed** (rank 0's) shuffles every rank's targets (rank ``r`` mixes in ``r``), so the ranks agree
  whatever their dropout draws did to their generators;
* **one rank is one process**: with P = 1 the fetch is a local gather and every batch, loss and metric equals
  ``--strategy mini``'s bit for bit.

Evaluation is exact layer-wise inference split over the ranks: each computes its own nodes' rows of every
layer and fetches the rest from their owners, so no rank holds a whole layer. Resume is exact: with more
than one rank, each epoch reseeds every rank's generator from (epoch seed, rank), so rank 0's checkpointed
generator decides every rank's next epoch. ``--samplers K`` samples a rank's batches in K processes, and
``--sampler-ranks K`` in K more ranks of the job that send them as flat messages over torch.distributed
(:func:`serve_batches`; the same batches in every mode); ``--feature-cache SIZE`` keeps the other ranks' rows
most likely to be sampled (SALIENT++'s VIP ranking), fetched once at the start. A rank that holds more parts
than fit streams them through its own partition buffer (``--buffer-parts``, ``--buffer-cache``,
``--memory-budget``): its batches sample its resident parts and a cache (which may hold any rows), so it fetches
nothing while it trains. Not built yet (docs/distributed.md): mini-batch grouping.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from trellis.data.store import GraphStore
from trellis.distributed.comm import Comm, RankEnv, free_port, rank_threads
from trellis.distributed.rows import RowFetch
from trellis.errors import TrellisUserError
from trellis.loader.blocks import parse_fanouts
from trellis.loader.buffer import ArenaRows, LayoutRows, PartitionBuffer, vip
from trellis.loader.features import NormalizedRows
from trellis.loader.inference import ranked_inference
from trellis.loader.producer import BatchMessage, decode_batch, encode_batch
from trellis.loader.sampler import NeighborLoader, NeighborSampler, mix64
from trellis.partition.layout import PartitionedGraph, part_dir_name
from trellis.plan.residency import BufferPlan
from trellis.train.build import ModelSpec
from trellis.train.config import TrainConfig
from trellis.train.data import GraphData, load_labels
from trellis.train.options import DEFAULT_TIMEOUT_S, NO_RANKS_CACHE
from trellis.train.strategies.batches import BatchStrategy, WaitedBatches, _epoch_seed
from trellis.train.strategies.buffered import (
    BufferedMini,
    layout_feature_norm,
    neighbour_batch_bytes,
    open_layout_for,
    plan_residency,
    store_edge_data,
)
from trellis.train.strategies.outofcore import budget_and_baseline
from trellis.train.strategy import Prediction, PredictRequest
from trellis.train.tasks import Task
from trellis.utils.memory import PeakMemory, proc_status, trim_heap
from trellis.utils.numba import set_threads
from trellis.utils.sizes import parse_size

#: In-edges per chunk of split evaluation, a sixteenth of one process's default: a chunk's input rows arrive
#: as copies, and a rank also holds the rows its peers asked for at the same time. On the 1M graph (2 ranks,
#: hidden 256) a rank peaked at 3,564 MiB with 4M edges, 2,776 with 1M, 2,332 with 500k, 1,964 with 250k.
RANK_CHUNK_EDGES = 250_000

#: Options of the single-process partition buffer.
BUFFER_ONLY = ("buffer_parts", "memory_budget", "buffer_cache", "buffer_replay", "buffer_replay_share",
               "buffer_replay_fanouts", "spill_dir")
#: Those a mini-batch rank takes: they make it train its parts through its own partition buffer.
RANK_BUFFER = ("buffer_parts", "memory_budget", "buffer_cache")


def rank_env() -> RankEnv:
    """Who this process is: a rank of a launched job, or (no launcher) a world of one on a free port."""
    env = RankEnv.from_environ()
    if env is None:
        return RankEnv(0, 1, 0, 1, "127.0.0.1", free_port())
    set_threads(rank_threads(env.local_world_size))
    return env


def join_job(cfg: TrainConfig, env: RankEnv, strategy: Any, members: int | None = None) -> Comm:
    """Join the job's process groups as ``env`` (one GPU per rank on CUDA) and make them the strategy's world.

    ``members``: the trainer ranks ``0..members-1`` (the rest of the job are sampler ranks).
    """
    if strategy.device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
        strategy.device = torch.device("cuda", env.local_rank)
    comm = Comm(env, strategy.device, float(getattr(cfg, "timeout", DEFAULT_TIMEOUT_S)), members=members)
    strategy.world = comm
    return comm


def rank_loader(cfg: TrainConfig, indptr: np.ndarray, indices: np.ndarray, targets: np.ndarray, batch: int,
                rank: int, y: Tensor | None, ew: Tensor | None, ef: Tensor | None) -> NeighborLoader:
    """Trainer ``rank``'s loader: blocks, labels and edge data of its targets (rows are fetched, not gathered).

    Built the same in the trainer and in a sampler rank, so both draw the same batches.
    """
    sampler = NeighborSampler(indptr, indices, parse_fanouts(cfg.fanouts, cfg.layers), labor=cfg.labor)
    return NeighborLoader(sampler, targets, batch, y=y, seed=rank, prefetch=cfg.prefetch, edge_weight=ew,
                          edge_feat=ef)


def send_batch(batch: Any, dst: int) -> None:
    """Send a batch to rank ``dst`` as one flat message (its sizes, header and payload; three sends)."""
    msg = encode_batch(batch)
    dist.send(torch.tensor([msg.header.numel(), msg.payload.numel()], dtype=torch.int64), dst=dst)
    dist.send(msg.header, dst=dst)
    dist.send(msg.payload, dst=dst)


def recv_batch(src: int) -> Any:
    """The batch :func:`send_batch` sent from rank ``src``."""
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, src=src)
    header = torch.empty(int(sizes[0]), dtype=torch.int64)
    payload = torch.empty(int(sizes[1]), dtype=torch.uint8)
    dist.recv(header, src=src)
    dist.recv(payload, src=src)
    return decode_batch(BatchMessage(header, payload))


class RankBatches:
    """An epoch's ``n`` batches from sampler rank ``src``, in order; ``wait_s`` is the time spent receiving them."""

    def __init__(self, src: int, n: int) -> None:
        self.src, self.n, self.taken, self.wait_s = src, n, 0, 0.0

    def __iter__(self) -> RankBatches:
        return self

    def __next__(self) -> Any:
        if self.taken >= self.n:
            raise StopIteration
        t0 = time.perf_counter()
        batch = recv_batch(self.src)
        self.wait_s += time.perf_counter() - t0
        self.taken += 1
        return batch


def serve_batches(cfg: TrainConfig, env: RankEnv) -> int:
    """A sampler rank (``--sampler-ranks K``): build the batches of the trainers it serves and send them.

    The job's last K ranks sample; sampler ``s`` serves the trainers ``t`` with ``t mod K = s``. Each epoch it
    receives each of its trainers' epoch seed, then sends their batches in step order (the trainers step in
    lockstep, so this order never waits on a trainer that waits on another). It stops when every trainer it
    serves sent -1. Batches are built by the trainer's own loader (:func:`rank_loader`, the same targets, share
    and seed), so they are the ones the trainer would have drawn.
    """
    k = int(cfg.sampler_ranks)
    trainers_n = env.world_size - k
    me = env.rank - trainers_n
    set_threads(rank_threads(env.local_world_size))
    comm = Comm(env, torch.device("cpu"), float(getattr(cfg, "timeout", DEFAULT_TIMEOUT_S)), members=trainers_n)
    try:
        assert cfg.store is not None
        store = GraphStore(cfg.store)
        layout = open_layout_for(cfg, store)
        y, splits, _ = load_labels(store, cfg.task, torch.device("cpu"), cfg.split_seed)
        ew, ef = store_edge_data(store, torch.device("cpu"))
        node_part = np.asarray(np.load(layout.path / "node_parts.npy"), dtype=np.int64)
        owner = rank_of_part(layout.num_parts, trainers_n)[node_part]
        train = splits["train"].cpu().numpy()
        counts = np.bincount(owner[train], minlength=trainers_n).tolist()
        indptr, indices = np.asarray(store.indptr), np.asarray(store.indices)
        mine = [t for t in range(trainers_n) if t % k == me]
        loaders = {t: rank_loader(cfg, indptr, indices, train[owner[train] == t], rank_share(cfg.batch_size, counts, t),
                                  t, y, ew, ef) for t in mine}
        seed = torch.empty(1, dtype=torch.int64)
        while True:
            seeds = {}
            for t in mine:
                dist.recv(seed, src=t)
                seeds[t] = int(seed.item())
            if all(v < 0 for v in seeds.values()):
                return 0
            epochs = {t: iter(loaders[t].epoch(seeds[t])) for t in mine if seeds[t] >= 0}
            for step in range(max(len(loaders[t]) for t in epochs)):
                for t, batches in epochs.items():
                    if step < len(loaders[t]):
                        send_batch(next(batches), t)
    finally:
        comm.close()


def rank_buffered(cfg: TrainConfig) -> bool:
    """Whether each mini-batch rank trains its parts through its own partition buffer (a buffer option given)."""
    return cfg.strategy == "mini" and any(getattr(cfg, k, None) is not None for k in RANK_BUFFER)


def _step_batches(batches: Any) -> list[Any]:
    """The rank's batches of its next step: one, or a partition buffer's two when the step spans states."""
    group = []
    for batch in batches:
        group.append(batch)
        if batch.step_end:
            break
    return group


def rank_of_part(num_parts: int, world: int) -> np.ndarray:
    """``[num_parts]`` rank that trains each part: part ``p`` goes to rank ``p mod world``."""
    return np.arange(num_parts, dtype=np.int64) % world


def check_ranks(cfg: TrainConfig, store: GraphStore, world: int) -> PartitionedGraph:
    """Refuse what ranks cannot train, before any rank trains: one line naming the flag and the fix.

    A rank of data-parallel mini-batch needs training nodes of its own; one of cluster-batch (which computes
    its rows of every batch) does not.

    Raises:
        TrellisUserError: A buffer option, more ranks than parts, or a rank whose parts hold no training node.
    """
    opts = cfg.options
    if world == 1 and cfg.feature_cache is not None:
        raise TrellisUserError(NO_RANKS_CACHE)
    allowed = RANK_BUFFER if cfg.strategy == "mini" else ()
    for name in BUFFER_ONLY:
        if name in opts.names() and opts.given(name) and name not in allowed:
            flag = "--" + name.replace("_", "-")
            what = ("ranks of cluster-batch keep their parts in memory" if cfg.strategy != "mini" else
                    "a rank's partition buffer takes --buffer-parts, --buffer-cache and --memory-budget")
            raise TrellisUserError(f"{flag} with --nproc {world}: {what}; drop {flag}, or train with --nproc 1")
    buffered = rank_buffered(cfg)
    if buffered:
        for flag, given in (("--samplers", cfg.samplers > 0), ("--sampler-ranks", bool(cfg.sampler_ranks)),
                            ("--feature-cache", cfg.feature_cache is not None)):
            if given:
                raise TrellisUserError(f"{flag} with a partition buffer per rank (--buffer-parts, --buffer-cache or "
                                       f"--memory-budget): the buffer builds a rank's batches from its resident parts "
                                       f"and its own cache; drop {flag} or the buffer options")
    if cfg.norm == "batch":
        raise TrellisUserError("--norm batch across ranks would normalize each rank's batch by its own statistics; "
                               "use --norm layer")
    layout = open_layout_for(cfg, store)
    if world > layout.num_parts:
        raise TrellisUserError(f"--nproc {world} is more ranks than the {layout.num_parts} parts of {cfg.parts_dir}; "
                               f"pass --nproc {layout.num_parts} or fewer, or re-partition with `trellis partition "
                               f"{cfg.store} --parts {world}`")
    held = np.bincount(rank_of_part(layout.num_parts, world), minlength=world)
    if buffered and cfg.buffer_parts is not None and cfg.buffer_parts > int(held.min()):
        r = int(held.argmin())
        raise TrellisUserError(f"--buffer-parts {cfg.buffer_parts} is more than the {int(held[r])} part(s) rank {r} "
                               f"of {world} holds (part p goes to rank p mod {world}); pass --buffer-parts "
                               f"{int(held.min())} or fewer")
    # the split the ranks train on: --split-seed redraws it (the store's own split refused valid layouts and let
    # a rank without targets through)
    train = load_labels(store, cfg.task, torch.device("cpu"), cfg.split_seed)[1]["train"].numpy()
    counts = rank_targets(layout, train, world)
    empty = [r for r, c in enumerate(counts) if c == 0]
    if empty and cfg.strategy == "mini":
        raise TrellisUserError(f"rank {empty[0]} of {world} would train no target: its parts of {cfg.parts_dir} "
                               "hold no training node; re-partition with `trellis partition --balance train` (every "
                               "part gets its share of training nodes) or use fewer ranks")
    return layout


def lockstep(comm: Comm, params: list[Tensor], optimizer: Any, loss: Tensor | None, n: int) -> int:
    """One data-parallel step's part on this rank; returns the step's targets over every rank.

    Backward of the rank's mean ``loss`` over its ``n`` targets, the gradients summed over the ranks, the
    optimizer step. The loss is scaled by ``n / step_n``, so the summed gradient is that of the mean over all
    the step's targets (one process's step over the same targets). A rank without a batch (``loss`` None) adds
    zeros, so every rank sums the same buffers and uneven batch counts never hang; a step without any target
    is skipped everywhere (0 returned).
    """
    return lockstep_parts(comm, params, optimizer, [(loss, n)])


def lockstep_parts(comm: Comm, params: list[Tensor], optimizer: Any, parts: list[tuple[Tensor | None, int]]) -> int:
    """:func:`lockstep` for a rank whose part of the step is several batches: ``(mean loss, targets)`` each.

    A partition buffer's step can span two buffer states, one batch in each; every batch's mean is scaled by
    its share of the whole step's targets.
    """
    n = sum(k for _, k in parts)
    step_n = int(comm.sum([float(n)])[0]) if comm.world_size > 1 else n
    if step_n == 0:
        return 0
    for loss, k in parts:
        if loss is not None:
            (loss if k == step_n else loss * (k / step_n)).backward()
    if comm.world_size > 1:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        comm.all_reduce_grads(params)
    optimizer.step()
    return step_n


def rank_share(batch_size: int, counts: list[int], rank: int) -> int:
    """A rank's part of a step's ``batch_size``, in proportion to its share of the targets (at least 1)."""
    return max(1, -(-int(batch_size) * int(counts[rank]) // max(1, sum(counts))))


def rank_targets(layout: PartitionedGraph, train: np.ndarray, world: int) -> list[int]:
    """Training nodes (of ``train``) each rank draws its targets from."""
    node_part = np.load(layout.path / "node_parts.npy", mmap_mode="r")
    train = np.asarray(train, dtype=np.int64)
    ranks = rank_of_part(layout.num_parts, world)[np.asarray(node_part[train], dtype=np.int64)]
    return np.bincount(ranks, minlength=world).tolist()


class DistributedMini(BatchStrategy):
    """Neighbour-sampled mini-batches, data-parallel over ranks (see the module docstring)."""

    name = "mini"

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.comm: Comm | None = None
        self.meter = PeakMemory()
        self._epoch: dict[str, Any] = {}

    # ---- data -----------------------------------------------------------------------------------
    def load(self) -> None:
        """Join the job, load this rank's parts' rows and targets, and build its sampler and fetch."""
        cfg = self.cfg
        env = rank_env()
        assert cfg.store is not None
        store = GraphStore(cfg.store)
        # a process that was not started as a rank (--explain, a world of one) prepares its own batches
        self.sampler_ranks = int(cfg.sampler_ranks or 0) if RankEnv.from_environ() is not None else 0
        trainers = env.world_size - self.sampler_ranks
        if self.sampler_ranks > trainers:
            raise TrellisUserError(f"--sampler-ranks {self.sampler_ranks} of a job of {env.world_size} ranks leaves "
                                   f"{trainers} trainer(s); each sampler rank serves at least one trainer")
        # --explain describes the job of --nproc ranks from one process: its checks are that job's
        layout = check_ranks(cfg, store, trainers if RankEnv.from_environ() is not None else int(cfg.nproc or 1))
        #: A partition buffer per rank: its parts rotate through memory, its batches sample the resident parts
        #: and a cache (--buffer-parts, --buffer-cache, --memory-budget); else every part stays in memory.
        self.buffered = rank_buffered(cfg)
        self.budget: tuple[int | None, int] = (None, proc_status().get("RssAnon", 0))
        if self.buffered and cfg.memory_budget is not None:
            self.budget = budget_and_baseline(cfg, self.device)
        self.comm = comm = join_job(cfg, env, self, members=trainers)
        y, splits, task = load_labels(store, cfg.task, self.device, cfg.split_seed)
        norm = layout_feature_norm(cfg, store, layout)
        ew, ef = store_edge_data(store, self.device)
        node_part = np.asarray(np.load(layout.path / "node_parts.npy"), dtype=np.int64)
        part_rank = rank_of_part(layout.num_parts, comm.world_size)
        self.my_parts = [int(p) for p in np.flatnonzero(part_rank == comm.rank)]
        self.owner = owner = part_rank[node_part]
        # a world of one evaluates as --strategy mini does, reading every part's rows from the layout's maps
        x_all = NormalizedRows(LayoutRows(layout.path, node_part.astype(np.int32)), norm)
        # a buffered rank holds no whole copy of its rows: it serves its peers' evaluation from the layout's maps
        own = x_all if self.buffered else NormalizedRows(self._own_rows(layout, node_part), norm)
        self.local_rows = local_rows = own
        self.fetch = RowFetch(comm, owner, local_rows.gather, local_rows.dim, local_rows.dtype)
        self.data = d = GraphData(store=store, graph=None, x=x_all, y=y, splits=splits, task=task, feature_norm=norm,
                                  edge_weight=ew, edge_feat=ef)
        self.store, self.task, self.feature_norm, self.layout = store, task, norm, layout
        self.spec = ModelSpec(d.in_dim, task.num_outputs, d.edge_dim, store.num_nodes, 0)
        self.indptr = np.asarray(store.indptr)
        self.indices = np.asarray(store.indices)
        train = splits["train"].cpu().numpy()
        self.targets = train[owner[train] == comm.rank]  # the store's order, so one rank is --strategy mini
        self.last_epoch = {}
        counts = torch.cat(comm.all_gather_rows(torch.tensor([self.targets.shape[0]])))
        self.rank_targets = [int(v) for v in counts]
        # --batch-size is the step's: each rank takes its share, so a step trains about as many targets, and an
        # epoch takes about as many steps, at any rank count (and one rank is --strategy mini)
        self.rank_batch = rank_share(cfg.batch_size, self.rank_targets, comm.rank)
        self.loader = self.make_loader()
        self.cache_bytes = self._fill_cache(owner)
        counts = torch.cat(comm.all_gather_rows(torch.tensor([len(self.loader)])))
        self.rank_batches = [int(v) for v in counts]
        self.steps = max(self.rank_batches)
        self.meter.start()

    def _fill_cache(self, owner: np.ndarray) -> int:
        """``--feature-cache``: fetch the other ranks' rows this rank's batches most likely sample, once.

        Ranked by SALIENT++'s analytical inclusion probability (:func:`~trellis.loader.buffer.vip`) for this
        rank's targets, fanouts and batch size; as many rows as the size holds. Returns the cache's bytes.
        """
        cfg = self.cfg
        if cfg.feature_cache is None:
            return 0
        rows = parse_size(cfg.feature_cache, flag="--feature-cache") // max(1, self.fetch.dim * 4)
        prob = vip(self.indptr, self.indices, self.targets, parse_fanouts(cfg.fanouts, cfg.layers), self.rank_batch)
        remote = np.flatnonzero((owner != self.fetch.comm.rank) & (prob > 0))
        best = remote[np.argsort(-prob[remote], kind="stable")[:rows]]
        return self.fetch.fill_cache(best)

    def _own_rows(self, layout: PartitionedGraph, node_part: np.ndarray) -> ArenaRows:
        """This rank's parts' raw feature rows, read whole into memory, addressed by global id."""
        slot_of = np.full(node_part.shape[0], -1, dtype=np.int64)
        blocks, at = [], 0
        for p in self.my_parts:
            rows = np.load(layout.path / part_dir_name(p) / "x.npy")
            rows = rows.reshape(rows.shape[0], -1)
            members = np.flatnonzero(node_part == p)  # a part's rows are its nodes in id order
            slot_of[members] = np.arange(at, at + members.shape[0])
            blocks.append(rows)
            at += members.shape[0]
        arena = np.ascontiguousarray(np.concatenate(blocks)) if len(blocks) > 1 else blocks[0]
        return ArenaRows(arena, slot_of)

    def make_loader(self) -> NeighborLoader | PartitionBuffer:
        """Blocks, labels and edge data of this rank's targets (input rows come from the fetch).

        Buffered: the rank's partition buffer over its own parts, whose batches carry their rows (sampled from
        the resident parts and the cache, as one process's buffer samples them).
        """
        assert self.comm is not None
        if self.buffered:
            return self._buffer()
        y, ew, ef = self.loader_tensors(on_cpu=True)  # a batch's input rows are fetched on the CPU too
        return rank_loader(self.cfg, self.indptr, self.indices, self.targets, self.rank_batch, self.comm.rank, y,
                           ew, ef)

    def _buffer(self) -> PartitionBuffer:
        """This rank's partition buffer: its parts' residency planned against its own budget."""
        assert self.comm is not None
        cfg, d, layout = self.cfg, self.data, self.layout
        if getattr(self, "plan", None) is None:  # a resumed rank keeps the interrupted one's (load_state_dict)
            # every rank plans its own parts; one that does not fit refuses for all, in one line
            self.plan = self.comm.refuse_together(
                lambda: self._residency(self.my_parts, self.rank_batch, len(self.targets)))
        degree = np.diff(self.indptr).astype(np.float32)
        return PartitionBuffer(layout, self.plan.capacity, parse_fanouts(cfg.fanouts, cfg.layers), self.targets,
                               self.rank_batch, y=d.y, degree=degree, feature_norm=self.feature_norm,
                               cache_rows=self.plan.cache_rows, labor=cfg.labor, seed=self.comm.rank,
                               device=self.device, prefetch=cfg.prefetch, edge_weight=d.edge_weight,
                               edge_feat=d.edge_feat, parts=self.my_parts)

    def _residency(self, parts: list[int], batch: int, targets: int) -> BufferPlan:
        """The residency of a rank holding ``parts`` and ``targets`` training nodes, ``batch`` of them per step."""
        batch_bytes = neighbour_batch_bytes(self.cfg, self.layout, self.spec.in_dim, np.diff(self.indptr),
                                            min(batch, max(1, targets)))
        return plan_residency(self.cfg, self.layout, self.spec, self.data.splits, self.budget[0], self.budget[1],
                              (batch_bytes, 0), parts=parts)

    def _epoch_batches(self, epoch_seed: int) -> Any:
        """The epoch's batches: from this rank's sampler rank (``--sampler-ranks``), or as one process has them."""
        if not self.sampler_ranks:
            return super()._epoch_batches(epoch_seed)
        assert self.comm is not None
        src = self.comm.members + self.comm.rank % self.sampler_ranks
        dist.send(torch.tensor([epoch_seed], dtype=torch.int64), dst=src)
        return RankBatches(src, len(self.loader))

    # ---- training -------------------------------------------------------------------------------
    def _shared_seed(self) -> int:
        """Rank 0's epoch seed on every rank (each draws one, so every rank's generator advances the same)."""
        seed = _epoch_seed()
        assert self.comm is not None
        if self.comm.world_size == 1:
            return seed
        t = torch.tensor([seed], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.comm.control)
        return int(t.item())

    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """One epoch: ``max`` over ranks of their batch counts in lockstep; the mean loss over every target."""
        comm = self.comm
        assert comm is not None
        model.train()
        t0 = time.perf_counter()
        seed = self._shared_seed()
        if comm.world_size > 1:
            # Each rank's dropout draws start from (epoch seed, rank): a resumed run restores rank 0's generator
            # only, and this makes every rank's epoch the uninterrupted run's all the same.
            torch.manual_seed(mix64(seed, comm.rank, 0xD209) >> 1)
        batches = self._open_epoch(seed)  # on a thread, or from --samplers K processes
        params: list[Tensor] = [p for p in model.parameters() if p.requires_grad]
        total, count, steps, fetch_s = 0.0, 0, 0, 0.0
        it = WaitedBatches(batches, self._starving_check())
        for step in range(self.steps):
            group = _step_batches(it) if step < len(self.loader) else []
            if not self.buffered:  # a buffer's batches carry their rows; the others fetch them (collectively)
                f0 = time.perf_counter()
                ids = group[0].node_ids.numpy() if group else np.empty(0, dtype=np.int64)
                x = self.fetch.fetch(ids)
                fetch_s += time.perf_counter() - f0
                if group:
                    group[0].x = x
            optimizer.zero_grad(set_to_none=True)
            parts: list[tuple[Tensor | None, int]] = []
            for batch in group:
                if self.device.type != "cpu":
                    batch = batch.to(self.device, non_blocking=True)
                parts.append(self._loss(model, batch, task))
            if lockstep_parts(comm, params, optimizer, parts or [(None, 0)]) == 0:
                continue  # no rank had a loss-carrying target: no step anywhere
            for loss, n in parts:
                if loss is not None:
                    total += float(loss.detach().to(torch.float64)) * n
                count += n
            steps += 1
        if next(it, None) is not None:  # ends the epoch's generator (a buffer records its last state there)
            raise RuntimeError(f"rank {comm.rank}: the loader had batches beyond its {len(self.loader)} steps")
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        self._close_epoch(time.perf_counter() - t0)  # (each rank chooses its builders' priority alone)
        comm.average_buffers(model)  # one model: every rank's normalization statistics the same
        total, count_all = comm.sum([total, float(count)]) if comm.world_size > 1 else (total, float(count))
        # times are this rank's (rank 0 writes the record); counts and bytes are the job's
        self._epoch = {"batches": steps, "targets": int(count_all), "epoch_s": time.perf_counter() - t0,
                       "fetch_s": fetch_s, "wait_s": float(getattr(batches, "wait_s", 0.0)), **self._job_fetch()}
        if self.buffered:
            self._epoch.update(self._job_buffer())
        trim_heap()
        return torch.tensor(total / max(count_all, 1.0), dtype=torch.float32)

    def _job_buffer(self) -> dict[str, Any]:
        """The epoch's partition-buffer counters: parts read and bytes summed over the ranks, the rest rank 0's."""
        assert self.comm is not None
        mine = self.loader.stats.as_metrics()
        job = self.comm.sum([mine["parts_loaded"], mine["buffer_bytes_read"]])
        return {**mine, "parts_loaded": int(job[0]), "buffer_bytes_read": int(job[1])}

    def begin_run(self, seed: int) -> None:
        """A run plans its first epoch afresh (a buffered rank's first state is drawn again)."""
        if self.buffered:
            self.loader.reset()

    def state_dict(self) -> dict[str, Any]:
        """Every buffered rank's last buffer state (its next epoch starts from it), gathered for rank 0's checkpoint."""
        if not self.buffered:
            return {}
        assert self.comm is not None
        carry = torch.tensor(list(self.loader.carry or ()), dtype=torch.int64)
        plan = torch.tensor([self.plan.capacity, self.plan.cache_rows], dtype=torch.int64)
        return {"rank_carry": [t.clone() for t in self.comm.all_gather_rows(carry)],
                "rank_plan": [t.clone() for t in self.comm.all_gather_rows(plan)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's buffer state and residency from the checkpoint.

        Why the residency too: a budget's plan depends on the rank's measured baseline, which a resuming rank
        measures anew, and another cache samples other neighbourhoods (as :class:`BufferedMini` found for one
        process): the resumed epochs would not be the uninterrupted run's. Every rank takes this path (the
        batch counts are gathered again), so a changed plan never leaves the ranks' step counts apart.
        """
        if not self.buffered:
            return
        assert self.comm is not None
        rank = self.comm.rank
        plans = state.get("rank_plan")
        if plans:
            capacity, cache_rows = (int(v) for v in plans[rank].tolist())
            if (capacity, cache_rows) != (self.plan.capacity, self.plan.cache_rows):
                self.loader.close()
                self.plan = replace(self.plan, capacity=capacity, cache_rows=cache_rows)
                self.loader = self._buffer()
            counts = torch.cat(self.comm.all_gather_rows(torch.tensor([len(self.loader)])))
            self.rank_batches = [int(v) for v in counts]
            self.steps = max(self.rank_batches)
        saved = state.get("rank_carry")
        if saved:
            self.loader.load_state_dict({"carry": saved[rank].tolist(), "pool": {}})

    def _job_fetch(self) -> dict[str, Any]:
        """The epoch's fetched rows and bytes summed over the ranks, and each rank's bytes."""
        assert self.comm is not None
        mine = self.fetch.stats.take()
        keys = sorted(mine)
        row = torch.tensor([[float(mine[k]) for k in keys]], dtype=torch.float64)
        per_rank = torch.cat(self.comm.all_gather_rows(row))
        out: dict[str, Any] = {k: int(per_rank[:, i].sum()) for i, k in enumerate(keys)}
        out["fetch_recv_bytes_per_rank"] = [int(v) for v in per_rank[:, keys.index("fetch_recv_bytes")].tolist()]
        if self.cfg.feature_cache is not None:
            away = out["fetch_cache_rows"] + out["fetch_remote_rows"]
            out["fetch_cache_hit_rate"] = out["fetch_cache_rows"] / max(1, away)
        return out

    def _infer(self, model: nn.Module, rows: np.ndarray | None = None) -> Tensor:
        """Exact layer-wise outputs of ``rows`` (sorted; None: every node), on every rank.

        One rank: :class:`BatchStrategy`'s inference, so a world of one is ``--strategy mini``. More: each rank
        computes its own nodes' rows of every layer and fetches the rest from their owners
        (:func:`~trellis.loader.inference.ranked_inference`), then the ranks exchange the requested outputs.
        """
        comm = self.comm
        assert comm is not None
        if comm.world_size == 1:
            return super()._infer(model, rows)
        rank = comm.rank
        owned = np.flatnonzero(self.owner == rank)
        wanted = np.arange(self.owner.shape[0]) if rows is None else np.asarray(rows, dtype=np.int64)
        mine = wanted[self.owner[wanted] == rank]

        def gather(ids: np.ndarray, served: Tensor | None) -> Tensor:
            if served is None:  # the inputs: this rank's rows and cache, the rest fetched
                return self.fetch.fetch(ids)
            flat = served.reshape(served.shape[0], -1)

            def serve(q: np.ndarray) -> Tensor:
                return flat.index_select(0, torch.from_numpy(np.searchsorted(owned, q)).to(flat.device))

            got = self.fetch.fetch(ids, serve, int(flat.shape[1]), cached=False)
            return got.view(ids.shape[0], *served.shape[1:])

        def agree(k: int) -> int:
            return int(max(comm.all_gather_rows(torch.tensor([k]))).item())

        d = self.data
        logits = ranked_inference(model, self.indptr, self.indices, owned, gather, agree, rows=mine,
                                  edge_weight=d.edge_weight, edge_feat=d.edge_feat, device=self.device,
                                  chunk_edges=RANK_CHUNK_EDGES,
                                  first_input=self.first_input)
        self.fetch.stats.take()  # evaluation's fetches are not the epoch's traffic
        got = torch.cat(comm.all_gather_rows(logits.cpu()))
        ids = torch.cat(comm.all_gather_rows(torch.from_numpy(mine))).numpy()
        order = np.argsort(ids, kind="stable")  # every rank's rows in id order: ``wanted``'s order
        return got[torch.from_numpy(order)].to(self.device)

    def explain(self, model: nn.Module) -> str:
        """The ranks' parts, targets and batch shares, then the mini-batch plan."""
        assert self.comm is not None
        world = self.cfg.nproc or self.comm.world_size
        counts = rank_targets(self.layout, self.data.splits["train"].cpu().numpy(), world)
        shares = [rank_share(self.cfg.batch_size, counts, r) for r in range(len(counts))]
        part_rank = rank_of_part(self.layout.num_parts, world)
        k = int(self.cfg.sampler_ranks or 0)
        lines = [f"distributed mini-batch: {world} rank(s) over {self.cfg.parts_dir}; remote rows fetched by "
                 "all_to_all each step" + (f", a cache of {self.cfg.feature_cache} per rank"
                                           if self.cfg.feature_cache else "")
                 + (f"; batches from {k} sampler rank(s) (ranks {world}..{world + k - 1}), sampler s serving the "
                    "trainers t with t mod K = s" if k else "")]
        lines += [f"  rank {r}: parts {np.flatnonzero(part_rank == r).tolist()}, {c:,} targets, {b} per step"
                  for r, (c, b) in enumerate(zip(counts, shares))]
        if self.buffered:  # each rank plans its own parts' residency against its budget: rank 0's
            parts0 = [int(p) for p in np.flatnonzero(part_rank == 0)]
            lines += [f"rank 0, its {len(parts0)} parts (the baseline measured here):",
                      self._residency(parts0, shares[0], counts[0]).table()]
        return "\n".join(lines) + "\n" + super().explain(model)

    # ---- reporting and teardown -----------------------------------------------------------------
    def banner(self) -> str:
        """Ranks, parts and targets."""
        assert self.comm is not None
        return (f"distributed mini-batch: {self.comm.world_size} rank(s) over {self.cfg.parts_dir} "
                f"({self.comm.backend}); targets per rank {self.rank_targets}, batch per rank "
                f"{self.rank_batch} here, {self.steps} steps per epoch"
                + (f"; a partition buffer per rank, {self.plan.capacity} of its parts resident and a cache of "
                   f"{self.plan.cache_rows:,} rows here" if self.buffered else ""))

    def epoch_info(self) -> dict[str, Any]:
        """Steps, targets and the feature fetch of the epoch."""
        return dict(self._epoch)

    def summary_info(self) -> dict[str, Any]:
        """Ranks, their parts, targets, batches and peak memory (RssAnon, MiB)."""
        assert self.comm is not None
        self.meter.sample()
        mine = torch.tensor([[float(self.meter.peak_anon) / 2**20]], dtype=torch.float64)
        peaks = torch.cat(self.comm.all_gather_rows(mine))[:, 0].tolist()
        return {"world_size": self.comm.world_size, "parts_dir": str(self.cfg.parts_dir),
                "backend": self.comm.backend, "rank_targets": self.rank_targets, "rank_batches": self.rank_batches,
                "rank_batch_size": self.rank_batch, "feature_cache_bytes": self.cache_bytes,
                "rank_peak_rss_anon_mb": peaks,
                **({"rank_buffer_parts": self.plan.capacity, "rank_cache_rows": self.plan.cache_rows}
                   if self.buffered else {})}

    def close(self) -> None:
        """Release this rank's sampler rank, then leave the job."""
        self.meter.stop()
        if getattr(self, "buffered", False):
            self.loader.close()  # the buffer's reading thread
        if self.comm is not None:
            if getattr(self, "sampler_ranks", 0):
                try:  # the sampler rank stops once every trainer it serves said so
                    dist.send(torch.tensor([-1], dtype=torch.int64),
                              dst=self.comm.members + self.comm.rank % self.sampler_ranks)
                except RuntimeError:
                    pass  # it is gone already: the launcher reports who died
            self.comm.close()
            self.comm = None
        super().close()

    @classmethod
    def predict_saved(cls, req: PredictRequest, embeddings_to: Path | None) -> Prediction:
        """Prediction runs in one process over the run's layout (the partition buffer's exact inference)."""
        return BufferedMini.predict_saved(req, embeddings_to)


__all__ = ["DistributedMini", "RankBatches", "check_ranks", "join_job", "lockstep", "lockstep_parts", "rank_buffered",
           "rank_env", "rank_loader", "rank_of_part", "rank_share", "rank_targets", "recv_batch", "send_batch",
           "serve_batches"]
