"""Pre-propagation training (``--strategy pp``): SGC, SIGN and HOGA over a ``trellis preprocess`` cache.

After preprocessing there is no graph left to train on, only dense rows, and the epoch time is dominated by
data loading (PP-GNN §3.3), so this strategy owns a placement-chosen loader (:mod:`trellis.loader.pp`):
rows from memory or from storage, chunk reshuffling, prefetching. Everything else — seeds, optimizers,
``--init``, the task's loss and metrics, early stopping, checkpoints and ``--resume`` — is the trainer's,
as for every strategy. Each epoch's shuffle follows ``(run seed, epoch)``, so a resumed run draws the
batches it would have drawn.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from trellis.data.store import GraphStore, open_store
from trellis.distributed.comm import RankEnv
from trellis.errors import TrellisUserError
from trellis.loader.pp import Placement, PPData, plan_placement
from trellis.loader.ppcache import PPCache, open_pp
from trellis.nn.init import init_parameters
from trellis.nn.pp_models import build_pp_model, hops_used
from trellis.nn.runtime import generator_scope
from trellis.train.build import ModelFactory, ModelSpec
from trellis.train.config import TrainConfig
from trellis.train.data import resolve_device
from trellis.train.loop import Lane, ModelBatch
from trellis.train.strategy import Prediction, PredictRequest, Strategy, register_strategy
from trellis.train.tasks import Task, resolve_task
from trellis.utils.memory import proc_io, proc_status

#: Tasks a pre-propagated cache can train (its labels: one value per row, or a multilabel row of 0/1).
PP_TASKS = ("multiclass", "binary", "multilabel")


def open_checked_cache(pp_dir: str, store: GraphStore) -> PPCache:
    """The cache at ``pp_dir``, checked to be built from ``store`` (by content checksum)."""
    cache = open_pp(pp_dir)
    cache.check_store(store)
    return cache


@torch.no_grad()
def predict_pp(record: dict[str, Any], store: GraphStore, device: torch.device,
               batch_bytes: int = 64 * 2**20) -> Tensor:
    """Logits ``[N, C]`` of every node of ``store`` from a saved pre-propagation model and its cache.

    Raises:
        TrellisUserError: The cache is gone, was built from another store, or keeps only split rows.
    """
    cache = open_checked_cache(record["pp_dir"], store)
    trained_on = record.get("pp_settings")  # model files before it was recorded: not checked
    if trained_on is not None and dict(cache.manifest["settings"]) != trained_on:
        now = dict(cache.manifest["settings"])
        changed = sorted(k for k in set(now) | set(trained_on) if now.get(k) != trained_on.get(k))
        raise TrellisUserError(
            f"{cache.path}: the cache was rebuilt since the model trained on it ("
            + ", ".join(f"{k} {trained_on.get(k)!r} then, {now.get(k)!r} now" for k in changed)
            + "); rebuild it with the run's settings (`trellis preprocess STORE --out PP_DIR --overwrite` with "
            "them), or predict with a run trained on this cache")
    if cache.split_rows_only:
        raise TrellisUserError(
            f"{cache.path}: built with --split-rows-only, so it holds only train/val/test rows; predicting every "
            "node needs all rows: `trellis preprocess STORE --all-rows --out PP_DIR --overwrite`")
    model = build_pp_model(record["model"], record["num_features"], record["hops"], record["out_dim"],
                           **record["kwargs"])
    model.load_state_dict(record["state_dict"])
    model.to(device).eval()
    arrays = [cache.hop(r) for r in hops_used(record["model"], cache.hops)]
    rows = cache.rows
    # rows per batch by bytes: 65,536 rows of every hop of Coauthor CS (6,805 features) were 5 GB at once
    batch_rows = max(1, batch_bytes // (4 * len(arrays) * max(1, cache.num_features)))
    out = torch.empty((store.num_nodes, record["out_dim"]), dtype=torch.float32, device=device)
    for a in range(0, cache.num_rows, batch_rows):
        b = min(a + batch_rows, cache.num_rows)
        x = torch.from_numpy(np.stack([arr[a:b] for arr in arrays], axis=1)).to(device)
        out[torch.from_numpy(np.array(rows[a:b], dtype=np.int64)).to(device)] = model(x).float()
    return out


@register_strategy("pp")
class PrePropagation(Strategy):
    """Dense models over pre-propagated rows; evaluation scores the validation and test rows each epoch."""

    eval_splits = ("val", "test")

    def load(self) -> None:
        """Open the store and its cache, choose the placement, and build the loaders."""
        cfg = self.cfg
        if cfg.task not in ("auto", *PP_TASKS):
            raise TrellisUserError(f"--task {cfg.task}: --strategy pp trains {', '.join(PP_TASKS)} node "
                                   "classification")
        self.store = open_store(str(cfg.store))
        self.cache = cache = open_checked_cache(str(cfg.pp_dir), self.store)
        if cache.y is None:
            raise TrellisUserError(f"{self.store.path}: the store has no labels; --strategy pp needs them")
        y = np.asarray(cache.y)
        self.task = resolve_task(cfg.task, cache.task, y, cache.num_classes or int(np.max(y)) + 1)
        if self.task.name not in PP_TASKS:
            raise TrellisUserError(f"{self.store.path}: the pp strategy trains {', '.join(PP_TASKS)} node "
                                   f"classification; this store's task is {self.task.name!r}")
        self.spec = ModelSpec(cache.num_features, self.task.num_outputs)
        self.hops = hops_used(cfg.model, cache.hops)
        # --memory-budget caps the process's peak RssAnon (as for every strategy): the rows get what it leaves
        self.baseline = int(proc_status().get("RssAnon", 0)) if cfg.memory_budget is not None else 0
        self.placement = plan_placement(cache, self.hops, cfg.batch_size, loader=cfg.pp_loader,
                                        chunk_size=cfg.chunk_size, memory_budget=cfg.memory_budget,
                                        device=self.device, baseline=self.baseline)
        self._io0 = proc_io()
        t0 = time.perf_counter()
        self.data = self._make_data(cache, self.placement, cfg.seed)
        self.load_time_s = time.perf_counter() - t0

    #: The data-parallel variant: :class:`~trellis.train.strategies.dist_pp.DistributedPP`, which sets this
    #: when imported (it builds on this class; the strategies package imports it).
    ranked: ClassVar[type[Strategy] | None] = None

    @classmethod
    def for_config(cls, cfg: TrainConfig) -> type[Strategy]:
        """This class in one process, the data-parallel variant across ranks.

        Ranks: ``--nproc`` > 1, or a process started as a rank (``torchrun``).
        """
        ranked = RankEnv.from_environ() is not None or (cfg.nproc or 1) > 1
        return PrePropagation.ranked if ranked and PrePropagation.ranked is not None else cls

    def _make_data(self, cache: PPCache, placement: Placement, seed: int) -> PPData:
        """The loaders this process trains and evaluates with."""
        return PPData(cache, self.hops, placement, int(self.cfg.batch_size), seed=seed)

    def banner(self) -> str:
        """The placement decision, printed when the run starts."""
        return self.placement.describe()

    @staticmethod
    def _model_kwargs(cfg: TrainConfig) -> dict[str, Any]:
        return {"hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads, "dropout": cfg.dropout,
                **cfg.model_args}

    def build_model(self, factory: ModelFactory, cfg: TrainConfig | None = None) -> nn.Module:
        """SGC/SIGN/HOGA for the cache's widths (the factory builds message-passing models only)."""
        cfg = cfg or self.cfg
        model = build_pp_model(cfg.model, self.cache.num_features, self.cache.hops, self.task.num_outputs,
                               **self._model_kwargs(cfg))
        return init_parameters(model, cfg.init)

    # ---- several configurations: each batch's rows read once for all of them ------------------------
    batches_models = True

    def open_batch(self, lanes: list[Lane], *, keep_splits: Sequence[str] | None = None,
                   splits: dict[str, Tensor] | None = None) -> ModelBatch:
        """K configurations over one read of each batch's rows (:class:`SharedRows`); one runs as ``train``."""
        if (len(lanes) == 1 and keep_splits is None) or splits is not None:
            return super().open_batch(lanes, splits=splits)  # one alone, or refused naming the strategy
        if len({ln.cfg.seed for ln in lanes}) > 1:
            raise TrellisUserError("--strategy pp shares batches between configurations of one seed (the shuffle "
                                   "follows it); batch configurations of different seeds separately")
        return SharedRows(self, lanes, keep_splits)

    def batch_size_for(self, models: list[nn.Module], budget_bytes: float, override: int | None,
                       ) -> tuple[int, str, list[dict[str, Any]]]:
        """Every configuration of a group in one batch, up to ``--batch-models``.

        The models are small beside the rows, and the rows are the cost each batch shares.
        """
        k = min(len(models), override or len(models))
        why = "--batch-models" if override else "every configuration: each batch's rows are read once for all"
        return k, f"K = {k}: {why}", []

    def model_record(self, cfg: TrainConfig) -> dict[str, Any]:
        """What rebuilds the model for ``trellis predict``: widths, hops and the cache."""
        return {"strategy": "pp", "num_features": self.cache.num_features, "hops": self.cache.hops,
                "out_dim": self.task.num_outputs, "kwargs": self._model_kwargs(cfg), "task": self.task.name,
                "pp_dir": str(Path(self.cache.path).resolve()), "feature_norm": self.cache.feature_norm,
                "features": "store", "num_nodes": self.store.num_nodes,
                "pp_settings": dict(self.cache.manifest["settings"])}  # predict refuses a cache rebuilt since

    def begin_run(self, seed: int) -> None:
        """Shuffles of this run follow its seed."""
        self.data.train.seed = seed

    def train_step(self, model: nn.Module, optimizer: Any, task: Task, epoch: int) -> Tensor:
        """One epoch over the training rows; returns the mean of the batches' losses."""
        loader = self.data.train
        loader.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros(())
        n_batches = 0
        for x, y in loader:
            assert y is not None  # training rows are labelled
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = task.loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach().cpu()
            n_batches += 1
        return torch.tensor(float(loss_sum) / max(1, n_batches), dtype=torch.float64)

    def _rows_logits(self, models: Sequence[nn.Module], split: str) -> tuple[list[Tensor], Tensor]:
        """Every model's logits of this process's labelled rows of the split, and their labels (maybe none).

        Each batch of rows is read once for all the models.
        """
        logits: list[list[Tensor]] = [[] for _ in models]
        labels = []
        for x, y in self.data.iter_split(split):
            assert y is not None
            keep = (y >= 0) if y.ndim == 1 else (y >= 0).all(dim=1)  # a multilabel row of -1: unlabelled
            keep = keep.to(self.device)
            x = x.to(self.device, non_blocking=True)
            for out, model in zip(logits, models):
                out.append(model(x)[keep].float())
            labels.append(y.to(self.device)[keep])
        width = self.task.num_outputs
        if labels:
            y_rows = torch.cat(labels)
        else:  # no rows here (a rank's empty slice): none, of the labels' row shape and type
            assert self.cache.y is not None
            y_rows = torch.from_numpy(np.array(self.cache.y[:0])).to(self.device)
        return [torch.cat(out) if out else torch.empty((0, width), device=self.device) for out in logits], y_rows

    def _split_logits(self, models: Sequence[nn.Module], split: str) -> tuple[list[Tensor], Tensor]:
        """Every model's logits of the split's labelled rows, and their labels."""
        logits, y = self._rows_logits(models, split)
        if y.shape[0] == 0:
            raise TrellisUserError(f"{self.cache.path}: the {split} split has no rows; --strategy pp needs them")
        return logits, y

    @torch.inference_mode()
    def evaluate_many(self, models: Sequence[nn.Module], task: Task,
                      splits: Sequence[str] | None = None) -> list[dict[str, float]]:
        """Each model's metrics (and ``val_loss``) over the cache's rows of ``splits`` (default: val and test)."""
        outs: list[dict[str, float]] = [{} for _ in models]
        for model in models:
            model.eval()
        for split in splits or self.eval_splits:
            logits, y = self._split_logits(models, split)
            for out, lg in zip(outs, logits):
                for name, value in task.metrics(lg, y).items():
                    out[f"{split}_{name}"] = value
                if split == "val":
                    out["val_loss"] = float(task.loss(lg, y))
        return outs

    def evaluate(self, model: nn.Module, task: Task) -> dict[str, float]:
        """Validation and test metrics (and ``val_loss``) over the cache's split rows."""
        return self.evaluate_many([model], task)[0]

    def predict(self, model: nn.Module) -> Tensor:
        """Logits of every node from the cache (refused for a ``--split-rows-only`` cache)."""
        return predict_pp({**self.model_record(self.cfg), "model": self.cfg.model, "state_dict": model.state_dict()},
                          self.store, self.device)

    @classmethod
    def predict_saved(cls, req: PredictRequest, embeddings_to: Path | None) -> Prediction:
        """Logits of every node from the run's cache (the model's input is pre-propagated rows, not a graph)."""
        saved = req.saved
        record = {**saved, "out_dim": saved.get("out_dim", saved.get("num_classes"))}  # older pp model files
        logits = predict_pp(record, open_store(req.store), resolve_device(req.device))
        return Prediction(logits, logits, "logits")

    def explain(self, model: nn.Module) -> str:
        """The model, its parameter count and the placement decision."""
        cache = self.cache
        params = sum(p.numel() for p in model.parameters())
        return (f"{self.cfg.model} over hops {list(self.hops)} of {cache.path} ({cache.num_features} features per "
                f"hop, {self.task.num_outputs} outputs): {params:,} parameters; no graph work at training time "
                f"(preprocessing took {cache.manifest.get('build', {}).get('seconds', float('nan')):.2f} s)\n"
                + self.placement.describe())

    def state_dict(self) -> dict[str, Any]:
        """The loader the run trains with: a resume keeps it (see :meth:`load_state_dict`)."""
        return {"loader": self.placement.loader, "chunk_size": self.placement.chunk_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Train on with the interrupted process's loader and chunk size.

        Why: without ``--memory-budget`` the placement is planned in 80% of the memory free now, so a resume on
        a fuller machine chose storage and chunk reshuffling where the run had memory and exact reshuffling,
        and its epochs were not the uninterrupted run's. A loader that no longer fits is refused by name.
        """
        loader, c = state.get("loader"), int(state.get("chunk_size") or 1)
        if loader is None or (loader, c) == (self.placement.loader, self.placement.chunk_size):
            return
        cfg = self.cfg
        try:
            placement = plan_placement(self.cache, self.hops, cfg.batch_size, loader=str(loader), chunk_size=c,
                                       memory_budget=cfg.memory_budget, device=self.device, baseline=self.baseline)
        except TrellisUserError as exc:
            raise TrellisUserError(f"--resume: the run trained with --pp-loader {loader} (chunk size {c}), which "
                                   f"does not fit now ({exc}); free memory and resume again, or start a new run"
                                   ) from None
        seed = self.data.train.seed
        self.data.close()
        self.placement = placement
        self.data = self._make_data(self.cache, placement, cfg.seed)
        self.data.train.seed = seed

    def derived_inputs(self) -> dict[str, Any]:
        """The cache's settings: a PP_DIR rebuilt with another operator or hop count is not the run's input."""
        return {"pp_settings": dict(self.cache.manifest["settings"])}

    def summary_info(self) -> dict[str, Any]:
        """The cache, the placement and loader, load time and bytes read from storage."""
        io1 = proc_io()
        return {"pp_dir": str(self.cache.path), "operator": self.cache.manifest["settings"],
                "hops_used": list(self.hops), "placement": self.placement.to_dict(),
                "loader": self.data.train.describe(), "load_time_s": self.load_time_s,
                "preprocess_seconds": self.cache.manifest.get("build", {}).get("seconds"),
                "read_bytes": io1.get("read_bytes", 0) - self._io0.get("read_bytes", 0),
                "feature_norm": self.cache.feature_norm, "features": "store"}

    def close(self) -> None:
        """Close the storage source's files."""
        self.data.close()


class SharedRows(ModelBatch):
    """K configurations trained over one read of each training batch's rows.

    Each configuration's forward, backward and optimizer step run on the batch in turn, its dropout drawn from
    its own generator, so each does what its solo run does; the batches (their order follows the seed every
    configuration shares) are loaded once, which is where a pre-propagation epoch spends its time (PP-GNN §3.3).
    """

    def __init__(self, strategy: PrePropagation, lanes: list[Lane], keep_splits: Sequence[str] | None) -> None:
        self.strategy = strategy
        self.models = [ln.model for ln in lanes]
        self.generators = [ln.generator for ln in lanes]
        self.splits = [s for s in strategy.eval_splits if keep_splits is None or s in keep_splits]
        self.active = list(range(len(lanes)))
        strategy.begin_run(lanes[0].cfg.seed)

    def step(self, optimizers: Sequence[Any], task: Task, epoch: int) -> list[Tensor]:
        """One epoch over the training rows; each configuration's mean batch loss."""
        st = self.strategy
        loader = st.data.train
        loader.set_epoch(epoch)
        run = [(self.models[k], self.generators[k], opt) for k, opt in zip(self.active, optimizers)]
        for model, _, _ in run:
            model.train()
        sums = [torch.zeros(()) for _ in run]
        n_batches = 0
        for x, y in loader:
            assert y is not None
            x = x.to(st.device, non_blocking=True)
            y = y.to(st.device, non_blocking=True)
            for k, (model, gen, opt) in enumerate(run):
                with generator_scope(gen):
                    opt.zero_grad(set_to_none=True)
                    loss = task.loss(model(x), y)
                    loss.backward()
                    opt.step()
                sums[k] += loss.detach().cpu()
            n_batches += 1
        return [torch.tensor(float(s) / max(1, n_batches), dtype=torch.float64) for s in sums]

    def evaluate(self, task: Task) -> list[dict[str, float]]:
        """Every active configuration's metrics over one read of the scored rows."""
        return self.strategy.evaluate_many([self.models[k] for k in self.active], task, self.splits)
