"""The gathered row's layout and the plan checksum (:mod:`omnilearn.decisions`), pure.

- :func:`~omnilearn.decisions.table_row` puts every header field in its own
  slot and the window after :data:`~omnilearn.decisions.HEADER`; the flags
  (stop, reset pending) are read from any worker's row.
- :func:`~omnilearn.decisions.plan_checksum` covers the plan in force, every
  pending change and the lag (hypothesis: changing any one number of them
  changes it), not the changes a later one superseded; it is exact in the
  float64 header; :func:`~omnilearn.decisions.plans_differ` names the workers
  that differ from worker 0.
- :func:`~omnilearn.decisions.checks_pay`: mid-interval checks run where the steps between two of them last
  at least :data:`~omnilearn.decisions.CHECK_WINDOW_MIN_S`, judged on the slowest worker's median step of the
  last interval (:func:`~omnilearn.decisions.interval_step_s`); never without checks (``every`` 0).
- :func:`~omnilearn.decisions.window_steps`: an interval shorter than ``min_window_s`` is stretched to the fewest
  whole intervals that last it, at most :data:`~omnilearn.decisions.MAX_STRETCH`; never with ``min_window_s`` 0
  or no step time known, nor before the loop has :func:`~omnilearn.decisions.settled` (the warm-up's intervals,
  and the window after a change).
- The loop hands the model pairs only to a controller that reads them.

Run: ``python -m pytest -q tests/unit/test_decisions.py``
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, strategies as st

from omnilearn.balance.loop import WINDOW_FIELDS
from omnilearn.data.schedule import BatchSchedule
from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import Decision, make_controller
from omnilearn.balance.loop import ControlLoop, window_row
from omnilearn.decisions import (CHECK, CHECK_WINDOW_MIN_S, HEADER, INTERVAL, MAX_STRETCH, checks_pay,
                                 WARMUP_INTERVALS, interval_step_s, settled, window_steps,
                                 plan_checksum, plans_differ, reset_asked, stop_asked, table_row)


def test_every_header_field_has_its_slot_and_the_window_follows():
    window = [32.0, 5.0, 0.01, 0.001][:WINDOW_FIELDS]
    row = table_row(INTERVAL, 7, 9, window, stop=True, cap=48, step_s=0.5, reset=True, plan=2**32 - 1)
    assert row[:HEADER] == [INTERVAL, 7, 9, 1.0, 48.0, 0.5, 1.0, float(2**32 - 1)]
    assert row[HEADER:] == window and len(row) == HEADER + WINDOW_FIELDS
    quiet = table_row(CHECK, 7, 9, window)
    assert quiet[3:8] == [0.0, 0.0, 0.0, 0.0, 0.0]  # no stop, no cap, no step time, no reset, no checksum
    assert reset_asked([quiet, row]) and not reset_asked([quiet, quiet])
    assert stop_asked([quiet, row]) and not stop_asked([quiet])


def schedule(changes: list[tuple[int, tuple[int, ...]]]) -> BatchSchedule:
    s = BatchSchedule((32, 32))
    for start, plan in changes:
        s.change(start, plan)
    return s


def test_the_checksum_covers_the_plan_from_the_step_on_and_the_lag():
    base = plan_checksum(schedule([(4, (40, 24)), (9, (48, 16))]), 6, 2)
    assert base == plan_checksum(schedule([(3, (40, 24)), (9, (48, 16))]), 6, 2)  # the same from step 6 on
    assert base != plan_checksum(schedule([(4, (40, 24)), (10, (48, 16))]), 6, 2)  # a pending change moved
    assert base != plan_checksum(schedule([(4, (40, 24)), (9, (47, 17))]), 6, 2)
    assert base != plan_checksum(schedule([(4, (40, 24))]), 6, 2)  # one rank lacks the pending change
    assert base != plan_checksum(schedule([(4, (41, 23)), (9, (48, 16))]), 6, 2)  # the plan in force
    assert base != plan_checksum(schedule([(4, (40, 24)), (9, (48, 16))]), 6, 0)  # the lag
    assert float(base) == base and 0 <= base < 2**32  # exact in a float64 slot


@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 63)), min_size=1, max_size=6),
       st.data())
def test_changing_any_number_that_decides_the_samples_changes_the_checksum(gaps_batches, data):
    changes, start = [], 0
    for gap, b in gaps_batches:
        start += gap
        changes.append((start, (b, 64 - b)))
    step = data.draw(st.integers(0, changes[-1][0] - 1))  # the last change is still pending at this step
    k = data.draw(st.integers(0, len(changes) - 1))
    while changes[k][0] <= step and changes[k + 1][0] <= step:  # superseded before the step: not covered
        k += 1
    start_k, (b, _) = changes[k]
    moved = [*changes[:k], (start_k, (b % 63 + 1, 63 - b % 63)), *changes[k + 1:]]
    assert plan_checksum(schedule(changes), step, 1) != plan_checksum(schedule(moved), step, 1)


def test_plans_differ_names_the_workers_apart_from_worker_0():
    rows = [table_row(INTERVAL, 3, 5, [0.0] * WINDOW_FIELDS, plan=p) for p in (11, 11, 12, 13)]
    assert plans_differ(rows) == [2, 3] and plans_differ(rows[:2]) == []



def test_checks_pay_where_the_steps_between_two_last_long_enough():
    assert checks_pay(CHECK_WINDOW_MIN_S / 5, 5) and checks_pay(0.2, 5)
    assert not checks_pay(CHECK_WINDOW_MIN_S / 5 * 0.99, 5) and not checks_pay(0.002, 5)  # 2 ms steps: 10 ms
    assert not checks_pay(10.0, 0)  # an interval too short for checks has none
    rows = [table_row(INTERVAL, 15, 15, [0.0] * WINDOW_FIELDS, step_s=s) for s in (0.004, 0.011, 0.009)]
    assert interval_step_s(rows) == 0.011  # the step waits for the slowest worker


def test_short_intervals_are_stretched_to_whole_intervals_that_last_the_window():
    assert window_steps(0.010, 15, 0.15) == 15  # 0.15 s: as long as the window, not stretched
    assert window_steps(0.050, 15, 0.15) == 15
    assert window_steps(0.0099, 15, 0.15) == 30  # 0.1485 s: two intervals
    assert window_steps(0.0024, 15, 0.15) == 75  # a tiny model's 2.4 ms steps: 36 ms, five intervals (180 ms)
    assert window_steps(1e-6, 15, 0.15) == 15 * MAX_STRETCH == window_steps(1e-300, 15, 0.15)  # at most
    assert window_steps(0.0024, 15, 0.0) == 15  # min_window_s 0: never
    assert window_steps(0.0, 15, 0.15) == window_steps(float("nan"), 15, 0.15) == 15  # no step time known
    assert window_steps(0.0024, 15, 0.15, settled=False) == 15


def test_the_loop_settles_after_the_warm_up_and_a_window_without_a_change():
    held = Decision(step=59, old=(64, 64), new=(64, 64), times_s=(0.01, 0.01), changed=False, reason="held")
    moved = dataclasses.replace(held, new=(70, 58), changed=True, reason="moved")
    assert not settled(held, WARMUP_INTERVALS - 1) and settled(held, WARMUP_INTERVALS)
    assert not settled(moved, WARMUP_INTERVALS) and not settled(moved, 100)  # the next window judges the change


def test_the_model_pairs_go_only_to_a_controller_that_reads_them():
    seen = {}
    for name in ("uniform", "omnilearn", "model"):
        controller = make_controller(name, Bounds(64, 2, 4, 64), [1.0, 1.0])
        propose = controller.propose
        controller.propose = lambda est, name=name, propose=propose: (seen.__setitem__(name, est.history),
                                                                        propose(est))[1]
        loop = ControlLoop(controller)
        for step in range(4):
            loop.update(step, [window_row(b, [0.01, 0.011, 0.012]) for b in loop.batches])
    assert seen["uniform"] is None and seen["omnilearn"] is None
    assert seen["model"].shape == (10, 2, 2)
