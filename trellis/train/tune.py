"""``trellis tune``: model selection on the model-batched sweep — successive halving, then a multi-seed report.

``trellis tune STORE --model gcn --budget 20m --out TUNE_DIR`` draws candidates from a search space
(:mod:`trellis.train.space`), trains them model-batched (K configurations per pass over the graph, the
sweep's :func:`~trellis.train.sweep.advance`), and stops weak candidates early by successive halving
(Jamieson & Talwalkar 2016; Li et al. 2018): every candidate trains to the first rung's epoch count, the best
``1/eta`` by validation go on to ``eta`` times more epochs, and so on up to ``--epochs``. Only validation
decides — the search evaluates the training and validation splits only, so the test split is not even
computed until the final report — and ties go to the cheaper configuration (fewer layers, then narrower).
The ``--playoff`` best finalists are retrained with fresh seeds and the best mean validation is the choice
(:meth:`Tune.playoff`); with ``--budget``, time the playoff leaves races the finalists still within the noise of
the leader over further rounds of seeds (:meth:`Tune._race`). The chosen configuration is then retrained over
``--splits`` splits (per-class splits drawn again, or a store's fixed splits:
:func:`trellis.train.data.redraw_split`) × ``--seeds`` seeds, and the report gives its validation and test mean ± std.

Why halving on a batched sweep: Lotan built model batching for model selection (its §1 and §7: a grid of
learning rate × optimizer × dropout with early stopping on validation). A grid trained to the end spends most
of its time on configurations that were visibly worse after a tenth of the epochs; halving spends it on the
survivors, and batching makes each pass over the graph serve K of them.

``TUNE_DIR`` (written in place, so that ``--resume TUNE_DIR`` continues an interrupted tune)::

    tune.json           the tune's settings, the space and the candidates (what --resume reads)
    progress.json       where the search stands (rung, batches done, promotions); state/<id>.pt per candidate
    leaderboard.csv     one row per candidate: rung reached, epochs, best validation metric, time, why it stopped
    leaderboard.json    the rows, the halving schedule, the batches, the selection and the final runs
    leaderboard.png     validation against the tune's wall clock for every candidate, and the final runs
    configs/<id>/       each candidate's config.json, metrics.jsonl (train and validation only) and model
    playoff/configs/<id>-p<r>/  the best finalists retrained with fresh seeds (train and validation only)
    final/configs/<run>/  the chosen configuration retrained per split and seed (the only runs with test metrics)
    best/config.json    the chosen configuration: `trellis train --config` replays its first final run exactly
    report.md           one paragraph: the choice, how sure it is, what it cost
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from trellis.errors import TrellisUserError
from trellis.nn.batched import family_of
from trellis.plan.batching import balanced_batches, default_budget_bytes
from trellis.train.build import ModelFactory, default_model_factory
from trellis.train.data import redraw_split, resolve_device, split_choices
from trellis.train.loop import StopOnSignal, StopRequested
from trellis.train.runs import MetricsLog, read_jsonl, write_json_atomic
from trellis.train.space import Space, candidates, load_space, parse_space, space_to_json
from trellis.train.strategies.full import FullBatch
from trellis.train.sweep import (
    ConfigState,
    SweepConfig,
    SweepEntry,
    _finish,
    advance,
    batch_group,
    build_config_model,
    config_label,
    load_sweep_data,
    make_entries,
    open_state,
    parse_grid,
    typed_base,
)
from trellis.utils.atomic import check_output
from trellis.utils.manifest import format_of
from trellis.utils.memory import PeakMemory

TUNE_FORMAT = "trellis-tune"

#: Fewest epochs a first rung gets: below it a slow-starting learning rate is judged before it moved.
MIN_RUNG_EPOCHS = 20


@dataclass
class TuneConfig:
    """A tune: what to search, how, and how to report.

    Attributes:
        store: Graph store directory.
        model: Model family (every candidate's).
        space: ``default`` or a JSON space file (not with ``grid``).
        grid: ``--grid KEY=V1,V2`` items: a finite space given on the command line.
        search: ``auto`` (grid when the space has at most ``candidates`` points, else random), ``grid``, ``random``.
        candidates: Number of random candidates (the first rung's size).
        budget_s: Wall-time budget in seconds (None: the whole halving schedule, however long).
        eta: Halving rate: each rung keeps the best ``1/eta`` and trains them ``eta`` times longer.
        min_epochs: Epochs of the first rung (None: ``epochs / eta^s``, at least :data:`MIN_RUNG_EPOCHS`).
        epochs: Epochs of the last rung, every candidate's maximum (None: the model's default).
        patience: Early-stopping patience (None: the model's default).
        seed: Seed of the draws and of every candidate; the final runs use ``seed .. seed + seeds - 1``.
        seeds: Seeds per split in the final retraining.
        playoff: Finalists retrained with fresh seeds before the choice (1: the search's best single run).
        playoff_seeds: Fresh seeds each playoff finalist is retrained with per round (with a budget, time left
            races the finalists within noise of the leader over further rounds).
        splits: Splits of the final retraining: per-class splits drawn again, or the store's fixed splits
            (None: 3 when the store records the per-class protocol or holds fixed splits, else 1: its split).
        base: Values every candidate shares (``--set KEY=VALUE``).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        batch_models: Configurations per batch (None: the cost model's choice).
        out: TUNE_DIR.
        overwrite: Replace an existing TUNE_DIR.
        progress: Progress bars on a terminal.
    """

    store: str
    model: str = "gcn"
    space: str | None = None
    grid: list[str] | None = None
    search: str = "auto"
    candidates: int = 27
    budget_s: float | None = None
    eta: int = 3
    min_epochs: int | None = None
    epochs: int | None = None
    patience: int | None = None
    seed: int = 0
    seeds: int = 3
    splits: int | None = None
    playoff: int = 15
    playoff_seeds: int = 3
    base: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    batch_models: int | None = None
    out: str = "tune"
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name, low in (("candidates", 1), ("eta", 2), ("seeds", 1), ("splits", 1), ("min_epochs", 1),
                          ("epochs", 1), ("patience", 1), ("playoff", 1), ("playoff_seeds", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise TrellisUserError(f"--{name.replace('_', '-')} must be an integer >= {low} (got {value})")
        if self.search not in ("auto", "grid", "random"):
            raise TrellisUserError(f"--search {self.search}: choose auto, grid or random")
        if self.budget_s is not None and not self.budget_s > 0:
            raise TrellisUserError(f"--budget must be a positive duration, e.g. 20m (got {self.budget_s} s)")
        self.base = typed_base(self.base)
        if self.grid and self.space not in (None, "default"):
            raise TrellisUserError(f"--space {self.space} and --grid are two ways to give the space; give one (put "
                                   "the grid's keys into the space file, or drop --space)")

    def search_space(self) -> Space:
        """The space to draw from: ``--grid`` items, a space file, or the model's default."""
        if self.grid:
            grid = parse_grid(self.grid)
            return parse_space(dict(grid), "--grid")
        out_of_core = self.base.get("memory_budget") is not None and self.base.get("strategy", "full") == "full"
        return load_space(self.space, self.model, out_of_core=out_of_core)


def parse_duration(text: str, flag: str = "--budget") -> float:
    """``90s``, ``20m``, ``1.5h`` (a bare number is minutes) -> seconds.

    Raises:
        TrellisUserError: Not a positive number with an optional s/m/h unit.
    """
    t = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0}
    unit = t[-1] if t and t[-1] in scale else "m"
    number = t[:-1] if t and t[-1] in scale else t
    try:
        value = float(number) * scale[unit]
    except ValueError:
        raise TrellisUserError(f"{flag} {text!r}: expected a duration such as 90s, 20m or 1.5h") from None
    if not (math.isfinite(value) and value > 0):
        raise TrellisUserError(f"{flag} {text!r}: the duration must be positive")
    return value


# ---- the halving schedule ----------------------------------------------------------------------------
def rung_epochs(n: int, max_epochs: int, eta: int, min_epochs: int | None = None) -> list[int]:
    """Epoch counts of the rungs: ``max_epochs / eta^s, ..., max_epochs / eta, max_epochs``.

    ``s`` halvings are as many as ``n`` candidates allow (one survivor at most at the end) and as the first
    rung's floor (``min_epochs`` or :data:`MIN_RUNG_EPOCHS`) allows.
    """
    floor = min(min_epochs or MIN_RUNG_EPOCHS, max_epochs)
    s = 0
    while eta ** (s + 1) <= n and max_epochs / eta ** (s + 1) >= floor:
        s += 1
    if min_epochs is not None and s > 0:
        # An explicit first rung: geometric from min_epochs up to max_epochs in s steps.
        ratio = (max_epochs / min_epochs) ** (1 / s)
        return sorted({max(1, round(min_epochs * ratio ** i)) for i in range(s)} | {max_epochs})
    return sorted({max(1, round(max_epochs / eta ** (s - i))) for i in range(s)} | {max_epochs})


def cost_key(cfg: Any) -> tuple[int, int]:
    """Cheaper first: fewer layers, then a narrower hidden layer (heads x width)."""
    return (int(cfg.layers), int(cfg.hidden) * int(getattr(cfg, "heads", 1) or 1))


def rank_states(states: list[ConfigState]) -> list[ConfigState]:
    """Best first, by validation only.

    Best validation metric, then the cheaper configuration, then the lower validation loss at that epoch,
    then the id: a total order, so ranks never depend on timing.
    """
    return sorted(states, key=lambda s: (-s.stopper.best_value, cost_key(s.entry.cfg),
                                         s.stopper.best_val_loss, s.entry.id))


# ---- state on disk (--resume) ------------------------------------------------------------------------
def _restart_log(s: ConfigState) -> None:
    """Empty ``s``'s ``metrics.jsonl``: its epochs are about to be run (again) from the start."""
    s.log.close()
    s.log = MetricsLog(s.log.path, offset=0)


def save_state(s: ConfigState, path: Path) -> None:
    """Everything a candidate's next epoch depends on, atomically."""
    tmp = path.with_suffix(".tmp")
    assert s.generator is not None
    torch.save({"model": s.model.state_dict(), "optimizer": s.optimizer.state_dict(),
                "generator": s.generator.get_state(), "stopper": s.stopper.state_dict(), "epochs": s.epochs,
                "time_s": s.time_s, "step_times": s.step_times, "stopped": s.stopped,
                "log_offset": s.log.offset}, tmp)
    tmp.replace(path)


def load_state(s: ConfigState, path: Path, device: torch.device) -> None:
    """Restore a candidate saved by :func:`save_state` (its log truncated back to the saved offset)."""
    st = torch.load(path, map_location=device, weights_only=True)
    s.model.load_state_dict(st["model"])
    s.optimizer.load_state_dict(st["optimizer"])
    assert s.generator is not None
    s.generator.set_state(st["generator"])
    s.stopper.load_state_dict(st["stopper"], device)
    s.epochs, s.time_s, s.step_times, s.stopped = st["epochs"], st["time_s"], list(st["step_times"]), st["stopped"]
    s.log.close()
    s.log = MetricsLog(s.log.path, offset=st["log_offset"])


# ---- the tune ----------------------------------------------------------------------------------------
class Tune:
    """One tune: its candidates, their states and the scheduler's position (see the module docstring)."""

    def __init__(self, tc: TuneConfig, err: IO[str] | None = None, factory: ModelFactory | None = None,
                 resume: bool = False) -> None:
        self.tc, self.err = tc, err if err is not None else sys.stderr
        self.factory = factory or default_model_factory
        self.root = Path(tc.out)
        self.space = tc.search_space()
        fixed = {k.replace("-", "_") for k in tc.base} & set(self.space)
        if fixed:
            raise TrellisUserError(f"--set {sorted(fixed)[0]}: it is also in the search space; give it in one place")
        self.sc = SweepConfig(store=tc.store, model=tc.model, grid={k: [0] for k in self.space}, base=tc.base,
                              epochs=tc.epochs, patience=tc.patience, seed=tc.seed, device=tc.device,
                              batch_models=tc.batch_models,
                              progress=tc.progress)
        draws, self.how = candidates(self.space, tc.candidates, tc.seed, tc.search)
        self.entries = make_entries(self.sc, draws)
        self._check_space_values(draws[0])
        self.entries = [replace(e, id=f"c{i:03d}") for i, e in enumerate(self.entries)]
        self.max_epochs = max(e.cfg.epochs for e in self.entries)
        self.rungs = rung_epochs(len(self.entries), self.max_epochs, tc.eta, tc.min_epochs)
        if not resume:
            if not (self.root.is_dir() and not self.root.is_symlink() and not any(self.root.iterdir())):
                check_output(self.root, overwrite=tc.overwrite, owned=is_tune_dir, what="tune directory (no tune.json)")
        self.device = resolve_device(tc.device)
        self.strategy = load_sweep_data(self.entries, self.device)
        self.task = self.strategy.task
        self.metric = self.task.select_metric(self.entries[0].cfg.metric)
        self.split_seeds = self._split_seeds()
        self.states: dict[str, ConfigState] = {}
        self.progress: dict[str, Any] = {"rung": 0, "batches_done": 0, "elapsed_s": 0.0, "rungs": [],
                                         "active": [e.id for e in self.entries], "batches": None, "cut": None,
                                         "done": False, "bracket": 0, "finalists": [], "bracket_s": []}
        self._first = len(self.entries)
        #: Stop requests (SIGINT/SIGTERM) honoured at epoch boundaries; run_tune installs the handlers.
        self.stop = StopOnSignal(self.err, enabled=False)
        self.playoff_rounds = 0  # rounds of fresh seeds the playoff ran (:meth:`playoff`)
        self.playoff_skipped: list[str] = []  # trained finalists whose playoff and final runs did not fit
        self.run_s: dict[str, float] = {}  # a playoff finalist's longest run so far (search or playoff), seconds

    def _check_space_values(self, draw: dict[str, Any]) -> None:
        """Refuse a space value no candidate may take, before anything trains: every choice, a range's ends.

        A range reaching an invalid value (``dropout`` uniform in [0, 1.05]) was accepted, and the tune failed
        brackets later on the draw that reached it, with nothing written but its state (its resume failed again).
        """
        for name, dim in self.space.items():
            for value in dim.choices if dim.kind == "choice" else (dim.low, dim.high):
                value = int(value) if dim.kind == "int_uniform" else value
                try:
                    make_entries(self.sc, [{**draw, name: value}])
                except TrellisUserError as exc:
                    where = "a choice" if dim.kind == "choice" else f"the range [{dim.low:g}, {dim.high:g}] reaches"
                    raise TrellisUserError(f"the search space's {name}: {where} {value!r}, which no run takes "
                                           f"({str(exc).split(': ', 1)[-1]}); narrow it") from None

    # -- brackets: a budget left over after the schedule buys another one (Hyperband's outer loop)
    def bracket_entries(self, k: int) -> list[SweepEntry]:
        """Bracket ``k``'s candidates: new random draws (seeded by ``--seed`` and ``k``), ids ``b<k>c<i>``."""
        draws, _ = candidates(self.space, self.tc.candidates, self.tc.seed + 7919 * k, "random")
        seen = {tuple(e.params.get(key) for key in self.space) for e in self.entries}
        fresh = [d for d in draws if tuple(d.get(key) for key in self.space) not in seen]
        return [replace(e, id=f"b{k}c{i:03d}") for i, e in enumerate(make_entries(self.sc, fresh))] if fresh else []

    def restore_brackets(self) -> None:
        """A resumed tune rebuilds the candidates of the brackets it had started (deterministic draws)."""
        for k in range(1, int(self.progress.get("bracket", 0)) + 1):
            self.entries += self.bracket_entries(k)

    def _next_bracket(self, clock: Callable[[], float]) -> bool:
        """Start another bracket when the budget has room for it and for what follows the search; else False.

        What follows is the final runs of the leader and the playoff of the finalists so far: a further
        bracket starts only when the time left after it still pays for the same playoff contenders as the
        time left now (:meth:`_contenders`). Why not reserve the playoff of every ``--playoff`` best finalist:
        a dear finalist that the playoff passes over anyway (hidden 256, its final runs priced at every epoch)
        then blocked every further bracket, and Computers tunes ended with 400 s of 1,200 unspent.
        """
        p = self.progress
        if self.how != "random" or self.tc.budget_s is None or not p["bracket_s"]:
            return False
        by_id = {e.id: e for e in self.entries}
        left = self.tc.budget_s - clock()
        finalists = self.by_price(rank_states([self._state(by_id[i]) for i in p["finalists"]]), left)
        if not self._room_for_bracket(finalists, left, max(p["bracket_s"]), self._final_estimate(left) or 0.0):
            return False
        fresh = self.bracket_entries(p["bracket"] + 1)
        if not fresh:  # the space is exhausted
            return False
        self.entries += fresh
        p.update(bracket=p["bracket"] + 1, rung=0, batches_done=0, batches=None, active=[e.id for e in fresh])
        self._save_progress()
        return True

    def _room_for_bracket(self, finalists: list[ConfigState], left_s: float, bracket_s: float,
                          final_s: float) -> bool:
        """Whether ``left_s`` seconds pay for a bracket of ``bracket_s`` seconds and what follows the search.

        What follows: the final runs (``final_s``) and a playoff of the same contenders as now.
        """
        after = left_s - bracket_s
        ids = lambda t: [s.entry.id for s in self._contenders(finalists, t)]  # noqa: E731
        return after >= final_s and ids(after) == ids(left_s)

    def _split_seeds(self) -> list[int | None]:
        store = self.strategy.store
        # other splits retrain in memory over the whole graph (a pre-propagation cache keeps its split)
        choices = split_choices(store) if isinstance(self.strategy, FullBatch) else 0
        if choices == 0:
            if self.tc.splits not in (None, 1):
                raise TrellisUserError(f"--splits {self.tc.splits}: {store.path} records neither a per-class split "
                                       "protocol (Shchur et al.'s npz imports do) nor fixed splits (Platonov et "
                                       "al.'s do); use --splits 1 (its one split)")
            return [None]
        count = self.tc.splits or (3 if choices is None else min(3, choices))
        if choices is not None:  # fixed splits: the store's is number 0
            if count > choices:
                raise TrellisUserError(f"--splits {count}: {store.path} holds {choices} fixed splits; give --splits "
                                       f"{choices} or fewer")
            return [None] + list(range(1, count))
        first = int(store.manifest.get("source", {}).get("split_seed") or 0)
        return [None] + [first + i for i in range(1, count)]

    # -- files
    def write_settings(self) -> None:
        """``tune.json``: what --resume needs to rebuild the same candidates."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / "tune.json", {
            # paths absolute: `--resume TUNE_DIR` from another directory finds the store and the space file
            "format": TUNE_FORMAT, "version": 1, "space": space_to_json(self.space),
            "settings": {**asdict(self.tc), "store": str(Path(self.tc.store).resolve()),
                         "out": str(self.root.resolve()),
                         **({"space": str(Path(self.tc.space).resolve())} if self.tc.space not in (None, "default")
                            else {})},
            "search": self.how, "rungs": self.rungs, "eta": self.tc.eta,
            "candidates": [{"id": e.id, **e.params} for e in self.entries]})

    def _save_progress(self) -> None:
        write_json_atomic(self.root / "progress.json", self.progress)

    def _state(self, e: SweepEntry) -> ConfigState:
        if e.id not in self.states:
            s = open_state(e, self.strategy, self.metric, self.device, self.root, self.factory)
            saved = self.root / "state" / f"{e.id}.pt"
            if saved.exists():
                load_state(s, saved, self.device)
            else:  # epochs an interrupted batch logged before its states were saved are run again
                _restart_log(s)
            self.states[e.id] = s
        return self.states[e.id]

    # -- the search
    def _batches(self, ids: list[str], entries: list[SweepEntry] | None = None) -> list[list[str]]:
        """Batches of the candidates ``ids`` of ``entries`` (default: the search's).

        By depth (and pre-norm blocks apart: they run one at a time), K from the cost model (fixed per rung once
        chosen).
        """
        budget = default_budget_bytes()  # in memory; a strategy under --memory-budget plans K within its own
        by_id = {e.id: e for e in (self.entries if entries is None else entries)}
        by_depth: dict[tuple[int, bool], list[str]] = {}
        for i in ids:
            by_depth.setdefault(batch_group(by_id[i].cfg), []).append(i)
        out: list[list[str]] = []
        for (_, pre_norm), group in by_depth.items():
            models = [build_config_model(by_id[i], self.strategy, torch.device("cpu"), self.factory)[0] for i in group]
            k = self.strategy.batch_size_for(models, budget, None if pre_norm else self.tc.batch_models)[0]
            out += [[group[j] for j in r] for r in balanced_batches(len(group), k)]
        return out

    def _batchable(self, ids: list[str]) -> bool:
        """Whether a batch runs as a BatchedGNN (a singleton of a family that cannot batch runs alone)."""
        if len(ids) > 1:
            return True
        try:
            family_of(self._state(next(e for e in self.entries if e.id == ids[0])).model)
            return True
        except TrellisUserError:
            return False

    def search(self, t_start: float) -> None:
        """Run (or continue) the halving schedule until its last rung or the budget's deadline."""
        p = self.progress
        base = p["elapsed_s"]
        clock = lambda: base + time.perf_counter() - t_start  # noqa: E731
        (self.root / "state").mkdir(exist_ok=True)
        while True:
            if p["rung"] < len(self.rungs):  # (a resumed tune may stop between brackets)
                started = clock()
                self._bracket(clock)
                if p["cut"] is not None:
                    return
                p["finalists"] += p["active"]
                p["bracket_s"].append(clock() - started)
                self._save_progress()
            if not self._next_bracket(clock):
                return

    def _bracket(self, clock: Callable[[], float]) -> None:
        """Run (or continue) the current bracket's halving schedule until its last rung or the deadline."""
        p = self.progress
        by_id = {e.id: e for e in self.entries}
        while p["rung"] < len(self.rungs):
            r = p["rung"]
            if p["batches"] is None:
                p["batches"] = self._batches([i for i in p["active"] if not self._state(by_id[i]).stopped])
                self._save_progress()
            for b in range(p["batches_done"], len(p["batches"])):
                ids = p["batches"][b]
                states = [self._state(by_id[i]) for i in ids]
                self.stop.check()
                try:
                    finished = advance(states, self.strategy, until=self.rungs[r], keep_splits=("train", "val"),
                                       err=self.err, progress=self.tc.progress,
                                       desc=f"rung {r} ({self.rungs[r]} ep) batch {b + 1}/{len(p['batches'])}",
                                       tag={"rung": r, "batch": b}, deadline=self._deadline(clock), clock=clock,
                                       after_epoch=self.stop.check)
                except StopRequested:
                    # mid-batch: the batch's states are saved at this epoch, and --resume continues them exactly
                    for s in states:
                        save_state(s, self.root / "state" / f"{s.entry.id}.pt")
                    p["elapsed_s"] = clock()
                    self._save_progress()
                    raise
                if not finished:
                    p["cut"] = {"bracket": p["bracket"], "rung": r, "batches_done": b, "epochs": self.rungs[r]}
                    break
                for s in states:
                    save_state(s, self.root / "state" / f"{s.entry.id}.pt")
                p["batches_done"] = b + 1
                p["elapsed_s"] = clock()
                self._save_progress()
            active = [self._state(by_id[i]) for i in p["active"]]
            ranked = self.by_price(rank_states(active), self._left(clock))
            last = r == len(self.rungs) - 1 or p["cut"] is not None
            keep = len(ranked) if last else max(1, math.ceil(len(ranked) / self.tc.eta))
            p["rungs"].append({"bracket": p["bracket"], "rung": r, "epochs": self.rungs[r],
                               "candidates": len(ranked), "kept": keep,
                               "batches": p["batches"], "cut": p["cut"] is not None,
                               "best": {s.entry.id: s.stopper.best_value for s in ranked}})
            p["active"] = [s.entry.id for s in ranked[:keep]]
            p.update(rung=r + 1, batches_done=0, batches=None, elapsed_s=clock())
            self._save_progress()
            if p["cut"] is not None:
                break

    def _deadline(self, clock: Callable[[], float]) -> float | None:
        """When the search must stop so that the final runs still fit in the budget.

        The final runs are priced at the likely choice's measured time per epoch (:meth:`_final_estimate`),
        for ``--epochs`` epochs, ``splits x seeds`` times. Before any candidate has a measured epoch there is
        no deadline.
        """
        left = self._left(clock)
        final_s = None if left is None else self._final_estimate(left)
        if left is None or final_s is None:
            return None
        return time.perf_counter() + left - final_s

    def _left(self, clock: Callable[[], float]) -> float | None:
        """Seconds of the budget left (None without one)."""
        return None if self.tc.budget_s is None else self.tc.budget_s - clock()

    def _final_estimate(self, left_s: float | None) -> float | None:
        """Seconds the final runs of the likely choice take: the best measured candidate ``left_s`` pays for.

        None before any candidate is measured, 0.0 while ``left_s`` pays for none of them (the search goes on
        to the end of the budget unless a cheaper one turns up). Why not the leader whatever its price: a
        Coauthor CS tune's first batch was one dear candidate alone, its final runs priced above the budget
        left, and the search stopped in rung 0 with that one candidate trained.

        The likely choice is looked for first among the candidates whose final runs take at most half the
        whole budget, and only when there is none among all that ``left_s`` pays for. Why: a leader whose final
        runs just fit the time left sets the deadline at once; a 20-minute Amazon Computers tune stopped in
        rung 0 after 59 s that way (its leader's final runs priced at 1,137 s of 1,141 s left), and that
        leader was then passed over anyway, since its playoff did not fit either.
        """
        pool = set(self.progress["active"]) | set(self.progress["finalists"])
        measured = [s for s in self.states.values() if s.epochs and s.entry.id in pool]
        if not measured:
            return None
        ranked = rank_states(measured)
        half = (self.tc.budget_s or 0.0) / 2
        for cap in ((None,) if left_s is None else (min(left_s, half), left_s)):
            first = self.by_price(ranked, cap)[0]
            if self._affordable(first, cap):
                return self._final_of(first)
        return 0.0

    def _affordable(self, s: ConfigState, left_s: float | None) -> bool:
        """Whether ``left_s`` seconds pay for ``s``'s final runs (always without a budget; never untrained)."""
        return left_s is None or (s.epochs > 0 and self._final_of(s) <= left_s)

    def by_price(self, ranked: list[ConfigState], left_s: float | None) -> list[ConfigState]:
        """``ranked`` with the candidates whose final runs ``left_s`` cannot pay for moved behind the rest.

        Such a candidate cannot be the choice, so it neither sets the deadline nor takes a promotion or the
        choice from one that can. Without a budget the order is unchanged.
        """
        if left_s is None:
            return ranked
        ok = [s for s in ranked if self._affordable(s, left_s)]
        keep = {id(s) for s in ok}
        return ok + [s for s in ranked if id(s) not in keep]

    def _final_of(self, s: ConfigState) -> float:
        """Seconds the final runs take if ``s`` is chosen: its measured time per epoch × ``--epochs`` × runs."""
        return s.time_s / s.epochs * self.max_epochs * len(self.split_seeds) * self.tc.seeds

    def _contenders(self, finalists: list[ConfigState], left_s: float | None) -> list[ConfigState]:
        """The playoff's finalists: the ``--playoff`` best that trained and that ``left_s`` seconds pay for.

        Each is priced at its own search run (its share of its batches, early stopping included) times
        ``--playoff-seeds``, and the final runs after the playoff at the dearest contender's (any of them may
        win). A finalist the budget cannot pay for is passed over and the next one tried: one dear finalist
        (hidden 256, its final runs priced at every epoch) no longer ends the playoff of the cheaper ones after
        it (a Coauthor CS tune stopped at 8 of 15 that way with 400 s of its budget unspent). Fewer than two:
        no playoff (nothing to choose between).
        """
        top: list[ConfigState] = []
        spent = final = 0.0
        for f in finalists:
            if len(top) == self.tc.playoff:
                break
            if not f.epochs:  # the budget cut the search before it trained
                continue
            cost, dearest = spent + f.time_s * self.tc.playoff_seeds, max(final, self._final_of(f))
            if left_s is not None and cost + dearest > left_s:
                continue
            top.append(f)
            spent, final = cost, dearest
        return top if len(top) > 1 else []

    # -- the playoff
    def playoff(self, finalists: list[ConfigState], left_s: float | None = None
                ) -> tuple[SweepEntry, list[dict[str, Any]]]:
        """The choice: the best mean validation of the ``--playoff`` best finalists, each retrained with fresh seeds.

        Why: the search ranks every candidate by one run, and when many finalists lie within the validation
        split's noise of each other the best single score among them is partly luck (the winner's curse: on
        Cora the search's best of 48 finalists scored 83.0 and 81.5 on average over three fresh seeds). Fresh
        seeds give each of the best finalists an estimate that was not selected for being high (the search's
        own run is left out of the mean); ties go to the cheaper configuration, as in the search. Only training
        and validation are computed. With a budget, the playoff takes as many finalists as ``left_s`` seconds
        pay for, the final runs of the dearest one included (:meth:`_contenders`); a further bracket starts
        only when it leaves the playoff the same contenders (:meth:`_next_bracket`). Time the first round
        leaves is raced away (:meth:`_race`).
        Returns the choice and one row per finalist (its runs and their mean), best first.
        """
        top = self._contenders(finalists, left_s)
        if not top:
            return finalists[0].entry, []
        taken = {f.entry.id for f in top}
        reach = (max(k for k, f in enumerate(finalists) if f.entry.id in taken) + 1 if len(top) == self.tc.playoff
                 else len(finalists))  # the playoff stopped at its --playoff-th contender, or tried every finalist
        self.playoff_skipped = [f.entry.id for f in finalists[:reach] if f.epochs and f.entry.id not in taken]
        t0 = time.perf_counter()
        runs: dict[str, list[float]] = {f.entry.id: [] for f in top}
        race, rounds = top, 0
        while race:
            self._playoff_round(race, rounds, runs)
            rounds, alive = rounds + 1, {f.entry.id for f in race}
            race = [] if left_s is None else self._race(race, runs, left_s - (time.perf_counter() - t0))
        # the choice is the best of the last round's finalists: one the race left out cannot come back
        rows: list[dict[str, Any]] = [
            {"config": f.entry.id, "search_val": float(f.stopper.best_value), "val_runs": runs[f.entry.id],
             "val_mean": statistics.fmean(runs[f.entry.id]), "raced_out": f.entry.id not in alive} for f in top]
        by_id = {f.entry.id: f.entry for f in top}
        rows.sort(key=lambda r: (r["raced_out"], -r["val_mean"], cost_key(by_id[r["config"]].cfg), r["config"]))
        self.playoff_rounds = rounds
        return by_id[rows[0]["config"]], rows

    def _playoff_round(self, top: list[ConfigState], round_: int, runs: dict[str, list[float]]) -> None:
        """Retrain each of ``top`` with ``--playoff-seeds`` more fresh seeds; append their best validation values.

        Round ``k``'s run ``r`` of a finalist is ``<id>-p<k * playoff_seeds + r>``, trained with the search's
        seed + 1 + that number, so every round's seeds are new and a round's runs do not depend on how many
        rounds follow.
        """
        n = self.tc.playoff_seeds
        numbers = range(round_ * n, (round_ + 1) * n)
        entries = [SweepEntry(f"{s.entry.id}-p{r}", {**s.entry.params, "seed": s.entry.cfg.seed + 1 + r},
                              replace(s.entry.cfg, seed=s.entry.cfg.seed + 1 + r))
                   for s in top for r in numbers]
        states = {e.id: open_state(e, self.strategy, self.metric, self.device, self.root / "playoff", self.factory)
                  for e in entries}
        try:
            for s in states.values():  # a resumed tune runs its playoff again from the start
                _restart_log(s)
            # one seed per batch, as in the search (a pre-propagation batch shares one shuffle)
            batches = [b for r in numbers for b in self._batches([f"{f.entry.id}-p{r}" for f in top], entries)]
            for b, ids in enumerate(batches):
                self.stop.check()
                desc = f"playoff batch {b + 1}/{len(batches)}" + (f", round {round_ + 1}" if round_ else "")
                advance([states[i] for i in ids], self.strategy, keep_splits=("train", "val"), err=self.err,
                        progress=self.tc.progress, desc=desc, tag={"playoff": b, "round": round_},
                        after_epoch=self.stop.check)
        finally:
            for s in states.values():
                s.log.close()
        for f in top:
            runs[f.entry.id] += [float(states[f"{f.entry.id}-p{r}"].stopper.best_value) for r in numbers]
            self.run_s[f.entry.id] = max([self.run_s.get(f.entry.id, f.time_s),
                                          *(states[f"{f.entry.id}-p{r}"].time_s for r in numbers)])

    def _race(self, alive: list[ConfigState], runs: dict[str, list[float]], left_s: float) -> list[ConfigState]:
        """The finalists to retrain with one more round of seeds: those of ``alive`` not clearly behind the leader.

        Why: a tune whose playoff ends with time left (its reserve was priced for a dear contender's final runs,
        and a cheaper one won: about 400 s of a 20-minute Computers tune) spends it where the choice is least
        sure. A finalist stays in the race while the leader's mean exceeds its own by at most two standard
        errors of the difference (the within-configuration variance pooled over every finalist's runs in
        ``runs``, as a few runs estimate one configuration's badly); the others are out for good, as in racing
        (Maron & Moore's Hoeffding races, irace's F-race). The round is priced as the first: each finalist's
        run × ``--playoff-seeds``, the dearest one's final runs reserved, each run at its longest so far (a
        playoff run may train longer than the search run). It races all the close finalists or none: racing
        only those the budget pays for left a dear, close one on fewer runs, and on a Cora tune it became the
        choice on its luckier three while six others were retrained down. Returns [] (no further round) when
        the leader is clear of the rest or the round does not fit.
        """
        mean = {i: statistics.fmean(v) for i, v in runs.items()}
        dof = sum(len(v) - 1 for v in runs.values())
        if dof <= 0:
            return []
        var = sum(sum((x - mean[i]) ** 2 for x in v) for i, v in runs.items()) / dof
        order = sorted(alive, key=lambda f: (-mean[f.entry.id], cost_key(f.entry.cfg), f.entry.id))
        lead = order[0].entry.id
        close = [order[0]] + [f for f in order[1:] if mean[lead] - mean[f.entry.id]
                              <= 2 * math.sqrt(var * (1 / len(runs[lead]) + 1 / len(runs[f.entry.id])))]
        cost = sum(self.run_s.get(f.entry.id, f.time_s) for f in close) * self.tc.playoff_seeds
        fits = cost + max(self._final_of(f) for f in close) <= left_s
        return close if len(close) > 1 and fits else []

    # -- the final runs
    def final_runs(self, best: SweepEntry) -> list[dict[str, Any]]:
        """Retrain ``best`` per split and seed (a split's seeds batched as the search batches), test split evaluated."""
        root = self.root / "final"
        rows = []
        meter = PeakMemory(device=self.device).start()
        try:
            for j, split_seed in enumerate(self.split_seeds):
                entries = [SweepEntry(f"s{j}-r{r}", {**best.params, "seed": best.cfg.seed + r,
                                                     "split_seed": split_seed},
                                      replace(best.cfg, seed=best.cfg.seed + r, split_seed=split_seed))
                           for r in range(self.tc.seeds)]
                data = self.strategy
                splits = None if split_seed is None else {
                    k: torch.from_numpy(np.asarray(v, dtype=np.int64)).to(self.device)
                    for k, v in redraw_split(data.store, np.asarray(data.store.y), split_seed).items()}
                states = [open_state(e, data, self.metric, self.device, root, self.factory) for e in entries]
                for s in states:  # a resumed tune runs its final runs again from the start
                    _restart_log(s)
                # the seeds batched as the search batches (the cost model's K): on minesweeper, where batching
                # does not pay, three seeds in one batch took 1.24x their solo epochs, and the budget overran
                by_id = {s.entry.id: s for s in states}
                groups = ([[by_id[i] for i in b] for b in self._batches(list(by_id), entries)]
                          if self._batchable([best.id]) else [[s] for s in states])
                try:
                    for g in groups:
                        self.stop.check()
                        advance(g, data, splits=splits, err=self.err, progress=self.tc.progress,
                                desc=f"final split {j + 1}/{len(self.split_seeds)}", tag={"split": j},
                                after_epoch=self.stop.check)
                finally:
                    for s in states:
                        s.log.close()
                for s in states:
                    row = _finish(s, 0, data, self.metric, root, meter.report())
                    rows.append({"run": s.entry.id, "split": j, "split_seed": split_seed, "seed": s.entry.cfg.seed,
                                 **{k: row["metrics"].get(k) for k in (f"val_{self.metric}", f"test_{self.metric}")},
                                 "best_epoch": row["best_epoch"], "epochs": row["epochs"], "time_s": row["time_s"]})
        finally:
            meter.stop()
        return rows


def run_tune(tc: TuneConfig, err: IO[str] | None = None, model_factory: ModelFactory | None = None,
             resume: bool = False) -> dict[str, Any]:
    """Search, select on validation, retrain the choice over splits and seeds, and write TUNE_DIR.

    Raises:
        TrellisUserError: Bad space, store, options or TUNE_DIR (checked before anything is written).
    """
    t_wall = time.perf_counter()
    tune = Tune(tc, err, model_factory, resume=resume)
    before = 0.0
    if not resume:
        if tune.root.exists():
            shutil.rmtree(tune.root)
        tune.write_settings()
    else:
        saved = tune.root / "progress.json"
        if saved.exists():
            tune.progress = {**tune.progress, **json.loads(saved.read_text())}
            before = tune.progress["elapsed_s"]
            tune.restore_brackets()
    with StopOnSignal(tune.err, notice="saving the tune's state after this epoch") as tune.stop:
        try:
            t0 = time.perf_counter()
            if not tune.progress["done"]:
                tune.search(t0)
                tune.progress["done"] = True
                tune._save_progress()
            search_s = tune.progress["elapsed_s"]
            by_id = {e.id: e for e in tune.entries}
            # the finalists of every completed bracket (a bracket the budget cut only when none completed)
            pool = tune.progress.get("finalists") or tune.progress["active"]
            t_final = time.perf_counter()
            left = None if tc.budget_s is None else tc.budget_s - search_s  # the playoff and the final runs
            ranked = rank_states([tune._state(by_id[i]) for i in pool])
            finalists = tune.by_price(ranked, left)
            first = next((k for k, s in enumerate(ranked) if tune._affordable(s, left)), 0)  # those ranked above it
            passed = [{"config": s.entry.id, "final_s_est": tune._final_of(s)} for s in ranked[:first] if s.epochs]
            best, playoff = tune.playoff(finalists, left)
            playoff_s = time.perf_counter() - t_final
            final = tune.final_runs(best)
            final_s = time.perf_counter() - t_final - playoff_s
        except (KeyboardInterrupt, StopRequested):
            print(f"tune interrupted; continue it with: trellis tune --resume {tune.root}", file=tune.err)
            raise KeyboardInterrupt from None
        except TrellisUserError:
            if not resume:  # a configuration no run takes: no half-written TUNE_DIR (its resume would fail alike)
                for s in tune.states.values():
                    s.log.close()
                shutil.rmtree(tune.root, ignore_errors=True)
            raise
        finally:
            for s in tune.states.values():
                s.log.close()
    board = _board(tune, best, final, search_s, final_s, before + time.perf_counter() - t_wall, playoff, playoff_s,
                   passed)
    write_json_atomic(tune.root / "leaderboard.json", board)
    (tune.root / "leaderboard.csv").write_text(leaderboard_csv(board))
    (tune.root / "best").mkdir(exist_ok=True)
    best_cfg = replace(best.cfg, split_seed=tune.split_seeds[0])
    write_json_atomic(tune.root / "best" / "config.json", best_cfg.replay_dict())
    (tune.root / "report.md").write_text(report_text(board) + "\n")
    plot_tune(tune.root, board)
    return board


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _board(tune: Tune, best: SweepEntry, final: list[dict[str, Any]], search_s: float, final_s: float,
           wall_s: float, playoff: list[dict[str, Any]] | None = None, playoff_s: float = 0.0,
           passed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The leaderboard and the report's facts, JSON-ready."""
    m = tune.metric
    last_rung = {i: -1 for i in (e.id for e in tune.entries)}
    for rung in tune.progress["rungs"]:
        for i in rung["best"]:
            last_rung[i] = rung["rung"]
    rows = []
    for e in tune.entries:
        if e.id not in tune.states and (tune.root / "state" / f"{e.id}.pt").is_file():
            tune._state(e)  # halved before an interruption: a resumed tune reads its saved state back
        s = tune.states.get(e.id)
        if s is None or s.stopper.best_metrics.get(f"val_{m}") is None:
            continue  # never evaluated (the budget ran out before its batch trained an epoch)
        reached = last_rung[e.id]
        why = ("selected" if e.id == best.id else s.stopped  # the choice is marked whatever stopped its search
               or ("finalist" if e.id in tune.progress["active"] else f"halved after rung {reached}"))
        rows.append({"config": e.id, **e.params, "rung": reached, "epochs": s.epochs,
                     f"val_{m}": s.stopper.best_metrics.get(f"val_{m}"), "val_loss": s.stopper.best_val_loss,
                     "best_epoch": s.stopper.best_epoch, "time_s": s.time_s, "stopped": why,
                     "cost": list(cost_key(e.cfg))})
    order = {s.entry.id: k for k, s in enumerate(rank_states(list(tune.states.values())))}
    rows.sort(key=lambda r: (-r["rung"], order[r["config"]]))
    for k, r in enumerate(rows, 1):
        r["rank"] = k
    val = [r[f"val_{m}"] for r in final]
    test = [r[f"test_{m}"] for r in final]
    top5 = [r[f"val_{m}"] for r in rows[:5]]
    # Two sources of spread: the seed (initialization, dropout) within a split, and the split itself.
    per_split = [[r[f"test_{m}"] for r in final if r["split"] == j] for j in range(len(tune.split_seeds))]
    seed_std = statistics.fmean(_mean_std(t)[1] for t in per_split)
    split_std = _mean_std([statistics.fmean(t) for t in per_split])[1]
    return {
        "format": TUNE_FORMAT, "version": 1, "store": str(tune.strategy.store.path),
        "store_name": tune.strategy.store.name, "model": tune.tc.model, "metric": m, "search": tune.how,
        "space": space_to_json(tune.space), "candidates": len(tune.entries), "eta": tune.tc.eta,
        "rungs": tune.rungs, "schedule": [{k: v for k, v in r.items() if k != "best"} for r in tune.progress["rungs"]],
        "cut": tune.progress["cut"], "budget_s": tune.tc.budget_s, "search_time_s": search_s,
        "final_time_s": final_s, "playoff_time_s": playoff_s, "playoff": playoff or [], "passed_over": passed or [],
        "playoff_seeds": tune.tc.playoff_seeds, "playoff_rounds": tune.playoff_rounds,
        "playoff_skipped": tune.playoff_skipped,
        "wall_time_s": wall_s, "device": str(tune.device),
        "best": {"config": best.id, "params": best.params, "train_config": best.cfg.to_dict()},
        "final": final, "split_seeds": tune.split_seeds, "seeds": tune.tc.seeds,
        "val_mean": _mean_std(val)[0], "val_std": _mean_std(val)[1],
        "test_mean": _mean_std(test)[0], "test_std": _mean_std(test)[1],
        "test_min": min(test), "test_max": max(test), "test_seed_std": seed_std, "test_split_std": split_std,
        "top5_val": top5, "rows": rows, "out": str(tune.root),
    }


def is_tune_dir(path: Path) -> bool:
    """Whether ``path`` holds a tune (``--overwrite`` replaces only such a directory)."""
    return format_of(path / "tune.json") == TUNE_FORMAT


def leaderboard_csv(board: dict[str, Any]) -> str:
    """One row per candidate: rank, id, its values, rung reached, epochs, best validation metric, time."""
    m = board["metric"]
    cols = ["rank", "config", *board["space"], "rung", "epochs", f"val_{m}", "val_loss", "best_epoch", "time_s",
            "stopped"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in board["rows"]:
        w.writerow({c: (f"{r[c]:.6g}" if isinstance(r.get(c), float) else r.get(c)) for c in cols})
    return buf.getvalue()


def _pct(v: float) -> str:
    return f"{100 * v:.2f}"


def _margin(board: dict[str, Any]) -> str:
    """How far the choice stands from the rest: the playoff's runner-up when there was a playoff.

    The search's top five single runs say little after a playoff (on Cora its choice's run ranked 6th), so
    the playoff's two best means are compared, against the standard error of their difference.
    """
    playoff = board.get("playoff") or []
    if len(playoff) > 1 and min(len(r["val_runs"]) for r in playoff[:2]) > 1:
        a, b = playoff[0], playoff[1]
        se = 100 * math.sqrt(sum(statistics.variance(r["val_runs"]) / len(r["val_runs"]) for r in (a, b)))
        gap = 100 * (a["val_mean"] - b["val_mean"])
        return (f"The playoff's runner-up ({b['config']}) averaged {_pct(b['val_mean'])} on validation, {gap:.2f} "
                f"points below the choice (standard error of the difference {se:.2f}), so the choice is "
                f"{'clear' if gap > 2 * se else 'within the noise of the runner-up'}. ")
    passed = board.get("passed_over") or []
    if passed:  # the spread of the top five says nothing of a choice that is not among them
        return (f"The choice is not the search's best: the {len(passed)} ranked above it were passed over (above), "
                "so its margin is not measured. ")
    top5 = board["top5_val"]
    return (f"The top five candidates scored {_pct(min(top5))} to {_pct(max(top5))} on validation, so the choice "
            f"is {'clear' if max(top5) - min(top5) > 2 * board['val_std'] else 'within the noise of the runners-up'}. ")


def report_text(board: dict[str, Any]) -> str:
    """The one-paragraph report."""
    m, best = board["metric"], board["best"]
    params = ", ".join(f"{k}={v}" for k, v in best["params"].items())
    # the first bracket's rungs (later brackets repeat the same schedule over fresh candidates)
    sched = " → ".join(f"{r['candidates']} × {r['epochs']} ep" for r in board["schedule"] if r.get("bracket", 0) == 0)
    cut = ""
    if board["cut"] and board["cut"].get("bracket", 0) > 0:
        cut = (f" The budget then cut bracket {board['cut']['bracket'] + 1} in rung {board['cut']['rung']}; the "
               "choice is among the completed brackets' finalists.")
    elif board["cut"]:
        cut = (f" The budget cut the search in rung {board['cut']['rung']}; the choice is among the candidates "
               "that reached it.")
    brackets = len({r.get("bracket", 0) for r in board["schedule"]})
    if brackets > 1:
        cut = (f" The schedule finished with budget left, so {brackets - 1} more bracket(s) of fresh candidates "
               f"ran on the same schedule ({board['candidates']} candidates in all).") + cut
    playoff = board.get("playoff") or []
    if playoff:
        rank = [r["config"] for r in sorted(playoff, key=lambda r: -r["search_val"])].index(best["config"]) + 1
        cut += (f" The {len(playoff)} best finalists were each retrained with {board['playoff_seeds']} fresh seeds "
                f"and the best mean validation {m} chose ({', '.join(_pct(r['val_mean']) for r in playoff)}; the "
                f"choice's search run ranked {rank} of {len(playoff)}).")
        named = {r["config"] for r in board.get("passed_over") or []}  # named below: their final runs alone
        skipped = [c for c in board.get("playoff_skipped") or [] if c not in named]
        if skipped:
            cut += (f" The playoff passed over {', '.join(skipped)}, whose playoff and final runs the budget left "
                    "could not pay for beside the others'.")
        rounds = board.get("playoff_rounds", 1)
        if rounds > 1:
            raced = sum(len(r["val_runs"]) > board["playoff_seeds"] for r in playoff)
            cut += (f" With budget left, the finalists within two standard errors of the leader raced on for "
                    f"{rounds - 1} more round(s) of fresh seeds ({raced} raced; the choice's mean is over "
                    f"{len(playoff[0]['val_runs'])} runs).")
    passed = board.get("passed_over") or []
    if passed:
        cut += (f" The {len(passed)} best-ranked finalist(s) were passed over: the budget left could not pay for "
                "their final runs (" + ", ".join(f"{r['config']}, {r['final_s_est']:.0f} s"
                                                        for r in passed) + ").")
    b_s = board["budget_s"]
    budget = ("" if not b_s else f" of a {b_s / 60:.0f}-minute budget" if b_s % 60 == 0
              else f" of a {b_s:.0f}-s budget")
    n_final = len(board["final"])
    return (
        f"Tuned {board['model']} on {board['store_name']}: {board['candidates']} candidates ({board['search']} "
        f"draws from the search space), successive halving with eta = {board['eta']} ({sched}), selected on "
        f"validation {m} only, ties to the cheaper configuration.{cut} Chosen: {best['config']} ({params}). "
        f"Retrained over {len(board['split_seeds'])} split(s) × {board['seeds']} seed(s) ({n_final} runs"
        + ("; one split: --splits 1, or the store has no other (neither a per-class protocol to redraw nor "
           "fixed splits)"
           if len(board["split_seeds"]) == 1 else "") + "): "
        f"validation {m} {_pct(board['val_mean'])} ± {_pct(board['val_std'])}, test {m} "
        f"{_pct(board['test_mean'])} ± {_pct(board['test_std'])} (runs from {_pct(board['test_min'])} to "
        f"{_pct(board['test_max'])}; standard deviation over seeds within a split {_pct(board['test_seed_std'])}, "
        f"of the split means {_pct(board['test_split_std'])}); the test split was read only for these runs. "
        + _margin(board) +
        f"Wall time {board['wall_time_s']:.0f} s{budget} (search {board['search_time_s']:.0f} s"
        + (f", playoff {board['playoff_time_s']:.0f} s" if playoff else "") + ", final runs "
        f"{board['final_time_s']:.0f} s) on {board['device']}. "
        + (f"The final runs alone took longer than the whole budget: a budget of at least "
           f"{2 * board['final_time_s']:.0f} s would leave the search as much time as them. "
           if b_s and board["final_time_s"] > b_s else "") +
        f"`trellis train --config {board['out']}/best/config.json` replays run s0-r0."
    )


def format_tune(board: dict[str, Any], top: int = 10) -> str:
    """The leaderboard's top rows and the report, as plain text."""
    m = board["metric"]
    keys = list(board["space"])
    head = ["#", "config", *keys, "rung", "epochs", f"val {m}", "time s", "stopped"]
    table = [[str(r["rank"]), r["config"], *(str(r.get(k)) for k in keys), str(r["rung"]), str(r["epochs"]),
              f"{r[f'val_{m}']:.4f}", f"{r['time_s']:.1f}", r["stopped"]] for r in board["rows"][:top]]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(t, widths)) for t in table]
    return "\n".join(lines) + "\n\n" + report_text(board)


def plot_tune(root: Path, board: dict[str, Any]) -> None:
    """``leaderboard.png``: every candidate's validation metric against the tune's wall clock, and the final runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = board["metric"]
    fig, (ax, ax_f) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    for r in board["rows"]:
        xs: list[float] = []
        ys: list[float] = []
        prev = None
        recs = [q for q in read_jsonl(root / "configs" / r["config"] / "metrics.jsonl") if f"val_{m}" in q]
        for k, q in enumerate(recs):  # the evaluated epochs (every epoch unless eval_every is set)
            if k and q.get("rung") != prev:  # a gap while other candidates train: the line breaks
                xs.append(math.nan)
                ys.append(math.nan)
            xs.append(q["clock_s"])
            ys.append(q.get(f"val_{m}", math.nan))
            prev = q.get("rung")
        top = r["rank"] <= 5
        ax.plot(xs, ys, lw=1.3 if top else 0.6,
                alpha=1.0 if top else 0.4, label=config_label(r) if top else None)
    ax.set(xlabel="tune wall clock (s)", ylabel=f"val {m}", title="candidates (top 5 labelled)")
    ax.legend(fontsize=7)
    final = board["final"]
    ax_f.scatter([f["split"] for f in final], [f[f"test_{m}"] for f in final], label="test")
    ax_f.scatter([f["split"] + 0.1 for f in final], [f[f"val_{m}"] for f in final], label="val")
    ax_f.set(xlabel="split", ylabel=m, title=f"{board['best']['config']}: final runs")
    ax_f.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(root / "leaderboard.png", dpi=100)
    plt.close(fig)


def load_resume(tune_dir: str) -> TuneConfig:
    """The settings of the tune in ``tune_dir`` (``--resume``).

    Raises:
        TrellisUserError: Not a tune directory, or its tune.json is unreadable.
    """
    path = Path(tune_dir) / "tune.json"
    if not is_tune_dir(Path(tune_dir)):
        raise TrellisUserError(f"--resume {tune_dir}: not a tune directory (no tune.json of a trellis tune)")
    try:
        settings = json.loads(path.read_text())["settings"]
    except (OSError, ValueError, KeyError) as exc:
        raise TrellisUserError(f"--resume {tune_dir}: cannot read {path} ({exc})") from None
    settings.pop("memory_budget_mb", None)  # tunes written before --memory-budget became the runs' budget
    if (Path(tune_dir) / "leaderboard.json").is_file():  # it ran again, its wall time replaced, to the same results
        raise TrellisUserError(f"--resume {tune_dir}: the tune has finished (its results are in "
                               f"{Path(tune_dir) / 'report.md'}); start a new tune with another --out")
    return TuneConfig(**{**settings, "out": str(tune_dir)})


__all__ = ["TuneConfig", "format_tune", "load_resume", "parse_duration", "run_tune", "rung_epochs"]
