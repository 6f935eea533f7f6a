"""Full-batch training out of core: ``--strategy full --memory-budget SIZE`` (Lotan's disk-awareness, planned).

The same full-batch step as in memory — one forward over the whole graph, the loss over the training
nodes, one backward, one optimizer step — run by :class:`trellis.nn.tiled.TiledGNN` over row tiles sized
by :func:`trellis.plan.outofcore.plan_out_of_core` so that the process's peak ``RssAnon`` stays within
the budget. Nothing of size ``N x F`` or ``E`` is loaded: the features, the CSR and the store's reverse
CSR stay memory-mapped, row normalization is written once to a spill file, and per-edge weights are
computed per tile from the ``O(N)`` degree vectors. Bag-of-words features (at most
:data:`~trellis.ops.sparse_rows.MAX_DENSITY` non-zeros, a built-in message-passing model) are written once as
sparse rows (:class:`~trellis.ops.sparse_rows.MappedSparseRows`) and reach the first layer as CSR tiles,
transformed first, as in memory: a tile then reads, drops out and multiplies only its stored values.

Spill files live under ``--spill-dir`` (default ``RUN_DIR/spill``) and are removed when the run ends,
on SIGINT/SIGTERM (through :meth:`close`) and, after a ``kill -9``, by the next run that opens the same
spill root (``--resume`` does).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import torch
from torch import Tensor, nn

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.nn.batched import check_tileable
from trellis.nn.models import GNN
from trellis.nn.tiled import EpochIO, Gather, Input, TiledGNN, epoch_traffic, layer_shapes
from trellis.nn.tiled_batch import BatchedTiledGNN
from trellis.ops import dropout as hash_dropout
from trellis.ops.sparse_rows import MAPPED_VALUE_BYTES, MappedSparseRows, linear, unmemoized
from trellis.ops.tiled import MappedCSR, iter_tiles
from trellis.plan.cost import GraphStats
from trellis.plan.outofcore import OutOfCorePlan, in_memory_estimate, joint_shape, plan_out_of_core
from trellis.train.build import ModelFactory, ModelSpec, build_run_model
from trellis.train.config import TrainConfig
from trellis.train.data import SPLITS, load_labels, normalize_features, sparse_rows_density
from trellis.train.features import node_inputs, parse_features
from trellis.train.loop import Lane, ModelBatch
from trellis.train.runs import default_run_dir
from trellis.train.strategy import Prediction, PredictRequest, Strategy, saved_model
from trellis.train.tasks import TASKS, Task, split_metrics
from trellis.utils.diskmap import new_map
from trellis.utils.memory import proc_io, proc_status, return_freed_memory
from trellis.utils.sizes import format_size, parse_size
from trellis.utils.spill import SpillDir, check_spill_root

#: Benchmarks set this environment variable to ``1`` to drop the page cache of the spills and the store before
#: every pass of the tiled engine, so that reads come from storage (see :class:`~trellis.nn.tiled.TiledGNN`).
COLD_ENV = "TRELLIS_OOC_COLD"


def budget_and_baseline(cfg: TrainConfig, device: torch.device, sparse_rows: bool = False) -> tuple[int, int]:
    """``(budget, baseline)`` in bytes: the parsed ``--memory-budget`` and the process's RssAnon before the graph.

    The kernels are compiled first (that would otherwise land inside the budget later); ``sparse_rows``: the
    sparse input's too.

    Raises:
        TrellisUserError: A device other than the CPU.
    """
    if device.type != "cpu":
        raise TrellisUserError(f"--memory-budget with --device {device}: the out-of-core engine runs on the CPU "
                               "only so far; use --device cpu, or drop --memory-budget")
    assert cfg.memory_budget is not None
    budget = parse_size(cfg.memory_budget, flag="--memory-budget")
    return_freed_memory()
    _warm_kernels(sparse_rows)
    return budget, proc_status().get("RssAnon", 0)


def _warm_kernels(sparse_rows: bool = False) -> None:
    """Compile (or load from numba's cache) the tiled kernels before the baseline is measured."""
    ip = np.array([0, 1, 2], dtype=np.int64)
    ix = np.array([1, 0], dtype=np.int64)
    g = MappedCSR(ip, ix, ip, ix)
    x = np.ones((2, 2), dtype=np.float32)
    for kind in ("gcn", "mean", "sum"):
        for rev in (False, True):
            g.aggregate(kind, g.tile(0, 2, reverse=rev), x, reverse=rev)
    if sparse_rows:  # a tile's dropout and first transform, forward and backward
        rows = MappedSparseRows(ip, ix, np.ones(2, dtype=np.float32), 2).rows(0, 2)
        w = torch.ones((2, 2), requires_grad=True)
        with unmemoized(), torch.enable_grad():  # a caller's no_grad (Run.predict) would skip the backward's kernels
            linear(hash_dropout.apply_sparse(rows, 0.5, 1), w).sum().backward()


class OutOfCoreFull(Strategy):
    """``--strategy full`` under ``--memory-budget`` (see the module docstring)."""

    name = "full"
    predicts_on_cpu = "tiled inference under --memory-budget"

    #: Cap on the rows of a tile (None: the plan's); tests force one-row and seven-row tiles with it.
    max_tile_rows: ClassVar[int | None] = None
    plan: OutOfCorePlan | None = None
    #: The configurations the tiles were planned for (a sweep replans for each batch).
    _plan_cfgs: tuple[TrainConfig, ...] = ()
    #: Spill traffic of the engine that trains now (one configuration's or K configurations').
    _io: EpochIO | None = None
    #: Set before :meth:`load` to predict without labels (``trellis predict``): the trained model's task.
    predict_task: Task | None = None
    bounds: np.ndarray
    spill: SpillDir | None = None
    #: The first layer's input: the store's map, an in-RAM array, or (None until written) a normalized spill.
    x: Input | None = None

    def load(self) -> None:
        """Open the store memory-mapped; load only labels, split ids and the ``O(N)`` degree vectors."""
        cfg = self.cfg
        self.store = store = GraphStore(str(cfg.store))
        kind, _ = parse_features(cfg.features)
        self.sparse_density = sparse_rows_density(store, cfg, self.device) \
            if store.x is not None and store.x.ndim == 2 else None
        self.budget, self.baseline = budget_and_baseline(cfg, self.device, self.sparse_density is not None)
        self.features = cfg.features
        self._x_raw: np.ndarray | None = None
        if kind == "embedding":
            raise TrellisUserError(f"--features {cfg.features} does not run under --memory-budget (a trainable "
                                   "[N, D] table would be resident); use --features store, degree or none")
        if kind == "store":
            if store.x is None:
                raise TrellisUserError(f"{store.path}: the store has no node features (x.npy); train with --features "
                                       "none or degree, or re-import it with features")
            self._x_raw = store.x
            norm = store.preferred_feature_norm if cfg.feature_norm == "auto" else cfg.feature_norm
            self.feature_norm = norm
            self.x = None
            if norm == "none" and store.x.dtype == np.float32 and store.x.ndim == 2 and self.sparse_density is None:
                self.x = store.x  # read in place: the kernels gather straight from the map
            in_dim = int(store.x.shape[1]) if store.x.ndim == 2 else 1
        else:
            self.feature_norm = "none"
            self.x = node_inputs(kind, store.num_nodes, np.asarray(store.indptr),
                                 np.asarray(store.indices)).numpy()
            in_dim = int(self.x.shape[1])
        rev_indptr, rev_indices, _ = store.reverse_csr()
        self.graph = MappedCSR(store.indptr, store.indices, rev_indptr, rev_indices)
        ef = store.edge_feat
        edge_dim = 0 if ef is None else int(np.prod(ef.shape[1:])) if ef.ndim > 1 else 1
        if self.predict_task is None:
            self.y, self.splits, self.task = load_labels(store, cfg.task, self.device, cfg.split_seed)
        else:  # prediction: no labels needed; the task is the trained model's
            self.y, self.splits, self.task = torch.empty(0), {s: torch.empty(0, dtype=torch.int64) for s in SPLITS}, \
                self.predict_task
        self.spec = ModelSpec(in_dim, self.task.num_outputs, edge_dim, store.num_nodes, 0)
        # The rows whose logits a pass keeps: training rows in the split's order (the in-memory run's
        # logits[train_idx]), and every scored split back to back (each split's logits are then a slice).
        self.train_rows = Gather.of(self.splits["train"].numpy())
        scored = [self.splits[s].numpy() for s in self.eval_splits]
        self.eval_rows = Gather.of(np.concatenate(scored))
        ends = np.cumsum([0] + [len(ids) for ids in scored]).tolist()
        self.eval_slices = {s: slice(a, b) for s, a, b in zip(self.eval_splits, ends[:-1], ends[1:])}
        self._engine: tuple[nn.Module, TiledGNN] | None = None
        self._disk0 = proc_io().get("read_bytes", 0)

    def _stats(self) -> GraphStats:
        """The graph's statistics for the plan (with the input's density when it is sparse rows)."""
        g = self.graph
        return GraphStats(g.num_nodes, g.num_nodes, g.num_edges, sparse_input=self.sparse_density)

    def _sparse_input_bytes(self) -> int:
        """Bytes of one read of the sparse rows (exact once written, else from the density); 0: dense input."""
        if self.sparse_density is None:
            return 0
        if isinstance(self.x, MappedSparseRows):
            return self.x.rows_nbytes(0, self.x.shape[0])
        n, width = self.spec.num_nodes, self.spec.in_dim
        return int(self.sparse_density * n * width) * MAPPED_VALUE_BYTES + 8 * n

    # ---- the model and the plan ------------------------------------------------------------------------
    def build_model(self, factory: ModelFactory, cfg: TrainConfig | None = None) -> nn.Module:
        """The model of a run of ``cfg``; the first call plans the tiles under the budget (refusing what cannot)."""
        cfg = cfg or self.cfg
        model = build_run_model(cfg, self.spec, factory)
        try:
            check_tileable(model)
        except TrellisUserError as exc:
            need = self._in_memory_estimate(model, cfg)
            why = (str(exc) if getattr(model, "plain", True) is False or cfg.edge_weight else
                   "the out-of-core engine tiles GCN, SAGE (mean) and GIN")
            raise TrellisUserError(
                f"--model {cfg.model} cannot train under --memory-budget: {why}; drop --memory-budget to train it "
                f"in memory (it needs about {format_size(need)} of free RAM)") from None
        if self.plan is None:
            self.plan_for(model, cfg)
        return model

    def open_batch(self, lanes: list[Lane], *, keep_splits: Sequence[str] | None = None,
                   splits: dict[str, Tensor] | None = None) -> ModelBatch:
        """One configuration through :meth:`train_step`, or K sharing every tile's reads (:class:`SharedTiles`).

        A sweep's configurations get tiles planned for their own widths (all K of them together).
        """
        cfgs = tuple(ln.cfg for ln in lanes)
        if cfgs != self._plan_cfgs:
            self.close()  # the previous configurations' engine and spills
            if self._x_raw is not None and self.x is not self._x_raw:
                self.x = None  # the normalized features were a spill: written again
            self.plan_for([ln.model for ln in lanes], list(cfgs))
        if (len(lanes) == 1 and keep_splits is None) or splits is not None:
            return super().open_batch(lanes, splits=splits)  # one alone, or refused naming the strategy
        return SharedTiles(self, lanes, keep_splits)

    def batch_size_for(self, models: list[nn.Module], budget_bytes: float, override: int | None,
                       ) -> tuple[int, str, list[dict[str, Any]]]:
        """The most configurations (up to ``--batch-models``, at most 8) whose joint tiles fit ``--memory-budget``.

        Out of core the epoch is the tiled aggregations, which K configurations share, so K is as large as the
        budget allows; ``budget_bytes`` (the sweep's in-memory budget) does not apply.
        """
        cap = min(len(models), override or 8)
        rows = []
        k = 1
        for kk in range(1, cap + 1):
            plan = self._plan([models[i] for i in range(kk)], dropout=False)
            fits = self.budget >= plan.min_budget
            rows.append({"k": kk, "min_budget_mb": plan.min_budget / 2**20, "fits": fits})
            if fits:
                k = kk
        if override and k < override and override <= len(models):
            raise TrellisUserError(f"--batch-models {override}: {override} configurations' tiles need at least "
                                   f"{format_size(rows[override - 1]['min_budget_mb'] * 2**20)} of "
                                   f"--memory-budget {self.cfg.memory_budget}; lower --batch-models or raise the "
                                   "budget")
        why = "--batch-models" if override else "the most configurations whose tiles fit --memory-budget (at most 8)"
        return k, f"K = {k}: {why}; every tile's graph reads and aggregations are shared", rows

    def _resident_vectors(self, k: int = 1) -> int:
        """Bytes of what stays in RAM beside the tiles: degrees, labels, split ids, gathers, scored logits.

        Evaluation holds the scored rows' logits (of each of ``k`` configurations) and the metrics'
        temporaries (labels gathered per split, predictions, probabilities: about two int64 and one
        logits-wide copy of the largest split).
        """
        n = self.store.num_nodes
        ids = sum(int(t.numel()) for t in self.splits.values())
        out_w = self.task.num_outputs
        scored = len(self.eval_rows)
        largest = max((int(t.numel()) for t in self.splits.values()), default=0)
        vectors = self.graph.nbytes_resident + self.y.numel() * self.y.element_size() + 8 * ids
        gathers = self.train_rows.nbytes + self.eval_rows.nbytes + 4 * out_w * (len(self.train_rows) + scored) * k
        metrics = largest * (16 + 4 * out_w)
        transient = 24 * (n + 1)  # cost arrays of the tile planner: freed before the first pass
        in_ram_x = self.x.nbytes if (isinstance(self.x, np.ndarray) and not isinstance(self.x, np.memmap)) else 0
        return int(vectors + max(gathers + metrics, transient) + in_ram_x)

    def _plan(self, models: Sequence[nn.Module], dropout: bool) -> OutOfCorePlan:
        """The tiles of ``models`` trained together (one model: its solo plan) under the budget."""
        g = self.graph
        stats = self._stats()
        shapes = [layer_shapes(m, stats) for m in models]
        layers = shapes[0] if len(shapes) == 1 else [joint_shape(group, i == 0) for i, group in enumerate(zip(*shapes))]
        params = sum(p.numel() for m in models for p in m.parameters())
        return plan_out_of_core(
            num_nodes=g.num_nodes, max_degree=max(g.max_degree, g.max_out_degree), layers=layers, params=params,
            budget=self.budget, baseline=self.baseline, resident_vectors=self._resident_vectors(len(models)),
            input_spilled=self.x is None, dropout=dropout, sparse_input_bytes=self._sparse_input_bytes())

    def plan_for(self, models: nn.Module | Sequence[nn.Module], cfgs: TrainConfig | Sequence[TrainConfig] | None = None,
                 ) -> None:
        """Plan the tiles of ``models`` (runs of ``cfgs``) under the budget; refuse a budget below the minimum."""
        models = [models] if isinstance(models, nn.Module) else list(models)
        cfgs = [cfgs or self.cfg] if not isinstance(cfgs, Sequence) else list(cfgs)
        cfg = cfgs[0]
        self._plan_cfgs = tuple(cfgs)
        self.plan = plan = self._plan(models, dropout=any(float(c.dropout) > 0.0 for c in cfgs))
        if self.budget < plan.min_budget:
            what = "this model" if len(models) == 1 else f"these {len(models)} configurations together"
            verb = "trains" if self.predict_task is None else "runs"
            raise TrellisUserError(f"--memory-budget {cfg.memory_budget} ({format_size(self.budget)}) is below the "
                                   f"smallest budget that {verb} {what} on this graph, "
                                   f"{format_size(plan.min_budget)} (the process itself takes "
                                   f"{format_size(self.baseline)}); raise it to at least "
                                   f"{format_size(plan.min_budget)}")
        self.bounds = self.graph.tile_bounds(plan.row_bytes, plan.edge_bytes, plan.tile_bytes,
                                             max_rows=self.max_tile_rows)
        root = self._spill_root()
        check_spill_root(root, plan.spill_bytes,
                         flag="--spill-dir" if cfg.spill_dir else "spill directory")

    def _spill_root(self) -> Path:
        cfg = self.cfg
        if cfg.spill_dir:
            return Path(cfg.spill_dir)
        return Path(cfg.out or default_run_dir(Path(str(cfg.store)).name, str(cfg.model))) / "spill"

    def _input(self) -> Input:
        """The first layer's input rows: the store's map, or a spill of the normalized features (written once).

        Sparse rows are written in two passes over the store's rows: their count per row, then their columns and
        values, each in chunks whose dense rows fit the plan's tile.
        """
        if self.x is not None:
            return self.x
        assert self.spill is not None and self._x_raw is not None and self.plan is not None
        n = self.store.num_nodes
        width = self.spec.in_dim
        if self.sparse_density is None:
            x = self.spill.array("x", (n, width))
            for r0, r1 in iter_tiles(self.bounds):
                x[r0:r1] = self._normalized(r0, r1).numpy()  # one tile at a time, as planned
            self.x = x
            return x
        step = max(1, self.plan.tile_bytes // (3 * 4 * max(1, width)))  # a dense chunk, its copy and its positions
        chunks = [(a, min(n, a + step)) for a in range(0, n, step)]
        indptr = self.spill.array("x.indptr", (n + 1,), np.int64)
        indptr[0] = 0
        for a, b in chunks:
            indptr[a + 1:b + 1] = np.count_nonzero(self._normalized(a, b).numpy(), axis=1)
        np.cumsum(indptr, out=indptr)
        nnz = int(indptr[n])
        indices = self.spill.array("x.indices", (max(1, nnz),), np.int64)
        values = self.spill.array("x.values", (max(1, nnz),), np.float32)
        for a, b in chunks:
            block = self._normalized(a, b).numpy()
            rows, cols = np.nonzero(block)  # row-major: each row's columns in order, as to_sparse_csr
            lo = int(indptr[a])
            indices[lo:lo + cols.shape[0]] = cols
            values[lo:lo + cols.shape[0]] = block[rows, cols]
            del block, rows, cols
        self.x = MappedSparseRows(indptr, indices, values, width)
        return self.x

    def _normalized(self, r0: int, r1: int) -> Tensor:
        """Rows ``[r0, r1)`` of the store's features, normalized as the in-memory run normalizes them."""
        assert self._x_raw is not None
        t = torch.from_numpy(np.array(self._x_raw[r0:r1], dtype=np.float32).reshape(r1 - r0, self.spec.in_dim))
        normalize_features(t, self.feature_norm)
        return t

    def _engine_for(self, model: nn.Module) -> TiledGNN:
        if self._engine is None or self._engine[0] is not model:
            if self.spill is None:
                self.spill = SpillDir(self._spill_root())
            self._engine = (model, TiledGNN(model, self.graph, self._input(), self.spill, self.bounds,
                                            cold=os.environ.get(COLD_ENV) == "1", stats=self._stats()))
            self._io = self._engine[1].io
        return self._engine[1]

    # ---- training -----------------------------------------------------------------------------------
    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """One full-batch step over tiles: forward, loss on the training rows, backward, optimizer step."""
        eng = self._engine_for(model)
        model.train()
        optimizer.zero_grad(set_to_none=True)
        leaf = eng.forward(True, self.train_rows).requires_grad_()  # the in-memory run's logits[train_idx]
        loss = task.loss(leaf, self.y[self.splits["train"]])
        loss.backward()
        assert leaf.grad is not None
        eng.backward(self.train_rows, leaf.grad)
        optimizer.step()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """Tiled inference of the scored rows; every split's metrics and ``val_loss``."""
        eng = self._engine_for(model)
        model.eval()
        logits = eng.forward(False, self.eval_rows)
        return split_metrics(task, lambda s: logits[self.eval_slices[s]], self.y,
                             {s: self.splits[s] for s in self.eval_splits})

    @torch.no_grad()
    def predict(self, model: nn.Module) -> Tensor:
        """Logits of every node, by tiled inference."""
        eng = self._engine_for(model)
        model.eval()
        return eng.forward(False, Gather.of(np.arange(self.store.num_nodes, dtype=np.int64)))

    def epoch_info(self) -> dict[str, Any]:
        """Spill traffic since the last epoch and what the process read from storage.

        Bytes written and read as tiles, bytes the kernels gathered as source rows from spill maps, and
        ``/proc/self/io`` ``read_bytes`` (what did not come from the page cache).
        """
        io = self._io
        if io is None:
            return {}
        disk = proc_io().get("read_bytes", 0)
        out = {"spill_written_bytes": io.written, "spill_read_bytes": io.read, "spill_gathered_bytes": io.gathered,
               "storage_read_bytes": disk - self._disk0}
        io.written = io.read = io.gathered = 0
        self._disk0 = disk
        return out

    # ---- explain, records, teardown ------------------------------------------------------------------
    def explain(self, model: nn.Module) -> str:
        """The tiles, each tensor's placement and the spill traffic per epoch."""
        assert self.plan is not None
        rows = np.diff(self.bounds)
        edges = max((self.graph.tile(a, b).num_edges for a, b in iter_tiles(self.bounds)), default=0)
        io = epoch_traffic(model, self._stats(), len(self.train_rows),
                           input_bytes=self._sparse_input_bytes() or None)
        plan = replace(self.plan, written_per_epoch=io.written, read_per_epoch=io.read)
        return plan.format(len(rows), (int(rows.min()), int(rows.max())), edges)

    def explain_batch(self, models: Sequence[nn.Module], dropout: bool) -> str:
        """The tiles and placements of ``models`` trained together (a sweep's batch), as they would be planned.

        The spill traffic is not priced: K configurations share the features' reads and a cached first
        aggregation, which the one-model rule (:func:`~trellis.nn.tiled.epoch_traffic`) does not follow; the
        measured bytes are in every configuration's ``metrics.jsonl``.
        """
        plan = self._plan(models, dropout=dropout)
        bounds = self.graph.tile_bounds(plan.row_bytes, plan.edge_bytes, plan.tile_bytes, max_rows=self.max_tile_rows)
        rows = np.diff(bounds)
        edges = max((self.graph.tile(a, b).num_edges for a, b in iter_tiles(bounds)), default=0)
        text = plan.format(len(rows), (int(rows.min()), int(rows.max())), edges, traffic=False)
        return (f"{text}\nper epoch: spill traffic measured, not priced, for {len(models)} configurations "
                "together (spill_written_bytes, spill_read_bytes in each configuration's metrics.jsonl)")

    def model_record(self, cfg: TrainConfig) -> dict[str, Any]:
        """Widths, task and inputs ``trellis predict`` rebuilds the model from."""
        return {"in_dim": self.spec.in_dim, "out_dim": self.task.num_outputs, "edge_dim": self.spec.edge_dim,
                "kwargs": cfg.model_kwargs(), "task": self.task.name, "feature_norm": self.feature_norm,
                "features": self.features, "num_nodes": self.store.num_nodes}

    def summary_info(self) -> dict[str, Any]:
        """Inputs as resolved, and the plan's tiles."""
        info: dict[str, Any] = {"feature_norm": self.feature_norm, "features": self.features}
        if self.plan is not None:
            info.update({"memory_budget_bytes": self.budget, "tiles": int(len(self.bounds) - 1),
                         "baseline_rss_anon_bytes": self.baseline})
        return info

    def state_dict(self) -> dict[str, Any]:
        """The tiles, which a resumed process keeps (exact resume).

        A process plans its tiles from the memory it measures at start; a resumed one measured a little more or less,
        which moved the tile boundaries and with them the last bits of every per-tile sum.
        """
        bounds = getattr(self, "bounds", None)
        return {} if bounds is None else {"bounds": torch.from_numpy(np.asarray(bounds, dtype=np.int64))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Train on the checkpoint's tiles (planned under the same budget, for the same graph)."""
        saved = state.get("bounds")
        if saved is None or getattr(self, "bounds", None) is None:
            return
        bounds = saved.numpy().astype(self.bounds.dtype)
        if bounds[0] != 0 or bounds[-1] != self.graph.num_nodes:
            raise TrellisUserError("--resume: the checkpoint's tiles do not cover this graph; start a new run")
        if not np.array_equal(bounds, self.bounds):
            self.bounds = bounds
            self._engine = None  # rebuilt on the checkpoint's tiles

    def close(self) -> None:
        """Remove the spill files."""
        self._engine = None
        self._io = None
        if self.spill is not None:
            self.spill.close()
            self.spill = None

    @classmethod
    def predict_saved(cls, req: PredictRequest, embeddings_to: Path | None) -> Prediction:
        """Tiled inference under the request's budget; the embeddings go to ``embeddings_to`` tile by tile."""
        saved = req.saved
        if saved.get("features", "store") not in ("store", "none", "degree"):
            raise TrellisUserError(f"--memory-budget: a model trained with --features {saved['features']} predicts "
                                   "in memory only; drop --memory-budget")
        assert req.memory_budget is not None
        cfg = TrainConfig(store=req.store, model=saved["model"], device="cpu", memory_budget=req.memory_budget,
                          spill_dir=req.spill_dir or str(req.run_dir / "spill"), feature_norm=saved["feature_norm"],
                          features=saved.get("features", "store"), progress=False)
        model = saved_model(req)
        model.load_state_dict(saved["state_dict"])
        model.eval()
        task = TASKS[saved["task"]](saved["out_dim"])
        logits, emb_dim = predict_out_of_core(cfg, model, task, embeddings_to)
        source = "penultimate" if len(getattr(model, "convs", ())) > 1 else "features"
        return Prediction(logits, None, source, emb_dim)

    def _in_memory_estimate(self, model: nn.Module, cfg: TrainConfig) -> int:
        """About the peak of the in-memory run of ``model`` (what a refusal names)."""
        heads = int(getattr(cfg, "heads", 1) or 1)
        widths = [self.spec.in_dim] + [int(cfg.hidden) * heads] * (int(cfg.layers) - 1) + [self.spec.out_dim]
        return in_memory_estimate(self.store.num_nodes, self.graph.num_edges, widths,
                                  edge_floats=6 * heads * int(cfg.layers))


class SharedTiles(ModelBatch):
    """K configurations trained out of core by one :class:`~trellis.nn.tiled_batch.BatchedTiledGNN`."""

    def __init__(self, strategy: OutOfCoreFull, lanes: list[Lane], keep_splits: Sequence[str] | None) -> None:
        st = strategy
        if st.spill is None:
            st.spill = SpillDir(st._spill_root())
        self.st = st
        self.eng = BatchedTiledGNN([ln.model for ln in lanes], [ln.generator for ln in lanes], st.graph, st._input(),
                                   st.spill, st.bounds, cold=os.environ.get(COLD_ENV) == "1", stats=st._stats())
        st._io = self.eng.io
        self.models = [ln.model for ln in lanes]
        self.splits = [s for s in st.eval_splits if keep_splits is None or s in keep_splits]

    @property
    def active(self) -> list[int]:  # type: ignore[override]
        """The engine's active configurations."""
        return self.eng.active

    def drop(self, k: int) -> None:
        """Configuration ``k`` stopped."""
        self.eng.drop(k)

    def step(self, optimizers: Sequence[Any], task: Task, epoch: int) -> list[Tensor]:
        """One shared forward over the tiles, each configuration's loss and gradient, one shared backward."""
        st = self.st
        for k in self.active:
            self.models[k].train()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        leaves = [lg.requires_grad_() for lg in self.eng.forward(True, st.train_rows)]
        y = st.y[st.splits["train"]]
        losses = [task.loss(leaf, y) for leaf in leaves]
        for loss in losses:
            loss.backward()
        self.eng.backward(st.train_rows, [cast(Tensor, leaf.grad) for leaf in leaves])
        for opt in optimizers:
            opt.step()
        return [loss.detach() for loss in losses]

    @torch.no_grad()
    def evaluate(self, task: Task) -> list[dict[str, float]]:
        """One shared tiled inference of the scored rows; every configuration's metrics."""
        st = self.st
        for k in self.active:
            self.models[k].eval()
        scored = {s: st.splits[s] for s in self.splits}

        def metrics(logits: Tensor) -> dict[str, float]:
            return split_metrics(task, lambda s: logits[st.eval_slices[s]], st.y, scored)

        return [metrics(logits) for logits in self.eng.forward(False, st.eval_rows)]


def predict_out_of_core(cfg: TrainConfig, model: nn.Module, task: Task,
                        emb_path: Path | None) -> tuple[Tensor, int]:
    """Logits of every node by tiled inference under ``cfg.memory_budget``; the embeddings go to ``emb_path``.

    The embeddings (the last layer's input: the penultimate layer's ReLU output, or the features of a
    one-layer model) are copied tile by tile from their spill into a ``.npy`` file (written to a temporary
    name and renamed), so they never sit in memory whole. Returns the logits and the embedding width (0
    when ``emb_path`` is None: no embeddings wanted).
    """
    strategy = OutOfCoreFull(cfg, torch.device("cpu"))
    strategy.predict_task = task
    try:
        strategy.load()
        if strategy.spec.in_dim != next(p for p in model.parameters() if p.dim() == 2).shape[1]:
            raise TrellisUserError(f"{cfg.store}: features have width {strategy.spec.in_dim}, not the model's; "
                                   "predict on a store with the same features")
        try:
            check_tileable(model)
        except TrellisUserError:
            raise TrellisUserError(f"--memory-budget: --model {cfg.model} cannot run out of core (GCN, SAGE and "
                                   "GIN tile); drop --memory-budget") from None
        strategy.plan_for(model)
        strategy._engine_for(model).keep_outputs = emb_path is not None  # the embeddings: the last hidden output
        logits = strategy.predict(model)
        if emb_path is None:
            return logits, 0
        assert strategy.spill is not None
        layers = len(cast(GNN, model).convs)
        src = strategy.spill.get(f"h{layers - 1}") if layers > 1 else strategy._input()
        tmp = emb_path.with_name(emb_path.name + ".tmp.npy")
        out = new_map(tmp, src.shape, np.float32, "free space or write the embeddings elsewhere")
        try:
            for r0, r1 in iter_tiles(strategy.bounds):
                out[r0:r1] = src.rows(r0, r1).to_dense().numpy() if isinstance(src, MappedSparseRows) else src[r0:r1]
            out.flush()
            del out
            os.replace(tmp, emb_path)
        finally:
            tmp.unlink(missing_ok=True)
        return logits, int(src.shape[1])
    finally:
        strategy.close()
