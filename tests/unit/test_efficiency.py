"""Unit tests for ideal step time and balance efficiency (``omnilearn.balance.efficiency``).

``T* = B / sum(b_i / compute_s_i) + min_i wait_s_i`` per step, and
``eta = mean T* / mean T`` (T: the slowest worker's step) over the steps
``>= first_step``. Checked on hand-computed examples, on synthetic balanced
runs (eta == 1), on a uniform split over linear-time workers of speeds
4,2,1, and per-worker means in ``worker_stats``.

Run:  cd /work/main && python -m pytest -q tests/unit/test_efficiency.py
"""

from __future__ import annotations

import math
import random
from statistics import fmean

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.balance.efficiency import StepRow, balance_efficiency, by_step, ideal_step_s, worker_stats

SETTINGS = settings(max_examples=100, deadline=None)


def uniform_linear_run(speeds, local_batch, sync_s, steps, first=0):
    """Rows of a BSP run with equal batches; worker i computes b / v_i, all wait for the slowest, then sync."""
    slowest = max(local_batch / v for v in speeds)
    rows = []
    for step in range(first, first + steps):
        for rank, v in enumerate(speeds):
            compute = local_batch / v
            wait = slowest - compute + sync_s
            rows.append(StepRow(step, rank, local_batch, compute, wait, compute + wait))
    return rows


# ---------------------------------------------------------------- ideal_step_s


def test_ideal_step_hand_examples():
    rows = [
        StepRow(0, 0, 4, 1.0, 3.5, 4.5),
        StepRow(0, 1, 4, 2.0, 2.5, 4.5),
        StepRow(0, 2, 4, 4.0, 0.5, 4.5),
    ]
    # B = 12, speeds 4 + 2 + 1 = 7 samples/s, slowest waits 0.5 s
    assert ideal_step_s(rows) == pytest.approx(12 / 7 + 0.5)
    rows = [StepRow(3, 0, 10, 0.5, 0.2, 0.7), StepRow(3, 1, 30, 1.5, 0.1, 1.6)]
    # speeds 20 + 20 = 40, B = 40 -> 1 s, plus min wait 0.1
    assert ideal_step_s(rows) == pytest.approx(1.1)
    assert ideal_step_s([StepRow(0, 0, 64, 2.0, 0.0, 2.0)]) == pytest.approx(2.0)


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(1, 512), st.floats(1e-3, 10), st.floats(0, 1)), min_size=1, max_size=8),
)
def test_ideal_step_formula_and_bounds(workers):
    rows = [StepRow(0, r, b, t, w, t + w) for r, (b, t, w) in enumerate(workers)]
    B = sum(b for b, _, _ in workers)
    v = sum(b / t for b, t, _ in workers)
    ideal = ideal_step_s(rows)
    assert ideal == pytest.approx(B / v + min(w for _, _, w in workers))
    # never slower than the slowest worker's actual step, never faster than the fastest compute
    assert ideal <= max(r.step_s for r in rows) * (1 + 1e-9)
    assert ideal >= min(r.compute_s for r in rows) * (1 - 1e-9)


# ---------------------------------------------------------------- balance_efficiency


@SETTINGS
@given(
    st.lists(st.integers(1, 256), min_size=1, max_size=8),
    st.lists(st.tuples(st.floats(1e-3, 5), st.floats(0, 1)), min_size=1, max_size=20),
)
def test_balanced_rows_have_efficiency_one(batches, steps):
    rows = []
    for step, (t0, sync) in enumerate(steps):
        # every worker's batch matches its speed: all compute for t0, then all sync for the same time
        for rank, b in enumerate(batches):
            rows.append(StepRow(step, rank, b, t0, sync, t0 + sync))
    random.Random(len(rows)).shuffle(rows)  # row order must not matter
    assert balance_efficiency(rows) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("sync_s", [0.0, 0.25])
def test_uniform_split_speeds_421(sync_s):
    rows = uniform_linear_run((4.0, 2.0, 1.0), local_batch=4, sync_s=sync_s, steps=5)
    # B = 12, sum v = 7: T* = 12/7 + sync; measured T = 4/1 + sync (the speed-1 worker)
    expected = (12 / 7 + sync_s) / (4 + sync_s)
    assert balance_efficiency(rows) == pytest.approx(expected)
    if sync_s == 0:
        assert balance_efficiency(rows) == pytest.approx(3 / 7)


def test_hl8_uniform_gain_is_three():
    rows = uniform_linear_run((6.0, 6.0, 4.0, 32.0), local_batch=32, sync_s=0.0, steps=3)
    assert 1 / balance_efficiency(rows) == pytest.approx(3.0)


def test_efficiency_is_ratio_of_means():
    rows = [
        StepRow(0, 0, 2, 1.0, 0.0, 1.0), StepRow(0, 1, 2, 1.0, 0.0, 1.0),  # T* = 1, T = 1
        StepRow(1, 0, 2, 1.0, 0.0, 3.0), StepRow(1, 1, 2, 1.0, 1.0, 2.0),  # T* = 1, T = 2.5 (mean step_s)
    ]
    assert balance_efficiency(rows) == pytest.approx(2 / 3.5)  # not mean(1, 1/2.5)


def test_first_step_filtering():
    good = uniform_linear_run((4.0, 2.0, 1.0), 4, 0.0, steps=4, first=10)
    warmup = [StepRow(s, r, 4, 100.0, 0.0, 1000.0) for s in range(10) for r in range(3)]
    assert balance_efficiency(warmup + good, first_step=10) == pytest.approx(3 / 7)
    assert balance_efficiency(warmup + good, first_step=12) == pytest.approx(3 / 7)
    assert balance_efficiency(warmup + good) != pytest.approx(3 / 7)
    assert math.isnan(balance_efficiency(warmup + good, first_step=14))
    assert math.isnan(balance_efficiency([]))


@SETTINGS
@given(
    st.lists(
        st.lists(st.tuples(st.integers(1, 64), st.floats(1e-2, 5), st.floats(0, 1)), min_size=2, max_size=2),
        min_size=1,
        max_size=10,
    ),
    st.integers(0, 12),
)
def test_efficiency_matches_reference(steps, first):
    rows = [
        StepRow(s, r, b, t, w, t + w) for s, workers in enumerate(steps) for r, (b, t, w) in enumerate(workers)
    ]
    kept = [w for s, w in enumerate(steps) if s >= first]
    eta = balance_efficiency(rows, first_step=first)
    if not kept:
        assert math.isnan(eta)
        return
    ideal = fmean(sum(b for b, _, _ in w) / sum(b / t for b, t, _ in w) + min(x for *_, x in w) for w in kept)
    measured = fmean(fmean(t + x for _, t, x in w) for w in kept)
    assert eta == pytest.approx(ideal / measured)
    assert eta > 0


@SETTINGS
@given(
    st.lists(st.lists(st.tuples(st.integers(1, 64), st.floats(1e-2, 5)), min_size=2, max_size=4), min_size=1,
             max_size=10),
    st.floats(0, 1),
)
def test_synchronous_steps_are_never_better_than_ideal(steps, sync_s):
    # In BSP every worker's step ends together: at the slowest compute plus the sync.
    rows = []
    for s, workers in enumerate(steps):
        end = max(t for _, t in workers) + sync_s
        rows += [StepRow(s, r, b, t, end - t, end) for r, (b, t) in enumerate(workers)]
    assert 0 < balance_efficiency(rows) <= 1 + 1e-9


def test_by_step_groups():
    rows = uniform_linear_run((2.0, 1.0), 2, 0.0, steps=3)
    groups = by_step(reversed(rows))
    assert sorted(groups) == [0, 1, 2]
    assert all(sorted(r.rank for r in v) == [0, 1] for v in groups.values())


# ---------------------------------------------------------------- worker_stats


def test_worker_stats_hand_example():
    rows = [
        StepRow(1, 1, 30, 3.0, 0.0, 3.0),
        StepRow(0, 0, 10, 1.0, 0.5, 1.5),
        StepRow(0, 1, 10, 1.5, 0.0, 1.5),
        StepRow(1, 0, 30, 1.0, 2.0, 3.0),
        StepRow(2, 0, 20, 4.0, 0.0, 4.0),
        StepRow(2, 1, 20, 0.5, 3.5, 4.0),
    ]
    s0, s1 = worker_stats(rows)
    assert (s0.rank, s1.rank) == (0, 1)
    assert s0.mean_batch == pytest.approx(20)
    assert s0.mean_compute_s == pytest.approx(2.0)
    assert s0.mean_wait_s == pytest.approx(2.5 / 3)
    assert s0.speed == pytest.approx(10.0)  # 20 / 2, not mean(10, 30, 5)
    assert s1.mean_compute_s == pytest.approx(5 / 3)
    assert s1.speed == pytest.approx(20 / (5 / 3))
    (f0, f1) = worker_stats(rows, first_step=1)
    assert f0.mean_batch == pytest.approx(25) and f0.mean_compute_s == pytest.approx(2.5)
    assert f0.speed == pytest.approx(10.0)
    assert f1.mean_wait_s == pytest.approx(1.75)
    assert worker_stats(rows, first_step=3) == []


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 4), st.integers(1, 256), st.floats(1e-3, 5), st.floats(0, 2))),
    st.integers(0, 20),
)
def test_worker_stats_matches_reference(raw, first):
    rows = [StepRow(s, r, b, t, w, t + w) for s, r, b, t, w in raw]
    stats = worker_stats(rows, first_step=first)
    ranks = sorted({r for s, r, *_ in raw if s >= first})
    assert [x.rank for x in stats] == ranks
    for x in stats:
        mine = [row for row in rows if row.rank == x.rank and row.step >= first]
        assert x.mean_batch == pytest.approx(fmean(r.batch for r in mine))
        assert x.mean_compute_s == pytest.approx(fmean(r.compute_s for r in mine))
        assert x.mean_wait_s == pytest.approx(fmean(r.wait_s for r in mine))
        assert x.speed == pytest.approx(x.mean_batch / x.mean_compute_s)
