"""The epoch loop: K configurations trained together (one for ``trellis train``) until each stops.

Why one loop: a solo run, a model-batched sweep and a tune's rungs all do the same thing per epoch — train a
step, evaluate, update each configuration's early stopping, log its record, drop the configurations that
stopped — and differ only in how many configurations share a step and what surrounds the loop (the
trainer's checkpoints and signals, a tune's rungs and deadline). The step itself is the strategy's: a
:class:`ModelBatch` from :meth:`trellis.train.strategy.Strategy.open_batch` trains its active
configurations one epoch (the full-batch strategy in one model-batched pass over the graph, the
pre-propagation strategy over one read of each batch's rows; others one configuration at a time), so every
strategy that can train one configuration can be swept and tuned, and one that shares its reads between
configurations is faster for it.

A configuration's records are the same whatever shares its step: ``step_time_s`` and ``time_s`` are its
share of the batch's (all of it for a batch of one), and a batch's records add ``batch_size`` and
``batch_step_time_s``. The share follows each lane's :attr:`Lane.weight` (the cost model's estimate of its
epoch): an equal split priced a hidden-256 GCN batched with a hidden-32 one at half its solo time (77 ms of
144 ms per epoch on minesweeper), and a tune that reserves its final runs at that price ran over its budget.
"""

from __future__ import annotations

import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import torch
from torch import Tensor, nn

from trellis.nn.runtime import generator_scope
from trellis.train.config import TrainConfig
from trellis.train.early_stopping import EarlyStopping
from trellis.train.runs import MetricsLog
from trellis.train.tasks import Task
from trellis.utils.signals import defer_if_in_llvm


@dataclass
class Lane:
    """One configuration under training: everything its next epoch depends on, and its log.

    A lane outlives a batch: ``trellis tune`` trains a configuration a few epochs in one batch, ranks it, and
    continues the survivors in new batches.

    Attributes:
        cfg: The configuration (what ``trellis train`` would run).
        model: Its model.
        optimizer: Its optimizer.
        stopper: Its early stopping on the validation metric.
        log: Its ``metrics.jsonl``.
        generator: Where its dropout masks are drawn from (None: the default generator, a solo run).
        epochs: Epochs trained so far.
        time_s: Its share of the wall time of those epochs (training step and evaluation).
        step_times: Its share of each training step.
        stopped: ``patience`` or ``epochs`` once it stopped for good; empty while it may continue.
        fields: Fields that lead each of its records (``run`` and ``seed``).
        weight: Its estimated work beside the others of its batch (any unit): the batch's time is divided in
            these proportions (:meth:`trellis.train.strategy.Strategy.epoch_weight`).
    """

    cfg: TrainConfig
    model: nn.Module
    optimizer: Any
    stopper: EarlyStopping
    log: MetricsLog
    generator: torch.Generator | None = None
    epochs: int = 0
    time_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    stopped: str = ""
    fields: dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0


class ModelBatch(ABC):
    """The configurations a strategy trains in one step; :attr:`active` indexes the models it was opened with."""

    active: list[int]

    @abstractmethod
    def step(self, optimizers: Sequence[Any], task: Task, epoch: int) -> list[Tensor]:
        """Train every active configuration one epoch (``optimizers`` in :attr:`active` order); their losses."""

    @abstractmethod
    def evaluate(self, task: Task) -> list[dict[str, float]]:
        """Every active configuration's metrics (``<split>_<metric>`` and ``val_loss``), in :attr:`active` order."""

    def drop(self, k: int) -> None:
        """Configuration ``k`` stopped: leave it out of later steps."""
        if k in self.active:
            self.active.remove(k)


class SoloBatch(ModelBatch):
    """One configuration through the strategy's own ``train_step`` and ``evaluate``.

    Args:
        strategy: The strategy (a :class:`~trellis.train.strategy.Strategy`).
        model: The configuration's model.
        generator: Its dropout generator (None: the default generator, as ``trellis train`` runs).
        keep_splits: Splits whose metrics are reported (None: every split the strategy scores); a tune's
            search leaves the test split out.
    """

    def __init__(self, strategy: Any, model: nn.Module, generator: torch.Generator | None = None,
                 keep_splits: Sequence[str] | None = None) -> None:
        self.strategy, self.model, self.generator = strategy, model, generator
        self.keep = None if keep_splits is None else tuple(keep_splits)
        self.active = [0]

    def step(self, optimizers: Sequence[Any], task: Task, epoch: int) -> list[Tensor]:
        """The strategy's training step, its dropout drawn from the configuration's generator."""
        with generator_scope(self.generator):  # None: the default generator, as a solo run draws
            return [self.strategy.train_step(self.model, optimizers[0], task, epoch)]

    def evaluate(self, task: Task) -> list[dict[str, float]]:
        """The strategy's evaluation, restricted to the kept splits."""
        ev = self.strategy.evaluate(self.model, task)
        if self.keep is not None:
            dropped = tuple(f"{s}_" for s in self.strategy.eval_splits if s not in self.keep)
            ev = {k: v for k, v in ev.items() if not k.startswith(dropped)}
        return [ev]


class StopRequested(Exception):  # noqa: N818 - an outcome, not an error
    """A signal asked the loop to stop; raised at an epoch boundary by :meth:`StopOnSignal.check`."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopOnSignal:
    """SIGINT/SIGTERM become a stop request honoured at the next epoch boundary; a second SIGINT aborts at once.

    The trainer checkpoints there and stops (``--resume`` continues it); a tune saves the states of the batch it
    was in. Handlers are installed only while the context is entered, only in the main thread, and only when
    ``enabled`` (a library caller's process keeps its own).

    Args:
        err: Where the notice goes.
        enabled: Install the handlers.
        notice: What the notice says will happen.
        quiet: Print no notice (a peer rank: rank 0 speaks for the job).
    """

    def __init__(self, err: IO[str], enabled: bool = True,
                 notice: str = "writing a checkpoint after this epoch", quiet: bool = False) -> None:
        self.err, self.enabled, self.notice, self.quiet = err, enabled, notice, quiet
        #: The signal that asked to stop (None: none yet).
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._retry: threading.Timer | None = None

    def __enter__(self) -> StopOnSignal:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        if self._retry is not None:
            self._retry.cancel()
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def check(self) -> None:
        """Raise :class:`StopRequested` if a signal asked to stop (call it at an epoch boundary)."""
        if self.signum is not None:
            raise StopRequested(self.signum)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            self._retry = defer_if_in_llvm(signum, frame)  # a raise inside numba's compilation would be lost
            if self._retry is None:
                raise KeyboardInterrupt
            return
        self.signum = signum
        if not self.quiet:
            print(f"\n{signal.Signals(signum).name}: {self.notice} (press Ctrl-C again to abort without one)",
                  file=self.err)


#: Called after each epoch with a lane and its record (the trainer's callbacks, a progress bar).
OnRecord = Callable[[Lane, dict[str, Any]], None]


def run_epochs(lanes: Sequence[Lane], open_batch: Callable[[list[Lane]], ModelBatch], task: Task, *,
               until: int | None = None, deadline: float | None = None, device: torch.device | None = None,
               epoch_info: Callable[[], dict[str, Any]] = dict, sample: Callable[[], None] | None = None,
               on_record: OnRecord | None = None, after_epoch: Callable[[], None] | None = None,
               tag: dict[str, Any] | None = None, clock: Callable[[], float] | None = None) -> bool:
    """Train ``lanes`` together, one step per epoch, until each stops or reaches ``until`` epochs.

    A lane stops for good at its early-stopping patience or its ``epochs``; ``until`` pauses the others, which
    a later call continues exactly.

    Args:
        lanes: The configurations.
        open_batch: Opens the strategy's batch over the lanes that still train (called once).
        task: The task (loss and metrics).
        until: Pause every lane at this many epochs (None: train each to its stop).
        deadline: A ``time.perf_counter`` value no epoch may end after: one that would, at the last epoch's pace,
            does not start. (An epoch that crossed it was the overshoot by which a budgeted tune's likely choice,
            whose final runs the deadline had reserved exactly, no longer fit and was passed over.)
        device: The device (CUDA work is synchronized around the timed step).
        epoch_info: Strategy fields added to every record (e.g. spill traffic).
        sample: Samples the memory peaks (after the step and after evaluation).
        on_record: Called with each lane's record after it is logged.
        after_epoch: Called after an epoch when some lane goes on (the trainer's checkpoints and stop requests).
        tag: Fields added to every record; with it (a sweep or a tune) records also carry the batch's size and
            step time.
        clock: A clock whose reading each record carries as ``clock_s`` (a tune's wall clock).

    Returns:
        False when the deadline passed before every lane was done.
    """
    limit = [min(ln.cfg.epochs, until if until is not None else ln.cfg.epochs) for ln in lanes]
    run_ids = [k for k, ln in enumerate(lanes) if not ln.stopped and ln.epochs < limit[k]]
    if not run_ids:
        return True
    batch = open_batch([lanes[k] for k in run_ids])
    cuda = device is not None and device.type == "cuda"
    # an epoch that would end past the deadline does not start: its length is the last epoch's, or before the
    # first the lanes' own measured epochs (their shares of earlier batches) added up
    last_s = sum(lanes[k].time_s / lanes[k].epochs for k in run_ids if lanes[k].epochs)
    while batch.active:
        if deadline is not None and time.perf_counter() + last_s > deadline:
            return False
        run = [lanes[run_ids[j]] for j in batch.active]
        t_epoch = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        losses = batch.step([ln.optimizer for ln in run], task, run[0].epochs)
        if cuda:
            torch.cuda.synchronize(device)
        step = time.perf_counter() - t0
        loss_values = [float(v) for v in losses]
        if sample is not None:
            sample()
        # evaluate when some lane is due (--eval-every), ends, or pauses here; every lane then gets the figures
        due = any(_eval_due(ln, limit[run_ids[j]]) for j, ln in zip(batch.active, run))
        evs: list[dict[str, float]] = batch.evaluate(task) if due else [{} for _ in run]
        if sample is not None:
            sample()
        if cuda:
            torch.cuda.synchronize(device)
        epoch_s = last_s = time.perf_counter() - t_epoch
        total = sum(ln.weight for ln in run)
        extra = epoch_info()
        stop: list[int] = []
        for j, ln, loss, ev in zip(list(batch.active), run, loss_values, evs):
            epoch = ln.epochs
            if ev:
                ln.stopper.update(epoch, ev, ln.model)
            part = ln.weight / total
            ln.time_s += epoch_s * part
            ln.step_times.append(step * part)
            ln.epochs = epoch + 1
            # time_s: cumulative wall time of this configuration's epochs (its share of the training step and
            # evaluation); setup and checkpoint writes are left out, and it continues from a checkpoint on
            # resume, so time to a target depends neither on checkpoint frequency nor on downtime.
            record = {**ln.fields, "epoch": epoch, "loss": loss, **ev, "best_epoch": ln.stopper.best_epoch,
                      "step_time_s": step * part, "time_s": ln.time_s, **extra}
            if tag is not None:
                record.update({**tag, "batch_size": len(run), "batch_step_time_s": step})
            if clock is not None:
                record["clock_s"] = clock()
            ln.log.write(record)
            if on_record is not None:
                on_record(ln, record)
            if ev and ln.stopper.should_stop:
                ln.stopped = "patience"
            elif ln.epochs >= ln.cfg.epochs:
                ln.stopped = "epochs"
            if ln.stopped or ln.epochs >= limit[run_ids[j]]:
                stop.append(j)
        for j in stop:
            batch.drop(j)
        if batch.active and after_epoch is not None:
            after_epoch()
    return True


def _eval_due(lane: Lane, limit: int) -> bool:
    """Whether the epoch just trained (``lane.epochs + 1``) is evaluated.

    Every ``eval_every``-th epoch is, the last of its ``epochs`` and the last before a pause at ``limit`` (a
    tune's rung) too, so a run always ends on an evaluation.
    """
    done = lane.epochs + 1
    every = lane.cfg.eval_every
    return done % every == 0 or done >= lane.cfg.epochs or done >= limit
