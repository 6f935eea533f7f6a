"""Hyperparameter sweeps with model batching: many configurations trained K at a time in one model.

``trellis sweep STORE --model gcn --grid lr=0.01,0.005 hidden=64,128,256 dropout=0.3,0.5`` expands the grid
into configurations, each a complete :class:`~trellis.train.config.TrainConfig` — exactly what
``trellis train`` would run — and trains them in model-batched groups (:mod:`trellis.nn.batched`): one
wide SpMM per layer reads the graph once for the K configurations of a batch, while each configuration
keeps its own parameters, optimizer (its own class, learning rate and weight decay), dropout stream, early
stopping and metrics. K comes from the planner's cost model and the memory budget
(:func:`trellis.plan.batching.choose_k`) unless ``--batch-models`` fixes it.

Why results equal solo runs: each configuration's model is built as the trainer builds it (same seed, same
initialization), its dropout masks come from a generator in the state the solo run's default generator
would be in (:func:`trellis.nn.batched.capture_generator`), the batched loss is the sum of the per-config
losses (so every configuration's gradient is its own loss's gradient), and a configuration that stops
early is dropped from the batch without touching the others. ``tests/train/test_sweep.py`` checks the
per-epoch losses against the real trainer.

Output (``--out SWEEP_DIR``, written to a temporary sibling and renamed into place when complete)::

    SWEEP_DIR/
      leaderboard.csv    one row per configuration, best validation metric first
      leaderboard.json   the rows plus the grid, the batches, K and how it was chosen, timings
      leaderboard.png    validation curves of every configuration and val/test bars
      sweep.json         the sweep's own settings
      configs/<id>/      a run directory per configuration: config.json (``trellis train --config`` repeats
                         it solo), metrics.jsonl, summary.json, models/run-0.pt (best-validation weights)
"""

from __future__ import annotations

import csv
import difflib
import io
import itertools
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from trellis.errors import TrellisUserError
from trellis.nn.init import INITS
from trellis.plan.rewrites import DEFAULT_REWRITES
from trellis.train.config import TrainConfig, check_keys
from trellis.train.optim import OPTIMIZERS
from trellis.train.runs import MetricsLog, torch_save_atomic, write_json_atomic
from trellis.train.tasks import Task

SWEEP_FORMAT = "trellis-sweep"


@dataclass(frozen=True)
class GridKey:
    """A hyperparameter the grid may vary.

    Attributes:
        name: Field of :class:`TrainConfig`.
        kind: ``float``, ``int`` or ``choice``.
        choices: Allowed values of a ``choice`` key.
        help: What it is.
    """

    name: str
    kind: str
    choices: tuple[str, ...] = ()
    help: str = ""


#: Hyperparameters a grid may list. The model family and the graph are fixed per sweep: configurations of
#: different families cannot share a batch, so ``model`` is refused with its own message.
GRID_KEYS: dict[str, GridKey] = {k.name: k for k in (
    GridKey("lr", "float", help="learning rate"),
    GridKey("weight_decay", "float", help="L2 penalty"),
    GridKey("dropout", "float", help="dropout before every layer"),
    GridKey("hidden", "int", help="hidden width"),
    GridKey("layers", "int", help="number of layers (configurations batch only with the same depth)"),
    GridKey("optimizer", "choice", tuple(OPTIMIZERS), help="optimizer (each configuration has its own)"),
    GridKey("init", "choice", INITS, help="weight initialization"),
    GridKey("momentum", "float", help="sgd momentum / adam beta1"),
)}


# ---- the grid ----------------------------------------------------------------------------------------
def parse_grid(items: Sequence[str] | None) -> dict[str, list[Any]]:
    """Parse ``KEY=V1,V2,...`` items into ``{key: [values]}`` (in the order given).

    Raises:
        TrellisUserError: An empty grid, an item without ``=``, an unknown or repeated key, no values, a
            repeated value, or a value of the wrong type — each naming the item and the fix.
    """
    if not items:
        raise TrellisUserError("--grid is empty: give at least one KEY=V1,V2,... (e.g. --grid lr=0.01,0.005 "
                               f"hidden=64,128); sweepable: {', '.join(GRID_KEYS)}")
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise TrellisUserError(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. lr=0.01,0.005)")
        if key == "model":
            raise TrellisUserError(
                f"--grid {item}: configurations of different model families cannot share a batch; the family "
                "is fixed by --model (run one sweep per family)")
        if key not in GRID_KEYS:
            hint = difflib.get_close_matches(key, list(GRID_KEYS), n=1)
            raise TrellisUserError(f"--grid {item}: unknown hyperparameter {key!r}"
                                   + (f"; did you mean {hint[0]!r}?" if hint else "")
                                   + f" (sweepable: {', '.join(GRID_KEYS)})")
        if key in grid:
            raise TrellisUserError(f"--grid {item}: {key} is given twice; list all its values in one item")
        texts = [v.strip() for v in values.split(",")]
        if not values.strip() or any(not t for t in texts):
            raise TrellisUserError(f"--grid {item}: {key} needs comma-separated values, e.g. {key}="
                                   + {"float": "0.01,0.005", "int": "64,128"}.get(GRID_KEYS[key].kind,
                                                                                  ",".join(GRID_KEYS[key].choices[:2])))
        parsed = [_parse_value(GRID_KEYS[key], t, item) for t in texts]
        for a, b in itertools.combinations(range(len(parsed)), 2):
            if parsed[a] == parsed[b]:
                raise TrellisUserError(f"--grid {item}: value {texts[b]} of {key} is given twice "
                                       "(every configuration must be distinct)")
        grid[key] = parsed
    return grid


def _parse_value(k: GridKey, text: str, item: str) -> Any:
    if k.kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise TrellisUserError(f"--grid {item}: {k.name} value {text!r} is not a number") from None
        if not math.isfinite(value):
            raise TrellisUserError(f"--grid {item}: {k.name} value {text!r} is not a finite number")
        return value
    if k.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise TrellisUserError(f"--grid {item}: {k.name} value {text!r} is not an integer") from None
    if text not in k.choices:
        hint = difflib.get_close_matches(text, list(k.choices), n=1)
        raise TrellisUserError(f"--grid {item}: {k.name} value {text!r} is not one of {', '.join(k.choices)}"
                               + (f"; did you mean {hint[0]!r}?" if hint else ""))
    return text


def expand_grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values (the last key varies fastest)."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


# ---- configuration -----------------------------------------------------------------------------------
@dataclass
class SweepConfig:
    """A sweep: the store, the model family, the grid and the settings every configuration shares.

    Attributes:
        store: Graph store directory.
        model: Model family (``gcn``, ``sage``, ``gin``; others run one configuration at a time).
        grid: Parsed grid (:func:`parse_grid`).
        base: Values every configuration starts from (``--set KEY=VALUE``; fields of :class:`TrainConfig`).
        epochs: Maximum epochs per configuration (None: the model's default).
        patience: Early-stopping patience per configuration (None: the model's default).
        seed: Seed of every configuration (each is built and trained as its solo run with this seed).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        batch_models: ``--batch-models K`` (None: chosen by the planner).
        memory_budget_mb: Memory the sweep may use (None: 60% of the available memory).
        out: SWEEP_DIR (None: ``sweeps/<store>-<model>-<time>``).
        overwrite: Replace an existing SWEEP_DIR.
        progress: Show a progress bar per batch on a terminal.
        rewrites: Planner rewrites (benchmarks turn them off to measure batching alone).
    """

    store: str
    model: str = "gcn"
    grid: dict[str, list[Any]] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=dict)
    epochs: int | None = None
    patience: int | None = None
    seed: int = 0
    device: str = "auto"
    batch_models: int | None = None
    memory_budget_mb: float | None = None
    out: str | None = None
    overwrite: bool = False
    progress: bool = True
    rewrites: tuple[str, ...] = DEFAULT_REWRITES

    def __post_init__(self) -> None:
        if not self.grid:
            parse_grid([])
        for key in self.grid:
            if key not in GRID_KEYS:
                parse_grid([f"{key}=" + ",".join(map(str, self.grid[key]))])
        if self.batch_models is not None and self.batch_models < 1:
            raise TrellisUserError(f"--batch-models must be a positive integer (got {self.batch_models})")
        if self.memory_budget_mb is not None and not self.memory_budget_mb > 0:
            raise TrellisUserError(f"--memory-budget must be a positive number of MiB (got {self.memory_budget_mb})")
        check_keys(self.base, "--set")
        fixed = {"store", "model", "seed", "runs", "resume", "out"}
        for key in self.base:
            name = key.replace("-", "_")
            if name in fixed:
                raise TrellisUserError(f"--set {key}: set by the sweep itself; use the sweep's own flag instead")
            if name in self.grid:
                raise TrellisUserError(f"--set {key} and --grid {name}: give the values in one place")


@dataclass
class SweepEntry:
    """One configuration of the sweep.

    Attributes:
        id: Short stable name (``c00``, ``c01``, ...), in grid order.
        params: The grid's values for this configuration.
        cfg: The complete, validated training configuration (what ``trellis train`` would run).
    """

    id: str
    params: dict[str, Any]
    cfg: TrainConfig


def make_entries(sc: SweepConfig) -> list[SweepEntry]:
    """Expand the grid into validated configurations.

    Raises:
        TrellisUserError: A combination ``trellis train`` would refuse (e.g. ``dropout=1.5``), naming it.
    """
    combos = expand_grid(sc.grid)
    width = max(2, len(str(len(combos) - 1)))
    entries = []
    for i, params in enumerate(combos):
        values: dict[str, Any] = {k.replace("-", "_"): v for k, v in sc.base.items()}
        values.update({"store": sc.store, "model": sc.model, "seed": sc.seed, "device": sc.device, "runs": 1,
                       "progress": False})
        if sc.epochs is not None:
            values["epochs"] = sc.epochs
        if sc.patience is not None:
            values["patience"] = sc.patience
        values.update(params)
        try:
            cfg = TrainConfig.from_dict(values, source="trellis sweep")
        except TrellisUserError as exc:
            shown = " ".join(f"{k}={v}" for k, v in params.items())
            raise TrellisUserError(f"--grid configuration {shown}: {exc}") from None
        entries.append(SweepEntry(f"c{i:0{width}d}", params, cfg))
    return entries


# ---- building a configuration's model as its solo run would --------------------------------------------
def build_config_model(entry: SweepEntry, data: Any, device: torch.device) -> tuple[nn.Module, torch.Generator]:
    """Build a configuration's model exactly as ``Trainer._run`` does, and its dropout generator.

    The trainer seeds everything with the run's seed, builds the model and moves it to the device; nothing
    draws random numbers between that and the first training step. So the state of the device's default
    generator right after building is where the solo run's dropout starts drawing.
    """
    from trellis.nn.batched import capture_generator
    from trellis.train.trainer import build_run_model, seed_everything

    seed_everything(entry.cfg.seed)
    model = build_run_model(entry.cfg, data).to(device)
    return model, capture_generator(device)


# ---- planning ----------------------------------------------------------------------------------------
@dataclass
class SweepGroup:
    """Configurations of one depth (only they can share a batch), their K and batches."""

    layers: int
    entries: list[SweepEntry]
    k: int
    batches: list[list[SweepEntry]]
    choice_text: str
    choice_rows: list[dict[str, Any]]
    plan_text: str = ""
    batchable: bool = True


def plan_sweep(sc: SweepConfig, entries: list[SweepEntry], data: Any, device: torch.device,
               explain: bool = False) -> list[SweepGroup]:
    """Group configurations by depth and choose K for each group from the cost model and memory budget."""
    from trellis.errors import TrellisUserError as _UserError
    from trellis.nn.batched import BatchedGNN, family_of, model_decl
    from trellis.plan import GraphStats
    from trellis.plan.batching import balanced_batches, choose_k, default_budget_bytes

    stats = GraphStats.of(data.graph)
    budget = sc.memory_budget_mb * 2**20 if sc.memory_budget_mb is not None else default_budget_bytes()
    groups: list[SweepGroup] = []
    by_depth: dict[int, list[SweepEntry]] = {}
    for e in entries:
        by_depth.setdefault(e.cfg.layers, []).append(e)
    for layers, group in by_depth.items():
        models = [build_config_model(e, data, torch.device("cpu"))[0] for e in group]
        try:
            family = family_of(models[0])
            decls = [model_decl(m, family) for m in models]
        except _UserError as exc:
            if sc.batch_models not in (None, 1):
                raise TrellisUserError(f"--batch-models {sc.batch_models}: {exc}") from None
            note = f"K = 1: {exc}"
            groups.append(SweepGroup(layers, group, 1, [[e] for e in group], note, [], batchable=False))
            continue
        choice = choose_k(decls, stats, budget_bytes=budget, override=sc.batch_models, rewrites=sc.rewrites)
        batches = [[group[i] for i in r] for r in balanced_batches(len(group), choice.k)]
        rows = [{"k": r.k, "batches": r.batches, "est_epoch_s": r.epoch_seconds, "est_peak_mb": r.peak_bytes / 2**20,
                 "fits": r.fits} for r in choice.estimates]
        plan_text = ""
        if explain:
            first = batches[0]
            bm = BatchedGNN([models[group.index(e)] for e in first], rewrites=sc.rewrites)
            plan_text = bm.explain(data.graph)
        groups.append(SweepGroup(layers, group, choice.k, batches, choice.format(), rows, plan_text))
    return groups


def explain_sweep(sc: SweepConfig) -> str:
    """What ``trellis sweep --explain`` prints: the configurations, K per group and the batched plans."""
    from trellis.train.trainer import load_graph_data, resolve_device

    entries = make_entries(sc)
    device = resolve_device(sc.device)
    data = load_graph_data(sc.store, device=torch.device("cpu"), task=entries[0].cfg.task,
                           feature_norm=entries[0].cfg.feature_norm, features=entries[0].cfg.features)
    groups = plan_sweep(sc, entries, data, device, explain=True)
    lines = [f"sweep: {len(entries)} configurations of {sc.model} on {data.store.name} "
             f"({data.graph.num_dst} nodes, {data.graph.num_edges} edges)"]
    for g in groups:
        lines.append(f"\n== {len(g.entries)} configuration(s) with {g.layers} layers: {len(g.batches)} batch(es) "
                     f"of up to {g.k}")
        lines.append(g.choice_text)
        for b, batch in enumerate(g.batches):
            lines.append(f"  batch {b}: " + ", ".join(f"{e.id} ({_params_text(e.params)})" for e in batch))
        if g.plan_text:
            lines.append(f"\nplan of batch 0:\n{g.plan_text}")
    return "\n".join(lines)


def _params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


# ---- training ----------------------------------------------------------------------------------------
@dataclass
class _Best:
    epoch: int = -1
    value: float = -math.inf
    val_loss: float = math.inf
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Tensor] | None = None


@dataclass
class _State:
    """Where one configuration of a batch stands."""

    entry: SweepEntry
    model: nn.Module
    optimizer: torch.optim.Optimizer
    log: MetricsLog
    best: _Best = field(default_factory=_Best)
    bad_epochs: int = 0
    epochs: int = 0
    time_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    stopped: str = ""


def evaluate_logits(task: Task, logits: Tensor, y: Tensor, splits: dict[str, Tensor]) -> dict[str, float]:
    """``<split>_<metric>`` for every split and metric plus ``val_loss`` (as the trainer's evaluation)."""
    out: dict[str, float] = {}
    for split, idx in splits.items():
        for name, value in task.metrics(logits[idx], y[idx]).items():
            out[f"{split}_{name}"] = value
    val = splits["val"]
    out["val_loss"] = float(task.loss(logits[val], y[val]))
    return out


def _train_batch(batch: list[SweepEntry], b: int, data: Any, task: Task, metric: str, device: torch.device,
                 root: Path, sc: SweepConfig, batchable: bool, err: IO[str]) -> list[dict[str, Any]]:
    """Train one batch of configurations to their early stops; returns one result per configuration."""
    from trellis.nn.batched import BatchedGNN
    from trellis.train.trainer import build_run_optimizer

    built = [build_config_model(e, data, device) for e in batch]
    states = []
    for e, (model, _) in zip(batch, built):
        cfg = e.cfg
        opt = build_run_optimizer(cfg, model)
        d = root / "configs" / e.id
        (d / "models").mkdir(parents=True, exist_ok=True)
        write_json_atomic(d / "config.json", cfg.to_dict())
        states.append(_State(e, model, opt, MetricsLog(d / "metrics.jsonl")))
    if batchable:
        bm: nn.Module = BatchedGNN([m for m, _ in built], [g for _, g in built], rewrites=sc.rewrites)
        active: list[int] = bm.active  # type: ignore[assignment]
    else:  # one configuration of a family that cannot batch: its own generator, the trainer's ops
        from trellis.plan.rewrites import generator_scope

        assert len(built) == 1
        model, gen = built[0]

        class _One(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = model
                self.active = [0]

            def forward(self, graph: Any, x: Tensor) -> list[Tensor]:
                with generator_scope(gen if self.training else None):
                    return [self.m(graph, x)] if self.active else []

            def drop(self, k: int) -> None:
                self.active.clear()

        bm = _One()
        active = bm.active
    sign = 1.0 if task.higher_is_better.get(metric, True) else -1.0
    max_epochs = max(s.entry.cfg.epochs for s in states)
    cuda = device.type == "cuda"
    graph, x, y, splits = data.graph, data.x, data.y, data.splits
    train_idx = splits["train"]
    bar = tqdm(total=max_epochs, desc=f"batch {b} ({len(batch)} configs)", unit="ep", file=err,
               disable=None if sc.progress else True, dynamic_ncols=True, leave=False)
    try:
        for epoch in range(max_epochs):
            if not active:
                break
            run = [states[k] for k in active]
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            bm.train()
            for s in run:
                s.optimizer.zero_grad(set_to_none=True)
            logits = bm(graph, x)
            losses = [task.loss(lg[train_idx], y[train_idx]) for lg in logits]
            torch.stack(losses).sum().backward()  # d(sum)/d(loss_k) = 1: each config gets its own gradient
            for s in run:
                s.optimizer.step()
            if cuda:
                torch.cuda.synchronize(device)
            step = time.perf_counter() - t0
            loss_values = [float(v) for v in torch.stack(losses).detach().cpu()]
            with torch.no_grad():
                bm.eval()
                logits = bm(graph, x)
                evs = [evaluate_logits(task, lg, y, splits) for lg in logits]
            del logits
            if cuda:
                torch.cuda.synchronize(device)
            share = (time.perf_counter() - t0) / len(run)
            stop: list[int] = []
            for k, s, loss, ev in zip(list(active), run, loss_values, evs):
                value, val_loss = sign * ev[f"val_{metric}"], ev["val_loss"]
                best = s.best
                if value > best.value or (value == best.value and val_loss < best.val_loss):
                    s.best = _Best(epoch, value, val_loss, dict(ev),
                                   {n: v.detach().clone() for n, v in s.model.state_dict().items()})
                    s.bad_epochs = 0
                else:
                    s.bad_epochs += 1
                s.time_s += share
                s.step_times.append(step / len(run))
                s.epochs = epoch + 1
                s.log.write({"run": 0, "seed": s.entry.cfg.seed, "epoch": epoch, "loss": loss, **ev,
                             "best_epoch": s.best.epoch, "step_time_s": step / len(run), "time_s": s.time_s,
                             "batch": b, "batch_size": len(run), "batch_step_time_s": step})
                if s.bad_epochs >= s.entry.cfg.patience:
                    s.stopped = "patience"
                elif epoch + 1 >= s.entry.cfg.epochs:
                    s.stopped = "epochs"
                if s.stopped:
                    stop.append(k)
            for k in stop:
                bm.drop(k)
            bar.set_postfix_str(f"{len(active)} active", refresh=False)
            bar.update(1)
    finally:
        bar.close()
        for s in states:
            s.log.close()
    return [_finish(s, b, data, task, metric, root) for s in states]


def _finish(s: _State, b: int, data: Any, task: Task, metric: str, root: Path) -> dict[str, Any]:
    """Write the configuration's summary and best weights; return its leaderboard row."""
    from trellis.train.trainer import FORMAT_VERSION, MODEL_FORMAT

    cfg, e = s.entry.cfg, s.entry
    d = root / "configs" / e.id
    if s.best.state is not None:
        s.model.load_state_dict(s.best.state)
    result = {"run": 0, "seed": cfg.seed, "best_epoch": s.best.epoch, "epochs": s.epochs, "time_s": s.time_s,
              **s.best.metrics}
    torch_save_atomic({
        "format": MODEL_FORMAT, "version": FORMAT_VERSION, "model": cfg.model, "in_dim": data.in_dim,
        "out_dim": task.num_outputs, "edge_dim": data.edge_dim, "kwargs": cfg.model_kwargs(), "task": task.name,
        "feature_norm": data.feature_norm, "metric": metric, "result": result, "init": e.cfg.init,
        "state_dict": {k: v.detach().cpu() for k, v in s.model.state_dict().items()},
    }, d / "models" / "run-0.pt")
    summary: dict[str, Any] = {"status": "complete", "metric": metric, "runs": 1, "seeds": [cfg.seed],
                               "best_epoch": [s.best.epoch], "epochs_run": [s.epochs], "best_run": 0,
                               "train_time_s": s.time_s, "model": cfg.model, "task": task.name,
                               "sweep_config": e.id, "params": e.params, "init": e.cfg.init, "batch": b,
                               "stopped": s.stopped, "config": cfg.to_dict(), "per_run": [result]}
    if s.step_times:
        summary["epoch_time_s_median"] = sorted(s.step_times)[len(s.step_times) // 2]
    for name in task.metric_names:
        for split in ("train", "val", "test"):
            v = s.best.metrics.get(f"{split}_{name}", float("nan"))
            summary.update({f"{split}_{name}": [v], f"{split}_{name}_mean": v, f"{split}_{name}_std": 0.0})
    from trellis.train.convergence import summarize_time_to_accuracy
    from trellis.train.runs import iter_jsonl

    summary.update(summarize_time_to_accuracy(iter_jsonl(d / "metrics.jsonl"), metric, cfg.target_acc,
                                              higher_is_better=task.higher_is_better.get(metric, True)))
    write_json_atomic(d / "summary.json", summary)
    row: dict[str, Any] = {"config": e.id, **e.params, f"val_{metric}": s.best.metrics.get(f"val_{metric}"),
                           f"test_{metric}": s.best.metrics.get(f"test_{metric}"),
                           "val_loss": s.best.metrics.get("val_loss"), "best_epoch": s.best.epoch,
                           "epochs": s.epochs, "time_s": s.time_s, "batch": b, "stopped": s.stopped,
                           "metrics": dict(s.best.metrics)}
    return row


def run_sweep(sc: SweepConfig, err: IO[str] | None = None) -> dict[str, Any]:
    """Train every configuration of the sweep and write SWEEP_DIR; returns the leaderboard (JSON-ready).

    Raises:
        TrellisUserError: Bad grid, store, options or SWEEP_DIR (nothing is written).
    """
    from trellis.train.trainer import load_graph_data, resolve_device

    err = err if err is not None else sys.stderr
    t_wall = time.perf_counter()
    entries = make_entries(sc)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(sc.out) if sc.out else Path("sweeps") / f"{Path(sc.store).name}-{sc.model}-{stamp}"
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not sc.overwrite:
        raise TrellisUserError(f"--out {out}: already exists; choose another --out or pass --overwrite")
    device = resolve_device(sc.device)
    first = entries[0].cfg
    data = load_graph_data(sc.store, device=device, task=first.task, feature_norm=first.feature_norm,
                           features=first.features)
    task = data.task
    metric = task.select_metric(first.metric)
    groups = plan_sweep(sc, entries, data, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        rows: list[dict[str, Any]] = []
        batches_info: list[dict[str, Any]] = []
        t_train = time.perf_counter()
        b = 0
        for g in groups:
            for batch in g.batches:
                t_b = time.perf_counter()
                rows += _train_batch(batch, b, data, task, metric, device, tmp, sc, g.batchable, err)
                batches_info.append({"batch": b, "layers": g.layers, "configs": [e.id for e in batch],
                                     "time_s": time.perf_counter() - t_b})
                b += 1
        sweep_time = time.perf_counter() - t_train
        sign = 1.0 if task.higher_is_better.get(metric, True) else -1.0
        rows.sort(key=lambda r: (-sign * _num(r[f"val_{metric}"]), _num(r["val_loss"]), r["config"]))
        for rank, r in enumerate(rows, 1):
            r["rank"] = rank
        board = {
            "format": SWEEP_FORMAT, "version": 1, "store": str(data.store.path), "store_name": data.store.name,
            "model": sc.model, "metric": metric, "task": task.name, "grid": sc.grid, "base": sc.base,
            "seed": sc.seed, "device": str(device), "configs": len(entries),
            "batch_models": {str(g.layers): g.k for g in groups},
            "batch_choice": {str(g.layers): {"text": g.choice_text, "candidates": g.choice_rows} for g in groups},
            "batches": batches_info, "rewrites": list(sc.rewrites), "sweep_time_s": sweep_time,
            "threads": torch.get_num_threads(), "rows": rows, "out": str(out),
        }
        board["wall_time_s"] = time.perf_counter() - t_wall
        write_json_atomic(tmp / "leaderboard.json", board)
        (tmp / "leaderboard.csv").write_text(leaderboard_csv(rows, list(sc.grid), metric))
        write_json_atomic(tmp / "sweep.json", {"format": SWEEP_FORMAT, "version": 1, "store": sc.store,
                                               "model": sc.model, "grid": sc.grid, "base": sc.base,
                                               "epochs": sc.epochs, "patience": sc.patience, "seed": sc.seed,
                                               "device": sc.device, "batch_models": sc.batch_models,
                                               "memory_budget_mb": sc.memory_budget_mb})
        plot_leaderboard(tmp, rows, metric)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return board


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


def leaderboard_csv(rows: list[dict[str, Any]], keys: list[str], metric: str) -> str:
    """The leaderboard as CSV: rank, configuration, its grid values, val/test metric, epochs, time."""
    cols = ["rank", "config", *keys, f"val_{metric}", f"test_{metric}", "val_loss", "best_epoch", "epochs",
            "time_s", "batch", "stopped"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: (f"{r[c]:.6g}" if isinstance(r.get(c), float) else r.get(c)) for c in cols})
    return buf.getvalue()


def format_leaderboard(board: dict[str, Any], top: int | None = None) -> str:
    """A plain-text table of the leaderboard (best first)."""
    metric = board["metric"]
    keys = list(board["grid"])
    rows = board["rows"][:top] if top else board["rows"]
    head = ["#", "config", *keys, f"val {metric}", f"test {metric}", "epochs", "time s"]
    table = [[str(r["rank"]), r["config"], *(str(r[k]) for k in keys), f"{_num(r[f'val_{metric}']):.4f}",
              f"{_num(r[f'test_{metric}']):.4f}", str(r["epochs"]), f"{r['time_s']:.1f}"] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) if table else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in table]
    ks = ", ".join(f"K={k} ({layers} layers)" for layers, k in board["batch_models"].items())
    lines.append(f"{board['configs']} configurations in {len(board['batches'])} batch(es), {ks}; sweep "
                 f"{board['sweep_time_s']:.1f} s on {board['device']}; results in {board['out']}")
    return "\n".join(lines)


def plot_leaderboard(root: Path, rows: list[dict[str, Any]], metric: str) -> None:
    """``leaderboard.png``: every configuration's validation curve, and val/test bars, best first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trellis.train.runs import read_jsonl

    fig, (ax_c, ax_b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, r in enumerate(rows):
        recs = read_jsonl(root / "configs" / r["config"] / "metrics.jsonl")
        label = f"#{r['rank']} {r['config']}" if i < 5 else None
        ax_c.plot([q["epoch"] for q in recs], [_num(q.get(f"val_{metric}")) for q in recs], lw=1.2 if i < 5 else 0.6,
                  alpha=1.0 if i < 5 else 0.5, label=label)
    ax_c.set(xlabel="epoch", ylabel=f"val {metric}", title="validation curves (top 5 labeled)")
    ax_c.legend(fontsize=7)
    names = [r["config"] for r in rows]
    ypos = range(len(rows))
    ax_b.barh([p + 0.2 for p in ypos], [_num(r[f"val_{metric}"]) for r in rows], height=0.4, label="val")
    ax_b.barh([p - 0.2 for p in ypos], [_num(r[f"test_{metric}"]) for r in rows], height=0.4, label="test")
    ax_b.set_yticks(list(ypos), names, fontsize=7)
    ax_b.invert_yaxis()
    ax_b.set(xlabel=metric, title="best-validation epoch: val and test")
    ax_b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "leaderboard.png", dpi=100)
    plt.close(fig)
