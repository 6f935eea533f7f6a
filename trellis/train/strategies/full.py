"""Full-batch (global-batch) training: every step runs the model over the whole graph in memory."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.nn.batched import BatchedGNN, family_of, model_decl
from trellis.nn.models import SPARSE_ROW_MODELS
from trellis.nn.runtime import generator_scope
from trellis.ops.graph import CSRGraph
from trellis.ops.sparse_rows import is_sparse
from trellis.plan.batching import choose_k
from trellis.plan.cost import GraphStats
from trellis.plan.outofcore import in_memory_estimate
from trellis.plan.planner import plan_model
from trellis.plan.rewrites import DEFAULT_REWRITES
from trellis.train.build import ModelSpec
from trellis.train.config import TrainConfig
from trellis.train.data import GraphData, load_graph_data, resolve_device
from trellis.train.features import NodeEmbedding
from trellis.train.loop import Lane, ModelBatch
from trellis.train.strategies.outofcore import OutOfCoreFull
from trellis.train.strategies.partitioned import PartitionedFull
from trellis.train.strategies.partitioned_outofcore import PartitionedOutOfCore
from trellis.train.strategy import Prediction, PredictRequest, Strategy, register_strategy, saved_model
from trellis.train.tasks import Task, evaluate_logits
from trellis.utils.sizes import format_size


class GraphStrategy(Strategy):
    """Shared by the strategies that train message-passing models on the store's graph (full, mini, cluster).

    :meth:`load` reads the graph, the node inputs (``--features``, ``--feature-norm``), labels and splits
    into a :class:`~trellis.train.data.GraphData` on the device.
    """

    data: GraphData
    #: Keep mostly-zero features sparse (:mod:`trellis.ops.sparse_rows`): only whole-graph first layers read them.
    sparse_rows = False

    def load(self) -> None:
        """Load the store's graph, inputs, labels and splits onto the device."""
        cfg = self.cfg
        self.data = d = load_graph_data(str(cfg.store), device=self.device, task=cfg.task,
                                        feature_norm=cfg.feature_norm, features=cfg.features,
                                        split_seed=cfg.split_seed, sparse_rows=self.sparse_rows)
        assert d.task is not None
        self.store, self.task, self.feature_norm = d.store, d.task, d.feature_norm
        self.spec = ModelSpec(d.in_dim, d.task.num_outputs, d.edge_dim, d.store.num_nodes, d.embedding_dim)

    def explain_graph(self) -> CSRGraph:
        """The whole graph."""
        assert self.data.graph is not None
        return self.data.graph

    def plan_stats(self) -> GraphStats:
        """The planner's statistics of the whole graph, with the share of a sparse input's stored values."""
        stats = GraphStats.of(self.explain_graph())
        x = self.data.x
        if isinstance(x, torch.Tensor) and is_sparse(x):
            stats = replace(stats, sparse_input=x.values().numel() / max(1, x.shape[0] * x.shape[1]))
        return stats

    def model_record(self, cfg: TrainConfig) -> dict[str, Any]:
        """Widths, task and inputs ``trellis predict`` rebuilds the model from."""
        d = self.data
        return {"in_dim": d.in_dim, "out_dim": self.task.num_outputs, "edge_dim": d.edge_dim,
                "kwargs": cfg.model_kwargs(), "task": self.task.name, "feature_norm": d.feature_norm,
                "features": d.features, "num_nodes": d.store.num_nodes}

    def summary_info(self) -> dict[str, Any]:
        """Inputs as resolved."""
        return {"feature_norm": self.data.feature_norm, "features": self.data.features}

    @classmethod
    @torch.no_grad()
    def predict_saved(cls, req: PredictRequest, embeddings_to: Path | None) -> Prediction:
        """The whole graph in memory: logits, and the penultimate layer's output when the model returns it.

        Bag-of-words rows stay sparse for the message-passing models, as full-batch training keeps them.
        """
        saved = req.saved
        features = saved.get("features", "store")
        data = load_graph_data(req.store, device=resolve_device(req.device), feature_norm=saved["feature_norm"],
                               need_labels=False, features=features,
                               sparse_rows=req.run_cfg.get("model") in SPARSE_ROW_MODELS)
        if data.embedding_dim and data.store.num_nodes != saved["num_nodes"]:
            raise TrellisUserError(f"{req.store}: has {data.store.num_nodes} nodes but the run learned an embedding "
                                   f"table of {saved['num_nodes']} (--features {features}); predict on the training "
                                   "graph")
        if data.in_dim != saved["in_dim"]:
            raise TrellisUserError(f"{req.store}: features have width {data.in_dim} but the model was trained on "
                                   f"width {saved['in_dim']}; predict on a store with the same features")
        model = saved_model(req)
        if data.embedding_dim:
            emb_model = NodeEmbedding(model, data.store.num_nodes, data.embedding_dim)
            emb_model.load_state_dict(saved["state_dict"])
            model = emb_model
        else:
            model.load_state_dict(saved["state_dict"])
        model.to(data.x.device).eval()
        logits: Tensor = model(data.graph, data.x)
        # A NodeEmbedding passes return_embedding on to its model.
        if embeddings_to is None or not _accepts_return_embedding(getattr(model, "model", model)):
            return Prediction(logits, logits, "logits")
        res = model(data.graph, data.x, return_embedding=True)
        return Prediction(logits, res[1] if isinstance(res, tuple) else res, "penultimate")


def _accepts_return_embedding(model: nn.Module) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "return_embedding" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def fit_warning(cfg: TrainConfig) -> str:
    """A message when the in-memory run is estimated not to fit in the memory available now (else empty)."""
    import psutil

    try:
        store = GraphStore(str(cfg.store), verify=False)
    except TrellisUserError:
        return ""  # load() reports the store's problem
    classes = int(store.num_classes or 2)
    widths = [max(1, store.num_features)] + [int(cfg.hidden)] * (int(cfg.layers) - 1) + [classes]
    need = in_memory_estimate(store.num_nodes, store.num_edges, widths)
    avail = int(psutil.virtual_memory().available)
    if need <= avail:
        return ""
    return (f"warning: full-batch in memory needs about {format_size(need)} here but {format_size(avail)} is "
            f"available; train out of core with --memory-budget {format_size(int(0.8 * avail))} (80% of it)")




@register_strategy("full")
class FullBatch(GraphStrategy):
    """Full-batch training: the loss over the training nodes of one forward pass over the whole graph.

    A GCN/SAGE/GIN stack runs as a one-configuration :class:`~trellis.nn.batched.BatchedGNN`: the planner's
    order per layer, the first layer's ``ÂX`` computed once and reused while the features are not dropped
    out, and the fused epilogues. A configuration of a model-batched sweep runs through the same code, so
    its solo run performs the same floating-point operations (Adam's and Adagrad's first steps turn
    last-bit differences of tiny gradients into ``±lr`` updates). Other models run as they are.
    """

    batches_models = True
    #: Planner rewrites of model-batched steps (benchmarks turn them off to measure batching alone).
    rewrites: tuple[str, ...] = DEFAULT_REWRITES
    _stats: GraphStats | None = None  # of the graph, for epoch_weight
    _runner: tuple[nn.Module, Callable[..., Tensor]] | None = None

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> type[Strategy]:
        """:class:`~trellis.train.strategies.outofcore.OutOfCoreFull` under ``--memory-budget``, else this class."""
        if cfg.parts_dir is not None:
            return PartitionedFull if cfg.memory_budget is None else PartitionedOutOfCore
        if cfg.memory_budget is not None:
            return OutOfCoreFull
        if cfg.spill_dir is not None:
            raise TrellisUserError("--spill-dir applies to --strategy full with --memory-budget only; add "
                                   "--memory-budget SIZE or drop --spill-dir")
        return cls

    def load(self) -> None:
        """Say when the in-memory run will not fit (and which budget would), then load as every graph strategy.

        Bag-of-words features stay sparse for the message-passing models (the MLP slices its rows).
        """
        warning = fit_warning(self.cfg)
        if warning:
            print(warning, file=sys.stderr)
        self.sparse_rows = self.cfg.model in SPARSE_ROW_MODELS
        super().load()

    def forward(self, model: nn.Module) -> Tensor:
        """The model's logits on the whole graph (through planner v2 where the family allows)."""
        if self._runner is None or self._runner[0] is not model:
            run: Callable[..., Tensor]
            try:
                family_of(model)
            except TrellisUserError:
                run = model
            else:
                batched = BatchedGNN([model])

                def run(g: CSRGraph, x: Tensor) -> Tensor:
                    batched.train(model.training)  # the wrapper follows the model's train/eval mode
                    return batched(g, x)[0]
            self._runner = (model, run)
        return self._runner[1](self.data.graph, self.data.x)

    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """One forward, backward and optimizer step."""
        d = self.data
        assert d.y is not None
        model.train()
        optimizer.zero_grad(set_to_none=True)
        logits = self.forward(model)
        idx = d.splits["train"]
        loss = task.loss(logits[idx], d.y[idx])
        loss.backward()
        optimizer.step()
        return loss.detach()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """One forward pass without dropout scores every split."""
        assert self.data.y is not None
        model.eval()
        return evaluate_logits(task, self.forward(model), self.data.y, self.data.splits)

    @torch.no_grad()
    def predict(self, model: nn.Module) -> Tensor:
        """Logits of every node."""
        model.eval()
        return self.forward(model)

    def open_batch(self, lanes: list[Lane], *, keep_splits: Sequence[str] | None = None,
                   splits: dict[str, Tensor] | None = None) -> ModelBatch:
        """A solo run's own step, or K configurations in one model-batched pass (:class:`BatchedStep`)."""
        if len(lanes) == 1 and keep_splits is None and splits is None:
            return super().open_batch(lanes)
        scored = self.data.splits if splits is None else splits
        if keep_splits is not None:
            scored = {k: v for k, v in scored.items() if k in keep_splits}
        return BatchedStep(self, lanes, scored, train_idx=(splits or self.data.splits)["train"])

    def batch_size_for(self, models: list[nn.Module], budget_bytes: float, override: int | None,
                       ) -> tuple[int, str, list[dict[str, Any]]]:
        """K from the cost model and the memory budget (:func:`trellis.plan.batching.choose_k`)."""
        try:
            family = family_of(models[0])
            decls = [model_decl(m, family) for m in models]
        except TrellisUserError as exc:
            if override not in (None, 1):
                raise TrellisUserError(f"--batch-models {override}: {exc}") from None
            return 1, f"K = 1: {exc}", []
        choice = choose_k(decls, self.plan_stats(), budget_bytes=budget_bytes, override=override,
                          rewrites=self.rewrites)
        rows = [{"k": r.k, "batches": r.batches, "est_epoch_s": r.epoch_seconds, "est_peak_mb": r.peak_bytes / 2**20,
                 "fits": r.fits} for r in choice.estimates]
        return choice.k, choice.format(), rows

    def epoch_weight(self, model: nn.Module) -> float:
        """The cost model's seconds of ``model``'s training step and evaluation pass (1.0 for other families).

        Relative, not absolute: on CPU its ratios between widths and depths were within 1.2x of the measured
        solo epochs on minesweeper and within 1.7x on Cora, where an equal split is off by up to 5x.
        """
        try:
            decl = model_decl(model, family_of(model))
        except TrellisUserError:
            return 1.0
        if self._stats is None:
            self._stats = self.plan_stats()
        return sum(plan_model([decl], self._stats, training=t, rewrites=self.rewrites).seconds() for t in (True, False))

    def explain(self, model: nn.Module) -> str:
        """Planner v2's plan (training step and evaluation pass) for GCN/SAGE/GIN; the model's own otherwise."""
        try:
            decl = model_decl(model, family_of(model))
        except TrellisUserError:
            return super().explain(model)
        stats = self.plan_stats()
        return (plan_model([decl], stats, training=True).format() + "\n\n"
                + plan_model([decl], stats, training=False).format())


class _One(nn.Module):
    """One configuration of a family that cannot batch, behind the batched model's interface.

    Its dropout draws from its own generator, in the trainer's ops, so it equals its solo run.
    """

    def __init__(self, model: nn.Module, generator: torch.Generator | None) -> None:
        super().__init__()
        self.m = model
        self.generator = generator
        self.active = [0]

    def forward(self, graph: Any, x: Tensor) -> list[Tensor]:
        """The configuration's logits (a one-element list), or none once it stopped."""
        with generator_scope(self.generator if self.training else None):
            return [self.m(graph, x)] if self.active else []

    def drop(self, k: int) -> None:
        """The configuration stopped."""
        self.active.clear()


class BatchedStep(ModelBatch):
    """K configurations trained by one :class:`~trellis.nn.batched.BatchedGNN` pass per step.

    The batched loss is the sum of the configurations' losses, so each one's gradient is its own loss's; each
    steps its own optimizer. One configuration of a family that cannot batch runs alone.
    """

    def __init__(self, strategy: FullBatch, lanes: list[Lane], splits: dict[str, Tensor], train_idx: Tensor) -> None:
        models, gens = [ln.model for ln in lanes], [ln.generator for ln in lanes]
        self.bm: nn.Module
        try:
            family_of(models[0])
        except TrellisUserError:
            if len(models) > 1:
                raise
            self.bm = _One(models[0], gens[0])
        else:
            self.bm = BatchedGNN(models, gens, rewrites=strategy.rewrites)
        self.data, self.splits, self.train_idx = strategy.data, splits, train_idx

    @property
    def active(self) -> list[int]:  # type: ignore[override]
        """The batched model's active configurations."""
        return cast(list[int], self.bm.active)

    def drop(self, k: int) -> None:
        """Configuration ``k`` stopped."""
        self.bm.drop(k)  # type: ignore[operator]

    def step(self, optimizers: Sequence[Any], task: Task, epoch: int) -> list[Tensor]:
        """One batched forward, the sum of the losses backward, every optimizer steps."""
        d, idx = self.data, self.train_idx
        assert d.y is not None
        self.bm.train()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        logits = self.bm(d.graph, d.x)
        losses = [task.loss(lg[idx], d.y[idx]) for lg in logits]
        torch.stack(losses).sum().backward()  # d(sum)/d(loss_k) = 1: each configuration gets its own gradient
        for opt in optimizers:
            opt.step()
        return [v.detach() for v in losses]

    @torch.no_grad()
    def evaluate(self, task: Task) -> list[dict[str, float]]:
        """One batched pass without dropout scores every configuration on the kept splits."""
        d = self.data
        assert d.y is not None
        self.bm.eval()
        return [evaluate_logits(task, lg, d.y, self.splits) for lg in self.bm(d.graph, d.x)]
