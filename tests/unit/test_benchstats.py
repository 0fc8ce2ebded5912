"""Unit tests for the bench figures (``omnilearn.experiments.bench.stats``), a pure module.

Checked against hand-computed values on small synthetic BSP runs:

- ``rows_from_records`` keeps only ``event == "step"`` records and maps fields;
- ``reaction_steps`` counts the unbalanced steps after each speed change
  (window 5, tolerance 10%), ``None`` when a block never rebalances or is too
  short (a change right at the end);
- ``time_to_accuracy`` gives the earliest ``wall_s`` among evaluations reaching
  the target, ``None`` when never reached or no target;
- ``fidelity_error`` is ~0 for compute times in the declared ratios and 0.2
  with one worker 20% off;
- ``arm_figures`` takes ``mean_step_s``/``samples_per_s`` from ``wall_step_s``
  and the rest from steps ``>= first_step``;
- the steady range: ``steps_per_epoch``, ``steady_range_start`` (first epoch
  boundary at or after half the run) and ``steady_wall_step_s`` (training
  clock read at evaluations);
- across repeats (``benchsummary``): paired speed-ups (``add_paired``: per
  repeat against that repeat's uniform arm; ideal from the lowest ``T*`` of
  the balanced arms), ``ci95``, ``verdict`` (faster/slower only when every
  repeat or the 95% CI is on one side of 1), ``spread_of``, ``merge``
  (spread, verdicts, settling within a control interval), ``add_floor`` (HL1
  balance efficiency), ``fmt_spread`` and ``markdown_table``;
- ``bench --mode asp``: ``eval_points`` (an ASP eval counts at the time of
  the push that made its weights), ``accuracy_at_time``, ``accuracy_by_budget``
  (the first evaluation after the budget, marked late, when none came by it), ``epoch_accuracies``
  and ``equal_epochs`` (accuracy at equal epochs of data),
  ``staleness_histogram`` / ``add_histograms``, ``spread`` and
  ``asp_markdown_table``.

Synthetic BSP steps: all workers' steps end together at ``max compute + sync``,
so ``wait_i = end - compute_i`` and ``step_s_i = end``; then
``T* = B / sum(v_i) + sync`` (``v_i = b_i / compute_i``).

Run:  cd /work/main && python -m pytest -q tests/unit/test_benchstats.py
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.experiments.bench.stats import (
    REACTION_WINDOW,
    arm_figures,
    fidelity_error,
    reaction_steps,
    rows_from_records,
    steady_range_start,
    steady_wall_step_s,
    steps_per_epoch,
    time_to_accuracy,
)
from omnilearn.experiments.bench.summary import (
    HEADER,
    SAME,
    add_floor,
    add_paired,
    ci95,
    fmt_spread,
    markdown_table,
    merge,
    settled_within,
    spread_of,
    verdict,
)
from omnilearn.balance.efficiency import StepRow, ideal_step_s, measured_step_s

SYNC_S = 1.0


def bsp_step(step, batches, computes, sync_s=SYNC_S):
    """Rows of one synchronous step: every worker's step ends at max(compute) + sync."""
    end = max(computes) + sync_s
    return [StepRow(step, rank, b, c, end - c, end) for rank, (b, c) in enumerate(zip(batches, computes))]


# Speeds are permutations of (1, 1, 2) samples/s, global batch 8, sync 1 s, so
# T* = 8 / 4 + 1 = 3 s in every step.
#   balanced:   batches 2*v_i -> every compute 2 s, step 3 s  (= T*)
#   unbalanced: one slow (v=1) worker gets 5, the other slow 1, the fast 2
#               -> computes 5, 1, 1 s, step 6 s (= 2 T*)
T_STAR = 3.0


def speed_step(step, speeds, balanced):
    if balanced:
        batches = [2 * v for v in speeds]
    else:
        slow = [i for i, v in enumerate(speeds) if v == 1]
        batches = [2] * len(speeds)
        batches[slow[0]], batches[slow[1]] = 5, 1
    return bsp_step(step, batches, [b / v for b, v in zip(batches, speeds)])


SPEED_BLOCKS = [(1, 1, 2), (2, 1, 1), (1, 2, 1), (1, 1, 2)]


def dynamic_run(change_steps, end_step, unbalanced_k):
    """Rows of a run whose speeds change at ``change_steps``; the first k steps after each are unbalanced."""
    rows = []
    bounds = list(change_steps) + [end_step]
    for block, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        speeds = SPEED_BLOCKS[block % len(SPEED_BLOCKS)]
        for step in range(start, stop):
            rows += speed_step(step, speeds, balanced=step - start >= unbalanced_k[block])
    return rows


# ---------------------------------------------------------------- synthetic data sanity


@pytest.mark.parametrize("speeds", SPEED_BLOCKS)
def test_synthetic_steps_have_hand_computed_times(speeds):
    bal, unbal = speed_step(0, speeds, True), speed_step(1, speeds, False)
    assert sum(r.batch for r in bal) == sum(r.batch for r in unbal) == 8
    assert ideal_step_s(bal) == pytest.approx(T_STAR)
    assert measured_step_s(bal) == pytest.approx(T_STAR)
    assert ideal_step_s(unbal) == pytest.approx(T_STAR)
    assert measured_step_s(unbal) == pytest.approx(2 * T_STAR)


# ---------------------------------------------------------------- rows_from_records


def test_rows_from_records_keeps_step_events_and_maps_fields():
    records = [
        {"event": "start", "rank": 0},
        {"event": "step", "step": 3, "rank": 1, "batch": 24, "compute_s": 0.5, "wait_s": 0.25,
         "step_s": 0.8, "loss": 2.3, "lr": 0.1},
        {"event": "eval", "step": 3, "rank": 0, "batch": 24, "compute_s": 9.0, "wait_s": 9.0,
         "step_s": 9.0, "test_accuracy": 0.5},
        {"step": 4, "rank": 0, "batch": 8, "compute_s": 1.0, "wait_s": 1.0, "step_s": 1.0},  # no event
        {"event": "step", "step": 4, "rank": 0, "batch": 8, "compute_s": 0.125, "wait_s": 0.0625,
         "step_s": 0.25},
    ]
    assert rows_from_records(records) == [
        StepRow(step=3, rank=1, batch=24, compute_s=0.5, wait_s=0.25, step_s=0.8),
        StepRow(step=4, rank=0, batch=8, compute_s=0.125, wait_s=0.0625, step_s=0.25),
    ]


def test_rows_from_records_empty_and_iterator():
    assert rows_from_records([]) == []
    gen = ({"event": "step", "step": i, "rank": 0, "batch": 1, "compute_s": 1.0, "wait_s": 0.0,
            "step_s": 1.0} for i in range(3))
    assert [r.step for r in rows_from_records(gen)] == [0, 1, 2]


# ---------------------------------------------------------------- reaction_steps


def test_reaction_window_is_five():
    assert REACTION_WINDOW == 5


def test_reaction_steps_balanced_at_once_is_zero():
    rows = dynamic_run([0, 20, 40], 60, [0, 0, 0])
    assert reaction_steps(rows, [0, 20, 40], 60) == [0, 0, 0]


@pytest.mark.parametrize("ks", [(4, 0, 7), (3, 6, 1), (1, 2, 10)])
def test_reaction_steps_returns_k_per_change(ks):
    rows = dynamic_run([0, 20, 40], 60, list(ks))
    assert reaction_steps(rows, [0, 20, 40], 60, tolerance=0.10, window=5) == list(ks)


def test_reaction_steps_none_when_block_never_balanced():
    # Block 2 is unbalanced for all 20 steps; block 3 balances only in its last 2 steps,
    # too few for a majority of a 5-step window.
    rows = dynamic_run([0, 20, 40], 60, [0, 20, 18])
    assert reaction_steps(rows, [0, 20, 40], 60) == [0, None, None]


def test_reaction_steps_change_right_at_the_end():
    rows = dynamic_run([0], 30, [0])
    assert reaction_steps(rows, [0, 30], 30) == [0, None]
    # Fewer than a window's steps left after the last change: not judged.
    rows = dynamic_run([0, 27], 30, [0, 0])
    assert reaction_steps(rows, [0, 27], 30) == [0, None]


def test_reaction_steps_tolerance_edge():
    # Two workers, batch 4 each, compute 2 s, no wait: T* = 8 / (2 + 2) = 2 s; every step takes 2.1 s
    # (1.05 T*): within 10%, not within 1%.
    rows = [StepRow(step, rank, 4, 2.0, 0.0, 2.1) for step in range(10) for rank in range(2)]
    assert reaction_steps(rows, [0], 10, tolerance=0.10) == [0]
    assert reaction_steps(rows, [0], 10, tolerance=0.01) == [None]


# ---------------------------------------------------------------- time_to_accuracy


def test_time_to_accuracy_first_hit():
    evals = [
        {"wall_s": 10.0, "test_accuracy": 0.50},
        {"wall_s": 20.0, "test_accuracy": 0.70},
        {"wall_s": 30.0, "test_accuracy": 0.80},  # reaches 0.8 exactly
        {"wall_s": 40.0, "test_accuracy": 0.75},
        {"wall_s": 50.0, "test_accuracy": 0.90},
    ]
    assert time_to_accuracy(evals, 0.8) == 30.0
    assert time_to_accuracy(evals, 0.85) == 50.0
    assert time_to_accuracy(evals, 0.1) == 10.0


def test_time_to_accuracy_takes_earliest_wall_time_whatever_the_order():
    evals = [
        {"wall_s": 50.0, "test_accuracy": 0.95},
        {"wall_s": 12.5, "test_accuracy": 0.91},
        {"wall_s": 5.0, "test_accuracy": 0.30},
        {"wall_s": 30.0, "test_accuracy": 0.92},
    ]
    assert time_to_accuracy(evals, 0.9) == 12.5


def test_time_to_accuracy_none():
    evals = [{"wall_s": 1.0, "test_accuracy": 0.4}, {"wall_s": 2.0, "test_accuracy": 0.6}]
    assert time_to_accuracy(evals, 0.61) is None
    assert time_to_accuracy(evals, None) is None
    assert time_to_accuracy([], 0.5) is None


# ---------------------------------------------------------------- fidelity_error


def uniform_rows(computes_per_rank, steps=4, batch=8):
    rows = []
    for step in range(steps):
        rows += bsp_step(step, [batch] * len(computes_per_rank), computes_per_rank, sync_s=0.01)
    return rows


def test_fidelity_error_exact_ratios_is_zero():
    # speeds 1, 0.5, 0.25 -> compute 0.1, 0.2, 0.4 s
    rows = uniform_rows([0.1, 0.2, 0.4])
    assert fidelity_error(rows, [1.0, 0.5, 0.25]) == pytest.approx(0.0, abs=1e-12)


def test_fidelity_error_fastest_not_rank_zero():
    rows = uniform_rows([0.3, 0.6, 0.15])
    assert fidelity_error(rows, [0.5, 0.25, 1.0]) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("compute", [0.48, 0.32])  # 20% slow, 20% fast (declared 0.4)
def test_fidelity_error_one_worker_20_percent_off(compute):
    rows = uniform_rows([0.1, 0.2, compute])
    assert fidelity_error(rows, [1.0, 0.5, 0.25]) == pytest.approx(0.2)


def test_fidelity_error_fastest_worker_off_shifts_the_base():
    # The fastest worker takes 0.12 s instead of 0.1: others' ratios 0.2/0.12 and 0.4/0.12
    # against 2 and 4 -> |1/1.2 - 1| = 1/6.
    rows = uniform_rows([0.12, 0.2, 0.4])
    assert fidelity_error(rows, [1.0, 0.5, 0.25]) == pytest.approx(1 / 6)


def test_fidelity_error_uses_means_over_steps_from_first_step():
    rows = []
    for step, computes in enumerate([[5.0, 0.1], [0.1, 5.0], [0.1, 0.15], [0.1, 0.25]]):
        rows += bsp_step(step, [8, 8], computes)
    # From step 2: rank 1 mean 0.2 = 2 x rank 0 mean 0.1 -> exact for speeds 1, 0.5.
    assert fidelity_error(rows, [1.0, 0.5], first_step=2) == pytest.approx(0.0, abs=1e-12)
    # From step 3 only: 0.25 / 0.1 = 2.5 against 2 -> 0.25.
    assert fidelity_error(rows, [1.0, 0.5], first_step=3) == pytest.approx(0.25)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.05, 1.0), min_size=1, max_size=6), st.floats(0.01, 1.0))
def test_fidelity_error_zero_for_any_exact_slowdowns(speeds, base_s):
    fastest = max(speeds)
    rows = uniform_rows([base_s * fastest / s for s in speeds], steps=2)
    assert fidelity_error(rows, speeds) == pytest.approx(0.0, abs=1e-9)


# ---------------------------------------------------------------- arm_figures


def arm_rows():
    rows = []
    rows += bsp_step(0, [8, 8], [10.0, 20.0], sync_s=5.0)  # warm-up, excluded
    rows += bsp_step(1, [8, 8], [30.0, 1.0], sync_s=5.0)  # warm-up, excluded
    # step 2: batches 4, 12; compute 0.4, 0.6 (v = 10, 20); sync 0.1 -> end 0.7, waits 0.3, 0.1
    #         T* = 16/30 + 0.1
    rows += bsp_step(2, [4, 12], [0.4, 0.6], sync_s=0.1)
    # step 3: batches 6, 10; compute 0.6, 0.5 (v = 10, 20); sync 0.2 -> end 0.8, waits 0.2, 0.3
    #         T* = 16/30 + 0.2
    rows += bsp_step(3, [6, 10], [0.6, 0.5], sync_s=0.2)
    return rows


def test_arm_figures_hand_computed():
    fig = arm_figures(arm_rows(), global_batch=16, wall_step_s=0.9, first_step=2)
    ideal = (16 / 30 + 0.1 + 16 / 30 + 0.2) / 2  # 0.68333...
    assert fig["mean_step_s"] == 0.9
    assert fig["samples_per_s"] == pytest.approx(16 / 0.9)
    assert fig["in_step_s"] == pytest.approx(0.75)
    assert fig["ideal_step_s"] == pytest.approx(ideal)
    assert fig["ideal_step_s"] == pytest.approx(0.683333333)
    assert fig["balance_efficiency"] == pytest.approx(ideal / 0.75)
    assert fig["mean_batch"] == pytest.approx([5.0, 11.0])
    assert fig["compute_s_per_worker"] == pytest.approx([0.5, 0.55])
    assert fig["wait_s_per_worker"] == pytest.approx([0.25, 0.2])


def test_arm_figures_wall_step_is_independent_of_rows():
    a = arm_figures(arm_rows(), 16, wall_step_s=2.0, first_step=2)
    b = arm_figures(arm_rows(), 16, wall_step_s=0.5, first_step=2)
    assert (a["mean_step_s"], a["samples_per_s"]) == (2.0, 8.0)
    assert (b["mean_step_s"], b["samples_per_s"]) == (0.5, 32.0)
    assert a["ideal_step_s"] == b["ideal_step_s"] and a["in_step_s"] == b["in_step_s"]


def test_arm_figures_first_step_zero_includes_warmup():
    fig = arm_figures(arm_rows(), 16, wall_step_s=1.0, first_step=0)
    # Step 0 ends at 25, step 1 at 35 -> in-step mean (25 + 35 + 0.7 + 0.8) / 4
    assert fig["in_step_s"] == pytest.approx((25 + 35 + 0.7 + 0.8) / 4)
    assert fig["mean_batch"] == pytest.approx([(8 + 8 + 4 + 6) / 4, (8 + 8 + 12 + 10) / 4])


# ---------------------------------------------------------------- the steady range


def test_steps_per_epoch_from_step_records():
    records = [{"event": "step", "step": s, "epoch": s // 19, "rank": 0} for s in range(40)]
    assert steps_per_epoch(records, 40) == 19
    assert steps_per_epoch(records[:10], 10) == 10  # shorter than an epoch: the run's length
    assert steps_per_epoch([], 0) == 0


@pytest.mark.parametrize("total, spe, first", [
    (300, 19, 152), (150, 19, 76), (200, 19, 114), (100, 19, 57), (152, 19, 76),  # first boundary >= half
    (100, 60, 60), (100, 70, 70), (100, 101, 0), (12, 39, 0),  # none before the end: the last one below half
    (1, 19, 0), (0, 19, 0),
])
def test_steady_range_start_is_the_epoch_boundary_at_half(total, spe, first):
    assert steady_range_start(total, spe) == first
    assert steady_range_start(total, spe, dynamic=True) == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5000), st.integers(1, 500))
def test_steady_range_start_properties(total, spe):
    first = steady_range_start(total, spe)
    assert 0 <= first < total and first % spe == 0
    assert first >= total // 2 or first + spe >= total  # at half, unless no boundary lies in the second half


def test_steady_wall_step_s_reads_the_clock_at_evaluations():
    evals = [{"event": "eval", "step": 19, "wall_s": 1.0}, {"event": "eval", "step": 38, "wall_s": 2.5},
             {"event": "eval", "step": 50, "wall_s": 3.1}]
    assert steady_wall_step_s(evals, 38, 50, 3.2) == pytest.approx((3.2 - 2.5) / 12)  # the run's end: train_s
    assert steady_wall_step_s(evals, 19, 38, 9.9) == pytest.approx((9.9 - 1.0) / 19)  # end given by train_s
    assert steady_wall_step_s(evals, 0, 50, 3.2) == pytest.approx(3.2 / 50)  # step 0 is 0 s
    assert steady_wall_step_s(evals, 20, 50, 3.2) is None  # no clock reading at step 20
    assert steady_wall_step_s(evals, 50, 50, 3.2) is None


# ---------------------------------------------------------------- paired speed-ups (benchsummary)


def test_add_paired_single_repeat():
    results = [
        {"setting": "HL2", "arm": "uniform", "mean_step_s": 2.0, "in_step_s": 1.8, "ideal_step_s": 1.0},
        {"setting": "HL2", "arm": "omnilearn", "mean_step_s": 1.0, "in_step_s": 0.9, "ideal_step_s": 0.6},
        {"setting": "HL2", "arm": "static", "mean_step_s": 1.6, "ideal_step_s": None},
        {"setting": "HL4", "arm": "omnilearn", "mean_step_s": 1.0, "in_step_s": 0.9, "ideal_step_s": 0.5},
        {"setting": "HL8", "arm": "uniform", "mean_step_s": 3.0, "in_step_s": 2.5, "ideal_step_s": 1.2},
    ]
    assert add_paired(results) is None
    got = [(r["setting"], r["arm"], r["speedup"], r["ideal_speedup"]) for r in results]
    assert got == [
        ("HL2", "uniform", 1.0, pytest.approx(3.0)),  # one ideal per setting: 1.8 / 0.6
        ("HL2", "omnilearn", 2.0, pytest.approx(3.0)),
        ("HL2", "static", 1.25, pytest.approx(3.0)),
        ("HL4", "omnilearn", None, None),  # no uniform arm
        ("HL8", "uniform", 1.0, None),  # no balanced arm
    ]
    assert results[1]["speedup_of_ideal"] == pytest.approx(2 / 3)
    assert results[1]["vs_uniform"] == 2.0 and results[1]["vs_static"] == pytest.approx(1.6)
    assert "vs_uniform" not in results[0] and "vs_static" not in results[2]  # fixed arms get no verdict
    assert results[3]["vs_static"] is None


def test_add_paired_pairs_within_a_repeat_and_takes_the_lowest_balanced_t_star():
    rows = [
        {"setting": "HL8", "arm": "uniform", "repeat": 0, "mean_step_s": 2.0, "in_step_s": 1.6},
        {"setting": "HL8", "arm": "omnilearn", "repeat": 0, "mean_step_s": 1.0, "ideal_step_s": 0.8},
        {"setting": "HL8", "arm": "model", "repeat": 0, "mean_step_s": 1.25, "ideal_step_s": 0.5},
        {"setting": "HL8", "arm": "uniform", "repeat": 1, "mean_step_s": 4.0, "in_step_s": 3.0},  # a slow repeat
        {"setting": "HL8", "arm": "omnilearn", "repeat": 1, "mean_step_s": 2.5, "ideal_step_s": 1.5},
        {"setting": "HL8", "arm": "model", "repeat": 1, "mean_step_s": 2.0, "ideal_step_s": 2.0},
    ]
    add_paired(rows)
    assert [r["speedup"] for r in rows] == [1.0, 2.0, 1.6, 1.0, 1.6, 2.0]  # each against its own repeat's uniform
    assert [r["ideal_speedup"] for r in rows] == [3.2, 3.2, 3.2, 2.0, 2.0, 2.0]  # 1.6 / 0.5, 3.0 / 1.5
    assert rows[2]["speedup_of_ideal"] == pytest.approx(0.5)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0.01, 10)), min_size=1, max_size=6))
def test_paired_speedup_is_the_ratio_within_each_repeat(times):
    rows = []
    for rep, (u, b) in enumerate(times):
        rows += [{"setting": "s", "arm": "uniform", "repeat": rep, "mean_step_s": u},
                 {"setting": "s", "arm": "omnilearn", "repeat": rep, "mean_step_s": b}]
    add_paired(rows)
    for rep, (u, b) in enumerate(times):
        assert rows[2 * rep]["speedup"] == 1.0
        assert rows[2 * rep + 1]["speedup"] == pytest.approx(u / b) == rows[2 * rep + 1]["vs_uniform"]


# ---------------------------------------------------------------- verdict and spread


def test_ci95_hand_computed():
    lo, hi = ci95([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, 2) = 4.303
    assert (lo, hi) == (pytest.approx(2 - 4.303 / 3 ** 0.5), pytest.approx(2 + 4.303 / 3 ** 0.5))
    assert ci95([1.0]) is None


@pytest.mark.parametrize("ratios, expected", [
    ([1.1, 1.2, 1.05], "faster"),
    ([1.01, 1.02], "faster"),
    ([0.9, 0.95, 0.8], "slower"),
    ([1.1, 0.95, 1.2], SAME),
    ([1.0, 1.1, 1.2], SAME),  # exactly 1 is not faster
    ([1.2] * 9 + [0.99], "faster"),  # one repeat below 1, but the 95% CI of the mean is well above
    ([0.8] * 9 + [1.01], "slower"),
    ([1.93], "– (1 repeat)"),  # one repeat: no spread, no verdict
    ([1.2, None, 1.3], "– (3 repeats)"),
    ([], "– (0 repeats)"),
])
def test_verdict(ratios, expected):
    assert verdict(ratios) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.2, 5.0), min_size=2, max_size=8))
def test_verdict_is_symmetric_and_needs_agreement(ratios):
    v, inverse = verdict(ratios), verdict([1 / r for r in ratios])
    assert {v, inverse} in ({"faster", "slower"}, {SAME})
    if min(ratios) > 1:
        assert v == "faster"
    if v == SAME:
        assert min(ratios) <= 1 <= max(ratios)


def test_spread_of():
    assert spread_of([1.0, 3.0, 2.0]) == {"mean": 2.0, "min": 1.0, "max": 3.0, "per_repeat": [1.0, 3.0, 2.0]}
    assert spread_of([1.0, None]) == {"mean": None, "min": None, "max": None, "per_repeat": [1.0, None]}
    assert spread_of([]) == {"mean": None, "min": None, "max": None, "per_repeat": []}


def test_fmt_spread():
    assert fmt_spread({"mean": 1.675, "min": 1.61, "max": 1.74}, ".2f") == "1.68 (1.61–1.74)"
    assert fmt_spread({"mean": 0.0426, "min": 0.041, "max": 0.0441}, ".1f", 1e3) == "42.6 (41.0–44.1)"
    assert fmt_spread({"mean": 2.0, "min": 2.0, "max": 2.0}, ".2f") == "2.00"  # one repeat: the value alone
    assert fmt_spread({"mean": None}, ".2f") == fmt_spread(None, ".2f") == "–"


def test_settled_within_needs_every_repeat():
    assert settled_within([[0, 15, 16, None], [3, 2, 1, 0]], 15) == [True, True, False, False]
    assert settled_within([[0, 1], [0]], 15) is None and settled_within([None], 15) is None


def bench_rows():
    """Two repeats, HL1 and HL8 (uniform, static, omnilearn) and paper (uniform, omnilearn), already measured."""
    rows = []
    steps = {("HL1", "uniform"): (1.0, 1.1), ("HL1", "static"): (1.0, 1.0), ("HL1", "omnilearn"): (0.95, 1.12),
             ("HL8", "uniform"): (2.0, 2.2), ("HL8", "static"): (1.2, 1.1), ("HL8", "omnilearn"): (1.0, 1.0),
             ("paper", "uniform"): (1.5, 1.5), ("paper", "omnilearn"): (1.0, 1.2)}
    eff = {"HL1": 0.8, "HL8": 0.9, "paper": 0.85}
    for rep in range(2):
        for (setting, arm), t in steps.items():
            paper = setting == "paper"
            rows.append({"setting": setting, "arm": arm, "repeat": rep, "steps": 100,
                         "run_dir": f"{setting}-{arm}-r{rep}",
                         "mean_step_s": t[rep], "samples_per_s": 512 / t[rep], "in_step_s": 0.9 * t[rep],
                         "ideal_step_s": 0.5, "balance_efficiency": eff[setting] + 0.02 * rep,
                         "wait_s_per_worker": [0.01 * (rep + 1)] * 2, "mean_batch": [100.0, 412.0 + rep],
                         "reaction_steps": [3, 20 + rep] if paper else None,
                         "settle_steps": [0, 14 + 2 * rep] if paper else None,
                         "speed_change_steps": [50, 75] if paper else None, "figures_from_step": 0 if paper else 57})
    return rows


def test_merge_gives_spread_verdicts_floor_and_settling():
    rows = bench_rows()
    add_paired(rows)
    merged = merge(rows, control_interval=15)
    add_floor(merged)
    by = {(r["setting"], r["arm"]): r for r in merged}
    assert len(merged) == 8 and all(r["repeats"] == 2 for r in merged)
    hl8 = by["HL8", "omnilearn"]
    assert hl8["speedup"] == pytest.approx(2.1) and hl8["spread"]["speedup"]["per_repeat"] == [2.0, 2.2]
    assert hl8["spread"]["mean_step_s"] == {"mean": 1.0, "min": 1.0, "max": 1.0, "per_repeat": [1.0, 1.0]}
    assert hl8["verdict"]["vs_uniform"]["verdict"] == "faster"
    assert hl8["verdict"]["vs_static"]["verdict"] == "faster"  # 1.2 and 1.1: both above 1
    assert hl8["verdict"]["vs_static"]["min"] == pytest.approx(1.1)
    assert hl8["mean_batch"] == [100.0, 412.5] and hl8["wait_s_per_worker"] == pytest.approx([0.015, 0.015])
    hl1 = by["HL1", "omnilearn"]
    assert hl1["verdict"]["vs_uniform"]["verdict"] == SAME  # 1.0/0.95 > 1 but 1.1/1.12 < 1
    assert "verdict" not in by["HL8", "static"]
    assert hl8["efficiency_floor"] == pytest.approx(0.81) and hl8["efficiency_over_floor"] == pytest.approx(0.91 / 0.81)
    assert by["HL8", "uniform"]["efficiency_floor"] is None  # only balanced arms
    paper = by["paper", "omnilearn"]
    assert paper["settle_steps"] == [0, 16] and paper["settle_steps_per_repeat"] == [[0, 14], [0, 16]]
    assert paper["settled_within_interval"] == [True, False] and paper["reaction_steps"] == [3, 21]
    assert by["HL8", "omnilearn"]["settled_within_interval"] is None


def test_markdown_table_rows_and_notes():
    rows = bench_rows()
    add_paired(rows)
    merged = merge(rows, 15)
    add_floor(merged)
    lines = markdown_table(merged, 15).split("\n")
    assert lines[0] == HEADER and lines[1] == "|" + "---|" * 13
    table = {tuple(line.split(" | ")[:2]): line for line in lines[2:10]}
    hl8 = table["| HL8", "omnilearn"].split(" | ")
    assert hl8[2:10] == ["1000.0", "512", "2.10 (2.00–2.20)", "3.78 (3.60–3.96)", "0.56",
                         "0.910 (0.900–0.920) / 0.810", "faster ×2.10 (2.00–2.20)", "faster ×1.15 (1.10–1.20)"]
    hl1 = table["| HL1", "omnilearn"].split(" | ")
    assert hl1[7] == "0.810 (0.800–0.820)" and hl1[8].startswith(SAME)  # no floor beside HL1 itself
    static = table["| HL8", "static"].split(" | ")
    assert static[8:10] == ["–", "–"]
    for line in lines[2:10]:
        assert line.count("|") == 14
    assert "Mean over 2 repeats (min–max)" in lines[11]
    assert lines[-1].startswith("paper, omnilearn: settled within one control interval (15 steps) after 1 of 2 "
                                "speed changes in every repeat (yes,no; worst repeat's settle steps 0,16)")


def test_markdown_table_empty_is_header_only():
    assert markdown_table([]).split("\n")[:2] == [HEADER, "|" + "---|" * 13]


def test_settle_steps_counts_to_the_blocks_own_settled_time():
    # These blocks settle exactly at T*, so both measures agree and count the k unbalanced steps.
    from omnilearn.experiments.bench.stats import settle_steps

    rows = dynamic_run([0, 20, 40], 60, [4, 0, 7])
    assert settle_steps(rows, [0, 20, 40], 60) == [4, 0, 7]
    assert settle_steps(rows, [0, 20, 40], 60, window=5) == reaction_steps(rows, [0, 20, 40], 60)


# ---------------------------------------------------------------- bench --mode asp

from omnilearn.experiments.bench.asptable import asp_markdown_table  # noqa: E402
from omnilearn.experiments.bench.stats import (accuracy_at_time, accuracy_by_budget, add_histograms,  # noqa: E402
                                              epoch_accuracies, equal_epochs, eval_points, spread, staleness_histogram)


def push(version, rank, staleness, wall_s):
    return {"event": "push", "version": version, "rank": rank, "batch": 64, "staleness": staleness,
            "wall_s": wall_s}


def test_eval_points_bsp_uses_the_evals_own_time():
    records = [{"event": "eval", "step": 40, "wall_s": 2.0, "test_accuracy": 0.5},
               {"event": "step", "step": 0}, {"event": "eval", "step": 20, "wall_s": 1.0, "test_accuracy": 0.3},
               {"event": "eval", "step": 60, "wall_s": 3.0, "test_accuracy": None}]
    assert eval_points(records) == [(1.0, 0.3), (2.0, 0.5)]


def test_eval_points_asp_counts_at_the_push_that_made_the_weights():
    # The final eval is taken once the slow worker came back (wall_s 5.6), but its weights are those of
    # version 3, applied at 4.9 s of training: it counts at 4.9.
    records = [{"event": "eval", "version": 0, "wall_s": 0.2, "test_accuracy": 0.1},
               push(1, 0, 0, 1.0), push(2, 1, 1, 2.5),
               {"event": "eval", "epoch": 0, "version": 2, "wall_s": 2.6, "test_accuracy": 0.4},
               push(3, 0, 1, 4.9), {"event": "eval", "epoch": 1, "version": 3, "wall_s": 5.6, "test_accuracy": 0.6}]
    assert eval_points(records) == [(0.0, 0.1), (2.5, 0.4), (4.9, 0.6)]
    assert accuracy_at_time(eval_points(records), 5.0) == 0.6


def test_accuracy_at_time_is_the_last_evaluation_by_the_budget():
    points = [(1.0, 0.3), (2.0, 0.5), (3.0, 0.4)]
    assert accuracy_at_time(points, 2.5) == 0.5
    assert accuracy_at_time(points, 3.0) == 0.4  # at the budget counts
    assert accuracy_at_time(points, 100.0) == 0.4  # not the best one: the last one
    assert accuracy_at_time(points, 0.5) is None
    assert accuracy_at_time([], 1.0) is None
    assert accuracy_at_time(points, 100.0, last=2) == pytest.approx((0.5 + 0.4) / 2)  # smoothed: the last two


def test_accuracy_by_budget_falls_back_to_the_first_evaluation_after_it():
    points = [(1.0, 0.3), (2.0, 0.5), (3.0, 0.4)]
    assert accuracy_by_budget(points, 2.5, last=2) == (pytest.approx(0.4), 2.0)  # on time: the latest's time
    assert accuracy_by_budget(points, 0.5, last=2) == (0.3, 1.0)  # none by the budget: the first, late
    assert accuracy_by_budget([], 1.0) == (None, None)


def test_asp_bench_measure_gives_a_bsp_arm_evaluated_only_after_the_budget_a_late_accuracy(tmp_path):
    # A slow host: the bsp arm's first epoch and its end both came after the 2 s budget (issue 32: it was None).
    import json

    from omnilearn.experiments.bench import aspresults
    from omnilearn.experiments.bench.bsp import Arm
    from omnilearn.experiments.config import TrainConfig
    from omnilearn.experiments.launch.local import Job

    (tmp_path / "summary.json").write_text(json.dumps({"steps": 12, "train_s": 3.1, "samples_per_s": 100.0,
                                                       "test_accuracy": 0.42, "workers": []}))
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"event": "eval", "epoch": 0, "step": 12, "wall_s": 3.1, "test_accuracy": 0.42}]) + "\n")
    cfg = TrainConfig(mode="bsp", workers=4, speeds="HL8", max_steps=12, epochs=12, quiet=True)
    got = aspresults.measure(Arm("HL8", "bsp", 0, Job(cfg, tmp_path)), 2.0, None)
    assert (got["accuracy_at_budget"], got["accuracy_at_budget_s"]) == (0.42, 3.1)
    row = {**got, "train_s": spread([3.1]), "test_accuracy": spread([0.42]),
           "accuracy_at_budget": spread([0.42]), "accuracy_at_budget_s": spread([3.1]),
           "time_to_accuracy_s": spread([None]), "equal_epochs": [1]}
    assert asp_markdown_table([row], 2.0, None).splitlines()[2].split(" | ")[5] == "42.0 (late: 3.1 s)"


def test_accuracy_at_epochs_averages_the_last_evaluations_up_to_e():
    from omnilearn.experiments.bench.stats import accuracy_at_epochs
    by_epoch = {1: 0.2, 2: 0.5, 3: 0.4, 4: 0.9}
    assert accuracy_at_epochs(by_epoch, 3) == 0.4
    assert accuracy_at_epochs(by_epoch, 3, last=3) == pytest.approx((0.2 + 0.5 + 0.4) / 3)
    assert accuracy_at_epochs(by_epoch, None, last=3) is None and accuracy_at_epochs({}, 2) is None


def test_staleness_histogram_hand_computed():
    pushes = [push(1, 0, 0, 0.1), push(2, 1, 2, 0.2), push(3, 0, 1, 0.3), push(4, 1, 2, 0.4), push(5, 0, 1, 0.5)]
    assert staleness_histogram(pushes, 3) == [[1, 2, 0], [0, 0, 2], [0, 0, 0]]
    assert staleness_histogram([], 2) == [[], []]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), max_size=60))
def test_staleness_histogram_counts_every_push_once(pairs):
    hist = staleness_histogram([push(v, w, s, 0.0) for v, (w, s) in enumerate(pairs)], 4)
    assert len({len(row) for row in hist}) == 1
    for w in range(4):
        mine = [s for r, s in pairs if r == w]
        assert sum(hist[w]) == len(mine)
        assert sum(s * c for s, c in enumerate(hist[w])) == sum(mine)


def test_add_histograms_pads_to_the_longest():
    assert add_histograms([[[1, 2], [0, 1]], [[0, 0, 3], [1]]]) == [[1, 2, 3], [1, 1, 0]]
    assert add_histograms([]) == []


def test_spread():
    assert spread([0.5, 0.7, 0.6]) == {"mean": pytest.approx(0.6), "min": 0.5, "max": 0.7}
    assert spread([0.5, None]) == {"mean": None, "min": None, "max": None}
    assert spread([]) == {"mean": None, "min": None, "max": None}


def asp_row(arm, levels, acc, stale, target_s, at_epochs=(None, None)):
    return {"setting": "HL8", "arm": arm, "levels": levels, "train_s": spread([10.0, 10.2]),
            "test_accuracy": spread(acc), "accuracy_at_budget": spread(acc),
            "accuracy_at_equal_epochs": spread(list(at_epochs)), "equal_epochs": [7, 8],
            "time_to_accuracy_s": spread(target_s), "mean_staleness": stale[0], "max_staleness": stale[1],
            "p99_staleness": stale[2],
            "mean_staleness_per_worker": [4.0, 4.0, 4.0, 2.0] if levels == "asp" else [0.0] * 4,
            "p99_staleness_per_worker": [7, 7, 8, 4] if levels == "asp" else [0] * 4,
            "updates_per_s_per_worker": [10.0, 10.0, 10.0, 30.25]}


def test_asp_markdown_table():
    rows = [asp_row("uniform", "asp", [0.6, 0.64], (3.5, 12, 8), [4.0, None], (0.5, 0.52)),
            asp_row("omnilearn", "asp", [0.7, 0.7], (2.0, 5, 4), [3.0, 5.0], (0.55, 0.55)),
            asp_row("bsp", "bsp", [0.72, 0.74], (0.0, 0, 0), [2.0, 2.0])]
    lines = asp_markdown_table(rows, 10.0, 0.5).splitlines()
    assert lines[0].startswith("| setting | HL table | arm | train s | final test acc % | acc % at budget | "
                               "acc % at equal epochs | time to 50% s |")
    assert lines[2] == "| HL8 | asp | uniform | 10.1 | 62.0 (60.0–64.0) | 62.0 (60.0–64.0) | 51.0 (50.0–52.0) @7–8 | " \
                       "never | 3.50 | 8 | 12 | 4.0/4.0/4.0/2.0 | 7/7/8/4 | 10.0/10.0/10.0/30.2 |"
    assert lines[3].split(" | ")[4:8] == ["70.0", "70.0", "55.0 @7–8", "4.0"]  # equal repeats: no range
    assert lines[4].split(" | ")[1:3] == ["bsp", "bsp"] and lines[4].split(" | ")[6] == "–"
    assert "Budget 10 s of training per arm" in lines[-1] and lines[-2] == ""
    no_target = asp_markdown_table(rows, 10.0, None).splitlines()
    assert "time to target s" in no_target[0] and no_target[2].split(" | ")[7] == "–"


# ---------------------------------------------------------------- accuracy at equal epochs


def asp_eval(epoch, version, acc):
    return {"event": "eval", "epoch": epoch, "version": version, "step": version // 4, "wall_s": 0.1 * version,
            "test_accuracy": acc}


def test_epoch_accuracies_asp_leaves_out_the_final_partial_evaluation():
    records = [push(1, 0, 0, 0.1), asp_eval(0, 10, 0.3), push(11, 1, 1, 1.2), asp_eval(1, 20, 0.5),
               push(21, 2, 0, 2.2), asp_eval(2, 25, 0.55)]  # the final one, mid-epoch 2
    assert epoch_accuracies(records) == {1: 0.3, 2: 0.5}


def bsp_records(total, spe):
    records = [{"event": "step", "step": s, "epoch": s // spe, "rank": 0} for s in range(total)]
    for e in range(-(-total // spe)):
        step = min(total, (e + 1) * spe)
        records.append({"event": "eval", "epoch": e, "step": step, "wall_s": 0.01 * step,
                        "test_accuracy": 0.1 * (e + 1)})
    return records


def test_epoch_accuracies_bsp_counts_the_last_one_when_it_ends_an_epoch():
    assert epoch_accuracies(bsp_records(50, 19)) == {1: 0.1, 2: 0.2}  # the last (step 50) is partial
    assert epoch_accuracies(bsp_records(57, 19)) == {1: 0.1, 2: 0.2, 3: pytest.approx(0.3)}
    assert epoch_accuracies(bsp_records(10, 19)) == {}  # never a whole epoch
    assert epoch_accuracies([{"event": "eval", "epoch": 0, "step": 5, "test_accuracy": None}]) == {}


def test_equal_epochs_is_the_largest_every_arm_reached():
    assert equal_epochs([{1: 0.3, 2: 0.5, 3: 0.6}, {1: 0.4, 2: 0.45}, {1: 0.2, 2: 0.3, 3: 0.4, 4: 0.5}]) == 2
    assert equal_epochs([{1: 0.3}, {}]) is None
    assert equal_epochs([]) is None


def test_a_failed_tensorflow_asp_arm_is_named_and_left_out_the_others_run(tmp_path, monkeypatch, capsys):
    """``bench --mode asp --framework tensorflow`` runs one cluster per arm: an arm that fails (a diverged run's
    non-finite gradients) is named in a warning and returned, and the arms after it still run."""
    from omnilearn.experiments.bench import asp as aspbench
    from omnilearn.experiments.config import TrainConfig
    from omnilearn.experiments.launch.supervise import WorkerFailed
    from omnilearn.experiments.train import tfasp

    ran = []

    def run_local(cfg, run_dir):
        ran.append(run_dir.name)
        if run_dir.name == "HL8-omnilearn-r0":
            raise WorkerFailed("the TensorFlow ASP chief failed (exit 1): RuntimeError: worker 3 pushed non-finite "
                               "gradients (loss nan); lower --lr")

    monkeypatch.setattr(tfasp, "run_local", run_local)
    base = TrainConfig(framework="tensorflow", workers=4, quiet=True)
    arms = aspbench.plan_asp(base, ("HL8",), 2, 5.0, tmp_path)
    failed = aspbench._launch(arms, tmp_path)
    assert ran == ["HL8-uniform-r0", "HL8-omnilearn-r0", "HL8-omnilearn-r1", "HL8-uniform-r1"]
    assert [(a.arm, a.repeat) for a, _ in failed] == [("omnilearn", 0)] and "non-finite" in failed[0][1]
    err = capsys.readouterr().err
    assert "HL8-omnilearn (seed 0) failed, left out of its row" in err and err.count("\n") == 1


def test_a_failed_tensorflow_chief_is_named_by_its_error_line_not_tensorflows_last_log_line(tmp_path):
    from omnilearn.experiments.train.tfasp import last_line

    log = tmp_path / "tf-chief.log"
    log.write_text("W0000 warming up\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "RuntimeError: worker 3 pushed non-finite gradients (loss nan); lower --lr\n"
                   "I0000 kernel_and_device.cc:101] Ignoring error status when releasing a function handle\n")
    assert last_line(log) == "RuntimeError: worker 3 pushed non-finite gradients (loss nan); lower --lr"
    log.write_text("I0000 only TensorFlow's lines\n\n")
    assert last_line(log) == "I0000 only TensorFlow's lines"
    log.write_text("")
    assert last_line(log) == "no output"
