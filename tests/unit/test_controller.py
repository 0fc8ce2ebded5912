"""Property tests for ``omnilearn.balance.controllers`` (batch-size controllers: estimates in, proposal out).

What is checked (hypothesis over random feasible bounds, batches and times):

- every proposal keeps ``sum(new) == B`` exactly and the bounds, and leaves its input alone;
- the paper's rule: ``propose`` is ``b_i * t_mean / t_i`` clamped, re-shared and rounded, with
  predicted times ``t_i * b_i' / b_i``; without binding bounds it lands within one unit of
  ``B * (b_i/t_i) / sum``; equal times propose the current batches;
- convergence: for linear-time workers (``t_i = b_i / v_i``, speed ratio <= 8) one proposal lands
  on the proportional split ``b_i ∝ v_i`` (within one unit) and equal times (within 5%), and the
  next proposal stays within one unit (a rounding tie: the loop's gain test holds such flips);
- ``static``/``uniform`` plans never change and propose themselves; ``make_controller`` and its
  error message; controllers' ``state_dict`` round trips through JSON; ``Decision``'s fields.

Whether a proposal is applied (deadband, noise, min samples, shifts) is the ControlLoop's job:
``tests/unit/test_loop.py``.

Run: ``cd /work/main && python -m pytest -q tests/unit/test_controller.py``
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from omnilearn.balance.allocation import Bounds, proportional_split, split_array, uniform_split
from omnilearn.balance.controllers import (
    CONTROLLERS,
    Decision,
    Estimates,
    FixedController,
    ModelController,
    ProportionalController,
    make_controller,
)

FAST = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------- strategies / helpers


@st.composite
def bounds_and_batches(draw, max_workers: int = 8):
    """Feasible bounds and a random integer split inside them that sums to B."""
    n = draw(st.integers(1, max_workers))
    lo = draw(st.integers(1, 40))
    hi = draw(st.integers(lo, 300))
    B = draw(st.integers(n * lo, n * hi))
    b = Bounds(B, n, lo, draw(st.sampled_from([hi, None])))
    batches = uniform_split(b)
    for _ in range(draw(st.integers(0, 20))):
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        units = min(draw(st.integers(0, B)), batches[i] - b.min_batch, b.upper - batches[j])
        if i != j and units > 0:
            batches[i] -= units
            batches[j] += units
    return b, tuple(batches)


times_s = st.floats(min_value=1e-4, max_value=10.0, allow_nan=False, allow_infinity=False)


def propose(bounds: Bounds, batches, times) -> list[int]:
    est = Estimates(np.array(batches), np.array(times, dtype=float), np.zeros(len(batches)))
    return ProportionalController(bounds).propose(est).batches.tolist()


def assert_valid(new, bounds: Bounds):
    assert all(isinstance(x, int) for x in new), new
    assert sum(new) == bounds.global_batch, (new, bounds)
    assert all(bounds.min_batch <= x <= bounds.upper for x in new), (new, bounds)


# --------------------------------------------------------------------------- the paper's rule


@FAST
@given(bb=bounds_and_batches(), data=st.data())
def test_propose_is_the_proportional_rule_with_predicted_times(bb, data):
    bounds, batches = bb
    times = data.draw(st.lists(times_s, min_size=bounds.workers, max_size=bounds.workers))
    est = Estimates(np.array(batches), np.array(times), np.zeros(bounds.workers))
    p = ProportionalController(bounds).propose(est)
    t_mean = sum(times) / len(times)
    expected = split_array([b * t_mean / t for b, t in zip(batches, times)], bounds).tolist()
    assert p.batches.tolist() == expected
    assert_valid(p.batches.tolist(), bounds)
    assert p.times_s == pytest.approx([t * n / b for t, n, b in zip(times, expected, batches)])
    assert est.batches.tolist() == list(batches)  # the input is not modified


@FAST
@given(n=st.integers(2, 8), data=st.data())
def test_proposal_lands_within_one_unit_of_the_rule(n, data):
    # no binding bounds: within one unit of B * (b_i / t_i) / sum_j (b_j / t_j)
    B = data.draw(st.integers(50 * n, 5000))
    bounds = Bounds(B, n, 1, None)
    batches = tuple(proportional_split(data.draw(st.lists(st.floats(1.0, 3.0), min_size=n, max_size=n)), bounds))
    times = data.draw(st.lists(st.floats(0.5, 1.5), min_size=n, max_size=n))
    rate = [b / t for b, t in zip(batches, times)]
    exact = [B * r / sum(rate) for r in rate]
    assume(min(exact) >= 1)
    new = propose(bounds, batches, times)
    assert_valid(new, bounds)
    assert all(abs(x - e) < 1 for x, e in zip(new, exact)), (new, exact)


@FAST
@given(bb=bounds_and_batches(), t=times_s, data=st.data())
def test_equal_times_propose_the_current_batches(bb, t, data):
    bounds, batches = bb
    jitter = data.draw(st.lists(st.floats(-1e-9, 1e-9), min_size=bounds.workers, max_size=bounds.workers))
    assert propose(bounds, batches, [t * (1 + j) for j in jitter]) == list(batches)


@FAST
@given(n=st.integers(2, 6), data=st.data())
def test_linear_workers_reach_the_proportional_split_in_one_proposal(n, data):
    speeds = data.draw(st.lists(st.floats(1.0, 8.0, allow_nan=False), min_size=n, max_size=n))
    B = data.draw(st.integers(max(512, 25 * (1 + 8 * (n - 1))), 4096))  # every ideal share >= 25
    bounds = Bounds(B, n, 1, None)
    ctl = ProportionalController(bounds)
    start = ctl.initial()
    assert start == uniform_split(bounds)
    new = propose(bounds, start, [b / v for b, v in zip(start, speeds)])
    ideal = [B * v / sum(speeds) for v in speeds]
    assert all(abs(b - i) <= 1 for b, i in zip(new, ideal)), (new, ideal)
    t_star = B / sum(speeds)
    assert all(abs(b / v / t_star - 1) <= 0.05 for b, v in zip(new, speeds))
    again = propose(bounds, new, [b / v for b, v in zip(new, speeds)])  # stays, up to a rounding tie
    assert max(abs(a - b) for a, b in zip(again, new)) <= 1


# --------------------------------------------------------------------------- fixed plans and factory


@FAST
@given(n=st.integers(1, 8), data=st.data())
def test_static_is_proportional_to_declared_speeds_and_never_changes(n, data):
    speeds = data.draw(st.lists(st.floats(0.5, 32.0), min_size=n, max_size=n))
    B = data.draw(st.integers(n, 5000))
    bounds = Bounds(B, n)
    ctl = make_controller("static", bounds, speeds)
    plan = ctl.initial()
    assert plan == proportional_split(speeds, bounds)
    exact = [B * v / sum(speeds) for v in speeds]
    if min(exact) >= 1:
        assert all(abs(b - e) < 1 for b, e in zip(plan, exact))
    times = data.draw(st.lists(times_s, min_size=n, max_size=n))
    p = ctl.propose(Estimates(np.array(plan), np.array(times), np.zeros(n)))
    assert p.batches.tolist() == plan and ctl.initial() == plan


@FAST
@given(n=st.integers(1, 16), data=st.data())
def test_uniform_gives_equal_batches(n, data):
    B = data.draw(st.integers(n, 10_000))
    ctl = make_controller("uniform", Bounds(B, n), [1.0 + i for i in range(n)])
    plan = ctl.initial()
    assert sum(plan) == B and max(plan) - min(plan) <= 1


@pytest.mark.parametrize("name", ["uniform", "static"])
def test_fixed_plans_propose_themselves(name):
    ctl = make_controller(name, Bounds(60, 3), [1.0, 2.0, 3.0])
    plan = np.array(ctl.initial())
    p = ctl.propose(Estimates(plan, np.array([1.0, 3.0, 9.0]), np.zeros(3)))
    assert p.batches.tolist() == plan.tolist() and p.times_s.tolist() == [1.0, 3.0, 9.0]
    assert name in p.reason and "fixed" in p.reason


def test_make_controller_builds_each_choice():
    bounds = Bounds(64, 4, 2, 40)
    omni = make_controller("omnilearn", bounds, [1, 2, 3, 4])
    assert isinstance(omni, ProportionalController) and omni.bounds == bounds
    assert omni.initial() == [16, 16, 16, 16]
    assert isinstance(make_controller("static", bounds, [1, 1, 1, 5]), FixedController)
    assert make_controller("static", bounds, [1, 1, 1, 5]).initial() == [8, 8, 8, 40]
    assert isinstance(make_controller("model", bounds, [1, 1, 1, 1]), ModelController)
    assert set(CONTROLLERS) == {"omnilearn", "static", "uniform", "model"}


@pytest.mark.parametrize("name", ["", "Omnilearn", "proportional", "dynamic"])
def test_make_controller_unknown_name_names_the_choices(name):
    with pytest.raises(ValueError) as err:
        make_controller(name, Bounds(8, 2), [1.0, 1.0])
    msg = str(err.value)
    assert repr(name) in msg
    assert all(choice in msg for choice in CONTROLLERS), msg


# --------------------------------------------------------------------------- state and Decision


@pytest.mark.parametrize("name", ["omnilearn", "uniform", "static"])
def test_controller_state_dict_round_trips_through_json(name):
    bounds = Bounds(100, 3)
    ctl = make_controller(name, bounds, [1.0, 2.0, 5.0])
    if isinstance(ctl, ProportionalController):
        ctl.start = [50, 30, 20]
    state = json.loads(json.dumps(ctl.state_dict()))
    fresh = make_controller(name, bounds, [1.0, 1.0, 1.0])
    fresh.load_state_dict(state)
    assert fresh.initial() == ctl.initial() and fresh.state_dict() == ctl.state_dict()
    other = "uniform" if name != "uniform" else "omnilearn"
    with pytest.raises(ValueError, match=repr(name)):
        make_controller(other, bounds, [1.0, 1.0, 1.0]).load_state_dict(state)


def test_decision_has_effective_step_and_predicted_times_and_is_frozen():
    d = Decision(3, (1, 2), (1, 2), (0.5, 0.5), False, "hold")
    assert d.effective_step is None and d.predicted_s is None
    d = Decision(3, (1, 2), (2, 1), (0.5, 0.5), True, "go", effective_step=5, predicted_s=(1.0, 0.75))
    assert d.effective_step == 5 and d.predicted_s == (1.0, 0.75)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.changed = False  # type: ignore[misc]
