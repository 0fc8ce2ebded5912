"""``omnilearn.tf.aspwatch.CallWatch`` on a scripted clock: which call is late, and each handed over once.

Run: ``python -m pytest -q tests/unit/test_aspwatch.py``
"""

from __future__ import annotations

from omnilearn.tf.aspwatch import CallWatch


def test_a_first_call_gets_the_timeout_later_ones_the_heartbeat_and_each_late_one_is_handed_over_once():
    watch = CallWatch(2, heartbeat_s=4.0, timeout_s=10.0)
    watch.begin(0, 0.0, 0, [1, 2])
    watch.begin(1, 0.0, 0, [3])
    assert watch.late(9.0) == []  # neither answered yet: a first call traces, allowed 10 s
    watch.back(0)
    watch.answered[0] = True
    watch.begin(0, 9.0, 1, [4])
    assert watch.late(12.0) == [(1, 12.0, 0, [3])]  # worker 1's first call, 12 s
    assert watch.hung == {1} and watch.late(30.0) == [(0, 21.0, 1, [4])]  # worker 0 answered: 4 s
    assert watch.late(40.0) == [] and watch.hung == {0, 1}


def test_a_call_back_in_time_is_never_late():
    watch = CallWatch(1, heartbeat_s=1.0, timeout_s=1.0)
    watch.begin(0, 0.0, 0, [0])
    watch.back(0)
    assert watch.late(100.0) == [] and not watch.hung
