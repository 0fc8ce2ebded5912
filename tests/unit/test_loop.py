"""Tests for ``omnilearn.balance.loop`` (the ControlLoop both BSP and ASP run).

What is checked:

- ``window_row``/``window_table``: count, median, 1.4826 * MAD, empty and single windows;
- churn: with 10% per-step noise and no real change, at most 10% of 200
  intervals change at 64 and at 1,024 simulated workers (the legacy rule,
  same simulation, changes in nearly all: the bound can fail);
- a real 2x slowdown of one worker is followed within 2 intervals (4 to 1,024
  workers, and 3-4 workers on a noisy host: 20-30% noise, 5% of steps 3x);
  the ASP scenario (3x slower after 400 steady pushes) within 2 control
  intervals, event-driven and hand-built, where the legacy server path takes
  many more; one wild time in a window of two samples neither misleads nor
  blinds the loop;
- bounded history: the ring never grows, the estimate pools only the newest
  ``history`` windows, shift detection keeps only the newest window;
- stale rows (another batch) count as no samples; ``min_samples`` holds;
- the deadband judges the predicted gain (a 8% single-worker change among 64
  is held), the noise gate holds a gain inside the window noise and is the
  exact worst case over the estimates' error box (hypothesis, brute force),
  small plans still move by one sample; invariants of every decision (hypothesis);
- ``effective_step = step + 1 + lag`` and changes at/after ``total_steps`` held;
- ``state_dict`` is JSON-able and a restored loop makes the same decisions.

Run: ``cd /work/main && python -m pytest -q tests/unit/test_loop.py``
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from omnilearn.balance.allocation import Bounds, uniform_split
from omnilearn.balance.controllers import Decision, Estimates, ProportionalController, make_controller
from omnilearn.balance.loop import WINDOW_FIELDS, ControlLoop, window_row, window_table
from omnilearn.experiments.simulate import churn as simulate

FAST = settings(max_examples=60, deadline=None)


def rows_of(batches, medians, count=15, spread=0.0):
    """One fresh row per worker: its current batch, ``count`` samples, the given median and spread."""
    return [(b, count, m, spread) for b, m in zip(batches, medians)]


def linear_loop(batches, **kw) -> ControlLoop:
    bounds = Bounds(sum(batches), len(batches))
    return ControlLoop(ProportionalController(bounds, start=list(batches)), **kw)


# ---------------------------------------------------------------- window rows


def test_window_row_summarises_one_window():
    assert WINDOW_FIELDS == 4
    b, n, med, spread = window_row(32, [1.0, 2.0, 3.0, 4.0, 100.0])
    assert (b, n, med) == (32.0, 5.0, 3.0)
    assert spread == pytest.approx(1.4826 * 1.0)  # |dev| = 2,1,0,1,97 -> MAD 1
    assert window_row(8, []) == (8.0, 0.0, 0.0, 0.0)
    assert window_row(8, [0.5]) == (8.0, 1.0, 0.5, 0.0)


@FAST
@given(n=st.integers(1, 6), k=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_window_table_equals_window_row_per_worker(n, k, seed):
    rng = np.random.default_rng(seed)
    batches, times = rng.integers(1, 100, n), rng.uniform(0.1, 2.0, (n, k))
    table = window_table(batches, times)
    assert table.shape == (n, WINDOW_FIELDS)
    for row, b, t in zip(table, batches, times):
        assert row == pytest.approx(window_row(int(b), t.tolist()), rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------- churn and following real changes (simulated)


@pytest.mark.parametrize("workers", [64, 1024])
@pytest.mark.parametrize("seed", [0, 1])
def test_noise_alone_changes_at_most_ten_percent_of_intervals(workers, seed):
    changes, _ = simulate.churn(workers, intervals=200, legacy=False, seed=seed)
    assert changes <= 20, changes


def test_the_legacy_rule_fails_that_churn_bound():
    # the same simulation through the rule the loop replaced (largest single-worker change vs the
    # deadband), kept as the reference baseline in simulate.py
    changes, _ = simulate.churn(64, intervals=50, legacy=True)
    assert changes > 5, changes


@pytest.mark.parametrize("workers", [4, 64, 1024])
def test_a_real_2x_slowdown_is_followed_within_two_intervals(workers):
    intervals = simulate.follow(workers, legacy=False)
    assert intervals is not None and intervals <= 2, intervals


@pytest.mark.parametrize("workers", [3, 4])
@pytest.mark.parametrize("noise", [0.2, 0.3])
def test_a_small_noisy_cluster_follows_a_real_2x_slowdown_within_two_intervals(workers, noise):
    # A shared host: 20-30% per-step noise and 5% of steps 3x longer. Over 1,000 seeds each: at 20%
    # all follow within 2 (99.9-100% within 1); at 30%, 98.6-99% within 1, and 2 (3 workers) and 1 (4
    # workers) in 1,000 move less than halfway in 2 (their 15-step medians came out ~25% low). The
    # gate before (z = sqrt(2 ln n) + 0.5, the slowest worker's error counted before AND after) took
    # 3-4 intervals in 3.5% and 1.3% (seeds 0 and 4 here), and followed within 1 in only 75-77%.
    runs = [simulate.follow(workers, legacy=False, seed=s, noise=noise, spikes=0.05) for s in range(10)]
    assert all(r is not None and r <= 2 for r in runs), runs
    changes, _ = simulate.churn(workers, intervals=200, legacy=False, noise=noise, spikes=0.05)
    assert changes <= 20, changes  # and that host's noise alone still rarely changes batches


@pytest.mark.parametrize("who", [0, 1])  # the worker that then slows down, or another
def test_one_wild_time_in_a_two_sample_window_does_not_blind_the_loop(who):
    """A 20x pause as one of two samples used to stay in the pooled spread: 6-7 intervals blind."""
    loop = linear_loop((64, 64, 64, 64))
    rng, speed = np.random.default_rng(5), np.ones(4)

    def window():
        return window_table(loop.plan, (loop.plan / 64 * speed)[:, None] * (1 + 0.05 * rng.standard_normal((4, 15))))

    for k in range(6):
        assert not loop.update(k, window()).changed
    rows = window()
    rows[who] = window_row(64, [1.0, 20.0])
    wild = loop.update(6, rows)
    speed[0] = 2.0  # balanced share of worker 0 now ~37: halfway is 50
    followed = [loop.update(7 + k, window()).changed for k in range(2)]
    assert any(followed) and loop.batches[0] <= 50, (followed, loop.batches)
    assert not wild.changed and wild.times_s[who] == pytest.approx(1.0, rel=0.05)  # nor misled


def test_asp_3x_slowdown_after_400_pushes_is_followed_within_two_intervals():
    assert simulate.asp_follow(legacy=False) <= 2
    old = simulate.asp_follow(legacy=True)  # the server's unbounded history without a recent window
    assert old is None or old > 4, old


def test_asp_scenario_by_hand_reacts_with_bounded_memory():
    """4 workers at 60 pushes per window: 400 steady pushes (~7 windows), then worker 0 is 3x slower."""
    batches = (64, 64, 64, 64)
    loop = linear_loop(batches)
    rng = np.random.default_rng(3)
    ring_bytes = loop.ring.nbytes
    for k in range(7):
        d = loop.update(60 * (k + 1), window_table(batches, 1.0 + 0.05 * rng.standard_normal((4, 15))))
        assert not d.changed
    slow = [window_row(64, 3.0 + 0.15 * rng.standard_normal(5))] + [  # 5 pushes in a window instead of 15
        window_row(64, 1.0 + 0.05 * rng.standard_normal(18)) for _ in range(3)]
    d = loop.update(480, slow)
    assert d.changed and d.new[0] < 0.5 * 64, d
    assert d.times_s[0] == pytest.approx(3.0, rel=0.1)  # only the newest window counts for worker 0
    assert loop.ring.nbytes == ring_bytes


# ---------------------------------------------------------------- history, stale rows, min_samples


def test_history_is_capped_and_the_estimate_pools_only_the_newest_windows():
    loop = ControlLoop(make_controller("uniform", Bounds(40, 2), [1, 1]), history=4)
    ring_bytes = loop.ring.nbytes
    medians = [1.00, 1.04, 0.96, 1.02, 0.98] * 20  # within the 10% shift: never a "speed change"
    for k, m in enumerate(medians):
        loop.update(k, [(20, 3 + k % 2, m, 0.01), (20, 5, 2.0, 0.0)])
    state = loop.state_dict()
    assert [len(w) for w in state["windows"]] == [4, 4]
    assert loop.ring.nbytes == ring_bytes
    counts = [3 + k % 2 for k in range(len(medians))][-4:]
    expected = sum(c * m for c, m in zip(counts, medians[-4:])) / sum(counts)
    count, times, _ = loop.estimates()
    assert count.tolist() == [sum(counts), 20] and times[0] == pytest.approx(expected, rel=1e-12)
    assert times[0] != pytest.approx(np.average(medians, weights=[3 + k % 2 for k in range(100)]), rel=1e-6)
    # a window without samples takes a place in the ring too: history counts control windows
    loop.update(len(medians), [(20, 0, 0.0, 0.0), (20, 5, 2.0, 0.0)])
    assert loop.estimates()[0].tolist() == [sum(counts[1:]), 20]


def test_shift_keeps_only_the_newest_window_but_noise_does_not_shift():
    loop = linear_loop((50, 50), shift=0.10)
    for k in range(5):
        loop.update(k, rows_of((50, 50), (1.0, 1.0), spread=0.05))
    d = loop.update(5, rows_of((50, 50), (1.08, 1.0), spread=0.05))  # +8%: inside shift, pooled
    assert d.times_s[0] == pytest.approx((5 * 1.0 + 1.08) / 6)
    d = loop.update(6, rows_of((50, 50), (1.5, 1.0), spread=0.05))  # +45%: a speed change
    assert d.times_s[0] == pytest.approx(1.5)


def test_stale_rows_count_as_no_samples():
    loop = linear_loop((50, 50), min_samples=3)
    d = loop.update(0, [(50, 15, 1.0, 0.0), (49, 15, 0.01, 0.0)])  # rank 1 measured at another batch
    assert not d.changed and "fewer than 3 samples" in d.reason
    d = loop.update(1, rows_of((50, 50), (1.0, 1.0)))
    assert d.times_s == (1.0, 1.0)  # the stale 0.01 s never entered
    assert not d.changed


def test_min_samples_counts_over_the_history():
    loop = linear_loop((50, 50), min_samples=3)
    d = loop.update(0, rows_of((50, 50), (1.0, 2.0), count=2))
    assert not d.changed and "fewer than 3" in d.reason
    d = loop.update(1, rows_of((50, 50), (1.0, 2.0), count=1))  # 2 + 1 samples: enough
    assert d.changed and d.new == (67, 33)


# ---------------------------------------------------------------- the gates


def test_deadband_is_on_the_predicted_gain_not_the_largest_single_change():
    batches = tuple([64] * 64)
    times = [1.0] * 63 + [0.92]  # one worker 8% faster: it would get 8% more, the step gains ~0.1%
    d = linear_loop(batches).update(0, rows_of(batches, times))
    assert not d.changed and "within deadband" in d.reason
    before, after = d.predicted_s
    assert before == 1.0 and (before - after) / before < 0.01
    # the legacy test (largest relative change > 5%) would have changed
    est = Estimates(np.array(batches), np.array(times), np.zeros(64))
    proposal = ProportionalController(Bounds(64 * 64, 64)).propose(est)
    assert max(abs(a - b) / b for a, b in zip(proposal.batches, batches)) > 0.05


def test_noise_gate_holds_a_gain_inside_the_window_noise():
    batches = (100, 100, 100, 100)
    medians = (1.1, 1.0, 1.0, 1.0)  # predicted gain ~7% > 5% deadband
    noisy = linear_loop(batches).update(0, rows_of(batches, medians, spread=0.3))
    assert not noisy.changed and "noise" in noisy.reason
    quiet = linear_loop(batches).update(0, rows_of(batches, medians, spread=0.01))
    assert quiet.changed
    before, after = quiet.predicted_s
    assert before == 1.1 and (before - after) / before > 0.05
    assert after == pytest.approx(max(t * n / b for t, n, b in zip(medians, quiet.new, batches)))


@FAST
@given(n=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_noise_gate_is_the_exact_worst_case_over_the_error_box(n, seed):
    rng = np.random.default_rng(seed)
    loop = linear_loop((10,) * n)
    times, stderr = rng.uniform(0.5, 2.0, n), rng.uniform(0.0, 0.2, n) * rng.integers(0, 2, n)
    predicted = times * rng.uniform(0.5, 1.5, n)
    z, before = loop.margin_z(), times.max()
    lo, hi = np.maximum(times - z * stderr, 0.0), times + z * stderr

    def least_gain(taus):  # (n, k) true times -> least of their k gains
        return float(np.min(taus.max(0) - (taus * (predicted / times)[:, None]).max(0)))

    worst = before - predicted.max() - before * loop.noise(times, stderr, predicted)
    # the minimum lies where each worker sits at an end of its box or at another's low end
    grids = [np.unique(np.concatenate(([lo[i], hi[i]], np.clip(lo, lo[i], hi[i])))) for i in range(n)]
    assert worst == pytest.approx(least_gain(np.array(np.meshgrid(*grids)).reshape(n, -1)), abs=1e-12)
    assert least_gain(rng.uniform(lo[:, None], hi[:, None], (n, 500))) >= worst - 1e-12


def test_small_plans_can_move_by_one_sample():
    loop = linear_loop((10, 10))
    d = loop.update(0, rows_of((10, 10), (1.2, 1.0)))  # proposal (9, 11): predicted 1.2 s -> 1.1 s
    assert d.changed and d.new == (9, 11) and d.predicted_s == (1.2, pytest.approx(1.1))
    tiny = linear_loop((2, 2, 2, 2))
    d = tiny.update(0, rows_of((2, 2, 2, 2), (2.0, 1.0, 1.0, 1.0)))
    assert d.changed and d.new[0] == 1 and max(abs(a - b) for a, b in zip(d.new, d.old)) == 1


@pytest.mark.parametrize("name", ["uniform", "static"])
def test_fixed_controllers_never_change(name):
    bounds = Bounds(100, 2)
    loop = ControlLoop(make_controller(name, bounds, [1.0, 3.0]))
    for k in range(3):
        d = loop.update(k, rows_of(loop.batches, (1.0, 5.0)))
        assert not d.changed and d.new == d.old and "fixed" in d.reason


@FAST
@given(n=st.integers(1, 12), lag=st.integers(0, 3), seed=st.integers(0, 2**31),
       deadband=st.sampled_from([0.0, 0.05, 0.2]))
def test_every_decision_keeps_sum_bounds_and_its_gates(n, lag, seed, deadband):
    rng = np.random.default_rng(seed)
    lo = int(rng.integers(1, 5))
    bounds = Bounds(int(rng.integers(n * lo, n * 60 + 1)), n, lo, int(rng.integers(60, 200)))
    loop = ControlLoop(ProportionalController(bounds), deadband=deadband, lag=lag)
    for step in range(6):
        old = loop.batches
        rows = [(b, rng.integers(0, 6), rng.uniform(0.2, 3.0), rng.uniform(0, 0.2)) for b in old]
        d = loop.update(step, rows)
        assert isinstance(d, Decision) and d.step == step and d.old == old
        assert sum(d.new) == bounds.global_batch and all(lo <= b <= bounds.upper for b in d.new)
        assert all(isinstance(b, int) for b in d.new) and loop.batches == d.new
        if d.changed and d.predicted_s is None:  # forced: the adaptive upper bound (random times fall)
            assert "capped" in d.reason and d.effective_step == step + 1 + lag and d.new != d.old
        elif d.changed:
            before, after = d.predicted_s
            assert (before - after) / before > deadband and d.effective_step == step + 1 + lag
            assert d.new != d.old
        else:
            assert d.new == d.old and d.effective_step is None


# ---------------------------------------------------------------- effective step and total steps


def test_effective_step_and_changes_past_the_end_are_held():
    rows = rows_of((50, 50), (1.0, 2.0))
    d = linear_loop((50, 50), lag=3, total_steps=100).update(90, rows)
    assert d.changed and d.effective_step == 94 and d.new == (67, 33)
    late = linear_loop((50, 50), lag=3, total_steps=100)
    d = late.update(96, rows)  # would start at step 100 == total_steps
    assert not d.changed and d.new == d.old == (50, 50) and "total steps 100" in d.reason
    assert late.batches == (50, 50)


def test_rows_after_a_change_at_the_old_batch_are_stale_until_it_takes_effect():
    loop = linear_loop((50, 50), lag=20)
    d = loop.update(9, rows_of((50, 50), (1.0, 2.0)))
    assert d.changed and loop.batches == (67, 33)
    d = loop.update(19, rows_of((50, 50), (1.0, 2.0)))  # still the old batches: no samples
    assert not d.changed and "fewer than" in d.reason


# ---------------------------------------------------------------- validation and state


def test_bad_rows_and_arguments_are_rejected():
    loop = linear_loop((50, 50))
    with pytest.raises(ValueError, match="rows must be"):
        loop.update(0, [(50, 1, 1.0, 0.0)])
    with pytest.raises(ValueError, match="finite"):
        loop.update(0, [(50, 3, math.nan, 0.0), (50, 3, 1.0, 0.0)])
    for kw in ({"deadband": 1.0}, {"deadband": -0.01}, {"deadband": math.nan}, {"lag": -1}, {"history": 0},
               {"min_samples": 0}, {"shift": 0.0}, {"total_steps": 0}):
        with pytest.raises(ValueError):
            linear_loop((50, 50), **kw)


def drive(loop: ControlLoop, cluster, steps: range):
    out = []
    for k in steps:
        out.append(loop.update(k, window_table(loop.plan, cluster.times(loop.batches, 6))))
    return out


def test_state_dict_round_trip_makes_the_same_decisions():
    bounds = Bounds(16 * 64, 16)
    cluster = simulate.make_cluster(16, seed=4, noise=0.2)
    loop = ControlLoop(ProportionalController(bounds), lag=1, history=5, total_steps=10_000)
    drive(loop, cluster, range(0, 12))
    state = json.loads(json.dumps(loop.state_dict()))  # plain Python only
    twin = ControlLoop(ProportionalController(bounds, start=uniform_split(bounds)), lag=1, history=5,
                       total_steps=10_000)
    twin.load_state_dict(state)
    assert twin.batches == loop.batches and twin.state_dict() == loop.state_dict()
    cluster.slow(3, 2.5)  # something to decide on
    seed = cluster.rng.bit_generator.state
    first = drive(loop, cluster, range(12, 30))
    cluster.rng.bit_generator.state = seed
    again = drive(twin, cluster, range(12, 30))
    assert first == again and any(d.changed for d in first)


def test_load_state_dict_rejects_another_worker_count():
    state = linear_loop((50, 50)).state_dict()
    with pytest.raises(ValueError, match="2 workers"):
        linear_loop((30, 30, 40)).load_state_dict(state)
