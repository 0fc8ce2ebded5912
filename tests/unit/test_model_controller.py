"""Tests for the ``model`` controller (``omnilearn.balance.model`` and ``controllers.ModelController``).

What is checked:

- exact affine workers seen at two distinct batches: ONE proposal lands within
  rounding of the equal-finish-time optimum (found here by bisection), sum == B,
  bounds hold, and the predicted times are the model's;
- hypothesis: random alphas, betas and bounds, sum == B and bounds always;
- a few windows 3x slower move the Theil-Sen fit little;
- fewer than two distinct batches (or no history): the proportional rule's plan;
- through ``ControlLoop`` with simulated affine workers (no noise): the model
  reaches within 2% of the optimal step time in at most 2 decisions, the
  proportional rule needs more (both counted);
- 4,096 workers: one ``propose`` is timed and printed (``-s``), not asserted.

Run: ``cd /work/main && python -m pytest -q -s tests/unit/test_model_controller.py``
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import (CONTROLLERS, Estimates, ModelController, ProportionalController,
                                           make_controller)
from omnilearn.balance.loop import ControlLoop
from omnilearn.balance.model import distinct_batches, equal_finish, fit_affine

FAST = settings(max_examples=80, deadline=None)


def history_of(alpha, beta, batch_sets):
    """(windows, n, 2) exact pairs: window k has worker i at ``batch_sets[k][i]``."""
    b = np.asarray(batch_sets, dtype=float)
    return np.stack((b, alpha + beta * b), axis=-1)


def optimum(alpha, beta, lo, hi, total):
    """The equal finish time by plain bisection (the reference for ``equal_finish``)."""
    low, high = float(np.min(alpha + beta * lo)), float(np.max(alpha + beta * hi))
    for _ in range(200):
        mid = 0.5 * (low + high)
        if np.clip((mid - alpha) / beta, lo, hi).sum() < total:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def estimates(batches, alpha, beta, history):
    b = np.asarray(batches, dtype=np.int64)
    return Estimates(b, alpha + beta * b, np.zeros(b.size), history)


def test_model_is_the_bsp_default_and_asp_keeps_the_proportional_rule():
    from omnilearn.config import BalanceConfig
    from omnilearn.experiments.config import ASP_DEFAULTS
    assert CONTROLLERS[:3] == ("omnilearn", "static", "uniform") and CONTROLLERS[3] == "model"
    assert BalanceConfig().controller == "model" and ASP_DEFAULTS["controller"] == "omnilearn"
    ctl = make_controller("model", Bounds(64, 4, 2, 40), [1, 1, 1, 1])
    assert isinstance(ctl, ModelController) and ctl.initial() == [16, 16, 16, 16]
    state = json.loads(json.dumps(ctl.state_dict()))
    twin = ModelController(Bounds(64, 4, 2, 40), start=[10, 10, 20, 24])
    twin.load_state_dict(state)
    assert twin.initial() == [16, 16, 16, 16]
    with pytest.raises(ValueError):
        twin.load_state_dict({"name": "omnilearn", "start": [16] * 4})


def test_one_decision_lands_on_the_equal_finish_optimum():
    alpha = np.array([0.30, 0.05, 0.10, 0.00, 0.50, 0.20])
    beta = np.array([0.010, 0.004, 0.020, 0.001, 0.002, 0.008])
    bounds = Bounds(600, 6, 4, 300)
    hist = history_of(alpha, beta, [[100] * 6, [100] * 6, [80, 120, 60, 140, 110, 90]])
    ctl = ModelController(bounds)
    p = ctl.propose(estimates(hist[-1, :, 0], alpha, beta, hist))
    new = p.batches
    assert new.sum() == 600 and (new >= 4).all() and (new <= 300).all()
    assert np.allclose(p.times_s, alpha + beta * new)
    finish = optimum(alpha, beta, 4.0, 300.0, 600)
    free = (new > 4) & (new < 300)
    assert free.sum() >= 4
    assert (np.abs(p.times_s[free] - finish) <= beta[free] + 1e-9).all()  # within one sample of the optimum
    assert float(np.max(p.times_s)) <= finish + float(beta.max()) + 1e-9
    shares, t = equal_finish(alpha, beta, 4, 300, 600)
    assert t == pytest.approx(finish, rel=1e-9) and shares.sum() == pytest.approx(600)


@FAST
@given(n=st.integers(1, 40), seed=st.integers(0, 2**31), lo=st.integers(1, 8), slack=st.floats(0.0, 1.0),
       room=st.floats(0.0, 3.0))
def test_sum_and_bounds_hold_for_random_workers(n, seed, lo, slack, room):
    rng = np.random.default_rng(seed)
    hi = lo + int(room * 50)
    total = n * lo + int(slack * n * (hi - lo))
    bounds = Bounds(total, n, lo, hi)
    alpha = rng.uniform(0.0, 1.0, n) * rng.integers(0, 2, n)  # some alphas exactly 0
    beta = 10.0 ** rng.uniform(-5, 0, n)
    first = rng.integers(lo, hi + 1, n)
    second = np.where(first < hi, first + 1, first - 1) if hi > lo else first
    hist = history_of(alpha, beta, [first, second])
    p = ModelController(bounds).propose(estimates(second, alpha, beta, hist))
    assert p.batches.dtype == np.int64 and int(p.batches.sum()) == total
    assert (p.batches >= lo).all() and (p.batches <= hi).all()
    assert np.isfinite(p.times_s).all()
    shares, finish = equal_finish(alpha, beta, lo, hi, total)
    assert shares.sum() == pytest.approx(total, rel=1e-9, abs=1e-6)
    assert (shares >= lo - 1e-9).all() and (shares <= hi + 1e-9).all()


def test_a_few_3x_slow_windows_barely_move_the_fit():
    alpha, beta = np.array([0.2, 0.05]), np.array([0.01, 0.002])
    batches = [[64, 64], [64, 64], [64, 64], [96, 96], [96, 96], [96, 96], [80, 80], [80, 80], [48, 48], [48, 48]]
    hist = history_of(alpha, beta, batches)
    wild = hist.copy()
    wild[[1, 4], :, 1] *= 3.0  # two of ten windows 3x slower (a pause, a neighbour's job)
    a, b = fit_affine(wild)
    assert np.allclose(b, beta, rtol=0.10) and np.allclose(a, alpha, atol=0.1 * (alpha + beta * 64))
    # least squares on the same pairs is thrown far off
    for i in range(2):
        x, y = wild[:, i, 0], wild[:, i, 1]
        ls_beta = np.polyfit(x, y, 1)[0]
        assert abs(ls_beta - beta[i]) > 3 * abs(b[i] - beta[i])


def test_fit_enforces_positive_slope_and_nonnegative_intercept():
    # worker 0: time falls with batch (noise): line through the origin; worker 1: negative intercept
    hist = np.array([[[10, 1.0], [10, 0.5]], [[20, 0.9], [20, 1.5]]], dtype=float)
    alpha, beta = fit_affine(hist)
    assert (alpha >= 0).all() and (beta > 0).all()
    assert alpha[0] == 0.0 and beta[0] == pytest.approx(np.median([1.0 / 10, 0.9 / 20]))
    assert alpha[1] == 0.0


def test_fewer_than_two_distinct_batches_is_the_proportional_step():
    bounds = Bounds(400, 4, 2)
    alpha, beta = np.array([0.1, 0.2, 0.0, 0.3]), np.array([0.01, 0.002, 0.004, 0.003])
    plan = np.array([100, 100, 100, 100])
    hist = history_of(alpha, beta, [[100, 100, 100, 100], [90, 100, 110, 100], [100, 100, 100, 100]])
    assert distinct_batches(hist).tolist() == [2, 1, 2, 1]
    est = estimates(plan, alpha, beta, hist)
    reference = ProportionalController(bounds).propose(est)
    for e in (est, estimates(plan, alpha, beta, None)):
        p = ModelController(bounds).propose(e)
        assert p.batches.tolist() == reference.batches.tolist()
        assert np.allclose(p.times_s, reference.times_s) and "fewer than 2 distinct" in p.reason


# ---------------------------------------------------------------- through the ControlLoop


def decisions_to_optimum(name, alpha, beta, bounds, windows=12):
    """Drive a ControlLoop with exact affine workers: (reached within 2% of the optimum, decisions applied, loop)."""
    loop = ControlLoop(make_controller(name, bounds, [1.0] * bounds.workers), deadband=0.01)
    best = optimum(alpha, beta, float(bounds.min_batch), float(bounds.upper), bounds.global_batch)
    changes = 0
    for step in range(windows):
        plan = np.asarray(loop.batches)
        if float(np.max(alpha + beta * plan)) <= 1.02 * best:
            return True, changes, loop
        t = alpha + beta * plan
        d = loop.update(step, [(b, 15, ti, 0.0) for b, ti in zip(plan, t)])
        changes += d.changed
    return False, changes, loop


def test_through_the_loop_the_model_needs_at_most_two_decisions_where_proportional_needs_more():
    rng = np.random.default_rng(7)
    n = 16
    alpha = rng.uniform(0.05, 0.5, n)  # fixed costs large beside the per-sample cost: far from proportional
    beta = rng.uniform(0.001, 0.008, n)
    bounds = Bounds(n * 64, n, 4, 512)
    reached, model, loop = decisions_to_optimum("model", alpha, beta, bounds)
    p_reached, proportional, _ = decisions_to_optimum("omnilearn", alpha, beta, bounds)
    print(f"\ndecisions to within 2% of the optimal step: model {model} (reached {reached}), "
          f"proportional {proportional} (reached {p_reached} in 12 windows)")
    assert reached and model <= 2
    assert proportional > model and proportional >= 3
    # the loop handed the model its windows across the batch change
    assert (distinct_batches(loop.history_pairs()) >= 2).all()


def test_loop_state_keeps_the_model_history():
    bounds = Bounds(4 * 64, 4, 4)
    alpha, beta = np.array([0.4, 0.1, 0.2, 0.0]), np.array([0.002, 0.004, 0.001, 0.008])
    loop = ControlLoop(make_controller("model", bounds, [1.0] * 4), deadband=0.01)
    for step in range(3):
        plan = np.asarray(loop.batches)
        loop.update(step, [(b, 15, ti, 0.0) for b, ti in zip(plan, alpha + beta * plan)])
    state = json.loads(json.dumps(loop.state_dict()))
    twin = ControlLoop(make_controller("model", bounds, [1.0] * 4), deadband=0.01)
    twin.load_state_dict(state)
    np.testing.assert_array_equal(np.nan_to_num(twin.history_pairs()), np.nan_to_num(loop.history_pairs()))
    assert twin.state_dict() == loop.state_dict()


def test_a_speed_shift_rescales_the_older_pairs():
    loop = ControlLoop(make_controller("uniform", Bounds(100, 2), [1, 1]))
    for k in range(4):
        loop.update(k, [(50, 15, 1.0, 0.01), (50, 15, 1.0, 0.01)])
    loop.update(4, [(50, 15, 3.0, 0.01), (50, 15, 1.0, 0.01)])  # worker 0 became 3x slower
    pairs = loop.history_pairs()
    assert np.isfinite(pairs[:, 0, 1]).sum() == 5 and np.allclose(pairs[-5:, 0, 1], 3.0)
    assert np.allclose(pairs[-5:, 1, 1], 1.0)
    assert loop.kept[0] == 1 and loop.kept[1] == 5  # the estimate itself keeps only the new window


def test_after_a_speed_change_the_model_lands_in_one_decision():
    """Worker 0 (affine, fitted over two batches) turns 2x slower: its older pairs, rescaled, keep the line."""
    alpha, beta = np.array([0.02, 0.02, 0.02, 0.02]), np.array([1e-3, 1e-3, 2e-3, 4e-3])
    loop = ControlLoop(ModelController(Bounds(512, 4, 8)), lag=0)
    step = 0
    for _ in range(8):  # settle
        step += 15
        loop.update(step, [(b, 15, a + bt * b, 0.0) for b, a, bt in zip(loop.plan, alpha, beta)])
    alpha, beta = alpha * np.array([2, 1, 1, 1]), beta * np.array([2, 1, 1, 1])
    step += 15
    d = loop.update(step, [(b, 15, a + bt * b, 0.0) for b, a, bt in zip(loop.plan, alpha, beta)])
    assert d.changed
    t = alpha + beta * np.asarray(d.new)
    assert t.max() / t.min() < 1.02  # balanced at once: equal finish times within rounding


def test_propose_at_4096_workers_is_fast_printed_not_asserted():
    rng = np.random.default_rng(3)
    n = 4096
    bounds = Bounds(n * 64, n, 4, 512)
    alpha, beta = rng.uniform(0.0, 0.5, n), rng.uniform(0.001, 0.01, n)
    batch_sets = [np.full(n, 64)] * 5 + [rng.integers(32, 128, n) for _ in range(5)]
    hist = history_of(alpha, beta, batch_sets)
    hist[:, :, 1] *= rng.uniform(0.95, 1.05, hist.shape[:2])
    ctl = ModelController(bounds)
    est = estimates(batch_sets[-1], alpha, beta, hist)
    ctl.propose(est)  # warm up
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        p = ctl.propose(est)
        runs.append(time.perf_counter() - t0)
    print(f"\nmodel propose at {n} workers, 10 windows: median {1e3 * np.median(runs):.2f} ms "
          f"(min {1e3 * min(runs):.2f} ms)")
    assert int(p.batches.sum()) == bounds.global_batch
