"""The trainer: runs, epochs, early stopping, checkpoints and the summary, over a training strategy.

Why this split: what one training step and one evaluation do depends on the strategy (the whole graph
now; sampled blocks, clusters or pre-propagated rows later), while everything around it — seeding,
runs over seeds ``seed..seed+R-1``, early stopping on the validation metric, restoring the best
weights, checkpoints, the metrics log, timing and memory — is the same for every strategy. A strategy
registers in :data:`STRATEGY_CLASSES` and the loop here drives it.

Resume is exact: a checkpoint holds the model, the optimizer, the early-stopping state (best weights,
best epoch, epochs without improvement), the byte offset of ``metrics.jsonl`` and the Python, NumPy,
torch (and CUDA) RNG states at an epoch boundary, so a killed run continued with
``trellis train --resume RUN_DIR`` draws the same dropout masks and ends with the same metrics, line for
line, as a run that was never interrupted.
"""

from __future__ import annotations

import math
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import Tensor, nn
from tqdm import tqdm

import trellis
from trellis.data.store import GraphStore
from trellis.errors import TrellisUserError
from trellis.ops.graph import CSRGraph
from trellis.train.config import TrainConfig
from trellis.train.convergence import summarize_time_to_accuracy
from trellis.train.optim import build_optimizer
from trellis.train.runs import (
    MetricsLog,
    RunPaths,
    default_run_dir,
    iter_jsonl,
    open_run_dir,
    plot_curves,
    prepare_run_dir,
    read_json,
    torch_save_atomic,
    write_json_atomic,
)
from trellis.train.tasks import Task, resolve_task

CHECKPOINT_FORMAT = "trellis-checkpoint"
MODEL_FORMAT = "trellis-model"
FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")


# ---- model construction -----------------------------------------------------------------------------
def _default_build_model(name: str, in_dim: int, out_dim: int, **kwargs: Any) -> nn.Module:
    from trellis.nn import build_model

    return build_model(name, in_dim, out_dim, **kwargs)


#: The model factory ``(name, in_dim, out_dim, **hparams) -> Module``; ``trellis.nn.build_model`` unless
#: replaced (tests substitute a small stub so the trainer is tested on its own).
build_model_fn: Callable[..., nn.Module] = _default_build_model


def make_model(name: str, in_dim: int, out_dim: int, *, edge_dim: int = 0, **kwargs: Any) -> nn.Module:
    """Build a model, turning a builder's complaint about the options into a user error naming ``--model``."""
    try:
        return build_model_fn(name, in_dim, out_dim, edge_dim=edge_dim, **kwargs)
    except (KeyError, ValueError, TypeError) as exc:
        msg = exc.args[0] if exc.args else str(exc)
        raise TrellisUserError(f"--model {name}: {msg}") from exc


def build_run_model(cfg: TrainConfig, data: GraphData) -> nn.Module:
    """A run's model as the trainer and the sweep build it: the family, ``--init``, then ``--features``' table.

    The order of random draws is fixed (the layers, their re-initialization, the embedding table), so a
    configuration built by the sweep starts from the same weights as its solo run.
    """
    from trellis.nn.init import init_parameters

    model = make_model(cfg.model, data.in_dim, data.task.num_outputs if data.task else 1, edge_dim=data.edge_dim,
                       **cfg.model_kwargs())
    init_parameters(model, cfg.init)
    if data.embedding_dim:
        from trellis.train.features import NodeEmbedding

        model = NodeEmbedding(model, data.store.num_nodes, data.embedding_dim)
    return model


def build_run_optimizer(cfg: TrainConfig, model: nn.Module) -> Any:
    """``--optimizer`` (with ``--momentum``) over the model; embedding tables get a sparse-aware one."""
    from trellis.train.features import NodeEmbedding, SplitOptimizer, sparse_optimizer

    extra = dict(cfg.optimizer_args)
    if cfg.momentum is not None:
        if cfg.optimizer == "sgd":
            extra["momentum"] = cfg.momentum
        else:  # adam / adamw: the first-moment decay
            extra["betas"] = (cfg.momentum, extra.get("betas", (0.9, 0.999))[1])
    tables = [m.table.weight for m in model.modules() if isinstance(m, NodeEmbedding)]
    table_ids = {id(p) for p in tables}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    opt = build_optimizer(cfg.optimizer, dense, lr=cfg.lr, weight_decay=cfg.weight_decay, **extra)
    if not tables:
        return opt
    return SplitOptimizer(opt, sparse_optimizer(cfg.optimizer, tables, cfg.lr))


def _plan_v2(model: nn.Module, graph: CSRGraph) -> str | None:
    """The planner v2 plan (training step and evaluation pass, with estimates) of a GCN/SAGE/GIN stack.

    Other models (GAT, GAT-E, MLP, embedding-fed models) describe themselves with their per-layer plans.
    """
    from trellis.nn.batched import family_of, model_decl
    from trellis.plan.cost import GraphStats
    from trellis.plan.planner import plan_model

    try:
        decl = model_decl(model, family_of(model))  # type: ignore[arg-type]
    except TrellisUserError:
        return None
    stats = GraphStats.of(graph)
    return (plan_model([decl], stats, training=True).format() + "\n\n"
            + plan_model([decl], stats, training=False).format())


# ---- data -------------------------------------------------------------------------------------------
@dataclass
class GraphData:
    """One graph's tensors on the training device, plus the task that reads its labels."""

    store: GraphStore
    graph: CSRGraph
    x: Tensor
    y: Tensor | None
    splits: dict[str, Tensor]
    task: Task | None
    feature_norm: str
    features: str = "store"
    embedding_dim: int = 0

    @property
    def in_dim(self) -> int:
        """Width of the model's input: the feature width, or the embedding table's for ``embedding:D``."""
        return self.embedding_dim or int(self.x.shape[1])

    @property
    def edge_dim(self) -> int:
        ef = self.graph.edge_feat
        return 0 if ef is None else int(ef.reshape(ef.shape[0], -1).shape[1])


def resolve_device(name: str) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``; refuse ``cuda`` on a machine without one."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise TrellisUserError(f"--device must be auto, cpu, cuda or cuda:N (got {name!r})")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TrellisUserError(f"--device {name}: no CUDA device is available here; use --device cpu or auto")
        dev = torch.device(name)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise TrellisUserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
        return dev
    return torch.device(name)


def normalize_features(x: Tensor, mode: str) -> tuple[Tensor, str]:
    """Apply ``--feature-norm`` (already resolved to ``row`` or ``none``) in place; returns ``(x, mode)``.

    ``row`` divides each row by its L1 norm (Kipf & Welling's preprocessing of bag-of-words features).
    ``auto`` is resolved by the caller from the store (:attr:`GraphStore.preferred_feature_norm`).
    """
    if mode == "row":
        norm = x.abs().sum(dim=1, keepdim=True).clamp_(min=torch.finfo(x.dtype).tiny)
        x.div_(norm)  # all-zero rows stay zero
    return x, mode


def load_graph_data(store_path: str | Path, *, device: torch.device, task: str = "auto",
                    feature_norm: str = "auto", need_labels: bool = True, features: str = "store") -> GraphData:
    """Open a store and move its graph, features, labels and splits to ``device``.

    Args:
        store_path: Store directory.
        device: Where the tensors live.
        task: ``--task`` (``auto`` = the store's).
        feature_norm: ``--feature-norm`` (``auto|none|row``).
        need_labels: Refuse a store without labels and train/val/test splits (training); prediction
            needs only the graph and features.
        features: ``--features`` (``store``, or computed inputs: :mod:`trellis.train.features`).
    """
    from trellis.train.features import node_inputs, parse_features

    store = GraphStore(store_path)
    where = str(store.path)
    kind, emb_dim = parse_features(features)
    if kind == "store":
        if store.x is None:
            raise TrellisUserError(f"{where}: the store has no node features (x.npy); train with --features none, "
                                   "degree or embedding:D, or re-import it with features")
        x = torch.from_numpy(np.array(store.x, dtype=np.float32, copy=True))
        if x.ndim == 1:
            x = x.unsqueeze(1)
        if feature_norm == "auto":
            feature_norm = store.preferred_feature_norm
        x, resolved_norm = normalize_features(x, feature_norm)
    else:
        x = node_inputs(kind, store.num_nodes, np.asarray(store.indptr), np.asarray(store.indices))
        resolved_norm = "none"
    graph = CSRGraph.from_store(store).to(device)
    y_t: Tensor | None = None
    splits: dict[str, Tensor] = {}
    task_obj: Task | None = None
    if need_labels:
        y = store.y
        if y is None:
            raise TrellisUserError(f"{where}: the store has no labels (y.npy); training needs labels — re-import "
                                   "it with labels")
        split_ids: dict[str, np.ndarray] = {}
        for s in SPLITS:
            ids = store.split(s)
            if ids is None or ids.size == 0:
                raise TrellisUserError(f"{where}: the store has no {s} split ({s}_idx.npy); re-import it with "
                                       "train/val/test node ids (the npz importer makes a random split)")
            split_ids[s] = np.array(ids, dtype=np.int64)  # a copy: torch warns on read-only store maps
        y_np = np.asarray(y)
        task_obj = resolve_task(task, store.task, y_np, store.num_classes)
        task_obj.check_labels(y_np, split_ids, where)
        y_t = task_obj.labels_tensor(y_np).to(device)
        splits = {s: torch.from_numpy(ids).to(device) for s, ids in split_ids.items()}
    return GraphData(store=store, graph=graph, x=x.to(device), y=y_t, splits=splits, task=task_obj,
                     feature_norm=resolved_norm, features=features, embedding_dim=emb_dim)


# ---- strategies -------------------------------------------------------------------------------------
class FullBatch:
    """Full-batch (global-batch) training: every step runs the model over the whole graph.

    The loss is taken over the training nodes; one evaluation forward pass (no dropout, no autograd)
    scores every split at once.
    """

    name = "full"

    def __init__(self, data: GraphData) -> None:
        self.data = data
        self._runner: tuple[nn.Module, Callable[..., Tensor]] | None = None

    def forward(self, model: nn.Module) -> Tensor:
        """The model's logits on the whole graph, through planner v2 where the family allows.

        A GCN/SAGE/GIN stack runs as a one-configuration :class:`~trellis.nn.batched.BatchedGNN`: the
        planner's order per layer, the first layer's ``ÂX`` computed once and reused while the features are
        not dropped out (every evaluation pass; training without input dropout), and the fused epilogues.
        A configuration of a model-batched sweep runs through the same code, so its solo run performs the
        same floating-point operations (Adam's and Adagrad's first steps turn last-bit differences of tiny
        gradients into ``±lr`` updates). Other models run as they are.
        """
        if self._runner is None or self._runner[0] is not model:
            from trellis.nn.batched import BatchedGNN, family_of

            try:
                family_of(model)
                batched = BatchedGNN([model])

                def run(g: CSRGraph, x: Tensor) -> Tensor:
                    batched.train(model.training)  # the wrapper follows the model's train/eval mode
                    return batched(g, x)[0]
            except TrellisUserError:
                run = model  # type: ignore[assignment]
            self._runner = (model, run)
        return self._runner[1](self.data.graph, self.data.x)

    def train_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, task: Task) -> Tensor:
        """One forward, backward and optimizer step; returns the loss (not synchronized)."""
        d = self.data
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
        """``<split>_<metric>`` for every split and metric, plus ``val_loss``."""
        d = self.data
        model.eval()
        logits = self.forward(model)
        out: dict[str, float] = {}
        for split, idx in d.splits.items():
            for name, value in task.metrics(logits[idx], d.y[idx]).items():
                out[f"{split}_{name}"] = value
        val = d.splits["val"]
        out["val_loss"] = float(task.loss(logits[val], d.y[val]))
        return out


#: Strategy registry: ``--strategy`` name -> class taking :class:`GraphData` (and the config, when the class
#: sets ``needs_config``). ``mini`` and ``cluster`` live in :mod:`trellis.train.minibatch`, imported on use.
STRATEGY_CLASSES: dict[str, Callable[..., Any]] = {"full": FullBatch}


def make_strategy(cfg: TrainConfig, data: GraphData) -> Any:
    """Instantiate ``cfg.strategy`` over ``data`` (loading the batch strategies' module when needed)."""
    if cfg.strategy not in STRATEGY_CLASSES:
        from trellis.train.minibatch import STRATEGIES as BATCH_STRATEGIES

        STRATEGY_CLASSES.update(BATCH_STRATEGIES)
    cls = STRATEGY_CLASSES[cfg.strategy]
    return cls(data, cfg) if getattr(cls, "needs_config", False) else cls(data)


# ---- reproducibility --------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices): model initialization and dropout follow the seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def get_rng_state() -> dict[str, Any]:
    """Every RNG the trainer touches, in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` captured."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- memory -----------------------------------------------------------------------------------------
def read_proc_status() -> dict[str, float]:
    """``VmHWM``, ``VmRSS`` and ``RssAnon`` of this process in MiB (empty off Linux)."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon"):
                    out[key] = int(rest.split()[0]) / 1024.0
    except OSError:
        pass
    return out


class MemoryMeter:
    """Peak memory of the run: total RSS high-water mark, sampled anonymous RSS and CUDA peak.

    Why RssAnon as well: the store is memory-mapped, and mapped file pages count in RSS although they
    belong to the page cache; anonymous RSS is the memory the process itself needs. The kernel keeps no
    high-water mark for it, so it is sampled after every training step and evaluation.
    """

    def __init__(self, device: torch.device, previous: dict[str, float] | None = None) -> None:
        self.device = device
        self.peak: dict[str, float] = dict(previous or {})
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.sample()

    def sample(self) -> None:
        st = read_proc_status()
        anon = st.get("RssAnon", st.get("VmRSS", 0.0))
        self.peak["peak_rss_anon_mb"] = max(self.peak.get("peak_rss_anon_mb", 0.0), anon)

    def report(self) -> dict[str, float]:
        """Peaks so far (merged with those of the process a resumed run started in)."""
        st = read_proc_status()
        hwm = st.get("VmHWM")
        if hwm is None:  # not Linux: fall back to getrusage's maximum resident set size
            import resource

            scale = 1 / 1024.0 if sys.platform != "darwin" else 1 / 2**20
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        self.peak["peak_rss_mb"] = max(self.peak.get("peak_rss_mb", 0.0), hwm)
        if self.device.type == "cuda":
            cuda = torch.cuda.max_memory_allocated(self.device) / 2**20
            self.peak["peak_cuda_mb"] = max(self.peak.get("peak_cuda_mb", 0.0), cuda)
        return dict(self.peak)


# ---- the loop ---------------------------------------------------------------------------------------
class TrainingInterrupted(Exception):  # noqa: N818 - an outcome, not an error
    """A run stopped on SIGINT/SIGTERM after writing a checkpoint; ``--resume`` continues it."""

    def __init__(self, run_dir: Path, run: int, epoch: int, signum: int) -> None:
        super().__init__(f"interrupted at run {run}, epoch {epoch}; checkpoint saved in {run_dir}")
        self.run_dir = run_dir
        self.run = run
        self.epoch = epoch
        self.signum = signum


@dataclass
class _Progress:
    """Where training stands; saved in every checkpoint."""

    run: int = 0
    epoch: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    memory: dict[str, float] = field(default_factory=dict)
    log_offset: int = 0


@dataclass
class _Best:
    epoch: int = -1
    value: float = -math.inf
    val_loss: float = math.inf
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Tensor] | None = None


EpochCallback = Callable[["Trainer", dict[str, Any]], None]


class Trainer:
    """Runs ``cfg.runs`` training runs and writes the run directory.

    Args:
        cfg: The validated configuration.
        callbacks: Called after every epoch with the trainer and the epoch's metrics record (tests use
            this to interrupt a run at a chosen epoch via :meth:`request_stop`).
        err: Stream for the progress bar and notices (default: stderr).
    """

    def __init__(self, cfg: TrainConfig, *, callbacks: Sequence[EpochCallback] = (),
                 err: IO[str] | None = None) -> None:
        self.cfg = cfg
        self.callbacks = list(callbacks)
        self.err = err if err is not None else sys.stderr
        self._stop_signal: int | None = None
        self.paths: RunPaths | None = None

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Checkpoint at the end of the current epoch and stop (what SIGINT/SIGTERM do)."""
        self._stop_signal = signum

    # ---- explain --------------------------------------------------------------------------------
    def explain(self) -> str:
        """The model's operator plan on the store's graph (``--explain``); trains nothing."""
        cfg = self.cfg
        if cfg.strategy == "pp":
            from trellis.train.pp import explain_pp

            return explain_pp(cfg)
        data = load_graph_data(cfg.store, device=resolve_device(cfg.device), task=cfg.task,
                               feature_norm=cfg.feature_norm, features=cfg.features)
        seed_everything(cfg.seed)
        model = build_run_model(cfg, data)
        if cfg.strategy == "full":
            v2 = _plan_v2(model, data.graph)
            if v2 is not None:
                return v2
        explain = getattr(model, "explain", None)
        if explain is None:
            return f"{cfg.model}: this model does not describe its plan"
        return str(explain(data.graph))

    # ---- fit ------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train every run (continuing from a checkpoint with ``cfg.resume``); returns the summary.

        Raises:
            TrainingInterrupted: SIGINT/SIGTERM (or :meth:`request_stop`) arrived; a checkpoint was written.
            TrellisUserError: Bad store, options or run directory.
        """
        cfg = self.cfg
        if cfg.strategy == "pp":
            from trellis.train.pp import train_pp_from_config

            return train_pp_from_config(cfg, log=lambda msg: print(msg, file=self.err))
        ckpt: dict[str, Any] | None = None
        if cfg.resume:
            paths = open_run_dir(cfg.resume)
            if paths.summary.is_file():
                print(f"{paths.root}: run already complete; summary unchanged", file=self.err)
                return read_json(paths.summary)
            if paths.checkpoint.is_file():
                ckpt = torch.load(paths.checkpoint, map_location="cpu", weights_only=True)
        # Everything that can refuse the input runs before a new run directory is created, so a bad
        # store or option leaves nothing behind.
        device = resolve_device(cfg.device)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        data = load_graph_data(cfg.store, device=device, task=cfg.task, feature_norm=cfg.feature_norm,
                               features=cfg.features)
        task = data.task
        metric = task.select_metric(cfg.metric)  # a metric that does not fit the store's task is refused here
        checksum = data.store.checksum
        strategy = make_strategy(cfg, data)
        make_model(cfg.model, data.in_dim, task.num_outputs, edge_dim=data.edge_dim, **cfg.model_kwargs())
        if ckpt is not None:
            if ckpt.get("format") != CHECKPOINT_FORMAT or ckpt.get("version") != FORMAT_VERSION:
                raise TrellisUserError(f"{paths.checkpoint}: not a checkpoint of this trellis version")
            if ckpt["store_checksum"] != checksum:
                raise TrellisUserError(f"--resume {paths.root}: the store {cfg.store} differs from the one the run "
                                       "started on; pass the original STORE")
            prog = _Progress(**ckpt["progress"])
        else:
            prog = _Progress()
        if not cfg.resume:
            store_name = Path(cfg.store).name
            paths = prepare_run_dir(cfg.out or default_run_dir(store_name, cfg.model), overwrite=cfg.overwrite)
            cfg.out = str(paths.root)
            write_json_atomic(paths.config, cfg.to_dict())
        self.paths = paths
        log = MetricsLog(paths.metrics, offset=prog.log_offset)
        meter = MemoryMeter(device, prog.memory)
        ctx = _RunContext(cfg, data, task, metric, strategy, paths, log, meter, prog, checksum, device)
        t_start = time.perf_counter()
        try:
            with self._signals():
                run_state = ckpt.get("run_state") if ckpt else None
                rng = ckpt.get("rng") if ckpt else None
                for r in range(prog.run, cfg.runs):
                    self._run(ctx, r, run_state if r == prog.run else None, rng)
                    run_state = rng = None
        finally:
            log.close()
        summary = self._summary(ctx, time.perf_counter() - t_start)
        plot_curves(paths.metrics, paths.curves, metric)
        write_json_atomic(paths.summary, summary)
        return summary

    @contextmanager
    def _signals(self) -> Iterator[None]:
        """Turn SIGINT/SIGTERM into "checkpoint after this epoch"; a second SIGINT aborts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: Any) -> None:
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = signum
            print(f"\n{signal.Signals(signum).name}: writing a checkpoint after this epoch "
                  "(press Ctrl-C again to abort without one)", file=self.err)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _checkpoint(self, ctx: _RunContext, run_state: dict[str, Any] | None) -> None:
        ctx.prog.log_offset = ctx.log.offset
        ctx.prog.memory = ctx.meter.report()
        torch_save_atomic({
            "format": CHECKPOINT_FORMAT, "version": FORMAT_VERSION, "store_checksum": ctx.checksum,
            "config": self.cfg.to_dict(), "progress": vars(ctx.prog), "run_state": run_state,
            "rng": get_rng_state(),
        }, ctx.paths.checkpoint)

    def _interrupt(self, ctx: _RunContext, run: int, epoch: int) -> None:
        assert self._stop_signal is not None
        raise TrainingInterrupted(ctx.paths.root, run, epoch, self._stop_signal)

    def _run(self, ctx: _RunContext, r: int, run_state: dict[str, Any] | None,
             rng: dict[str, Any] | None) -> None:
        cfg, data, task, prog = self.cfg, ctx.data, ctx.task, ctx.prog
        seed = cfg.seed + r
        if self._stop_signal is not None:  # signal arrived between runs or while loading
            self._checkpoint(ctx, None)
            self._interrupt(ctx, r, prog.epoch)
        if run_state is None:
            seed_everything(seed)
        model = build_run_model(cfg, data).to(ctx.device)
        ctx.num_parameters = sum(p.numel() for p in model.parameters())
        optimizer = build_run_optimizer(cfg, model)
        best = _Best()
        bad_epochs = 0
        run_time = 0.0
        start = 0
        if run_state is not None:
            model.load_state_dict(run_state["model"])
            optimizer.load_state_dict(run_state["optimizer"])
            b = run_state["best"]
            best = _Best(b["epoch"], b["value"], b["val_loss"], b["metrics"],
                         {k: v.to(ctx.device) for k, v in b["state"].items()} if b["state"] is not None else None)
            bad_epochs = int(run_state["bad_epochs"])
            run_time = float(run_state["run_time_s"])
            start = prog.epoch
            assert rng is not None
            set_rng_state(rng)
        sign = 1.0 if task.higher_is_better.get(ctx.metric, True) else -1.0
        cuda = ctx.device.type == "cuda"
        bar = tqdm(total=cfg.epochs, initial=start, desc=f"run {r + 1}/{cfg.runs} (seed {seed})", unit="ep",
                   file=self.err, disable=None if cfg.progress else True, dynamic_ncols=True, leave=True)
        try:
            epoch = start
            for epoch in range(start, cfg.epochs):
                t_epoch = time.perf_counter()
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                t0 = time.perf_counter()
                loss_t = ctx.strategy.train_step(model, optimizer, task)
                if cuda:
                    torch.cuda.synchronize(ctx.device)
                step = time.perf_counter() - t0
                loss = float(loss_t)
                prog.step_times.append(step)
                ctx.meter.sample()
                ev = ctx.strategy.evaluate(model, task)
                ctx.meter.sample()
                value, val_loss = sign * ev[f"val_{ctx.metric}"], ev["val_loss"]
                if value > best.value or (value == best.value and val_loss < best.val_loss):
                    best = _Best(epoch, value, val_loss, dict(ev),
                                 {k: v.detach().clone() for k, v in model.state_dict().items()})
                    bad_epochs = 0
                else:
                    bad_epochs += 1
                run_time += time.perf_counter() - t_epoch
                # time_s: cumulative wall time of this run's epochs so far (training step and evaluation);
                # setup and checkpoint writes are left out, and it continues from the checkpoint on
                # --resume, so time to a target does not depend on checkpoint frequency or on downtime.
                record = {"run": r, "seed": seed, "epoch": epoch, "loss": loss, **ev, "best_epoch": best.epoch,
                          "step_time_s": step, "time_s": run_time}
                ctx.log.write(record)
                for cb in self.callbacks:
                    cb(self, record)
                bar.set_postfix_str(f"loss {loss:.4f} val {ctx.metric} {ev[f'val_{ctx.metric}']:.4f}", refresh=False)
                bar.update(1)
                if bad_epochs >= cfg.patience or epoch + 1 == cfg.epochs:
                    break
                periodic = cfg.checkpoint_every > 0 and (epoch + 1) % cfg.checkpoint_every == 0
                if periodic or self._stop_signal is not None:
                    prog.run, prog.epoch = r, epoch + 1
                    self._checkpoint(ctx, {
                        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "best": {"epoch": best.epoch, "value": best.value, "val_loss": best.val_loss,
                                 "metrics": best.metrics, "state": best.state},
                        "bad_epochs": bad_epochs, "run_time_s": run_time,
                    })
                    if self._stop_signal is not None:
                        self._interrupt(ctx, r, epoch + 1)
        finally:
            bar.close()
        # The run ended (patience or epoch budget): keep the best-validation weights.
        if best.state is not None:
            model.load_state_dict(best.state)
        result = {"run": r, "seed": seed, "best_epoch": best.epoch, "epochs": epoch + 1, "time_s": run_time,
                  **best.metrics}
        torch_save_atomic({
            "format": MODEL_FORMAT, "version": FORMAT_VERSION, "model": cfg.model, "in_dim": data.in_dim,
            "out_dim": task.num_outputs, "edge_dim": data.edge_dim, "kwargs": cfg.model_kwargs(),
            "task": task.name, "feature_norm": data.feature_norm, "features": data.features,
            "num_nodes": data.store.num_nodes, "metric": ctx.metric, "result": result,
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        }, ctx.paths.model(r))
        prog.results.append(result)
        prog.run, prog.epoch = r + 1, 0
        self._checkpoint(ctx, None)
        if self._stop_signal is not None and r + 1 < cfg.runs:
            self._interrupt(ctx, r + 1, 0)

    def _summary(self, ctx: _RunContext, wall_s: float) -> dict[str, Any]:
        cfg, prog, task, data = self.cfg, ctx.prog, ctx.task, ctx.data
        results = prog.results
        summary: dict[str, Any] = {"status": "complete", "metric": ctx.metric}
        for name in task.metric_names:
            for split in SPLITS:
                vals = [float(res[f"{split}_{name}"]) for res in results]
                summary[f"{split}_{name}"] = vals
                summary[f"{split}_{name}_mean"] = statistics.fmean(vals)
                summary[f"{split}_{name}_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        sign = 1.0 if task.higher_is_better.get(ctx.metric, True) else -1.0
        best_run = max(range(len(results)), key=lambda i: sign * results[i][f"val_{ctx.metric}"])
        times = prog.step_times
        summary.update({
            "runs": cfg.runs,
            "seeds": [res["seed"] for res in results],
            "best_epoch": [res["best_epoch"] for res in results],
            "epochs_run": [res["epochs"] for res in results],
            "best_run": best_run,
            "epoch_time_s_median": statistics.median(times),
            "epoch_time_s_mean": statistics.fmean(times),
            "steps_timed": len(times),
            "train_time_s": sum(res["time_s"] for res in results),
            "wall_time_s_this_process": wall_s,
            **ctx.meter.report(),
            "model": cfg.model,
            "num_parameters": ctx.num_parameters or _num_parameters(ctx.paths.model(best_run)),
            "strategy": cfg.strategy,
            "task": task.name,
            "num_classes": task.num_outputs,
            "feature_norm": data.feature_norm,
            "features": data.features,
            "device": str(ctx.device),
            "threads": torch.get_num_threads(),
            "store": str(data.store.path),
            "store_name": data.store.name,
            "store_checksum": ctx.checksum,
            "num_nodes": data.store.num_nodes,
            "num_edges": data.store.num_edges,
            "num_features": data.in_dim,
            "run_dir": str(ctx.paths.root),
            "trellis_version": trellis.__version__,
            "torch_version": torch.__version__,
            "config": cfg.to_dict(),
            "per_run": results,
        })
        # Time to accuracy from the log, not from this process's memory: after --resume the epochs of
        # earlier processes exist only there (the log is truncated to the checkpoint, so it holds each
        # epoch exactly once).
        summary.update(summarize_time_to_accuracy(
            iter_jsonl(ctx.paths.metrics), ctx.metric, cfg.target_acc,
            higher_is_better=task.higher_is_better.get(ctx.metric, True)))
        return summary


def _num_parameters(model_file: Path) -> int:
    """Parameter count from a saved model (when every run finished in an earlier process)."""
    sd = torch.load(model_file, map_location="cpu", weights_only=True)["state_dict"]
    return int(sum(v.numel() for v in sd.values() if v.is_floating_point()))


@dataclass
class _RunContext:
    cfg: TrainConfig
    data: GraphData
    task: Task
    metric: str
    strategy: Any
    paths: RunPaths
    log: MetricsLog
    meter: MemoryMeter
    prog: _Progress
    checksum: str
    device: torch.device
    num_parameters: int = 0


def train(cfg: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """Train with ``cfg`` and return the summary (see :class:`Trainer`)."""
    return Trainer(cfg, **kwargs).fit()
