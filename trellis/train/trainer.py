"""The trainer: one loop — runs, epochs, early stopping, checkpoints and the summary — over any strategy.

Why one loop: what one epoch and one evaluation are depends on the strategy (the whole graph; sampled
blocks or clusters from memory maps; pre-propagated rows; next, tiles of a graph beyond memory and a
distributed rank's partition), while everything around it — seeding, runs over seeds ``seed..seed+R-1``,
early stopping on the validation metric, restoring the best weights, checkpoints, the metrics log, timing
and memory — is the same for every strategy. Strategies register in :mod:`trellis.train.strategy`; every
training option (optimizer, momentum, init, task, metric, target accuracy, resume) therefore means the
same thing for each of them.

Resume is exact: a checkpoint holds the model, the optimizer, the early-stopping state, the strategy's own
state, the byte offset of ``metrics.jsonl`` and the Python, NumPy, torch (and CUDA) RNG states at an epoch
boundary, so a killed run continued with ``trellis train --resume RUN_DIR`` draws the same dropout masks and
batches and ends with the same metrics, line for line, as a run that was never interrupted.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from tqdm.auto import tqdm

import trellis
from trellis.errors import TrellisUserError
from trellis.plan.price import Price, run_value
from trellis.train.build import ModelFactory, build_run_optimizer, default_model_factory
from trellis.train.config import PATH_FIELDS, TrainConfig
from trellis.train.convergence import summarize_time_to_accuracy
from trellis.train.data import resolve_device
from trellis.train.early_stopping import EarlyStopping
from trellis.train.loop import Lane, StopOnSignal, run_epochs
from trellis.train.rng import get_rng_state, seed_everything, set_rng_state
from trellis.train.runs import (
    JOB_ENV,
    PEER_PREFIX,
    MetricsLog,
    RunLock,
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
from trellis.train.strategies import Strategy, strategy_class
from trellis.train.summary import RunSummary, split_metrics_of
from trellis.train.tasks import Task
from trellis.utils.atomic import remove_stale_temps
from trellis.utils.memory import PeakMemory
from trellis.utils.tempdirs import OwnedTempDir

CHECKPOINT_FORMAT = "trellis-checkpoint"
MODEL_FORMAT = "trellis-model"
FORMAT_VERSION = 1


def _load_checkpoint(paths: RunPaths) -> dict[str, Any]:
    """The run's checkpoint; a damaged one is one line that names it and the way out."""
    try:
        ckpt = torch.load(paths.checkpoint, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises pickle, OS and EOF errors for a damaged file
        raise TrellisUserError(f"{paths.checkpoint}: unreadable ({type(exc).__name__}); restore it, or remove it to "
                               "restart the run from its first epoch with --resume") from None
    if not isinstance(ckpt, dict):
        raise TrellisUserError(f"{paths.checkpoint}: not a checkpoint of this trellis version")
    return ckpt


def _check_checkpoint_config(paths: RunPaths, saved: Any, cfg: TrainConfig) -> None:
    """A checkpoint continues the configuration that wrote it: an edited config.json or a foreign one is named.

    The store's path, the run directory and the device may differ (a resume may name them anew), and ``epochs``:
    a bound, not part of any epoch's computation (a longer run continues the same trajectory).
    """
    if not isinstance(saved, dict):
        return
    now = cfg.to_dict()
    first = {"strategy": 0, "model": 1}  # a checkpoint of another kind of run is named as such
    diff = sorted((k for k in set(saved) | set(now)
                   if k not in ("store", "out", "device", "epochs") and saved.get(k) != now.get(k)),
                  key=lambda k: (first.get(k, 2), k))
    if diff:
        k = diff[0]
        raise TrellisUserError(f"--resume {paths.root}: its checkpoint was written with {k} = {saved.get(k)!r} but "
                               f"config.json says {now.get(k)!r}; restore config.json, or start a new run")


def _record_for_resume(cfg: TrainConfig, world_size: int) -> None:
    """Make ``cfg`` say what ``--resume`` needs to start this run again the same way, from anywhere.

    Paths become absolute (a layout, a cache or a spill root named relative to where the run started was not
    found by a resume from another directory). And a job started by torchrun (``--nproc`` unset) records its
    trainer count: a mini- or cluster-batch config without ``--nproc`` means one process training every part
    through its buffer, so the resume of a 2-rank torchrun job trained on silently as another strategy.
    """
    for key in PATH_FIELDS:
        value = getattr(cfg, key, None)
        if value:
            setattr(cfg, key, str(Path(value).resolve()))
    if cfg.nproc is None and world_size > 1 and cfg.strategy in ("mini", "cluster"):
        cfg.nproc = world_size


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
class _RunContext:
    """What every run of one ``fit`` shares."""

    strategy: Strategy
    task: Task
    metric: str
    paths: RunPaths
    log: MetricsLog
    meter: PeakMemory
    prog: _Progress
    checksum: str
    device: torch.device
    num_parameters: int = 0

    def peaks(self) -> dict[str, float]:
        """Memory peaks of this process merged with those of the process a resumed run started in."""
        now = self.meter.report()
        return {k: max(v, self.prog.memory.get(k, 0.0)) for k, v in {**self.prog.memory, **now}.items()}


EpochCallback = Callable[["Trainer", dict[str, Any]], None]


class Trainer:
    """Runs ``cfg.runs`` training runs of ``cfg.strategy`` and writes the run directory.

    Args:
        cfg: The validated configuration (copied: the caller's object is never changed).
        model_factory: Builds the message-passing model by name (default: :func:`trellis.nn.build_model`).
        callbacks: Called after every epoch with the trainer and the epoch's metrics record (tests use
            this to interrupt a run at a chosen epoch via :meth:`request_stop`).
        err: Stream for the progress bar and notices (default: stderr).
        handle_signals: Turn SIGINT/SIGTERM into "checkpoint and stop" while training (the CLI's choice; a
            library caller's process keeps its own handlers).
        run_dir: Write the run directory (default). False trains in a scratch directory that is removed at
            the end: the models and the history stay in memory (:attr:`models`, :attr:`history`), and the
            summary's ``run_dir`` is None (``trellis.train`` without ``out``).
        keep_models: Keep every run's best-validation model and the metrics records in memory.
        quiet: Print no banner (the strategy's description of what it runs): a library caller without progress.
    """

    def __init__(self, cfg: TrainConfig, *, model_factory: ModelFactory | None = None,
                 callbacks: Sequence[EpochCallback] = (), err: IO[str] | None = None,
                 handle_signals: bool = True, run_dir: bool = True, keep_models: bool = False,
                 quiet: bool = False) -> None:
        self.cfg = copy.deepcopy(cfg)
        self.model_factory = model_factory or default_model_factory
        self.callbacks = list(callbacks)
        self.err = err if err is not None else sys.stderr
        self.handle_signals = handle_signals
        self.write_run_dir = run_dir
        self.keep_models = keep_models or not run_dir
        self.quiet = quiet
        self._signal = StopOnSignal(self.err, enabled=False)
        self.paths: RunPaths | None = None
        #: Per run, its best-validation model (with ``keep_models``).
        self.models: list[nn.Module] = []
        #: Per run, what its model file holds beside the weights (with ``keep_models``; ``Run.predict`` reads it).
        self.headers: list[dict[str, Any]] = []
        #: The metrics records of every epoch (with ``keep_models``), as ``metrics.jsonl`` holds them.
        self.history: list[dict[str, Any]] = []
        self._lock: RunLock | None = None  # held on the run directory while this process writes it

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Checkpoint at the end of the current epoch and stop (what SIGINT/SIGTERM do)."""
        self._signal.signum = signum

    def _strategy(self, device: torch.device) -> Strategy:
        cls = strategy_class(self.cfg.strategy).for_config(self.cfg)
        cls.check_options(self.cfg)
        strategy = cls(self.cfg, device)
        strategy.open(self.cfg.edge_weight)
        return strategy

    # ---- explain --------------------------------------------------------------------------------
    def explain(self) -> str:
        """The model's plan on the strategy's data (``--explain``); trains nothing."""
        strategy = self._strategy(resolve_device(self.cfg.device))
        try:
            seed_everything(self.cfg.seed)
            return strategy.explain(strategy.build_model(self.model_factory))
        finally:
            strategy.close()

    # ---- fit ------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train every run (continuing from a checkpoint with ``cfg.resume``); returns the summary.

        Raises:
            TrainingInterrupted: SIGINT/SIGTERM (or :meth:`request_stop`) arrived; a checkpoint was written.
            TrellisUserError: Bad store, options or run directory.
        """
        cfg = self.cfg
        ckpt: dict[str, Any] | None = None
        if cfg.resume:
            paths = open_run_dir(cfg.resume, resume=True)
            if paths.summary.is_file():
                print(f"{paths.root}: run already complete; summary unchanged", file=self.err)
                return dict(read_json(paths.summary))
            if os.environ.get("RANK", "0") == "0":  # rank 0 writes the run directory (its peers, scratch ones)
                self._lock = RunLock(paths.root).acquire()
            for d in (paths.root, paths.checkpoint.parent, paths.models):  # a kill -9 mid-write left these
                remove_stale_temps(d)
            if paths.checkpoint.is_file():
                ckpt = _load_checkpoint(paths)
        # Everything that can refuse the input runs before a new run directory is created, so a bad
        # store or option leaves nothing behind.
        device = resolve_device(cfg.device)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True)
        # from before the data is loaded: a load's transient copies can be the run's peak
        meter = PeakMemory(device=device).start()
        try:
            strategy = self._strategy(device)
            try:
                return self._fit(strategy, device, ckpt, paths if cfg.resume else None, meter)
            finally:
                strategy.close()
        finally:
            meter.stop()
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _fit(self, strategy: Strategy, device: torch.device, ckpt: dict[str, Any] | None,
             paths: RunPaths | None, meter: PeakMemory) -> dict[str, Any]:
        cfg = self.cfg
        task = strategy.task
        metric = task.select_metric(cfg.metric)  # a metric that does not fit the store's task is refused here
        checksum = strategy.checksum
        strategy.build_model(self.model_factory)  # refuses bad model options before anything is written
        if ckpt is not None:
            assert paths is not None
            if ckpt.get("format") != CHECKPOINT_FORMAT or ckpt.get("version") != FORMAT_VERSION:
                raise TrellisUserError(f"{paths.checkpoint}: not a checkpoint of this trellis version")
            if ckpt["store_checksum"] != checksum:
                raise TrellisUserError(f"--resume {paths.root}: the store {cfg.store} differs from the one the run "
                                       "started on; pass the original STORE")
            _check_checkpoint_config(paths, ckpt.get("config"), cfg)
            derived = strategy.derived_inputs()
            then = ckpt.get("derived_inputs") or {}  # what an older checkpoint did not record is not compared
            changed = [k for k in then if then[k] != derived.get(k)]
            if changed:
                raise TrellisUserError(f"--resume {paths.root}: what the run trains on besides the store changed since "
                                       f"it started ({changed[0]}: {then[changed[0]]} then, {derived.get(changed[0])} "
                                       "now; a rebuilt --pp-dir or --parts-dir?); restore it, or start a new run")
            prog = _Progress(**ckpt["progress"])
            logged = paths.metrics.stat().st_size if paths.metrics.is_file() else -1
            if logged < prog.log_offset:
                raise TrellisUserError(f"--resume {paths.root}: {paths.metrics.name} is "
                                       + ("missing" if logged < 0 else f"shorter ({logged} bytes) than the "
                                          f"checkpoint's record of it ({prog.log_offset})")
                                       + "; the epochs it held cannot be recovered: start a new run")
        else:
            prog = _Progress()
        scratch = None
        owned = None
        if paths is None and not self.write_run_dir:
            owned = OwnedTempDir("trellis-run-")
            scratch = owned.name
            paths = prepare_run_dir(Path(scratch) / "run")
        elif strategy.world.rank != 0:  # a peer of the process that writes the run directory
            # named by the launcher's job, which removes what a killed peer leaves (train/launch.py); under torchrun
            # (no launcher) the next peer's directory removes it (an owned directory: utils/tempdirs.py)
            owned = OwnedTempDir(f"{PEER_PREFIX}{os.environ.get(JOB_ENV, 'torchrun')}-")
            scratch = owned.name
            paths = prepare_run_dir(Path(scratch) / "run")
        elif paths is None:
            root = Path(cfg.out or default_run_dir(Path(str(cfg.store)).name, cfg.model))
            if self._lock is None:
                self._lock = RunLock(root).acquire()  # before --overwrite could clear a running run's files
            paths = prepare_run_dir(root, overwrite=cfg.overwrite)
            cfg.out = str(paths.root)
            _record_for_resume(cfg, strategy.world.world_size)
            # the store recorded absolute: `--resume RUN_DIR` from another directory finds it
            write_json_atomic(paths.config, cfg.replay_dict())
        strategy.world.barrier("after the run directory")
        self.paths = paths
        banner = strategy.banner()
        if banner and strategy.world.rank == 0:
            if not self.quiet:
                print(banner, file=self.err)
            elif banner.startswith("warning: "):  # a library caller without progress still hears of a risk
                warnings.warn(banner.removeprefix("warning: "), stacklevel=3)
        log = MetricsLog(paths.metrics, offset=prog.log_offset if scratch is None else None)
        ctx = _RunContext(strategy, task, metric, paths, log, meter, prog, checksum, device)
        t_start = time.perf_counter()
        fresh = ckpt is None and scratch is None
        try:
            requested, self._signal = self._signal.signum, StopOnSignal(self.err, enabled=self.handle_signals,
                                                                  quiet=strategy.world.rank != 0)
            self._signal.signum = requested  # a stop requested before training started still holds
            with self._signal:
                run_state = ckpt.get("run_state") if ckpt else None
                rng = ckpt.get("rng") if ckpt else None
                for r in range(prog.run, cfg.runs):
                    try:
                        self._run(ctx, r, run_state if r == prog.run else None, rng)
                    except TrainingInterrupted:
                        raise  # its checkpoint continues the run
                    except Exception:
                        # failed in the first epoch (a user layer's wrong shape, a torch error in the user's code):
                        # leave nothing half-written, and no directory that `--resume` would be suggested for
                        if fresh and r == 0 and not prog.results and not log.offset:
                            log.close()
                            shutil.rmtree(paths.root, ignore_errors=True)
                        raise
                    run_state = rng = None
            summary = self._summary(ctx, time.perf_counter() - t_start).to_dict()
            if self.keep_models:
                self.history = list(iter_jsonl(paths.metrics))
        finally:
            log.close()
            if owned is not None:
                owned.cleanup()
        if scratch is None:
            plot_curves(paths.metrics, paths.curves, metric)
            write_json_atomic(paths.summary, summary)
        strategy.world.barrier("after the summary")
        return summary

    def _stopping(self, strategy: Strategy) -> bool:
        """Whether a stop was requested here or, in a distributed run, on any rank (every rank then stops).

        Every process first reaches the epoch's end (a missing rank is named), then a stop anywhere stops all.
        """
        world = strategy.world
        world.barrier("epoch end")
        if world.any(self._signal.signum is not None) and self._signal.signum is None:
            self._signal.signum = signal.SIGTERM
        return self._signal.signum is not None

    def _checkpoint(self, ctx: _RunContext, run_state: dict[str, Any] | None) -> None:
        ctx.prog.log_offset = ctx.log.offset
        ctx.prog.memory = ctx.peaks()
        torch_save_atomic({
            "format": CHECKPOINT_FORMAT, "version": FORMAT_VERSION, "store_checksum": ctx.checksum,
            "derived_inputs": ctx.strategy.derived_inputs(),
            "config": self.cfg.to_dict(), "progress": vars(ctx.prog), "run_state": run_state,
            "rng": get_rng_state(),
        }, ctx.paths.checkpoint)
        ctx.strategy.world.barrier("after the checkpoint")

    def _interrupt(self, ctx: _RunContext, run: int, epoch: int) -> None:
        assert self._signal.signum is not None
        raise TrainingInterrupted(ctx.paths.root, run, epoch, self._signal.signum)

    def _run(self, ctx: _RunContext, r: int, run_state: dict[str, Any] | None,
             rng: dict[str, Any] | None) -> None:
        cfg, task, prog, strategy = self.cfg, ctx.task, ctx.prog, ctx.strategy
        seed = cfg.seed + r
        if self._stopping(strategy):  # signal arrived between runs or while loading
            self._checkpoint(ctx, None)
            self._interrupt(ctx, r, prog.epoch)
        if run_state is None:
            seed_everything(seed)
        model = strategy.build_model(self.model_factory).to(ctx.device)
        ctx.num_parameters = sum(p.numel() for p in model.parameters())
        optimizer = build_run_optimizer(cfg, model)
        stopper = EarlyStopping(ctx.metric, cfg.patience, task.higher_is_better.get(ctx.metric, True))
        run_time = 0.0
        start = 0
        strategy.begin_run(seed)
        if run_state is not None:
            model.load_state_dict(run_state["model"])
            optimizer.load_state_dict(run_state["optimizer"])
            stopper.load_state_dict(run_state["best"], ctx.device)
            strategy.load_state_dict(run_state.get("strategy", {}))
            run_time = float(run_state["run_time_s"])
            start = prog.epoch
            assert rng is not None
            set_rng_state(rng)
        lane = Lane(cfg, model, optimizer, stopper, ctx.log, epochs=start, time_s=run_time,
                    step_times=prog.step_times, fields={"run": r, "seed": seed})
        bar = tqdm(total=cfg.epochs, initial=start, desc=f"run {r + 1}/{cfg.runs} (seed {seed})", unit="ep",
                   file=self.err, disable=None if cfg.progress and strategy.world.rank == 0 else True,
                   dynamic_ncols=True, leave=True)

        def on_record(ln: Lane, record: dict[str, Any]) -> None:
            for cb in self.callbacks:
                cb(self, record)
            val = record.get(f"val_{ctx.metric}")  # absent between evaluations (--eval-every)
            if val is not None:
                bar.set_postfix_str(f"loss {record['loss']:.4f} val {ctx.metric} {val:.4f}", refresh=False)
            bar.update(1)

        def after_epoch() -> None:
            periodic = cfg.checkpoint_every > 0 and lane.epochs % cfg.checkpoint_every == 0
            if self._stopping(strategy) or periodic:
                prog.run, prog.epoch = r, lane.epochs
                self._checkpoint(ctx, {
                    "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "best": stopper.state_dict(), "run_time_s": lane.time_s, "strategy": strategy.state_dict(),
                })
                if self._signal.signum is not None:
                    self._interrupt(ctx, r, lane.epochs)

        try:
            run_epochs([lane], strategy.open_batch, task, device=ctx.device, epoch_info=strategy.epoch_info,
                       sample=ctx.meter.sample, on_record=on_record, after_epoch=after_epoch)
        finally:
            bar.close()
        run_time = lane.time_s
        stopper.restore(model)  # the run ended (patience or epoch budget): keep the best-validation weights
        result = {"run": r, "seed": seed, "best_epoch": stopper.best_epoch, "epochs": lane.epochs, "time_s": run_time,
                  **stopper.best_metrics}
        header = model_header(cfg, ctx.metric, result, strategy.model_record(cfg))
        save_model(ctx.paths.model(r), model, header)
        if self.keep_models:
            self.models.append(model)
            self.headers.append(header)
        prog.results.append(result)
        prog.run, prog.epoch = r + 1, 0
        self._checkpoint(ctx, None)
        if r + 1 < cfg.runs and self._stopping(strategy):
            self._interrupt(ctx, r + 1, 0)

    def _summary(self, ctx: _RunContext, wall_s: float) -> RunSummary:
        cfg, prog, task, strategy = self.cfg, ctx.prog, ctx.task, ctx.strategy
        results = prog.results
        sign = 1.0 if task.higher_is_better.get(ctx.metric, True) else -1.0
        vals = [sign * res[f"val_{ctx.metric}"] for res in results]
        best_run = max(range(len(results)), key=lambda i: -math.inf if math.isnan(vals[i]) else vals[i])
        times = prog.step_times
        peaks = ctx.peaks()
        store = strategy.store
        info: dict[str, Any] = {
            "wall_time_s_this_process": wall_s,
            "num_parameters": ctx.num_parameters or _num_parameters(ctx.paths.model(best_run)),
            "num_classes": task.num_outputs, "device": str(ctx.device), "threads": torch.get_num_threads(),
            "store": str(store.path), "store_name": store.name, "store_checksum": ctx.checksum,
            "num_nodes": store.num_nodes, "num_edges": strategy.num_edges, "num_features": strategy.spec.in_dim,
            "run_dir": str(ctx.paths.root) if self.write_run_dir else None, "trellis_version": trellis.__version__,
            "torch_version": torch.__version__, "config": cfg.to_dict(),
        }
        # A run whose best epoch is in the last 5% of its epoch budget was still improving when it stopped.
        # AUC over a val split of one class is undefined (NaN): such runs chose their best epoch by val loss.
        info["undefined_val_metric"] = [i for i, res in enumerate(results) if math.isnan(res[f"val_{ctx.metric}"])]
        info["still_improving"] = [i for i, res in enumerate(results)
                                   if res["epochs"] >= cfg.epochs and res["best_epoch"] + 1 > 0.95 * cfg.epochs]
        strategy_info = strategy.summary_info()
        if cfg.price_per_hour is not None:
            info.update(self._priced(statistics.median(times), strategy_info, peaks["peak_rss_anon_mb"]))
        # Time to accuracy from the log, not from this process's memory: after --resume the epochs of
        # earlier processes exist only there (the log is truncated to the checkpoint, so it holds each
        # epoch exactly once).
        tta = summarize_time_to_accuracy(iter_jsonl(ctx.paths.metrics), ctx.metric, cfg.target_acc,
                                         higher_is_better=task.higher_is_better.get(ctx.metric, True))
        return RunSummary(
            metric=ctx.metric, strategy=cfg.strategy, model=cfg.model, task=task.name, runs=cfg.runs,
            seeds=[res["seed"] for res in results], best_epoch=[res["best_epoch"] for res in results],
            epochs_run=[res["epochs"] for res in results], best_run=best_run,
            split_metrics=split_metrics_of(results, task.metric_names, strategy.eval_splits),
            epoch_time_s_median=statistics.median(times), epoch_time_s_mean=statistics.fmean(times),
            steps_timed=len(times), train_time_s=sum(res["time_s"] for res in results),
            peak_rss_anon_mb=peaks["peak_rss_anon_mb"], peak_rss_mb=peaks["peak_rss_mb"],
            peak_cuda_mb=peaks.get("peak_cuda_mb"), per_run=results, time_to_accuracy=tta,
            strategy_info=strategy_info, info=info)

    def _priced(self, epoch_s: float, strategy_info: dict[str, Any], peak_anon_mb: float) -> dict[str, Any]:
        """Cost per epoch and value under ``--price-per-hour`` (see :mod:`trellis.plan.price`)."""
        assert self.cfg.price_per_hour is not None
        price = Price.parse(self.cfg.price_per_hour)
        per_rank_mb = strategy_info.get("rank_peak_rss_anon_mb") or [peak_anon_mb]
        threads = torch.get_num_threads()
        hourly = [price.machine_hourly(threads, float(mb) / 1024.0) for mb in per_rank_mb]
        return {"price": price.describe(), "machines": len(hourly), **run_value(epoch_s, hourly)}


def model_header(cfg: TrainConfig, metric: str, result: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """What ``models/run-N.pt`` holds beside the weights: the strategy's ``record`` (what rebuilds the model)."""
    return {"format": MODEL_FORMAT, "version": FORMAT_VERSION, "model": cfg.model, "strategy": cfg.strategy,
            "metric": metric, "result": result, "init": cfg.init, **record}


def save_model(path: Path, model: nn.Module, header: dict[str, Any]) -> None:
    """Write ``models/run-N.pt``: the weights and ``header`` (:func:`model_header`), what ``trellis predict`` reads."""
    torch_save_atomic({**header, "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}, path)


def _num_parameters(model_file: Path) -> int:
    """Parameter count from a saved model (when every run finished in an earlier process)."""
    sd = torch.load(model_file, map_location="cpu", weights_only=True)["state_dict"]
    return int(sum(v.numel() for v in sd.values() if v.is_floating_point()))


def train(cfg: TrainConfig, **kwargs: Any) -> dict[str, Any]:
    """Train with ``cfg`` and return the summary (see :class:`Trainer`).

    With ``parts_dir`` outside a launched rank this starts the ranks itself (:func:`trellis.train.launch.train_ranks`)
    and returns the job's summary, as ``trellis train --parts-dir`` does.
    """
    from trellis.train.launch import needs_launch, train_ranks

    if needs_launch(cfg):
        if kwargs.get("model_factory") is not None:
            raise TrellisUserError("a model_factory cannot travel to ranks started here; start the ranks with "
                                   "torchrun (each calls trellis.train.trainer.train) or pass nproc=1")
        return train_ranks(cfg, err=kwargs.get("err"))
    return Trainer(cfg, **kwargs).fit()
