"""The builders' priority: chosen by measurement over two epochs, and applied to threads and processes."""

from __future__ import annotations

import os
import threading

import pytest

from trellis.utils.priority import PriorityTrial, set_background


@pytest.mark.parametrize(("background_s", "normal_s", "chosen"), [(1.0, 1.2, True), (1.3, 1.1, False)])
def test_trial_runs_epoch_1_in_the_background_epoch_2_normal_then_keeps_the_faster(monkeypatch, background_s,
                                                                                   normal_s, chosen):
    monkeypatch.delenv("TRELLIS_BACKGROUND", raising=False)
    trial = PriorityTrial()
    seen = []
    for seconds in (5.0, background_s, normal_s, 9.0, 9.0):  # epoch 0 is a warm-up: its time says nothing
        seen.append(trial.before())
        assert trial.on is seen[-1]
        trial.after(seconds)
    assert seen == [False, True, False, chosen, chosen]
    assert trial.choice is chosen


@pytest.mark.parametrize(("value", "on"), [("0", False), ("1", True)])
def test_environment_variable_fixes_the_choice(monkeypatch, value, on):
    monkeypatch.setenv("TRELLIS_BACKGROUND", value)
    trial = PriorityTrial()
    seen = []
    for seconds in (1.0, 1.0, 2.0, 1.0):
        seen.append(trial.before())
        trial.after(seconds)
    assert seen == [on] * 4


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="scheduling policies are Linux's")
def test_set_background_moves_a_thread_to_idle_priority_and_back():
    got: dict[str, int] = {}
    ready, done = threading.Event(), threading.Event()

    def body() -> None:
        assert set_background(True)
        got["idle"] = os.sched_getscheduler(0)
        got["tid"] = threading.get_native_id()
        ready.set()
        done.wait(5)
        got["after"] = os.sched_getscheduler(0)

    t = threading.Thread(target=body)
    t.start()
    assert ready.wait(5)
    assert set_background(False, got["tid"])  # from outside, by thread id (as the producer does for processes)
    done.set()
    t.join()
    assert got["idle"] == os.SCHED_IDLE and got["after"] == os.SCHED_OTHER
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's own priority is untouched


def test_a_starving_trial_gives_up_at_once(monkeypatch):
    """Samplers in the background that starve the trainer (a busy shared machine): the normal priority from then
    on; a trainer that waits little, or briefly, keeps the trial going."""
    monkeypatch.delenv("TRELLIS_BACKGROUND", raising=False)
    trial = PriorityTrial()
    assert trial.before() is False  # epoch 0 warms up at the normal priority
    assert not trial.starving(5.0, 6.0)  # (nothing in the background to give up)
    trial.after(6.0)
    assert trial.before() is True
    assert not trial.starving(0.9, 1.5)  # too early to tell
    assert not trial.starving(0.8, 2.0)  # waited less than half the time
    assert trial.starving(1.2, 2.0)
    assert not trial.starving(5.0, 6.0)  # decided once
    assert trial.on is False and trial.choice is False
    trial.after(3.0)
    assert trial.before() is False and trial.before() is False  # and it stays so
