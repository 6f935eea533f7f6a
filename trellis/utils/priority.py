"""Batch preparation in the background: batch builders take the CPU time the trainer leaves idle.

The threads and processes that build batches can run at the lowest priority (Linux ``SCHED_IDLE``). Why: on a
machine whose cores the trainer keeps busy (its torch and numba threads, one per core), a builder at the same
priority preempts one of the trainer's threads, and each of the trainer's parallel regions then waits for the
thread that lost its core: training slows by more than the preparation's own work. Between its parallel regions
the trainer runs serial stretches (Python, small ops) that leave a core idle, and a builder at the lowest priority
runs exactly there. Measured on 2 cores (docs/benchmarks.md): one sampler process beside the trainer, the epoch
went from 1.24x to 1.15x the training alone.

It does not always pay: where preparation needs more than those idle stretches, the trainer waits for batches
instead of sharing its cores, and on a machine shared with other busy processes a builder at the lowest priority
gets almost no CPU. So the training loop measures instead of guessing (:class:`PriorityTrial`): its second epoch
runs with the builders in the background, its third at the normal priority, and the faster of the two decides the
rest of the run. ``TRELLIS_BACKGROUND=0`` (or ``1``) fixes the choice.
"""

from __future__ import annotations

import os
import threading

__all__ = ["PriorityTrial", "background_wanted", "set_background"]

_FIXED = os.environ.get("TRELLIS_BACKGROUND", "").strip().lower()
_state = {"on": _FIXED not in ("0", "false", "off")}
_lock = threading.Lock()


def background_wanted() -> bool:
    """Whether batch builders started now should run in the background (what :class:`PriorityTrial` chose)."""
    return bool(_state["on"])


def _choose(on: bool) -> None:
    with _lock:
        _state["on"] = on


class PriorityTrial:
    """The training loop's choice of the builders' priority, by measurement (see the module's docstring).

    Epoch 0 warms up (compiled kernels, page faults) in the background; epoch 1 runs in the background, epoch 2 at
    the normal priority; from epoch 3 on, the faster of those two. Call :meth:`before` at each epoch's start (it
    returns the priority to apply to builders that already run) and :meth:`after` with the epoch's seconds.
    """

    def __init__(self) -> None:
        self.fixed = _FIXED in ("0", "1", "false", "true", "off", "on")
        self.seconds: dict[bool, float] = {}
        self.epoch = 0
        self.choice: bool | None = background_wanted() if self.fixed else None

    def before(self) -> bool:
        """This epoch's priority (True: background); builders started from now on take it."""
        on = self.choice if self.choice is not None else self.epoch != 2
        _choose(on)
        return on

    def after(self, seconds: float) -> None:
        """Record the epoch just trained; after epoch 2, keep the faster priority."""
        if self.choice is None and self.epoch in (1, 2):
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
