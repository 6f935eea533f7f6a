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
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from trellis.errors import TrellisUserError
from trellis.nn.batched import BatchedGNN, capture_generator
from trellis.nn.init import INITS
from trellis.nn.models import JKS, NORMS
from trellis.plan.batching import balanced_batches, default_budget_bytes
from trellis.plan.rewrites import DEFAULT_REWRITES
from trellis.train.build import ModelFactory, build_run_optimizer, default_model_factory
from trellis.train.config import PATH_FIELDS, TrainConfig, typed_values
from trellis.train.convergence import summarize_time_to_accuracy
from trellis.train.data import resolve_device
from trellis.train.early_stopping import EarlyStopping
from trellis.train.loop import Lane, run_epochs
from trellis.train.optim import OPTIMIZERS
from trellis.train.rng import seed_everything
from trellis.train.runs import MetricsLog, iter_jsonl, read_jsonl, write_json_atomic
from trellis.train.strategies import Strategy, strategy_class
from trellis.train.strategies.full import FullBatch
from trellis.train.strategies.outofcore import OutOfCoreFull
from trellis.train.strategies.pp import PrePropagation
from trellis.train.summary import RunSummary, split_metrics_of
from trellis.train.trainer import model_header, save_model
from trellis.utils.atomic import check_output, replace_dir, temp_sibling
from trellis.utils.manifest import format_of
from trellis.utils.memory import PeakMemory

SWEEP_FORMAT = "trellis-sweep"

#: Strategies a sweep (and a tune) trains.
SWEEP_STRATEGIES = ("full", "pp")


@dataclass(frozen=True)
class GridKey:
    """A hyperparameter the grid may vary.

    Attributes:
        name: Field of :class:`TrainConfig`.
        kind: ``float``, ``int``, ``bool`` or ``choice``.
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
    GridKey("residual", "bool", help="residual connections (true/false)"),
    GridKey("pre_norm", "bool", help="pre-norm residual blocks (true/false; gcn, sage, gin)"),
    GridKey("norm", "choice", NORMS, help="normalization of hidden layers"),
    GridKey("jk", "choice", JKS, help="jumping knowledge"),
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
        parsed = [parse_grid_value(GRID_KEYS[key], t, item) for t in texts]
        for a, b in itertools.combinations(range(len(parsed)), 2):
            if parsed[a] == parsed[b]:
                raise TrellisUserError(f"--grid {item}: value {texts[b]} of {key} is given twice "
                                       "(every configuration must be distinct)")
        grid[key] = parsed
    return grid


def parse_grid_value(k: GridKey, text: str, item: str, flag: str = "--grid") -> Any:
    """One value of hyperparameter ``k`` from its text (``flag`` and ``item`` name it in errors)."""
    if k.kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise TrellisUserError(f"{flag} {item}: {k.name} value {text!r} is not a number") from None
        if not math.isfinite(value):
            raise TrellisUserError(f"{flag} {item}: {k.name} value {text!r} is not a finite number")
        return value
    if k.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise TrellisUserError(f"{flag} {item}: {k.name} value {text!r} is not an integer") from None
    if k.kind == "bool":
        flag_value = {"true": True, "false": False, "1": True, "0": False}.get(text.lower())
        if flag_value is None:
            raise TrellisUserError(f"{flag} {item}: {k.name} value {text!r} is not true or false")
        return flag_value
    if text not in k.choices:
        hint = difflib.get_close_matches(text, list(k.choices), n=1)
        raise TrellisUserError(f"{flag} {item}: {k.name} value {text!r} is not one of {', '.join(k.choices)}"
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
        self.base = typed_base(self.base)
        # the sweep's own flags (device, epochs, patience, progress: their values overrode a --set one silently)
        fixed = {"store", "model", "seed", "runs", "resume", "out", "device", "epochs", "patience", "progress"}
        for key in self.base:
            name = key.replace("-", "_")
            if name in fixed:
                raise TrellisUserError(f"--set {key}: set by the sweep itself; use the sweep's own flag instead"
                                       + (f" (--{name})" if name in ("device", "epochs", "patience") else ""))
            if name in ("explain", "json", "overwrite"):  # accepted and ignored: a tune ran whole under explain
                raise TrellisUserError(f"--set {key}: not an option of a configuration (it is one of a `trellis "
                                       f"train` invocation); use the command's own --{name} where it has one "
                                       "(see its --help)")
            if name == "strategy" and self.base[key] not in SWEEP_STRATEGIES:
                raise TrellisUserError(f"--set {key}={self.base[key]}: a sweep trains --strategy "
                                       f"{' or '.join(SWEEP_STRATEGIES)} (in memory or with --set memory_budget=SIZE); "
                                       "train other strategies with `trellis train`")
            if name in self.grid:
                raise TrellisUserError(f"--set {key} and --grid {name}: give the values in one place")


def typed_base(base: dict[str, Any]) -> dict[str, Any]:
    """``--set``'s values typed: its strings and a Python caller's numbers make one record (and one resume).

    Raises:
        TrellisUserError: An unknown key or a value that does not parse, named as ``--set``'s.
    """
    try:
        typed = typed_values(base, "--set")
    except TrellisUserError as exc:
        raise TrellisUserError(f"--set: {exc}") from None
    for key in PATH_FIELDS:  # sweep.json too names them absolute
        if typed.get(key):
            typed[key] = str(Path(typed[key]).resolve())
    return typed


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


def make_entries(sc: SweepConfig, combos: list[dict[str, Any]] | None = None) -> list[SweepEntry]:
    """Validated configurations of the grid's combinations (or of ``combos``, e.g. a tune's random draws).

    Raises:
        TrellisUserError: A combination ``trellis train`` would refuse (e.g. ``dropout=1.5``), naming it.
    """
    combos = expand_grid(sc.grid) if combos is None else combos
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
            raise TrellisUserError(f"configuration {shown}: {exc}") from None
        entries.append(SweepEntry(f"c{i:0{width}d}", params, cfg))
    return entries


# ---- building a configuration's model as its solo run would --------------------------------------------
def build_config_model(entry: SweepEntry, strategy: Strategy, device: torch.device,
                       factory: ModelFactory = default_model_factory) -> tuple[nn.Module, torch.Generator]:
    """Build a configuration's model exactly as the trainer's run does, and its dropout generator.

    The trainer seeds everything with the run's seed, builds the model and moves it to the device; nothing
    draws random numbers between that and the first training step. So the state of the device's default
    generator right after building is where the solo run's dropout starts drawing.
    """
    seed_everything(entry.cfg.seed)
    model = strategy.build_model(factory, entry.cfg).to(device)
    return model, capture_generator(device)


# ---- planning ----------------------------------------------------------------------------------------
def batch_group(cfg: TrainConfig) -> tuple[int, bool]:
    """Which configurations may share a model batch: those of one depth, pre-norm blocks apart (run alone)."""
    return int(cfg.layers), bool(cfg.pre_norm)


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
    pre_norm: bool = False

    @property
    def key(self) -> str:
        """The group's name in ``leaderboard.json`` (its depth; pre-norm blocks apart)."""
        return f"{self.layers}-pre-norm" if self.pre_norm else str(self.layers)


def plan_sweep(sc: SweepConfig, entries: list[SweepEntry], strategy: Strategy, device: torch.device,
               explain: bool = False, factory: ModelFactory = default_model_factory) -> list[SweepGroup]:
    """Group configurations by depth and let the strategy choose K for each group (its cost model and budget)."""
    budget = default_budget_bytes()  # in memory; a strategy under --memory-budget plans K within its own
    groups: list[SweepGroup] = []
    by_depth: dict[tuple[int, bool], list[SweepEntry]] = {}
    for e in entries:
        by_depth.setdefault(batch_group(e.cfg), []).append(e)
    for (layers, pre_norm), group in by_depth.items():
        models = [build_config_model(e, strategy, torch.device("cpu"), factory)[0] for e in group]
        # --batch-models sizes the batches that can form; pre-norm blocks run one at a time whatever it says
        k, text, rows = strategy.batch_size_for(models, budget, None if pre_norm else sc.batch_models)
        batches = [[group[i] for i in r] for r in balanced_batches(len(group), k)]
        plan_text = ""
        first_models = [models[group.index(e)] for e in batches[0]]
        if explain and isinstance(strategy, FullBatch) and rows:
            plan_text = BatchedGNN(first_models, rewrites=sc.rewrites).explain(strategy.explain_graph())
        elif explain and isinstance(strategy, OutOfCoreFull):
            plan_text = strategy.explain_batch(first_models, any(float(e.cfg.dropout) > 0.0 for e in batches[0]))
        groups.append(SweepGroup(layers, group, k, batches, text, rows, plan_text, pre_norm))
    return groups


def load_sweep_data(entries: list[SweepEntry], device: torch.device, rewrites: Sequence[str] = DEFAULT_REWRITES,
                    spill_dir: Path | None = None) -> Strategy:
    """The data every configuration trains on, loaded once by the first configuration's strategy.

    ``spill_dir`` is where an out-of-core strategy spills when the configurations name no ``--spill-dir``.
    """
    cfg = entries[0].cfg
    if spill_dir is not None and cfg.memory_budget is not None and cfg.spill_dir is None and cfg.strategy == "full":
        cfg = replace(cfg, spill_dir=str(spill_dir))
    strategy = strategy_class(cfg.strategy).for_config(cfg)(cfg, device)
    if not isinstance(strategy, FullBatch | OutOfCoreFull | PrePropagation):
        raise TrellisUserError(f"--set strategy={cfg.strategy}: a sweep trains --strategy full (in memory or with "
                               "--memory-budget) or pp; train other strategies with `trellis train`")
    if isinstance(strategy, FullBatch):
        strategy.rewrites = tuple(rewrites)
    strategy.open(any(e.cfg.edge_weight for e in entries))
    return strategy


def explain_sweep(sc: SweepConfig, model_factory: ModelFactory | None = None) -> str:
    """What ``trellis sweep --explain`` prints: the configurations, K per group and the batched plans."""
    entries = make_entries(sc)
    device = resolve_device(sc.device)
    strategy = load_sweep_data(entries, torch.device("cpu"))
    groups = plan_sweep(sc, entries, strategy, device, explain=True, factory=model_factory or default_model_factory)
    lines = [f"sweep: {len(entries)} configurations of {sc.model} on {strategy.store.name} "
             f"({strategy.store.num_nodes} nodes, {strategy.num_edges} edges), --strategy {strategy.name}"]
    for g in groups:
        kind = " in pre-norm blocks" if g.pre_norm else ""
        lines.append(f"\n== {len(g.entries)} configuration(s) with {g.layers} layers{kind}: {len(g.batches)} batch(es) "
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
class ConfigState(Lane):
    """A configuration of the sweep as the epoch loop trains it: its lane and its sweep entry."""

    entry: SweepEntry = field(kw_only=True)


def open_state(entry: SweepEntry, strategy: Strategy, metric: str, device: torch.device, root: Path,
               factory: ModelFactory = default_model_factory) -> ConfigState:
    """A configuration's fresh state (built as its solo run builds it) and its run directory under ``root``."""
    model, gen = build_config_model(entry, strategy, device, factory)
    cfg = entry.cfg
    d = root / "configs" / entry.id
    (d / "models").mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / "config.json", cfg.replay_dict())
    stopper = EarlyStopping(metric, cfg.patience, strategy.task.higher_is_better.get(metric, True))
    return ConfigState(cfg, model, build_run_optimizer(cfg, model), stopper, MetricsLog(d / "metrics.jsonl"), gen,
                       fields={"run": 0, "seed": cfg.seed}, weight=strategy.epoch_weight(model), entry=entry)


def advance(states: list[ConfigState], strategy: Strategy, *, until: int | None = None,
            splits: dict[str, Tensor] | None = None, keep_splits: Sequence[str] | None = None,
            err: IO[str] | None = None, desc: str = "", progress: bool = True, tag: dict[str, Any] | None = None,
            deadline: float | None = None, clock: Callable[[], float] | None = None,
            after_epoch: Callable[[], None] | None = None) -> bool:
    """Train ``states`` together through the strategy's batch, in the trainer's epoch loop (see there).

    ``splits`` replace the store's (a tune's final runs); ``keep_splits`` are the ones scored (a tune's search
    leaves the test split out). Returns False when ``deadline`` passed before every state was done.
    """
    limit = max(min(s.cfg.epochs, until if until is not None else s.cfg.epochs) for s in states)
    first = min(s.epochs for s in states)
    bar = tqdm(total=max(0, limit - first), desc=desc, unit="ep", file=err or sys.stderr,
               disable=None if progress else True, dynamic_ncols=True, leave=False)
    epochs_seen: set[int] = set()
    seeds = {s.cfg.seed for s in states}
    if len(seeds) == 1:
        strategy.begin_run(seeds.pop())  # e.g. the pre-propagation loader's shuffle follows the run's seed

    def on_record(lane: Lane, record: dict[str, Any]) -> None:
        if record["epoch"] not in epochs_seen:  # one tick per epoch of the batch
            epochs_seen.add(record["epoch"])
            bar.set_postfix_str(f"{record['batch_size']} active", refresh=False)
            bar.update(1)

    try:
        return run_epochs(states, lambda lanes: strategy.open_batch(lanes, keep_splits=keep_splits, splits=splits),
                          strategy.task, until=until, deadline=deadline, device=strategy.device,
                          epoch_info=strategy.epoch_info, on_record=on_record, tag=tag or {}, clock=clock,
                          after_epoch=after_epoch)
    finally:
        bar.close()


def _train_batch(batch: list[SweepEntry], b: int, strategy: Strategy, metric: str, device: torch.device,
                 root: Path, sc: SweepConfig, err: IO[str], factory: ModelFactory,
                 meter: PeakMemory) -> list[dict[str, Any]]:
    """Train one batch of configurations to their early stops; returns one result per configuration."""
    states = [open_state(e, strategy, metric, device, root, factory) for e in batch]
    try:
        advance(states, strategy, err=err, desc=f"batch {b} ({len(batch)} configs)", progress=sc.progress,
                tag={"batch": b})
    finally:
        for s in states:
            s.log.close()
    return [_finish(s, b, strategy, metric, root, meter.report()) for s in states]


def _finish(s: ConfigState, b: int, strategy: Strategy, metric: str, root: Path,
            peaks: dict[str, float]) -> dict[str, Any]:
    """Write the configuration's run directory (model, summary) as its solo run would; return its row.

    ``peaks`` are the sweep process's memory peaks so far: the configurations of a batch share one model.
    """
    cfg, e, task = s.entry.cfg, s.entry, strategy.task
    d = root / "configs" / e.id
    s.stopper.restore(s.model)
    best = s.stopper.best_metrics
    result = {"run": 0, "seed": cfg.seed, "best_epoch": s.stopper.best_epoch, "epochs": s.epochs,
              "time_s": s.time_s, **best}
    save_model(d / "models" / "run-0.pt", s.model, model_header(cfg, metric, result, strategy.model_record(cfg)))
    times = s.step_times or [float("nan")]
    summary = RunSummary(
        metric=metric, strategy=cfg.strategy, model=cfg.model, task=task.name, runs=1, seeds=[cfg.seed],
        best_epoch=[s.stopper.best_epoch], epochs_run=[s.epochs], best_run=0,
        split_metrics=split_metrics_of([result], task.metric_names, strategy.eval_splits),
        epoch_time_s_median=statistics.median(times), epoch_time_s_mean=statistics.fmean(times),
        steps_timed=len(s.step_times), train_time_s=s.time_s, peak_rss_anon_mb=peaks["peak_rss_anon_mb"],
        peak_rss_mb=peaks["peak_rss_mb"], peak_cuda_mb=peaks.get("peak_cuda_mb"), per_run=[result],
        time_to_accuracy=summarize_time_to_accuracy(iter_jsonl(d / "metrics.jsonl"), metric, cfg.target_acc,
                                                    higher_is_better=task.higher_is_better.get(metric, True)),
        strategy_info=strategy.summary_info(),
        info={"sweep_config": e.id, "params": e.params, "init": cfg.init, "batch": b, "stopped": s.stopped,
              "config": cfg.to_dict()})
    write_json_atomic(d / "summary.json", summary.to_dict())
    return {"config": e.id, **e.params, f"val_{metric}": best.get(f"val_{metric}"),
            f"test_{metric}": best.get(f"test_{metric}"), "val_loss": best.get("val_loss"),
            "best_epoch": s.stopper.best_epoch, "epochs": s.epochs, "time_s": s.time_s, "batch": b,
            "stopped": s.stopped, "metrics": dict(best)}


def run_sweep(sc: SweepConfig, err: IO[str] | None = None,
              model_factory: ModelFactory | None = None) -> dict[str, Any]:
    """Train every configuration of the sweep and write SWEEP_DIR; returns the leaderboard (JSON-ready).

    Raises:
        TrellisUserError: Bad grid, store, options or SWEEP_DIR (nothing is written).
    """
    err = err if err is not None else sys.stderr
    model_factory = model_factory or default_model_factory
    t_wall = time.perf_counter()
    entries = make_entries(sc)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(sc.out) if sc.out else Path("sweeps") / f"{Path(sc.store).name}-{sc.model}-{stamp}"
    if not (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):  # an empty dir is simply used
        check_output(out, overwrite=sc.overwrite, owned=is_sweep_dir, what="sweep directory (no sweep.json)")
    device = resolve_device(sc.device)
    if any(e.cfg.memory_budget is not None for e in entries):
        import matplotlib.pyplot  # noqa: F401 - the leaderboard draws with it at the end: count it in the baseline
    tmp = temp_sibling(out)
    try:
        strategy = load_sweep_data(entries, device, sc.rewrites, spill_dir=tmp / "spill")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        task = strategy.task
        metric = task.select_metric(entries[0].cfg.metric)
        groups = plan_sweep(sc, entries, strategy, device, factory=model_factory)
    except BaseException:
        strategy.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meter = PeakMemory(device=device).start()
    try:
        rows: list[dict[str, Any]] = []
        batches_info: list[dict[str, Any]] = []
        t_train = time.perf_counter()
        b = 0
        for g in groups:
            for batch in g.batches:
                t_b = time.perf_counter()
                rows += _train_batch(batch, b, strategy, metric, device, tmp, sc, err, model_factory, meter)
                batches_info.append({"batch": b, "layers": g.layers, "configs": [e.id for e in batch],
                                     "time_s": time.perf_counter() - t_b})
                b += 1
        sweep_time = time.perf_counter() - t_train
        strategy.close()  # spills of an out-of-core sweep go before the directory is renamed into place
        sign = 1.0 if task.higher_is_better.get(metric, True) else -1.0
        rows.sort(key=lambda r: (-sign * _num(r[f"val_{metric}"]), _num(r["val_loss"]), r["config"]))
        for rank, r in enumerate(rows, 1):
            r["rank"] = rank
        board = {
            "format": SWEEP_FORMAT, "version": 1, "store": str(strategy.store.path), "store_name": strategy.store.name,
            "model": sc.model, "metric": metric, "task": task.name, "grid": sc.grid, "base": sc.base,
            "seed": sc.seed, "device": str(device), "configs": len(entries),
            "batch_models": {g.key: g.k for g in groups},
            "batch_choice": {g.key: {"text": g.choice_text, "candidates": g.choice_rows} for g in groups},
            "batches": batches_info, "rewrites": list(sc.rewrites), "sweep_time_s": sweep_time,
            "threads": torch.get_num_threads(), "rows": rows, "out": str(out), **meter.report(),
        }
        board["wall_time_s"] = time.perf_counter() - t_wall
        write_json_atomic(tmp / "leaderboard.json", board)
        (tmp / "leaderboard.csv").write_text(leaderboard_csv(rows, list(sc.grid), metric))
        write_json_atomic(tmp / "sweep.json", {"format": SWEEP_FORMAT, "version": 1, "store": sc.store,
                                               "model": sc.model, "grid": sc.grid, "base": sc.base,
                                               "epochs": sc.epochs, "patience": sc.patience, "seed": sc.seed,
                                               "device": sc.device, "batch_models": sc.batch_models})
        plot_leaderboard(tmp, rows, metric)
        replace_dir(tmp, out)
    except BaseException:
        strategy.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        meter.stop()
    return board


def is_sweep_dir(path: Path) -> bool:
    """Whether ``path`` holds a sweep's output (``sweep.json`` or ``leaderboard.json`` of format trellis-sweep).

    ``--overwrite`` replaces only such a directory: a mistyped ``--out`` must not delete the user's files.
    """
    return SWEEP_FORMAT in (format_of(path / "sweep.json"), format_of(path / "leaderboard.json"))


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


def config_label(row: dict[str, Any]) -> str:
    """``#1 c03 lr=0.01 hidden=64``: a leaderboard row's rank, id and the hyperparameters that vary."""
    params = " ".join(f"{k}={row[k]}" for k in GRID_KEYS if k in row)
    return f"#{row['rank']} {row['config']}" + (f" {params}" if params else "")


def plot_leaderboard(root: Path, rows: list[dict[str, Any]], metric: str) -> None:
    """``leaderboard.png``: every configuration's validation curve, and val/test bars, best first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, r in enumerate(rows):
        recs = [q for q in read_jsonl(root / "configs" / r["config"] / "metrics.jsonl")
                if q.get(f"val_{metric}") is not None]  # the evaluated epochs (--set eval_every=N)
        label = config_label(r) if i < 5 else None
        ax_c.plot([q["epoch"] for q in recs], [_num(q.get(f"val_{metric}")) for q in recs], lw=1.2 if i < 5 else 0.6,
                  alpha=1.0 if i < 5 else 0.5, label=label)
    ax_c.set(xlabel="epoch", ylabel=f"val {metric}", title="validation curves (top 5 labeled)")
    ax_c.legend(fontsize=7)
    names = [config_label(r) for r in rows]
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
