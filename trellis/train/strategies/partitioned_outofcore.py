"""Out-of-core ranks: ``--parts-dir`` with ``--memory-budget SIZE``, each rank training its part within SIZE.

A machine of a cluster may hold a partition larger than its memory (Lotan's papers100M runs were
"disk-aware"). Each rank runs the out-of-core engine (:class:`trellis.nn.tiled.TiledGNN`) on its part: its
pull graph (``L`` owned rows over ``L + H`` sources) and that graph's reverse stay memory-mapped, every
layer's ``[L + H, d]`` tensors live in spill files of the rank's own spill directory, and tiles of owned
rows are computed one at a time. The halo rows are filled between the tiles' passes by one exchange per
layer (:class:`trellis.distributed.halo.MappedHalo`: only the rows sent and received are in memory), and in
the backward pass the halo rows' gradients go back to their owners before the layer's dense backward.

Exactness is the distributed engine's (loss scaled by ``local / global`` training rows, gradients summed by
an all-reduce, metrics from the gathered scored rows) with the out-of-core engine's (same layers, the
single process's plan from the whole graph's statistics, dropout masks keyed by global id in every tile):
losses equal the single process's to float summation order. Destination-owned layouts, GCN, SAGE (mean) and
GIN, on the CPU; the blocking schedule.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from trellis.data.store import GraphStore
from trellis.distributed.halo import MappedHalo, Route, Traffic
from trellis.distributed.ownership import dst_methods
from trellis.errors import BudgetTooSmall, TrellisUserError
from trellis.nn.batched import check_tileable
from trellis.nn.tiled import Gather, TiledGNN
from trellis.ops.tiled import MappedCSR
from trellis.partition.layout import LocalGraph, PartitionedGraph
from trellis.plan.outofcore import OutOfCorePlan
from trellis.train.build import ModelFactory, ModelSpec, build_run_model
from trellis.train.config import TrainConfig
from trellis.train.data import normalize_features
from trellis.train.features import parse_features
from trellis.train.runs import default_run_dir
from trellis.train.strategies.outofcore import COLD_ENV, budget_and_baseline
from trellis.train.strategies.partitioned import PartitionedFull, rank_plan
from trellis.train.strategy import Strategy
from trellis.train.tasks import Task
from trellis.utils.csr import build_reverse_csr
from trellis.utils.diskmap import SPILL_FIX, new_map
from trellis.utils.memory import trim_heap
from trellis.utils.sizes import format_size
from trellis.utils.spill import SpillDir, check_spill_root


def refuse_untileable(model: nn.Module, cfg: TrainConfig) -> None:
    """Refuse a model out-of-core ranks cannot tile, in one line naming the flag."""
    try:
        check_tileable(model)
    except TrellisUserError as exc:
        why = (str(exc) if not getattr(model, "plain", True)
               else "the out-of-core engine tiles GCN, SAGE (mean) and GIN")
        raise TrellisUserError(f"--model {cfg.model} cannot train under --memory-budget: {why}; drop "
                               "--memory-budget") from None


def check_rank_model(cfg: TrainConfig, store: GraphStore) -> None:
    """:func:`refuse_untileable` before any rank starts (the launcher's preflight).

    The model of ``cfg`` on ``store``'s widths: each rank refused it after the job had started, every rank
    printing the error.
    """
    ef = store.edge_feat
    spec = ModelSpec(max(1, store.num_features), 2, 0 if ef is None else int(ef.shape[1]), store.num_nodes, 0)
    refuse_untileable(build_run_model(cfg, spec), cfg)


class PartitionedOutOfCore(PartitionedFull):
    """``full`` with ``--parts-dir`` and ``--memory-budget`` (see the module docstring)."""

    #: Cap on the rows of a tile (tests force small tiles with it).
    max_tile_rows: int | None = None
    #: Rows per peer and round of a halo exchange (None: from the budget; tests force many rounds with it).
    halo_chunk_rows: int | None = None

    def load(self) -> None:
        """Join the job; map this rank's part, write its normalized inputs (halo rows filled) to its spill."""
        cfg = self.cfg
        if cfg.overlap or cfg.staleness:
            raise TrellisUserError("--overlap and --staleness run on in-memory ranks; drop them or --memory-budget")
        kind, _ = parse_features(cfg.features)
        if kind != "store":
            raise TrellisUserError(f"--features {cfg.features} with --parts-dir and --memory-budget: only the "
                                   "store's features are read out of core; use --features store")
        self.budget, self.baseline = budget_and_baseline(cfg, self.device)
        assert cfg.parts_dir is not None
        ownership = PartitionedGraph(cfg.parts_dir).ownership
        if ownership != "dst":
            raise TrellisUserError(f"--memory-budget with --parts-dir trains destination-owned layouts; "
                                   f"{cfg.parts_dir} is {ownership}-owned: partition with {', '.join(dst_methods())}")
        part = self._join()
        try:
            self._open(part)
        except BaseException:
            self.close()  # leave the job: the trainer closes only a strategy that loaded
            raise
        self.meter.start()

    def _open(self, part: LocalGraph) -> None:
        """This rank's halo route, labels and split rows (collective: the route's handshake)."""
        cfg, comm = self.cfg, self.comm
        assert comm is not None
        if part.x is None:
            raise TrellisUserError(f"{cfg.parts_dir}: the layout has no node features; train with --features none "
                                   "in memory (drop --memory-budget)")
        L, n = part.num_local, part.num_nodes
        self.num_local, self.mode = L, "pull"
        self.node_ids = np.asarray(part.local_to_global, dtype=np.int64)
        self.traffic = Traffic()
        route = Route.owner_to_holders(comm, self.node_ids, L, np.arange(L, n, dtype=np.int64),
                                       np.asarray(part.halo_owner)).to(torch.device("cpu"))
        self.halo = MappedHalo(route, L, self.node_ids[:L], self.traffic)
        self.spill: SpillDir | None = None  # made with the tiles, once the run directory exists
        self.plan: OutOfCorePlan | None = None
        self.feature_norm = self._feature_norm()
        self._labels(part, self.node_ids[:L], int(np.prod(part.x.shape[1:])) if part.x.ndim > 1 else 1)
        self._part = part
        self._engine: tuple[nn.Module, TiledGNN] | None = None
        self.row_keys = {}

    def _spill_root(self) -> Path:
        cfg = self.cfg
        assert self.comm is not None
        base = Path(cfg.spill_dir) if cfg.spill_dir else \
            Path(cfg.out or default_run_dir(Path(str(cfg.store)).name, str(cfg.model))) / "spill"
        return base / f"rank-{self.comm.rank:05d}"

    def banner(self) -> str:
        """Ranks, the budget and this rank's rows."""
        assert self.comm is not None
        return (f"distributed out of core: {self.comm.world_size} rank(s) over {self.cfg.parts_dir} (pull, "
                f"{self.comm.backend}), --memory-budget {self.cfg.memory_budget} per rank; rank 0 holds "
                f"{self.num_local:,} nodes and {self.node_ids.shape[0] - self.num_local:,} halo nodes")

    # ---- the model and its tiles ----------------------------------------------------------------------
    def build_model(self, factory: ModelFactory, cfg: TrainConfig | None = None) -> nn.Module:
        """The run's model; the first call plans the tiles under the budget (and refuses what cannot run)."""
        model = Strategy.build_model(self, factory, cfg)
        refuse_untileable(model, self.cfg)
        if self.plan is None:
            self._plan(model)
        return model

    def _mapped_graph(self) -> MappedCSR:
        """The part's pull CSR, memory-mapped, and its reverse, built once and written to the spill directory."""
        part = self._part
        assert self.spill is not None
        ip = part.indptr[: self.num_local + 1]  # a pull part's halo rows hold no edges
        indptr, indices = np.asarray(ip, dtype=np.int64), np.asarray(part.indices, dtype=np.int64)
        rev = build_reverse_csr(indptr, indices, self.node_ids.shape[0])[:2]
        del indptr, indices
        maps = []
        for name, a in zip(("rev_indptr", "rev_indices"), rev):
            m = new_map(self.spill.path / f"{name}.npy", a.shape, np.int64, SPILL_FIX)
            m[:] = a
            maps.append(m)
        del rev
        trim_heap()
        return MappedCSR(ip, part.indices, maps[0], maps[1], degree=np.array(part.in_degree))

    def _plan(self, model: nn.Module) -> None:
        """Plan the tiles under the budget from the part's sizes (writes nothing: the run may not exist yet)."""
        cfg, part = self.cfg, self._part
        assert self.comm is not None
        plan, chunk_rows = rank_plan(model, self.stats, self.spec.in_dim, part, self.comm.world_size, self.budget,
                                     self.baseline, float(cfg.dropout) > 0.0, self.halo_chunk_rows,
                                     self.y_local.numel() // max(1, self.num_local))
        self.halo.set_chunk_rows(chunk_rows)

        def check() -> None:  # every rank checks its part; the one needing the most says so (one line)
            if self.budget < plan.min_budget:
                raise BudgetTooSmall(f"--memory-budget {cfg.memory_budget} ({format_size(self.budget)}) per rank "
                                     f"is below the smallest budget that trains this model on part {part.part} "
                                     f"(the most any rank needs), {format_size(plan.min_budget)} (the rank itself "
                                     f"takes {format_size(self.baseline)}); raise it to at least "
                                     f"{format_size(plan.min_budget)}", plan.min_budget)
            check_spill_root(self._spill_root(), plan.spill_bytes, flag="--spill-dir" if cfg.spill_dir else
                             "spill directory")

        self.comm.refuse_together(check)
        self.plan = plan

    def _tiles(self) -> None:
        """Make the spill directory, map the part's CSR and its reverse, and cut the tiles of the plan."""
        plan = self.plan
        assert plan is not None
        self.spill = SpillDir(self._spill_root())
        self.graph = g = self._mapped_graph()
        self.bounds = g.tile_bounds(plan.row_bytes, plan.edge_bytes, plan.tile_bytes, max_rows=self.max_tile_rows)
        self.source_bounds = g.source_bounds(plan.row_bytes, plan.edge_bytes, plan.tile_bytes,
                                             max_rows=self.max_tile_rows)

    def _input(self) -> np.ndarray:
        """The first layer's input ``[L + H, F]``: the owned rows normalized tile by tile, the halo filled once."""
        assert self.spill is not None
        if not self.spill.has("x"):
            raw, L = self._part.x, self.num_local
            assert raw is not None
            width = self.spec.in_dim
            x = self.spill.array("x", (self.node_ids.shape[0], width))
            for r0 in range(0, L, 65536):
                r1 = min(L, r0 + 65536)
                t = torch.from_numpy(np.array(raw[r0:r1], dtype=np.float32).reshape(r1 - r0, width))
                normalize_features(t, self.feature_norm)
                x[r0:r1] = t.numpy()
            self.halo.fill(x)
            self.traffic.take()  # a one-off, not an epoch's exchange
        return self.spill.get("x")

    def _engine_for(self, model: nn.Module) -> TiledGNN:
        if self._engine is None or self._engine[0] is not model:
            if self.spill is None:
                self._tiles()
            assert self.spill is not None
            self._engine = (model, TiledGNN(model, self.graph, self._input(), self.spill, self.bounds,
                                            cold=os.environ.get(COLD_ENV) == "1", halo=self.halo,
                                            source_bounds=self.source_bounds, stats=self.stats))
        return self._engine[1]

    # ---- training -----------------------------------------------------------------------------------
    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """A tiled forward and backward on every rank, gradients summed, one optimizer step; the global loss."""
        assert self.comm is not None
        t0 = time.perf_counter()
        self.comm.clock.take()
        eng = self._engine_for(model)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        idx = self.local_splits["train"]
        rows = Gather.of(idx.numpy())
        leaf = eng.forward(True, rows).requires_grad_()
        n = int(idx.shape[0])
        if n:
            loss = task.loss(leaf, self.y_local[idx])
            if n != self.num_train:
                loss = loss * (n / self.num_train)
            loss.backward()
            assert leaf.grad is not None
            grad = leaf.grad
        else:  # no training rows here: zero gradients keep every exchange of the backward pass in step
            loss, grad = leaf.sum() * 0.0, torch.zeros_like(leaf)
        eng.backward(rows, grad)
        return self._finish_step(model, optimizer, loss, t0)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """Tiled inference of the scored rows; metrics of the gathered rows (identical on every rank)."""
        from trellis.train.tasks import evaluate_logits

        eng = self._engine_for(model)
        model.eval()
        mine = eng.forward(False, Gather.of(self._scored().numpy()))
        logits, y, splits = self._gathered(mine)
        self._eval_bytes = self.traffic.take()["exchange_bytes"]
        metrics = evaluate_logits(task, logits, y, splits)
        trim_heap()
        return metrics

    def epoch_info(self) -> dict[str, Any]:
        """The distributed step's bytes and times, and this rank's spill traffic."""
        out = super().epoch_info()
        if self._engine is not None:
            io = self._engine[1].io
            out.update(spill_written_bytes=io.written, spill_read_bytes=io.read, spill_gathered_bytes=io.gathered)
            io.written = io.read = io.gathered = 0
        return out

    def summary_info(self) -> dict[str, Any]:
        """Ranks and per-rank memory, the budget and this rank's tiles."""
        tiles = int(len(self.bounds) - 1) if self.spill is not None else 0
        return {**super().summary_info(), "memory_budget_bytes": self.budget, "tiles": tiles}

    def close(self) -> None:
        """Remove this rank's spill files and leave the job."""
        self._engine = None
        if getattr(self, "spill", None) is not None:
            assert self.spill is not None
            self.spill.close()
            self.spill = None
            if not self.cfg.spill_dir:  # RUN_DIR/spill, shared by the ranks: the last one to close removes it
                with contextlib.suppress(OSError):
                    self._spill_root().parent.rmdir()
        super().close()
