"""The ControlLoop's guards (balance/guards.py) and the controllers' rounding to multiples.

- per-worker caps: configured caps hold in every proposal; a reported cap (an
  out-of-memory error) re-plans at once; the adaptive upper bound caps a worker
  whose throughput fell after its batch grew, and a speed shift forgets it;
- the step guard takes back a change whose measured step got slower, then holds;
- ``round_multiple`` keeps batches in multiples of k, the sum exact;
- ``shifted`` flags a clear speed change in a few steps, not noise.

Run: ``python -m pytest -q tests/unit/test_guards.py``
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import ModelController, ProportionalController, make_controller, round_multiple
from omnilearn.balance.loop import ControlLoop, window_table


def feed(loop: ControlLoop, step: int, times, step_s=None, caps=None, k: int = 15):
    rows = [(b, k, t, 0.01 * t) for b, t in zip(loop.plan, times)]
    return loop.update(step, rows, caps=caps, step_s=step_s)


def test_configured_per_worker_caps_hold_in_every_proposal():
    caps = (300, 64, 64, 128)
    loop = ControlLoop(ModelController(Bounds(512, 4, 8, caps)), lag=0)
    alpha, beta = np.full(4, 0.01), np.array([1e-4, 1e-3, 1e-3, 1e-3])  # worker 0 ten times faster
    for k in range(1, 8):
        feed(loop, 15 * k, alpha + beta * loop.plan)
        assert loop.plan.sum() == 512 and (loop.plan <= caps).all()
    assert loop.plan[0] == 300  # it takes all it may


def test_a_reported_cap_replans_at_once_within_it():
    loop = ControlLoop(ProportionalController(Bounds(400, 4, 8)), lag=1)
    feed(loop, 14, [1.0, 1.0, 1.0, 1.0])
    assert loop.batches == (100, 100, 100, 100)
    d = feed(loop, 29, [1.0, 1.0, 1.0, 1.0], caps=[60, 0, 0, 0])  # rank 0 ran out of memory above 60
    assert d.changed and d.new[0] == 60 and sum(d.new) == 400 and d.effective_step == 31
    assert "cap" in d.reason
    for k in range(3, 8):  # later proposals keep it
        d = feed(loop, 15 * k - 1, [0.5, 1.0, 1.0, 1.0], caps=[60, 0, 0, 0])
        assert loop.plan[0] <= 60
    twin = ControlLoop(ProportionalController(Bounds(400, 4, 8)), lag=1)
    twin.load_state_dict(loop.state_dict())
    assert twin.caps.state_dict() == loop.caps.state_dict()


def test_caps_that_cannot_hold_the_batch_are_stretched_not_fatal():
    loop = ControlLoop(ProportionalController(Bounds(400, 2, 8)), lag=0)
    feed(loop, 14, [1.0, 1.0])
    d = feed(loop, 29, [1.0, 1.0], caps=[100, 100])  # 200 < 400: both over; stretched in proportion
    assert sum(loop.batches) == 400 and not d.changed


def test_the_adaptive_upper_bound_caps_a_worker_whose_throughput_fell():
    fast = [100.0]  # worker 0's samples/s up to 100 samples; above, memory pressure halves it

    def times(plan):
        b0, b1 = plan
        return [b0 / fast[0] * (2.0 if b0 > 100 else 1.0), b1 / 50.0]

    loop = ControlLoop(ProportionalController(Bounds(200, 2, 8)), lag=0)
    feed(loop, 14, times(loop.plan))  # worker 0 twice as fast: it grows
    assert loop.plan[0] > 100
    d = feed(loop, 29, times(loop.plan))  # ...but its samples/s fell
    assert d.changed and d.new[0] == 100 and "throughput fell" in d.reason
    for k in range(3, 6):  # it is as fast as ever at 100, but may not grow again
        feed(loop, 15 * k - 1, times(loop.plan))
        assert loop.plan[0] == 100
    fast[0] = 400.0  # a real speed shift: what was learned about it no longer holds
    for k in range(6, 9):
        feed(loop, 15 * k - 1, [b / fast[0] for b in loop.plan[:1]] + [loop.plan[1] / 50.0])
    assert loop.plan[0] > 100


def test_a_change_that_made_the_measured_step_slower_is_taken_back_then_held():
    loop = ControlLoop(ProportionalController(Bounds(200, 2, 8)), lag=0, history=4)
    feed(loop, 14, [1.0, 2.0], step_s=[2.0, 2.0], k=1)  # too few samples to decide on: measured, held
    feed(loop, 29, [1.0, 2.0], step_s=[2.1, 2.1], k=1)
    d = feed(loop, 44, [1.0, 2.0], step_s=[2.0, 2.0])
    assert d.changed
    old = d.old
    d = feed(loop, 59, [1.2, 1.2], step_s=[2.5, 2.5])  # balanced compute, but the step got 25% slower
    assert d.changed and d.new == old and "slower" in d.reason
    d = feed(loop, 74, [1.0, 2.0], step_s=[2.0, 2.0])
    assert not d.changed and "holding" in d.reason


def test_a_change_that_helped_is_kept_and_one_window_is_not_judged():
    loop = ControlLoop(ProportionalController(Bounds(200, 2, 8)), lag=0)
    feed(loop, 14, [1.0, 2.0], step_s=[2.0, 2.0], k=1)
    assert feed(loop, 29, [1.0, 2.0], step_s=[2.1, 2.1]).changed
    d = feed(loop, 44, [1.2, 1.2], step_s=[1.6, 1.6])
    assert not d.changed and loop.guard.before is None
    single = ControlLoop(ProportionalController(Bounds(200, 2, 8)), lag=0)
    assert feed(single, 14, [1.0, 2.0], step_s=[2.0, 2.0]).changed
    assert not feed(single, 29, [1.2, 1.2], step_s=[3.0, 3.0]).changed  # no spread before: not taken back


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), k=st.sampled_from([2, 4, 8, 16]), seed=st.integers(0, 2**31))
def test_round_multiple_keeps_the_sum_the_bounds_and_the_multiples(n, k, seed):
    rng = np.random.default_rng(seed)
    lo = int(rng.integers(1, 9))
    total = int(rng.integers(n * lo, n * 200 + 1))
    bounds = Bounds(total, n, lo)
    shares = rng.dirichlet(np.ones(n)) * (total - n * lo) + lo
    new = round_multiple(shares, bounds, k)
    assert new.sum() == total and (new >= lo).all() and (new <= total).all()
    if -(-lo // k) * n <= total // k:  # feasible in multiples
        assert ((new % k) != 0).sum() <= 1


def test_the_model_controller_rounds_to_multiples():
    c = make_controller("model", Bounds(512, 4, 8), [1, 1, 1, 1], multiple=8)
    loop = ControlLoop(c, lag=0)
    alpha, beta = np.full(4, 0.01), np.array([1e-4, 3e-4, 7e-4, 1e-3])
    for step in range(14, 120, 15):
        feed(loop, step, alpha + beta * loop.plan)
        assert (loop.plan % 8 == 0).all() and loop.plan.sum() == 512


def test_shifted_sees_a_2x_change_in_five_steps_but_not_noise():
    rng = np.random.default_rng(0)
    loop = ControlLoop(ProportionalController(Bounds(256, 4, 8)), lag=0)
    for k in range(6):
        loop.update(15 * k + 14, window_table(loop.plan, 1.0 + 0.1 * rng.standard_normal((4, 15))))
    quiet = window_table(loop.plan, 1.0 + 0.1 * rng.standard_normal((4, 5)))
    assert not loop.shifted(quiet).any()
    slow = window_table(loop.plan, np.array([[2.0], [1.0], [1.0], [1.0]]) * (1 + 0.1 * rng.standard_normal((4, 5))))
    assert loop.shifted(slow).tolist() == [True, False, False, False]
    d = loop.update(95, slow)
    assert d.changed and d.new[0] < d.old[0]


def test_noise_at_1024_workers_rarely_changes_the_plan():
    rng = np.random.default_rng(1)
    n = 1024
    alpha, beta = np.full(n, 0.004), 1e-3 * 4.0 ** -rng.uniform(0, 1, n)
    loop = ControlLoop(ModelController(Bounds(64 * n, n, 4)), lag=0)
    changes = 0
    for k in range(40):
        d = loop.update(15 * k + 14, window_table(loop.plan, (alpha + beta * loop.plan)[:, None]
                                                  * (1 + 0.1 * rng.standard_normal((n, 15)))))
        changes += d.changed and k >= 10
    assert changes <= 3  # of 30 intervals after settling: at most 10%


def test_a_worker_pinned_at_min_batch_while_slowest_is_named():
    from omnilearn.balance.guards import pinned_low

    assert pinned_low(np.array([56, 8]), np.array([0.020, 0.041]), lower=8, margin=0.05) == 1  # waits for it
    assert pinned_low(np.array([56, 8]), np.array([0.020, 0.0205]), lower=8, margin=0.05) is None  # balanced
    assert pinned_low(np.array([40, 24]), np.array([0.020, 0.041]), lower=8, margin=0.05) is None  # can still move
    assert pinned_low(np.array([64]), np.array([0.02]), lower=8, margin=0.05) is None


def test_the_loop_reports_a_worker_stuck_at_min_batch():
    loop = ControlLoop(make_controller("model", Bounds(16, 2, 8), (1.0, 1.0)), total_steps=1000)
    rng = np.random.default_rng(0)
    for k in range(3):  # worker 1 is 3x slower, and 8/8 is the only plan min_batch=8 allows
        loop.update(15 * k + 14, window_table(loop.plan, np.array([[0.01], [0.03]]) * (1 + 0.01 * rng.random((2, 15)))))
    assert loop.batches == (8, 8) and loop.pinned == 1
    free = ControlLoop(make_controller("model", Bounds(16, 2, 2), (1.0, 1.0)), total_steps=1000)
    per_sample = np.array([0.01, 0.03]) / 8  # time proportional to batch: 12/4 finishes together
    for k in range(4):
        times = (per_sample * free.plan)[:, None] * (1 + 0.01 * rng.random((2, 15)))
        free.update(15 * k + 14, window_table(free.plan, times))
    assert free.batches == (12, 4) and free.pinned is None
