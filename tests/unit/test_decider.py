"""The decider thread (``omnilearn.bsp.decider``): jobs run in order, outcomes and errors reach the joiner.

Run: ``python -m pytest -q tests/unit/test_decider.py``
"""

from __future__ import annotations

import threading

import pytest

from omnilearn.bsp.decider import Decider


def test_jobs_run_in_order_on_one_other_thread_and_the_joiner_gets_each_outcome():
    decider = Decider()
    seen: list[tuple[int, str]] = []
    pending = [decider.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i * i)
               for i in range(5)]
    assert [p.result() for p in pending] == [0, 1, 4, 9, 16]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {name for _, name in seen} == {"omnilearn-decide"}
    decider.stop()


def test_an_error_in_the_thread_is_raised_by_the_joiner_and_the_thread_goes_on():
    decider = Decider()

    def fail():
        raise RuntimeError("ranks are out of step")

    failed = decider.submit(fail)
    with pytest.raises(RuntimeError, match="out of step"):
        failed.result()
    assert decider.submit(lambda: "next").result() == "next"
    decider.stop()
    decider.stop()  # idempotent
    assert decider.submit(lambda: "again").result() == "again"  # a new thread after a stop
    decider.stop()
