"""Unit tests for the bench figures (``omnilearn.experiments.benchstats``), a pure module.

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
- ``add_speedups`` and ``markdown_table``;
- ``bench --mode asp``: ``eval_points`` (an ASP eval counts at the time of
  the push that made its weights), ``accuracy_at_time``,
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

from omnilearn.experiments.benchstats import (
    REACTION_WINDOW,
    add_speedups,
    arm_figures,
    fidelity_error,
    markdown_table,
    reaction_steps,
    rows_from_records,
    time_to_accuracy,
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


# ---------------------------------------------------------------- add_speedups


def test_add_speedups():
    results = [
        {"setting": "HL2", "arm": "uniform", "mean_step_s": 2.0, "in_step_s": 1.8, "ideal_step_s": 1.0},
        {"setting": "HL2", "arm": "omnilearn", "mean_step_s": 1.0, "in_step_s": 0.9, "ideal_step_s": 0.6},
        {"setting": "HL2", "arm": "static", "mean_step_s": 1.6, "ideal_step_s": None},
        {"setting": "HL4", "arm": "omnilearn", "mean_step_s": 1.0, "in_step_s": 0.9, "ideal_step_s": 0.5},
        {"setting": "HL8", "arm": "uniform", "mean_step_s": 3.0, "in_step_s": 2.5, "ideal_step_s": 1.2},
    ]
    assert add_speedups(results) is None
    got = [(r["setting"], r["arm"], r["speedup"], r["ideal_speedup"]) for r in results]
    assert got == [
        ("HL2", "uniform", 1.0, pytest.approx(3.0)),  # one ideal per setting: 1.8 / 0.6
        ("HL2", "omnilearn", 2.0, pytest.approx(3.0)),
        ("HL2", "static", 1.25, pytest.approx(3.0)),
        ("HL4", "omnilearn", None, None),  # no uniform arm
        ("HL8", "uniform", 1.0, None),  # no balanced arm
    ]


# ---------------------------------------------------------------- markdown_table

HEADER = ("| setting | arm | step ms | samples/s | speed-up | ideal speed-up | balance eff. | "
          "mean wait ms per worker | reaction steps (to T*+10%) | settle steps |")


def test_markdown_table_rows():
    results = [
        {"setting": "HL2", "arm": "uniform", "mean_step_s": 0.25, "samples_per_s": 1024.4,
         "speedup": 1.0, "ideal_speedup": 1.5, "balance_efficiency": 0.66666,
         "wait_s_per_worker": [0.0123, 0.1], "reaction_steps": None},
        {"setting": "HL8", "arm": "omni", "mean_step_s": 0.1234, "samples_per_s": 99.6,
         "speedup": None, "ideal_speedup": None, "balance_efficiency": None,
         "reaction_steps": [3, None, 0], "settle_steps": [1, 2, None]},
        {"setting": "dyn", "arm": "omni", "mean_step_s": 1.0, "samples_per_s": 8.0,
         "wait_s_per_worker": []},
    ]
    lines = markdown_table(results).split("\n")
    assert lines == [
        HEADER,
        "|---|---|---|---|---|---|---|---|---|---|",
        "| HL2 | uniform | 250.0 | 1024 | 1.00 | 1.50 | 0.667 | 12.3/100.0 | – | – |",
        "| HL8 | omni | 123.4 | 100 | – | – | – | – | 3,never,0 | 1,2,never |",
        "| dyn | omni | 1000.0 | 8 | – | – | – | – | – | – |",
    ]
    for line in lines:
        assert line.count("|") == 11


def test_markdown_table_empty_is_header_only():
    assert markdown_table([]) == HEADER + "\n|---|---|---|---|---|---|---|---|---|---|"


def test_markdown_table_all_none_reactions():
    r = {"setting": "s", "arm": "a", "mean_step_s": 0.001, "samples_per_s": 1.0,
         "reaction_steps": [None, None]}
    assert markdown_table([r]).splitlines()[-1].endswith("| – | never,never | – |")


def test_settle_steps_counts_to_the_blocks_own_settled_time():
    # These blocks settle exactly at T*, so both measures agree and count the k unbalanced steps.
    from omnilearn.experiments.benchstats import settle_steps

    rows = dynamic_run([0, 20, 40], 60, [4, 0, 7])
    assert settle_steps(rows, [0, 20, 40], 60) == [4, 0, 7]
    assert settle_steps(rows, [0, 20, 40], 60, window=5) == reaction_steps(rows, [0, 20, 40], 60)


# ---------------------------------------------------------------- bench --mode asp

from omnilearn.experiments.benchstats import (accuracy_at_time, add_histograms, asp_markdown_table, eval_points,  # noqa: E402
                                  spread, staleness_histogram)


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


def asp_row(arm, levels, acc, stale, target_s):
    return {"setting": "HL8", "arm": arm, "levels": levels, "train_s": spread([10.0, 10.2]),
            "test_accuracy": spread(acc), "accuracy_at_budget": spread(acc),
            "time_to_accuracy_s": spread(target_s), "mean_staleness": stale[0], "max_staleness": stale[1],
            "mean_staleness_per_worker": [4.0, 4.0, 4.0, 2.0] if levels == "asp" else [0.0] * 4,
            "updates_per_s_per_worker": [10.0, 10.0, 10.0, 30.25]}


def test_asp_markdown_table():
    rows = [asp_row("uniform", "asp", [0.6, 0.64], (3.5, 12), [4.0, None]),
            asp_row("omnilearn", "asp", [0.7, 0.7], (2.0, 5), [3.0, 5.0]),
            asp_row("bsp", "bsp", [0.72, 0.74], (0.0, 0), [2.0, 2.0])]
    lines = asp_markdown_table(rows, 10.0, 0.5).splitlines()
    assert lines[0].startswith("| setting | HL table | arm | train s | final test acc % | acc % at budget | "
                               "time to 50% s |")
    assert lines[2] == "| HL8 | asp | uniform | 10.1 | 62.0 (60.0–64.0) | 62.0 (60.0–64.0) | never | 3.50 | 12 | " \
                       "4.0/4.0/4.0/2.0 | 10.0/10.0/10.0/30.2 |"
    assert lines[3].split(" | ")[4:7] == ["70.0", "70.0", "4.0"]  # equal repeats: no range
    assert lines[4].split(" | ")[1:3] == ["bsp", "bsp"]
    assert "Budget 10 s of training per arm" in lines[-1] and lines[-2] == ""
    no_target = asp_markdown_table(rows, 10.0, None).splitlines()
    assert "time to target s" in no_target[0] and no_target[2].split(" | ")[6] == "–"
