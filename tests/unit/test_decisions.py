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
- The loop hands the model pairs only to a controller that reads them.

Run: ``python -m pytest -q tests/unit/test_decisions.py``
"""

from __future__ import annotations

from hypothesis import given, strategies as st

from omnilearn.balance.loop import WINDOW_FIELDS
from omnilearn.data.schedule import BatchSchedule
from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import make_controller
from omnilearn.balance.loop import ControlLoop, window_row
from omnilearn.decisions import (CHECK, CHECK_WINDOW_MIN_S, HEADER, INTERVAL, checks_pay, interval_step_s,
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
