"""StepTimer, DelayEmulator and the StepLedger's pairing of reported steps with timed ones, on the CPU.

Run: ``python -m pytest -q tests/unit/test_timing.py``
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from omnilearn.bsp.steps import ROW_FIELDS, StepLedger
from omnilearn.emulation.delay import DelayEmulator
from omnilearn.clocks.step import StepTimer


def busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_wait_is_the_time_between_ready_and_the_last_reduction():
    timer = StepTimer()
    timer.begin()
    timer.mark_ready()
    ready = timer.ready_s
    timer.mark_reduced(False)
    time.sleep(0.02)
    timer.mark_reduced(True)
    timer.end()
    (t,) = timer.collect()
    assert t.wait_s >= 0.02 and t.wait_s == pytest.approx(timer.reduced_s - ready)
    assert t.compute_s == pytest.approx(t.step_s - t.wait_s)
    assert timer.collect() == []  # collected once


def test_reductions_finishing_out_of_order_on_other_threads_keep_the_latest():
    timer = StepTimer()
    timer.begin()
    timer.mark_ready()
    before, after = [], []

    def reduce(delay_s: float) -> None:
        time.sleep(delay_s)
        before.append(time.perf_counter())
        timer.mark_reduced(False)
        after.append(time.perf_counter())

    threads = [threading.Thread(target=reduce, args=(d,)) for d in (0.03, 0.0, 0.01)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # The latest mark lies between the last thread's stamps around it (no tolerance: a busy host may pause a
    # thread for any time between its mark and a stamp taken after it).
    assert max(before) <= timer.reduced_s <= max(after)


def test_no_hook_means_no_wait():
    timer = StepTimer()
    timer.begin()
    timer.end()
    assert timer.collect()[0].wait_s == 0.0


def test_end_without_begin_is_an_error():
    with pytest.raises(RuntimeError, match="without begin"):
        StepTimer().end()


def test_delay_makes_the_step_at_least_slowdown_times_its_native_compute():
    torch.set_num_threads(1)  # native compute = process CPU time (load on the host does not count)
    timer = StepTimer()
    emulator = DelayEmulator(timer, 3.0)
    timer.begin()
    busy(0.03)
    # the native compute just before and just after the emulator's own reading: other threads of this process
    # (a test run's leftover ones) may add CPU time while it sleeps, so each bound uses the side that holds
    before_s = time.process_time() - timer.start_cpu_s
    slept = emulator.before_sync()
    after_s = time.process_time() - timer.start_cpu_s
    assert timer.elapsed_s() >= 3.0 * before_s * 0.98  # slept up to the target (or was already past it)
    assert slept <= max(0.0, 3.0 * after_s) and slept >= 0.0
    timer.mark_ready()
    timer.end()
    assert timer.collect()[0].delay_s == slept


def test_delay_applies_on_every_micro_step_cumulatively():
    torch.set_num_threads(1)
    timer = StepTimer()
    emulator = DelayEmulator(timer, 2.0)
    timer.begin()
    slept = []
    for _ in range(2):  # two micro-batches: after each, the step so far is >= 2x its native compute
        busy(0.02)
        before_s = time.process_time() - timer.start_cpu_s  # as above: the bound that other threads cannot break
        slept.append(emulator.before_sync())
        assert timer.elapsed_s() >= 2.0 * before_s * 0.98
    timer.mark_ready()
    timer.end()
    assert timer.collect()[0].delay_s == pytest.approx(sum(slept))


def test_native_speed_never_sleeps_and_bad_slowdowns_are_refused():
    timer = StepTimer()
    timer.begin()
    assert DelayEmulator(timer).before_sync() == 0.0
    with pytest.raises(ValueError, match="at least 1"):
        DelayEmulator(timer).set_slowdown(0.5)


def ledger_with_two_steps() -> tuple[StepLedger, StepTimer]:
    timer = StepTimer()
    ledger = StepLedger(timer, on_start=lambda step: None)
    for step in (0, 1):
        ledger.handed_out(step, restart=False)
        ledger.report(batch=8 + step, loss=0.5, lr=0.1)
    return ledger, timer


def test_each_reported_step_gets_its_own_row():
    ledger, _ = ledger_with_two_steps()
    rows = ledger.take_rows()
    assert [(r[0], r[1]) for r in rows] == [(0.0, 8.0), (1.0, 9.0)] and all(len(r) == len(ROW_FIELDS) for r in rows)


@pytest.mark.parametrize("drift", ["times collected elsewhere", "a step timed outside the ledger"])
def test_a_drift_between_reported_and_timed_steps_is_an_error_not_a_short_window(drift):
    ledger, timer = ledger_with_two_steps()
    if drift == "times collected elsewhere":  # the old zip paired nothing and dropped both rows silently
        timer.collect()
        counts = "2 step(s) reported but 0 timed"
    else:  # the old zip dropped the extra timed step without a word
        timer.begin()
        timer.end()
        counts = "2 step(s) reported but 3 timed"
    with pytest.raises(RuntimeError, match=re.escape(counts)):
        ledger.rows()
