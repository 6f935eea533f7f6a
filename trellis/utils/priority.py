"""Sampler processes in the background: batch builders take the CPU time the trainer leaves idle.

The sampler processes (``--samplers K``) can run at the lowest priority (Linux ``SCHED_IDLE``). Why: on a machine
whose cores the trainer keeps busy (its torch and numba threads, one per core), a sampler at the same priority
preempts one of the trainer's threads, and each of the trainer's parallel regions then waits for the thread that
lost its core: training slows by more than the sampler's own work. Between its parallel regions the trainer runs
serial stretches (Python, small ops) that leave a core idle, and a sampler at the lowest priority runs exactly
there. Measured on 2 cores (docs/benchmarks.md): one sampler process beside the trainer, the epoch was 5-11%
shorter in every run.

It does not always pay: where preparation needs more than those idle stretches, the trainer waits for batches
instead of sharing its cores, and on a machine shared with other busy processes a sampler at the lowest priority
gets almost no CPU. So the training loop measures instead of guessing (:class:`PriorityTrial`): its second epoch
runs with the samplers in the background, its third at the normal priority, and the faster of the two decides the
rest of the run; a background epoch in which the trainer waits for more than half of its first seconds ends the
trial at once. ``TRELLIS_BACKGROUND=0`` (or ``1``) fixes the choice.

Threads of the trainer's own process (the loaders' prefetching) stay at the normal priority: a thread at the lowest
priority that holds the GIL stalls every other thread of the process until it is scheduled again. Measured with
two busy processes beside a run on 2 cores: an in-memory epoch whose prefetching thread was in the background took
42-51 s instead of 2-3 s, even with the trial giving up as soon as it could run.
"""

from __future__ import annotations

import os

__all__ = ["STARVING", "PriorityTrial", "set_background"]

#: A trial in the background gives up at once when the trainer has waited for batches more than this fraction of
#: an epoch's first seconds (:meth:`PriorityTrial.starving`): on a machine other processes keep busy, the lowest
#: priority gets almost nothing, and an epoch would crawl.
STARVING = 0.5


def _fixed() -> bool | None:
    """The choice ``TRELLIS_BACKGROUND`` fixes (``1``/``0``), or None (measure)."""
    value = os.environ.get("TRELLIS_BACKGROUND", "").strip().lower()
    return True if value in ("1", "true", "on") else False if value in ("0", "false", "off") else None


class PriorityTrial:
    """The training loop's choice of the sampler processes' priority, by measurement (see the module's docstring).

    Epoch 0 warms up (compiled kernels, page faults) at the normal priority; epoch 1 runs in the background, epoch 2
    at the normal priority; from epoch 3 on, the faster of those two. Call :meth:`before` at each epoch's start (it
    returns the priority to apply to the sampler processes), :meth:`starving` as batches arrive, and :meth:`after`
    with the epoch's seconds. A trial that starves the trainer ends at once at the normal priority.

    Attributes:
        on: This epoch's priority (True: background), as :meth:`before` or :meth:`starving` last set it.
        choice: The priority of every later epoch once chosen (None while the trial runs).
    """

    def __init__(self) -> None:
        self.choice: bool | None = _fixed()
        self.fixed = self.choice is not None
        self.on = False
        self.seconds: dict[bool, float] = {}
        self.epoch = 0

    def before(self) -> bool:
        """This epoch's priority (True: background)."""
        self.on = self.choice if self.choice is not None else self.epoch == 1
        return self.on

    def starving(self, wait_s: float, elapsed_s: float) -> bool:
        """Mid-epoch: whether builders in the background starve the trainer; if so, the normal priority from now on.

        Called as batches arrive and while the trainer waits. True (once) when this epoch's builders run in the
        background, at least two seconds have passed and the trainer waited more than :data:`STARVING` of them:
        the choice is then made (normal priority), and the caller moves its sampler processes.
        """
        if self.fixed or not self.on or elapsed_s < 2.0 or wait_s <= STARVING * elapsed_s:
            return False
        self.choice = self.on = False
        return True

    def after(self, seconds: float) -> None:
        """Record the epoch just trained; after epoch 2, keep the faster priority."""
        if self.choice is None and self.epoch in (1, 2):  # (no choice made yet, e.g. by starving)
            self.seconds[self.epoch == 1] = float(seconds)
            if self.epoch == 2:
                self.choice = self.seconds[True] <= self.seconds[False]
        self.epoch += 1


def set_background(on: bool, tid: int = 0) -> bool:
    """Run thread or process ``tid`` (0: the calling thread) at the lowest priority (``on``) or the normal one.

    Linux ``SCHED_IDLE`` (threads started later by that thread inherit it); elsewhere nice 19 (only ``on`` and
    ``tid == 0``). Returns whether the priority was set: a priority is an optimization, never a reason to fail.
    """
    try:
        policy = os.SCHED_IDLE if on else os.SCHED_OTHER
        os.sched_setscheduler(tid, policy, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        if not on or tid != 0:
            return False
        try:
            os.nice(19)
            return True
        except OSError:
            return False
