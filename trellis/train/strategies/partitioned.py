"""Partition-parallel full-batch training: one rank per part of a partitioned layout, the single process's result.

``trellis train STORE --parts-dir PART_DIR`` selects this strategy (``full`` with ``--parts-dir``). Each rank
loads only its part (:meth:`PartitionedGraph.part`) and the store's metadata and labels, runs the same model
code as one process on its owned rows, and exchanges halo rows through the graph view and the exchange of
its layout's ownership (:mod:`trellis.distributed.ownership`). What makes the result the single process's:

* **loss**: each rank's mean loss over its training rows is scaled by ``local / global`` training count, so
  the ranks' gradients sum to the gradient of the global mean; parameter gradients are summed by one
  all-reduce on their own group (the halo exchange has another), and the reported loss is the sum;
* **masks**: dropout masks are keyed by global node id (and attention masks by the edge's position in the
  whole graph), so every rank draws the single process's mask on its rows (:func:`trellis.ops.dropout.keyed_rows`);
* **plan**: every rank plans its layers from the whole graph's statistics, so all pick the same order and
  exchange at the same width (a fingerprint of the plan is compared across ranks at load);
* **metrics**: computed from the scored rows' logits gathered from every rank in the store's split order,
  so AUC and F1 (which are not sums) are the single process's.

Model parameters, optimizer state and RNG streams are the same on every rank (same seed, same summed
gradients), so rank 0's checkpoint is every rank's state; the checkpoint counts as written when every rank
has passed the barrier after it.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trellis.data.store import GraphStore
from trellis.distributed.attention import edge_keys, self_loop_eids
from trellis.distributed.comm import Comm, Link, RankEnv, free_port, rank_threads
from trellis.distributed.ownership import OWNERSHIPS, PullExchange, RankGraph, build_rank_graph, dst_methods
from trellis.distributed.schedule import StaleBuffers
from trellis.errors import TrellisUserError
from trellis.nn.batched import BatchedGNN, check_tileable, family_of
from trellis.nn.tiled import layer_shapes
from trellis.ops.dropout import keyed_rows
from trellis.ops.graph import CSRGraph
from trellis.ops.sparse_rows import is_sparse
from trellis.partition.layout import LocalGraph, PartitionedGraph, open_layout_of
from trellis.plan.cost import GraphStats
from trellis.plan.outofcore import OutOfCorePlan, plan_out_of_core
from trellis.train.build import ModelFactory, ModelSpec
from trellis.train.config import TrainConfig
from trellis.train.data import (
    SPLITS,
    load_labels,
    normalize_features,
    resolve_device,
    sparse_rows_density,
    sparse_rows_of,
)
from trellis.train.features import parse_features
from trellis.train.strategies.outofcore import budget_and_baseline
from trellis.train.strategy import Strategy
from trellis.train.tasks import Task, evaluate_logits
from trellis.utils.memory import PeakMemory, trim_heap
from trellis.utils.numba import set_threads
from trellis.utils.sizes import format_size

#: Models that aggregate by themselves (attention): on the pull graph under destination ownership, through
#: the exchange's two-phase softmax elsewhere (:mod:`trellis.distributed.attention`).
ATTENTION_MODELS = ("gat", "gate")


def check_layout(cfg: TrainConfig, store: GraphStore, world_size: int | None) -> PartitionedGraph:
    """Open ``--parts-dir`` and refuse a layout of another store or a rank count other than its parts.

    Raises:
        TrellisUserError: One line naming the flag and the fix.
    """
    assert cfg.parts_dir is not None
    layout = open_layout_of(cfg.parts_dir, store)
    if world_size is not None and world_size != layout.num_parts:
        # under torchrun (no --nproc given) the job's size is what does not match
        given = f"--nproc {world_size}" if cfg.nproc is not None else f"a job of {world_size} ranks (WORLD_SIZE)"
        fix = f"pass --nproc {layout.num_parts}" if cfg.nproc is not None else f"start {layout.num_parts} ranks"
        raise TrellisUserError(f"{given} does not match the {layout.num_parts} parts of {cfg.parts_dir}: one rank "
                               f"trains one part; {fix} or re-partition with `trellis partition {cfg.store} "
                               f"--parts {world_size}`")
    if (cfg.overlap or cfg.staleness > 0) and layout.ownership != "dst":
        flag = "--overlap" if cfg.overlap else f"--staleness {cfg.staleness}"
        raise TrellisUserError(f"{flag} splits each rank's pull graph into interior and boundary edges, but "
                               f"{cfg.parts_dir} is {layout.ownership}-owned; partition with a destination-owned "
                               f"method ({', '.join(dst_methods())}) or drop {flag}")
    if cfg.staleness > 0 and cfg.model in ATTENTION_MODELS:
        raise TrellisUserError(f"--staleness applies to GCN, SAGE and GIN (their aggregation is the exchange's); "
                               f"--model {cfg.model} aggregates by itself: drop --staleness")
    kind, _ = parse_features(cfg.features)
    if kind not in ("store", "none"):
        raise TrellisUserError(f"--features {cfg.features} is not available with --parts-dir yet (store and none "
                               "are); drop --parts-dir or use --features store")
    return layout


def rank_plan(model: nn.Module, stats: GraphStats, in_dim: int, part: LocalGraph, world: int, budget: int,
              baseline: int, dropout: bool, chunk_rows: int | None = None, label_width: int = 1,
              ) -> tuple[OutOfCorePlan, int]:
    """The tile plan of one rank's part under ``budget``, and the rows per peer of its halo exchange rounds.

    A function of the part's sizes alone, so ``--explain`` prices every rank's part without joining a job.
    ``label_width``: values per label row (a multilabel store's classes).
    """
    n = int(part.num_nodes)
    params = sum(p.numel() for p in model.parameters())
    shapes = layer_shapes(model, stats)
    widest = max([in_dim] + [s.w_out for s in shapes])
    # halo exchanges in rounds: sent and received rows of one round within an eighth of the budget (the same
    # on every rank: the budget, the model and the world size are)
    per_row = 2 * world * widest * 4
    labels = 8 * sum(int(np.asarray(a).shape[0]) for a in part.splits.values()) + 8 * part.num_local * label_width
    degree = np.asarray(part.in_degree)
    out_degree = np.bincount(np.asarray(part.indices), minlength=n)
    max_degree = max(int(degree.max()) if degree.size else 0, int(out_degree.max()) if n else 0)
    del out_degree

    def halo_rows(b: int) -> int:
        return chunk_rows or max(1024, b // 8 // per_row)

    def plan_for(b: int) -> OutOfCorePlan:
        return plan_out_of_core(
            num_nodes=n, max_degree=max_degree, layers=shapes, params=params, budget=b, baseline=baseline,
            resident_vectors=16 * n + halo_rows(b) * per_row + labels + 16 * part.num_local, input_spilled=True,
            dropout=dropout, recompute_dropout=False)

    plan = plan_for(budget)
    # The smallest budget is the one whose own plan fits it: the rounds grow with the budget, so the plan's own
    # minimum named a budget that then needed more (Cora, 2 parts: 277 MiB at 200M, 286 at 270M, 289 at 278MiB).
    # The need grows by about an eighth of the budget, so this converges in a few steps; two rows more cover
    # the rounding of the rows per round, so that every budget from there up fits too.
    smallest = plan_for(0).min_budget
    for _ in range(100):
        need = plan_for(smallest).min_budget
        if need <= smallest:
            break
        smallest = need
    return replace(plan, min_budget=smallest + 2 * per_row), halo_rows(budget)


def explain_distributed(cfg: TrainConfig, factory: ModelFactory | None = None) -> str:
    """``--explain`` with ``--parts-dir``: the layout, its exchange per layer, and the plan every rank runs.

    Joins no job: every rank plans from the whole graph's statistics, so the plan is the single process's,
    and the exchange is the partition's estimate (which the measured bytes equal).
    """
    from trellis.train.build import build_run_model, default_model_factory
    from trellis.train.tasks import resolve_task

    store = GraphStore(str(cfg.store))
    layout = check_layout(cfg, store, cfg.nproc)
    q = layout.quality or {}
    task = resolve_task(cfg.task, store.task, np.asarray(store.y), store.num_classes)
    spec = ModelSpec(max(1, store.num_features) if cfg.features == "store" else 1, task.num_outputs,
                     int(store.edge_feat.shape[1]) if store.edge_feat is not None else 0, store.num_nodes, 0)
    model = build_run_model(cfg, spec, factory or default_model_factory)
    lines = [f"distributed: {layout.num_parts} ranks over {cfg.parts_dir} ({layout.ownership}-owned: "
             f"{OWNERSHIPS[layout.ownership].mode} exchange)"]
    if q:
        lines.append(f"exchange per layer at width {q['width']} (all ranks): forward "
                     f"{q['exchange_fwd_bytes'] / 2**20:,.1f} MiB, backward {q['exchange_bwd_bytes'] / 2**20:,.1f} "
                     "MiB; a layer exchanges at the width its plan aggregates (scale by width / "
                     f"{q['width']}); halo per part {q['part_halo']}")
    try:
        family_of(model)
    except TrellisUserError:
        lines.append(f"{cfg.model}: aggregates by itself; each layer's input rows are fetched at its input width")
    else:
        b = BatchedGNN([model])
        b.stats = GraphStats(store.num_nodes, store.num_nodes, store.num_edges,
                             sparse_input=rank_sparse_density(cfg, store, resolve_device(cfg.device)))
        lines += ["", b.explain(CSRGraph.from_numpy(np.zeros(1, np.int64), np.zeros(0, np.int64)))]
    if cfg.memory_budget is not None and cfg.strategy == "full":
        lines += ["", *_explain_ranks_out_of_core(cfg, store, layout, model, spec.in_dim)]
    return "\n".join(lines)


def rank_sparse_density(cfg: TrainConfig, store: GraphStore, device: torch.device) -> float | None:
    """The features' density when in-memory ranks take them as sparse rows (as one process does), else None.

    Every rank decides alike, from the store. Why: the first layer's dense transform and dropout over bag-of-words
    rows were most of a rank's step (Coauthor CS: 6,805 words per row, 60 present), and one process already kept
    them sparse. The first layer then transforms first on every rank (the plan's ``sparse_input``), so the halo
    exchange moves transformed rows, never the input's. Attention layers fetch their input's halo rows before
    transforming them, and out-of-core ranks tile and exchange dense rows: both keep dense rows.
    """
    if cfg.model in ATTENTION_MODELS or cfg.memory_budget is not None:
        return None
    return sparse_rows_density(store, cfg, device)


def _explain_ranks_out_of_core(cfg: TrainConfig, store: GraphStore, layout: PartitionedGraph, model: nn.Module,
                               in_dim: int) -> list[str]:
    """Each rank's tile plan under ``--memory-budget``, from its part's sizes (as the rank plans it at start).

    Why: with ``--memory-budget`` every rank trains its part out of core, and ``--explain`` printed only the
    in-memory operator plan. The baseline is this process's, measured as a rank measures its own (the kernels
    loaded first: measured before them, it was about 6 MiB below a rank's, and a budget it said fits was refused).
    """
    try:
        check_tileable(model)
    except TrellisUserError as exc:
        return [f"out of core per rank: --model {cfg.model} cannot be tiled ({exc})"]
    budget, baseline = budget_and_baseline(cfg, torch.device("cpu"))  # measured as a rank measures its own
    stats = GraphStats(store.num_nodes, store.num_nodes, store.num_edges)
    width = 1 if store.y is None or np.asarray(store.y).ndim == 1 else int(np.asarray(store.y).shape[1])
    lines = [f"out of core per rank (--memory-budget {cfg.memory_budget} = {format_size(budget)} each; baseline "
             f"{format_size(baseline)} measured here):"]
    for r in range(layout.num_parts):
        part = layout.part(r)
        plan, _ = rank_plan(model, stats, in_dim, part, layout.num_parts, budget, baseline,
                            float(cfg.dropout) > 0.0, label_width=width)
        fits = "fits" if budget >= plan.min_budget else f"TOO SMALL: raise it to {format_size(plan.min_budget)}"
        lines.append(f"  rank {r}: part {r}, {part.num_local:,} + {part.num_nodes - part.num_local:,} halo rows; "
                     f"smallest budget {format_size(plan.min_budget)} ({fits}); tile {format_size(plan.tile_bytes)}, "
                     f"spills up to {format_size(plan.spill_bytes)} on disk")
    return lines


class PartitionedFull(Strategy):
    """Full-batch training of one part per rank (see the module docstring); ``full`` with ``--parts-dir``."""

    name = "full"

    @classmethod
    def check_options(cls, cfg: TrainConfig) -> None:
        """Also refuse model options whose result would depend on how the graph is split across ranks."""
        super().check_options(cfg)
        if cfg.norm == "batch":
            raise TrellisUserError("--norm batch across ranks would normalize each rank's rows by their own "
                                   "statistics; use --norm layer (row-wise, exact across ranks)")
        if cfg.edge_weight:
            raise TrellisUserError("--edge-weight is not available across ranks (each rank's weighted degrees would "
                                   "be local); train in one process, or drop --edge-weight")
    eval_splits = ("train", "val", "test")

    def __init__(self, cfg: TrainConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.comm: Comm | None = None
        self._runner: tuple[nn.Module, Any] | None = None
        self.meter = PeakMemory()
        self._step_traffic: dict[str, Any] = {}
        self._eval_bytes = 0

    # ---- data -----------------------------------------------------------------------------------
    def load(self) -> None:
        """Join the job, open this rank's part and build its graph, view and exchange."""
        cfg = self.cfg
        part = self._join()
        comm, store = self.comm, self.store
        assert comm is not None
        self.rg: RankGraph = build_rank_graph(part, comm, self.device)
        self.traffic, self.mode, self.num_local = self.rg.traffic, self.rg.mode, part.num_local
        if isinstance(self.rg.exchange, PullExchange):
            self.rg.exchange.set_schedule(cfg.overlap, cfg.staleness)
        self.node_ids = self.rg.node_ids
        owned = self.node_ids[: part.num_local]
        # inputs: the part's own feature rows, normalized as the single process normalizes them
        kind, _ = parse_features(cfg.features)
        if kind == "store":
            if part.x is None:
                raise TrellisUserError(f"{cfg.parts_dir}: the layout has no node features (the store had none); "
                                       "train with --features none")
            norm = self._feature_norm()
            # bag-of-words rows, as one process keeps them: converted a chunk at a time (no dense copy of the part)
            sparse = sparse_rows_of(part.x, norm, max_density=1.0) if self._sparse_density() is not None else None
            if sparse is not None:
                x, self.feature_norm = sparse, norm
            else:
                x, self.feature_norm = normalize_features(torch.from_numpy(np.array(part.x, dtype=np.float32)), norm)
        else:
            x, self.feature_norm = torch.ones(part.num_local, 1), "none"
        self.x = x.to(self.device)
        if self.rg.pull_view is not None:
            self.rg.pull_view.constant = self.x
        self._labels(part, owned, int(self.x.shape[1]))
        # dropout masks keyed by global node id (and attention's by the edge's position in the whole graph)
        self.row_keys: dict[str, np.ndarray] = {}
        if comm.world_size > 1:
            self.row_keys["nodes"] = owned
            if cfg.model in ATTENTION_MODELS:
                pull, split = self.rg.pull_graph, self.rg.exchange.attention()
                if pull is not None:
                    looped, loop_eids = pull.with_self_loops(), self_loop_eids(pull)
                else:
                    assert split is not None
                    looped, loop_eids = split.graph, split.loop_eids
                self.row_keys["edges"] = edge_keys(comm, looped, loop_eids, np.asarray(store.indptr))
        self.meter.start()

    def _join(self) -> LocalGraph:
        """Join the job (or make a world of one) and open this rank's part of the checked layout."""
        cfg = self.cfg
        env = RankEnv.from_environ()
        self.store = store = GraphStore(str(cfg.store))
        layout = check_layout(cfg, store, cfg.nproc or 1 if env is None else env.world_size)
        if env is None:  # one process, no launcher: a world of one
            env = RankEnv(0, 1, 0, 1, "127.0.0.1", free_port())
        else:
            set_threads(rank_threads(env.local_world_size))
        if self.device.type == "cuda":  # one GPU per rank: "cuda" now means this rank's
            torch.cuda.set_device(env.local_rank)
            self.device = torch.device("cuda", env.local_rank)
        link = None if cfg.emulate_link is None else Link.parse(cfg.emulate_link)
        self.comm = Comm(env, self.device, cfg.timeout, link)
        self.world = self.comm
        return layout.part(self.comm.rank)

    def _feature_norm(self) -> str:
        return self.store.preferred_feature_norm if self.cfg.feature_norm == "auto" else self.cfg.feature_norm

    def _labels(self, part: LocalGraph, owned: np.ndarray, in_dim: int) -> None:
        """Labels of the owned rows, local split ids, the store's split order (gathered metrics), the spec."""
        cfg, store = self.cfg, self.store
        y, splits, task = load_labels(store, cfg.task, torch.device("cpu"), cfg.split_seed)
        self.task = task
        self.y_local = y[torch.from_numpy(owned.copy())].to(self.device)
        self.local_splits = {s: torch.from_numpy(np.array(part.splits.get(s, np.empty(0, np.int64)),
                                                          dtype=np.int64)).to(self.device) for s in SPLITS}
        # the store's split order, for gathered metrics; and the global training count for the loss
        self.split_ids = {s: splits[s].numpy() for s in SPLITS}
        self.y_split = {s: y[splits[s]] for s in SPLITS}
        self.num_train = int(self.split_ids["train"].shape[0])
        self.spec = ModelSpec(in_dim, task.num_outputs, self._edge_dim(part), store.num_nodes, 0)
        self.stats = GraphStats(store.num_nodes, store.num_nodes, store.num_edges, sparse_input=self._sparse_density())

    def _sparse_density(self) -> float | None:
        """The features' density when the ranks take them as sparse rows (:func:`rank_sparse_density`)."""
        return rank_sparse_density(self.cfg, self.store, self.device)

    @staticmethod
    def _edge_dim(part: Any) -> int:
        ef = part.edge_feat
        return 0 if ef is None else int(np.asarray(ef).reshape(ef.shape[0], -1).shape[1])

    @property
    def checksum(self) -> str:
        """The store's checksum (the layout was checked against it)."""
        return str(self.store.checksum)

    def banner(self) -> str:
        """Ranks, ownership and this rank's rows."""
        d = self.rg.describe()
        assert self.comm is not None
        return (f"distributed: {self.comm.world_size} rank(s) over {self.cfg.parts_dir} ({d['mode']}, "
                f"{self.comm.backend}); rank 0 holds {d['num_local']:,} nodes and {d['num_halo']:,} halo nodes")

    # ---- the model ------------------------------------------------------------------------------
    def build_model(self, factory: ModelFactory, cfg: TrainConfig | None = None) -> nn.Module:
        """The run's model; every rank checks that its peers planned the same layers."""
        model = super().build_model(factory, cfg)
        self._check_plan(model)
        return model

    def _runner_for(self, model: nn.Module) -> Any:
        if self._runner is None or self._runner[0] is not model:
            try:
                family_of(model)
            except TrellisUserError:  # aggregates by itself (attention): the pull graph, halo rows from the view
                graph, view = self.rg.graph, self.rg.view
                if self.rg.pull_graph is not None and self.rg.pull_view is not None:
                    graph, view = self.rg.pull_graph, self.rg.pull_view

                def run(train: bool) -> Tensor:
                    return model(graph, self.x, view=view)
            else:
                batched = BatchedGNN([model])
                batched.stats = self.stats

                def run(train: bool) -> Tensor:
                    batched.train(train)
                    return batched(self.rg.graph, self.x, view=self.rg.view)[0]
            self._runner = (model, run)
        return self._runner[1]

    def _check_plan(self, model: nn.Module) -> None:
        try:
            family_of(model)
        except TrellisUserError:
            text = type(model).__name__
        else:
            b = BatchedGNN([model])
            b.stats = self.stats
            text = b.explain(self.rg.graph)
        mine = int(hashlib.sha256(text.encode()).hexdigest()[:12], 16)
        assert self.comm is not None
        total = self.comm.sum([float(mine)])[0]
        if total != float(mine) * self.comm.world_size:
            raise RuntimeError(f"rank {self.comm.rank}: the ranks planned different layer orders; every rank must "
                               "run the same trellis version on the same store")

    def forward(self, model: nn.Module) -> Tensor:
        """Logits of the owned rows."""
        with keyed_rows(**self.row_keys):
            return self._runner_for(model)(model.training)

    # ---- training -------------------------------------------------------------------------------
    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """Forward and backward on every rank, gradients summed, one optimizer step; the global loss."""
        assert self.comm is not None
        t0 = time.perf_counter()
        self.comm.clock.take()
        buffers = self._buffers()
        if buffers is not None:
            buffers.begin_step()
        model.train()
        optimizer.zero_grad(set_to_none=True)
        logits = self.forward(model)
        idx = self.local_splits["train"]
        n = int(idx.shape[0])
        if n:
            loss = task.loss(logits[idx], self.y_local[idx])
            if n != self.num_train:
                loss = loss * (n / self.num_train)
        else:  # no training rows here: a zero that keeps every exchange of the backward pass in step
            loss = logits.sum() * 0.0
        loss.backward()
        return self._finish_step(model, optimizer, loss, t0)

    def _finish_step(self, model: nn.Module, optimizer: Any, loss: Tensor, t0: float) -> Tensor:
        """Gradients summed over the ranks, the optimizer's step, the step's bytes and times; the global loss."""
        assert self.comm is not None
        self.comm.all_reduce_grads([p for p in model.parameters() if p.requires_grad])
        optimizer.step()
        comm_s, blocked_s = self.comm.clock.take()
        step_s = time.perf_counter() - t0
        total = self.comm.sum([float(loss.detach())])[0]
        self._step_traffic = self._job_traffic()
        self._step_traffic.update(self._job_times(step_s - blocked_s, comm_s))
        buffers = self._buffers()
        if buffers is not None:
            self._step_traffic.update(buffers.take_ages())
        trim_heap()  # freed exchange buffers leave RssAnon before evaluation allocates its own
        return torch.tensor(total, dtype=torch.float32)

    def begin_run(self, seed: int) -> None:
        """A run (seed) starts: stale halo rows of the previous run's model are not this run's."""
        buffers = self._buffers()
        if buffers is not None:
            buffers.reset()

    def _buffers(self) -> StaleBuffers | None:
        rg = getattr(self, "rg", None)  # out-of-core ranks have no in-memory rank graph
        return rg.exchange.buffers if rg is not None and isinstance(rg.exchange, PullExchange) else None

    def _job_times(self, compute_s: float, comm_s: float) -> dict[str, float]:
        """``compute_s`` and ``comm_s`` of the step: each the maximum over the ranks.

        ``compute_s`` is a rank's step time less the time it waited for exchanges (its local work, the
        gradient all-reduce included); ``comm_s`` the summed duration of its exchanges, start to arrival
        (:class:`~trellis.distributed.comm.CommClock`).
        """
        assert self.comm is not None
        row = torch.tensor([[compute_s, comm_s]], dtype=torch.float64)
        per_rank = torch.cat(self.comm.all_gather_rows(row))
        return {"compute_s": float(per_rank[:, 0].max()), "comm_s": float(per_rank[:, 1].max())}

    def state_dict(self) -> dict[str, Any]:
        """Every rank's stale halo rows and gradients (``--staleness``), gathered to the checkpoint rank 0 writes."""
        buffers = self._buffers()
        if buffers is None:
            return {}
        assert self.comm is not None
        import io

        blob = io.BytesIO()
        torch.save(buffers.state_dict(), blob)
        mine = torch.frombuffer(bytearray(blob.getvalue()), dtype=torch.uint8)
        return {"stale_buffers": [t.clone() for t in self.comm.all_gather_rows(mine)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's stale buffers from the checkpoint."""
        buffers = self._buffers()
        saved = state.get("stale_buffers")
        if buffers is None or not saved:
            return
        assert self.comm is not None
        import io

        mine = torch.load(io.BytesIO(saved[self.comm.rank].numpy().tobytes()), weights_only=True)
        buffers.load_state_dict(mine, self.comm, self.device)

    def _job_traffic(self) -> dict[str, Any]:
        """The step's bytes per layer and direction summed over the ranks, and each rank's total."""
        assert self.comm is not None
        mine = self.traffic.take()
        mine.pop("exchange_bytes")
        keys = sorted(mine)
        row = torch.tensor([[float(mine[k]) for k in keys] + [float(sum(mine.values()))]], dtype=torch.float64)
        per_rank = torch.cat(self.comm.all_gather_rows(row))
        out: dict[str, Any] = {k: int(per_rank[:, i].sum()) for i, k in enumerate(keys)}
        out["exchange_bytes"] = int(per_rank[:, -1].sum())
        out["exchange_bytes_per_rank"] = [int(v) for v in per_rank[:, -1].tolist()]
        return out

    def _scored(self) -> Tensor:
        """Local rows of every split's nodes, split after split (what :meth:`_gathered` is given logits of)."""
        return torch.cat([self.local_splits[s] for s in SPLITS])

    def _gathered(self, mine: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Logits of every split's nodes from every rank, in the store's split order, with their labels.

        ``mine``: this rank's logits of :meth:`_scored`'s rows, in that order.
        """
        assert self.comm is not None
        idx = self._scored()
        all_rows = torch.cat(self.comm.all_gather_rows(mine.detach().cpu()))  # only the scored rows move
        all_ids = torch.cat(self.comm.all_gather_rows(torch.from_numpy(self.node_ids[idx.cpu().numpy()]))).numpy()
        order = np.argsort(all_ids, kind="stable")
        sorted_ids = all_ids[order]
        parts, ys, splits, at = [], [], {}, 0
        for s in SPLITS:
            ids = self.split_ids[s]
            pos = order[np.searchsorted(sorted_ids, ids)]
            parts.append(all_rows[torch.from_numpy(pos)])
            ys.append(self.y_split[s])
            splits[s] = torch.arange(at, at + ids.shape[0])
            at += ids.shape[0]
        return torch.cat(parts), torch.cat(ys), splits

    @torch.no_grad()
    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """One forward pass without dropout; metrics of the gathered split rows (identical on every rank)."""
        model.eval()
        logits, y, splits = self._gathered(self.forward(model)[self._scored()])
        self._eval_bytes = self.traffic.take()["exchange_bytes"]
        metrics = evaluate_logits(task, logits, y, splits)
        del logits
        trim_heap()
        return metrics

    def model_record(self, cfg: TrainConfig) -> dict[str, Any]:
        """What ``trellis predict`` rebuilds the model from (it predicts in one process, on the store)."""
        return {"in_dim": self.spec.in_dim, "out_dim": self.task.num_outputs, "edge_dim": self.spec.edge_dim,
                "kwargs": cfg.model_kwargs(), "task": self.task.name, "feature_norm": self.feature_norm,
                "features": cfg.features, "num_nodes": self.store.num_nodes}

    def epoch_info(self) -> dict[str, Any]:
        """Halo bytes of the epoch.

        The training step's per layer and direction summed over ranks (what ``trellis partition``
        estimates), each rank's step total, and rank 0's evaluation bytes.
        """
        return {**self._step_traffic, "eval_exchange_bytes": self._eval_bytes}

    def summary_info(self) -> dict[str, Any]:
        """Ranks, ownership, every rank's rows and peak memory (RssAnon, MiB)."""
        assert self.comm is not None
        self.meter.sample()
        mine = torch.tensor([[float(self.meter.peak_anon) / 2**20, float(self.num_local)]], dtype=torch.float64)
        per_rank = torch.cat(self.comm.all_gather_rows(mine))
        x = getattr(self, "x", None)  # out-of-core ranks hold no input tensor (dense rows in their spills)
        return {"world_size": self.comm.world_size, "parts_dir": str(self.cfg.parts_dir), "mode": self.mode,
                "backend": self.comm.backend, "rank_peak_rss_anon_mb": per_rank[:, 0].tolist(),
                "rank_num_local": [int(v) for v in per_rank[:, 1].tolist()],
                "input_rows": "sparse" if isinstance(x, Tensor) and is_sparse(x) else "dense"}

    def close(self) -> None:
        """Leave the job."""
        self.meter.stop()
        if self.comm is not None:
            self.comm.close()
            self.comm = None
