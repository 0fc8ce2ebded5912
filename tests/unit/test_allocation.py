"""Property tests for ``omnilearn.balance.allocation`` (pure batch-split arithmetic).

What is checked, over random feasible ``(B, n, min_batch, max_batch)`` and
random positive weights (hypothesis):

- ``check_feasible`` / ``Bounds`` reject ``n*min > B``, ``n*max < B``,
  ``min > max`` and ``workers < 1`` with ``InfeasibleBounds`` whose message
  names the offending values, and accept every feasible configuration;
- ``water_fill`` (clamp and re-share, the first half of ``split_array``) sums
  to ``B`` (1e-6), stays inside ``[min, max]``, keeps the order of the targets
  and is a water-filling (unclamped workers share one scale factor, clamped
  ones sit on the bound their target pushes to);
- ``round_shares`` (the second half), ``split_array``, ``proportional_split``
  and ``uniform_split`` return
  integers that sum to ``B`` exactly and respect the bounds; the proportional
  split is within 1 of the exact share when no bound binds; the uniform split
  differs by at most 1 (extra units to the lowest ranks).
- the vectorised core: ``water_fill`` equals the former pure-Python
  water-filling loop (kept below as the reference) within 1e-9 * B and
  ``round_shares`` equals the former rounding loop exactly, on any input;
  with per-worker bounds and up to 5,000 workers (numpy-drawn) ``water_fill``
  and ``split_array`` keep the sum, the bounds and the water-filling shape.

Run: ``cd /work/main && python -m pytest -q tests/unit/test_allocation.py``
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from omnilearn.balance.allocation import (
    Bounds,
    InfeasibleBounds,
    check_feasible,
    proportional_split,
    round_shares,
    split_array,
    uniform_split,
    water_fill,
)

FAST = settings(max_examples=200, deadline=None)


def limits(b: Bounds) -> tuple:
    """What the allocation path passes ``water_fill`` and ``round_shares``: lower, upper, total."""
    return b.min_batch, b.upper, b.global_batch


@st.composite
def feasible_bounds(draw, max_workers: int = 8, allow_none: bool = True) -> Bounds:
    n = draw(st.integers(1, max_workers))
    lo = draw(st.integers(1, 50))
    hi = draw(st.integers(lo, 400))
    B = draw(st.integers(n * lo, n * hi))
    if allow_none and draw(st.booleans()) and B >= lo:
        return Bounds(B, n, lo, None)  # upper bound = B
    return Bounds(B, n, lo, hi)


def weights_for(n: int):
    return st.lists(
        st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
        min_size=n,
        max_size=n,
    )


def names(msg: str, value: int) -> bool:
    """The message mentions ``value`` as a whole number (not as part of another)."""
    return re.search(rf"(?<![\d-]){re.escape(str(value))}(?!\d)", msg) is not None


# --------------------------------------------------------------------------- check_feasible


@FAST
@given(n=st.integers(1, 16), lo=st.integers(1, 100), data=st.data())
def test_rejects_global_batch_below_workers_times_min(n, lo, data):
    B = data.draw(st.integers(1, n * lo - 1)) if n * lo > 1 else None
    assume(B is not None)
    hi = data.draw(st.integers(lo, lo + 100))
    with pytest.raises(InfeasibleBounds) as err:
        check_feasible(B, n, lo, hi)
    msg = str(err.value)
    assert names(msg, B) and names(msg, n) and names(msg, lo), msg
    with pytest.raises(InfeasibleBounds):
        Bounds(B, n, lo, hi)


@FAST
@given(n=st.integers(1, 16), lo=st.integers(1, 50), data=st.data())
def test_rejects_global_batch_above_workers_times_max(n, lo, data):
    hi = data.draw(st.integers(lo, lo + 100))
    B = data.draw(st.integers(n * hi + 1, n * hi + 1000))
    with pytest.raises(InfeasibleBounds) as err:
        check_feasible(B, n, lo, hi)
    msg = str(err.value)
    assert names(msg, B) and names(msg, n) and names(msg, hi), msg
    with pytest.raises(InfeasibleBounds):
        Bounds(B, n, lo, hi)


@FAST
@given(n=st.integers(1, 16), hi=st.integers(1, 100), data=st.data())
def test_rejects_min_above_max(n, hi, data):
    lo = data.draw(st.integers(hi + 1, hi + 100))
    B = data.draw(st.integers(1, 10_000))
    with pytest.raises(InfeasibleBounds) as err:
        check_feasible(B, n, lo, hi)
    msg = str(err.value)
    assert names(msg, lo) and names(msg, hi), msg


@FAST
@given(n=st.integers(-10, 0), B=st.integers(1, 1000), lo=st.integers(1, 10))
def test_rejects_fewer_than_one_worker(n, B, lo):
    with pytest.raises(InfeasibleBounds) as err:
        check_feasible(B, n, lo, lo + 10)
    assert names(str(err.value), n), str(err.value)
    with pytest.raises(InfeasibleBounds):
        Bounds(B, n, lo, lo + 10)


def test_infeasible_bounds_is_a_value_error():
    assert issubclass(InfeasibleBounds, ValueError)


@FAST
@given(b=feasible_bounds())
def test_accepts_every_feasible_configuration(b):
    check_feasible(b.global_batch, b.workers, b.min_batch, b.upper)  # must not raise
    assert b.upper == (b.global_batch if b.max_batch is None else b.max_batch)


# --------------------------------------------------------------------------- water_fill: clamp and re-share


@st.composite
def bounds_and_targets(draw):
    b = draw(feasible_bounds())
    target = st.one_of(
        st.just(0.0),
        st.floats(min_value=-50, max_value=0, allow_nan=False),
        st.floats(min_value=1e-6, max_value=1e5, allow_nan=False),
    )
    targets = draw(st.lists(target, min_size=b.workers, max_size=b.workers))
    return b, targets


@FAST
@given(bt=bounds_and_targets())
def test_water_fill_sums_to_global_batch_within_bounds(bt):
    b, targets = bt
    shares = water_fill(targets, *limits(b)).tolist()
    assert len(shares) == b.workers
    assert abs(sum(shares) - b.global_batch) <= 1e-6
    eps = 1e-9 * b.global_batch
    assert all(b.min_batch - eps <= s <= b.upper + eps for s in shares), shares


@FAST
@given(bt=bounds_and_targets())
def test_water_fill_keeps_order_and_is_water_filling(bt):
    b, targets = bt
    shares = water_fill(targets, *limits(b)).tolist()
    clipped = [max(t, 0.0) for t in targets]
    for i in range(b.workers):
        for j in range(b.workers):
            if clipped[i] < clipped[j]:
                assert shares[i] <= shares[j] + 1e-9, (i, j, shares)
    eps = 1e-7 * max(1.0, b.global_batch)
    free = [i for i in range(b.workers) if b.min_batch + eps < shares[i] < b.upper - eps]
    if free and all(clipped[i] > 0 for i in free):
        lam = shares[free[0]] / clipped[free[0]]
        for i in free:  # one common scale factor for the unclamped workers
            assert math.isclose(shares[i] / clipped[i], lam, rel_tol=1e-6)
        for i in range(b.workers):
            if i in free:
                continue
            if abs(shares[i] - b.upper) <= eps:  # clamped at the top: scaled target reaches it
                assert lam * clipped[i] >= b.upper * (1 - 1e-6)
            else:  # clamped at the bottom: scaled target is at or below it
                assert abs(shares[i] - b.min_batch) <= eps
                assert lam * clipped[i] <= b.min_batch * (1 + 1e-6)


@st.composite
def bounds_and_split(draw, max_workers: int = 8):
    """Feasible bounds and a random integer split inside them that sums to B."""
    b = draw(feasible_bounds(max_workers=max_workers))
    split = uniform_split(b)
    for _ in range(draw(st.integers(0, 20))):
        i = draw(st.integers(0, b.workers - 1))
        j = draw(st.integers(0, b.workers - 1))
        units = draw(st.integers(0, b.global_batch))
        units = min(units, split[i] - b.min_batch, b.upper - split[j])
        if i != j and units > 0:
            split[i] -= units
            split[j] += units
    return b, split


@FAST
@given(bs=bounds_and_split())
def test_water_fill_leaves_feasible_targets_alone(bs):
    b, split = bs
    shares = water_fill([float(x) for x in split], *limits(b)).tolist()
    assert all(abs(s - x) <= 1e-9 * b.global_batch for s, x in zip(shares, split)), (split, shares)


# --------------------------------------------------------------------------- round_shares, split_array


def assert_valid_split(split, b: Bounds):
    assert len(split) == b.workers
    assert all(isinstance(x, int) for x in split), split
    assert sum(split) == b.global_batch, (split, b)
    assert all(b.min_batch <= x <= b.upper for x in split), (split, b)


@FAST
@given(bt=bounds_and_targets())
def test_split_array_exact_sum_within_bounds_and_one_unit_of_share(bt):
    b, targets = bt
    shares = water_fill(targets, *limits(b)).tolist()
    split = split_array(targets, b).tolist()
    assert_valid_split(split, b)
    assert all(abs(x - s) < 1 + 1e-9 for x, s in zip(split, shares)), (split, shares)


@FAST
@given(b=feasible_bounds(), data=st.data())
def test_round_shares_repairs_any_shares(b, data):
    # "never pushing a worker past max_batch": even shares outside the bounds
    # or not summing to B come back as a valid split
    shares = data.draw(
        st.lists(st.floats(-10, 2.0 * b.upper, allow_nan=False), min_size=b.workers, max_size=b.workers)
    )
    assert_valid_split(round_shares(shares, *limits(b)).tolist(), b)


@FAST
@given(bs=bounds_and_split())
def test_round_shares_and_split_array_keep_integer_shares(bs):
    b, split = bs
    assert_valid_split(split, b)  # the strategy itself is sound
    assert round_shares([float(x) for x in split], *limits(b)).tolist() == split
    assert split_array([float(x) for x in split], b).tolist() == split


# --------------------------------------------------------------------------- proportional_split


@FAST
@given(b=feasible_bounds(), data=st.data())
def test_proportional_split_exact_sum_and_bounds(b, data):
    w = data.draw(weights_for(b.workers))
    split = proportional_split(w, b)
    assert_valid_split(split, b)
    # heavier weight never gets fewer samples than a lighter one
    for i in range(b.workers):
        for j in range(b.workers):
            if w[i] < w[j]:
                assert split[i] <= split[j] + 1, (w, split)


@FAST
@given(n=st.integers(1, 8), B=st.integers(1, 100_000), data=st.data())
def test_proportional_split_within_one_of_exact_share_when_bounds_do_not_bind(n, B, data):
    w = data.draw(weights_for(n))
    exact = [B * x / sum(w) for x in w]
    assume(min(exact) >= 1.0)  # min_batch=1 and max=B never bind
    b = Bounds(B, n, 1, None)
    split = proportional_split(w, b)
    assert_valid_split(split, b)
    assert all(abs(x - e) < 1.0 for x, e in zip(split, exact)), (split, exact)


@FAST
@given(b=feasible_bounds(), k=st.integers(-8, 8), data=st.data())
def test_proportional_split_is_scale_invariant(b, k, data):
    w = data.draw(weights_for(b.workers))
    assert proportional_split(w, b) == proportional_split([x * 2.0**k for x in w], b)


def test_proportional_split_respects_a_binding_max():
    b = Bounds(100, 3, 1, 40)
    assert proportional_split([10.0, 1.0, 1.0], b) == [40, 30, 30]
    b = Bounds(100, 3, 20, 100)
    assert proportional_split([100.0, 1.0, 1.0], b) == [60, 20, 20]


@pytest.mark.parametrize("w", [[1.0, 0.0], [1.0, -2.0], [1.0, float("nan")], [1.0, float("inf")]])
def test_proportional_split_rejects_bad_weights(w):
    with pytest.raises(ValueError):
        proportional_split(w, Bounds(10, 2))


def test_proportional_split_rejects_wrong_length():
    with pytest.raises(ValueError, match="3 weights for 2 workers"):
        proportional_split([1.0, 1.0, 1.0], Bounds(10, 2))


# --------------------------------------------------------------------------- uniform_split


@FAST
@given(b=feasible_bounds(max_workers=16))
def test_uniform_split_differs_by_at_most_one(b):
    split = uniform_split(b)
    assert_valid_split(split, b)
    assert max(split) - min(split) <= 1
    assert split == sorted(split, reverse=True)  # the remainder goes to the lowest ranks
    q, r = divmod(b.global_batch, b.workers)
    assert split == [q + 1] * r + [q] * (b.workers - r)


# --------------------------------------------------------------------------- vectorised core vs the former loops


def reference_water_fill(targets, bounds: Bounds) -> list[float]:
    """The pure-Python water-filling loop ``water_fill`` was before it was vectorised."""
    lo, hi, total = float(bounds.min_batch), float(bounds.upper), float(bounds.global_batch)
    shares = [max(float(t), 0.0) for t in targets]
    fixed: dict[int, float] = {}
    for _ in range(len(shares) + 1):
        free = [i for i in range(len(shares)) if i not in fixed]
        remaining = total - sum(fixed.values())
        weight = sum(shares[i] for i in free)
        for i in free:
            shares[i] = remaining * shares[i] / weight if weight > 0 else remaining / len(free)
        over = [i for i in free if shares[i] > hi]
        under = [i for i in free if shares[i] < lo]
        if not over and not under:
            break
        excess = sum(shares[i] - hi for i in over)
        deficit = sum(lo - shares[i] for i in under)
        for i in over if excess >= deficit else under:
            fixed[i] = hi if excess >= deficit else lo
    return [fixed.get(i, shares[i]) for i in range(len(shares))]


def reference_round_shares(shares, bounds: Bounds) -> list[int]:
    """The pure-Python rounding loop ``round_shares`` was before it was vectorised."""
    floors = [min(max(math.floor(s + 1e-9), bounds.min_batch), bounds.upper) for s in shares]
    missing = bounds.global_batch - sum(floors)
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
    step = 1 if missing > 0 else -1
    while missing != 0:
        for i in order if step > 0 else reversed(order):
            if missing == 0:
                break
            nxt = floors[i] + step
            if bounds.min_batch <= nxt <= bounds.upper:
                floors[i] = nxt
                missing -= step
    return floors


@FAST
@given(bt=bounds_and_targets())
def test_water_fill_equals_the_former_loop(bt):
    b, targets = bt
    ref = reference_water_fill(targets, b)
    assert water_fill(targets, *limits(b)).tolist() == pytest.approx(ref, rel=1e-9, abs=1e-9 * b.global_batch)


@FAST
@given(b=feasible_bounds(), data=st.data())
def test_round_shares_equals_the_former_loop_on_any_shares(b, data):
    shares = data.draw(
        st.lists(st.floats(-10, 2.0 * b.upper, allow_nan=False), min_size=b.workers, max_size=b.workers)
    )
    assert round_shares(shares, *limits(b)).tolist() == reference_round_shares(shares, b)
    exact = reference_water_fill(shares, b)
    assert round_shares(exact, *limits(b)).tolist() == reference_round_shares(exact, b)


@st.composite
def many_workers(draw):
    """Up to 5,000 workers with per-worker bounds, drawn by numpy from a hypothesis seed."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = int(rng.choice([1, 7, 300, 5000]))
    lo = rng.integers(1, 20, n).astype(float)
    hi = lo + rng.integers(0, 300, n)
    total = float(rng.integers(int(lo.sum()), int(hi.sum()) + 1))
    kind = draw(st.sampled_from(["lognormal", "zeros", "tiny"]))
    w = rng.lognormal(0.0, 2.0, n)
    if kind == "zeros":
        w[rng.random(n) < 0.3] = 0.0
    elif kind == "tiny":
        w = w * 1e-9
    return w, lo, hi, total


@settings(max_examples=80, deadline=None)
@given(case=many_workers())
def test_water_fill_with_per_worker_bounds_is_a_water_filling(case):
    w, lo, hi, total = case
    shares = water_fill(w, lo, hi, total)
    assert abs(shares.sum() - total) <= 1e-9 * total
    eps = 1e-9 * total
    assert np.all(shares >= lo - eps) and np.all(shares <= hi + eps)
    free = (shares > lo + eps) & (shares < hi - eps) & (w > 0)
    if free.any():
        lam = np.median(shares[free] / w[free])
        assert np.allclose(shares[free] / w[free], lam, rtol=1e-6)
        pinned = lo == hi  # on both bounds at once: nothing to check
        at_lo, at_hi = (w > 0) & (shares <= lo + eps) & ~pinned, (shares >= hi - eps) & ~pinned
        assert np.all(lam * w[at_lo] <= lo[at_lo] * (1 + 1e-6) + 2 * eps)
        assert np.all(lam * w[at_hi] >= hi[at_hi] * (1 - 1e-6) - 2 * eps)


@settings(max_examples=80, deadline=None)
@given(case=many_workers())
def test_round_shares_with_per_worker_bounds_is_exact(case):
    w, lo, hi, total = case
    shares = water_fill(w, lo, hi, total)
    split = round_shares(shares, lo.astype(int), hi.astype(int), int(total))
    assert split.dtype.kind == "i" and int(split.sum()) == int(total)
    assert np.all(split >= lo) and np.all(split <= hi)
    assert np.all(np.abs(split - shares) < 1 + 1e-6)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.sampled_from([64, 1024, 4096]))
def test_split_array_at_scale_keeps_the_sum_the_bounds_and_the_shares(seed, n):
    rng = np.random.default_rng(seed)
    lo = int(rng.integers(1, 8))
    b = Bounds(int(rng.integers(n * lo, n * 100)), n, lo, int(rng.integers(100, 400)))
    targets = rng.lognormal(3.0, 1.0, n)
    split = split_array(targets, b)
    assert int(split.sum()) == b.global_batch and split.min() >= b.min_batch and split.max() <= b.upper
    assert np.all(np.abs(split - water_fill(targets, *limits(b))) < 1 + 1e-6)  # within a unit of its share
