"""The figures ``omnilearn bench`` reports for one run, computed from its records. Pure.

Per arm and repeat, over one steady range of steps (:func:`steady_range_start`:
from the first epoch boundary at or after half the run; the whole run for the
dynamic ``paper`` routine): wall time per step read off the training clock
at the range's ends (:func:`steady_wall_step_s`; evaluation excluded),
samples/s, the mean time inside the steps, ``T*`` and balance efficiency
(see :mod:`omnilearn.balance.efficiency`), each worker's mean batch, compute
and wait; for a dynamic routine the reaction and settle time after each speed
change. Across arms and repeats (paired speed-ups, spread, verdicts, the
table): :mod:`omnilearn.experiments.bench.summary`. For ``bench --mode asp``:
accuracy at a training-time budget and at equal epochs of data, staleness
histograms, repeats as mean and range (its table:
:mod:`omnilearn.experiments.bench.asptable`).

Test: ``pytest tests/unit/test_benchstats.py``.
"""

from __future__ import annotations

from statistics import fmean, median
from typing import Iterable, Sequence

from omnilearn.balance.efficiency import StepRow, balance_efficiency, by_step, ideal_step_s, measured_step_s, worker_stats

REACTION_WINDOW = 5  # steps in the rolling median that decides "back within 10% of T*"


def rows_from_records(records: Iterable[dict]) -> list[StepRow]:
    return [StepRow(r["step"], r["rank"], r["batch"], r["compute_s"], r["wait_s"], r["step_s"])
            for r in records if r.get("event") == "step"]


def reaction_steps(rows: Sequence[StepRow], change_steps: Sequence[int], end_step: int,
                   tolerance: float = 0.10, window: int = REACTION_WINDOW) -> list[int | None]:
    """Steps after each change until the step time is back within ``tolerance`` of T*.

    "Back" means: that step is within tolerance and so is the median of the
    ``window`` steps from it on (one lucky step does not count). ``None``
    where it never got there before the next change (or ``end_step``).
    """
    steps = by_step(rows)
    measured = {s: measured_step_s(v) for s, v in steps.items()}
    ideal = {s: ideal_step_s(v) for s, v in steps.items()}
    bounds = list(change_steps) + [end_step]
    out: list[int | None] = []
    for start, stop in zip(bounds, bounds[1:]):
        found = None
        for j in range(start, stop - window + 1):
            span = [s for s in range(j, j + window) if s in measured]
            settled = j in measured and measured[j] <= (1 + tolerance) * ideal[j]
            if settled and median(measured[s] for s in span) <= (1 + tolerance) * median(ideal[s] for s in span):
                found = j - start
                break
        out.append(found)
    return out


def settle_steps(rows: Sequence[StepRow], change_steps: Sequence[int], end_step: int,
                 tolerance: float = 0.10, window: int = REACTION_WINDOW) -> list[int | None]:
    """Steps after each change until the step time is within ``tolerance`` of where the block settles.

    The settled time is the median step time of the block's last third. Unlike
    :func:`reaction_steps` this does not depend on how close to ``T*`` the
    host's sync overhead lets a balanced step come.
    """
    measured = {s: measured_step_s(v) for s, v in by_step(rows).items()}
    bounds = list(change_steps) + [end_step]
    out: list[int | None] = []
    for start, stop in zip(bounds, bounds[1:]):
        tail = [measured[s] for s in range(stop - max(1, (stop - start) // 3), stop) if s in measured]
        limit = (1 + tolerance) * median(tail) if tail else None
        found = None
        for j in range(start, stop - window + 1):
            span = [measured[s] for s in range(j, j + window) if s in measured]
            if limit and j in measured and measured[j] <= limit and median(span) <= limit:
                found = j - start
                break
        out.append(found)
    return out


def time_to_accuracy(evals: Sequence[dict], target: float | None) -> float | None:
    """Training time (s) of the first evaluation reaching ``target`` test accuracy."""
    if target is None:
        return None
    hits = [e["wall_s"] for e in evals if e["test_accuracy"] >= target]
    return min(hits) if hits else None


def fidelity_error(rows: Sequence[StepRow], speeds: Sequence[float], first_step: int = 0) -> float:
    """Largest relative error of the workers' compute ratios against the declared slowdowns.

    Meaningful for equal batches (the ``uniform`` arm): worker i should take
    ``max(s) / s_i`` times as long as the fastest.
    """
    stats = worker_stats(rows, first_step)
    fastest = max(range(len(speeds)), key=lambda i: speeds[i])
    base = stats[fastest].mean_compute_s
    errors = [abs((s.mean_compute_s / base) / (max(speeds) / speeds[s.rank]) - 1) for s in stats]
    return max(errors)


def steps_per_epoch(records: Iterable[dict], total_steps: int) -> int:
    """A BSP run's steps per epoch, from its step records (``epoch = step // steps_per_epoch``).

    A run shorter than one epoch gives ``total_steps`` (its only epoch boundary is step 0).
    """
    firsts = [r["step"] for r in records if r.get("event") == "step" and r.get("epoch") == 1]
    return min(firsts) if firsts else total_steps


def steady_range_start(total_steps: int, steps_per_epoch: int, dynamic: bool = False) -> int:
    """First step of the measured range: the first epoch boundary at or after half the run, else the last before it.

    Epoch boundaries are where a run's training clock is read (its evaluations), so the wall time of the
    range is exact; ``plainddp`` takes its clock at the same step. ``dynamic`` (a speed schedule): step 0,
    the whole run. Warm-up is a separate, unmeasured job (:mod:`omnilearn.experiments.bench.bsp`).
    """
    if dynamic or total_steps <= 1:
        return 0
    spe, half = max(1, steps_per_epoch), total_steps // 2
    up = -(-half // spe) * spe
    return up if up < total_steps else half // spe * spe


def steady_wall_step_s(evals: Iterable[dict], first_step: int, end_step: int, train_s: float) -> float | None:
    """Training-clock seconds per step over steps ``first_step .. end_step - 1``; ``None`` without a clock point there.

    Clock points: step 0 (0 s), every evaluation (``step`` done, ``wall_s``: training time, evaluation
    excluded) and the run's end (``train_s``). So per-interval control work and data loading count, as in
    plain DDP's wall clock; evaluation does not.
    """
    at = {0: 0.0, **{int(e["step"]): float(e["wall_s"]) for e in evals if "step" in e and "wall_s" in e}}
    at[end_step] = train_s
    if first_step not in at or end_step <= first_step:
        return None
    return (at[end_step] - at[first_step]) / (end_step - first_step)


def arm_figures(rows: Sequence[StepRow], global_batch: int, wall_step_s: float, first_step: int) -> dict:
    """Step-time figures of one arm over the steps ``>= first_step``."""
    kept = [v for s, v in by_step(rows).items() if s >= first_step]
    stats = worker_stats(rows, first_step)
    return {
        "mean_step_s": wall_step_s,
        "samples_per_s": global_batch / wall_step_s,
        "in_step_s": fmean(measured_step_s(v) for v in kept),
        "ideal_step_s": fmean(ideal_step_s(v) for v in kept),
        "balance_efficiency": balance_efficiency(rows, first_step),
        "mean_batch": [s.mean_batch for s in stats],
        "compute_s_per_worker": [s.mean_compute_s for s in stats],
        "wait_s_per_worker": [s.mean_wait_s for s in stats],
    }


# ---------------------------------------------------------------- bench --mode asp

def eval_points(records: Iterable[dict]) -> list[tuple[float, float]]:
    """(training time s, test accuracy) of every evaluation, in time order.

    BSP: the eval's own ``wall_s``. ASP (``push`` records present): the
    ``wall_s`` of the push that made the evaluated weights (version 0: 0 s),
    so the final evaluation, taken after the last worker stopped, counts at
    the moment the last update was applied, not when the stragglers returned.
    """
    records = list(records)
    pushed = {r["version"]: r["wall_s"] for r in records if r.get("event") == "push"}
    out = []
    for r in records:
        if r.get("event") != "eval" or not isinstance(r.get("test_accuracy"), (int, float)):
            continue
        if pushed and "version" in r:
            t = 0.0 if r["version"] == 0 else pushed.get(r["version"], r["wall_s"])
        else:
            t = r["wall_s"]
        out.append((float(t), float(r["test_accuracy"])))
    return sorted(out, key=lambda p: p[0])


SMOOTH_EVALS = 3  # ASP accuracies: the mean of this many evaluations (one moves 2-4 points epoch to epoch)


def accuracy_at_time(points: Sequence[tuple[float, float]], budget_s: float, last: int = 1) -> float | None:
    """Mean test accuracy of the ``last`` evaluations at or before ``budget_s`` of training; ``None`` if none was."""
    before = sorted((t, a) for t, a in points if t <= budget_s)[-last:]
    return fmean(a for _, a in before) if before else None


def accuracy_by_budget(points: Sequence[tuple[float, float]], budget_s: float,
                       last: int = 1) -> tuple[float | None, float | None]:
    """(accuracy at the budget, training s of the latest evaluation it counts); ``(None, None)`` without evaluations.

    The mean of the ``last`` evaluations at or before ``budget_s``
    (:func:`accuracy_at_time`). A run whose first evaluation came after the
    budget (a BSP arm whose first epoch and end both fell past it, on a slow
    host) is not left without a figure: its first evaluation stands in, and the
    time returned (above ``budget_s``) says it came late.
    """
    on_time = [t for t, _ in points if t <= budget_s]
    if on_time:
        return accuracy_at_time(points, budget_s, last), max(on_time)
    if not points:
        return None, None
    at_s, accuracy = min(points)
    return accuracy, at_s


def accuracy_at_epochs(by_epoch: dict[int, float], epochs: int | None, last: int = 1) -> float | None:
    """Mean test accuracy after the ``last`` whole-epoch evaluations up to ``epochs`` (``None``: none)."""
    if epochs is None:
        return None
    kept = [by_epoch[e] for e in sorted(by_epoch) if e <= epochs][-last:]
    return fmean(kept) if kept else None


def epoch_accuracies(records: Iterable[dict]) -> dict[int, float]:
    """Test accuracy after each whole epoch of data: ``{epochs done: accuracy}``.

    Evaluations come once per epoch (``epoch``: the index of the epoch just
    finished, so ``epoch + 1`` epochs are done) and once at the end, after a
    partial epoch. ASP (``push`` records present): the final evaluation is
    left out (its ``epoch`` is the one still being dealt). BSP: the last one
    counts when its ``step`` ends an epoch (steps per epoch from the step records).
    """
    records = list(records)
    evals = [r for r in records if r.get("event") == "eval" and isinstance(r.get("test_accuracy"), (int, float))
             and isinstance(r.get("epoch"), int)]
    if not evals:
        return {}
    whole, last = evals[:-1], evals[-1]
    if not any(r.get("event") == "push" for r in records):
        spe = steps_per_epoch(records, 0)
        if spe > 0 and last.get("step") == (last["epoch"] + 1) * spe:
            whole.append(last)
    return {r["epoch"] + 1: float(r["test_accuracy"]) for r in whole}


def equal_epochs(arms: Sequence[dict[int, float]]) -> int | None:
    """The largest epoch count every arm reached (an evaluation after it), ``None`` when one reached none."""
    reached = [max(a) if a else 0 for a in arms]
    return min(reached) if reached and min(reached) > 0 else None


def staleness_histogram(pushes: Iterable[dict], workers: int) -> list[list[int]]:
    """``counts[w][s]``: pushes of worker ``w`` applied with staleness ``s``; all rows as long as the largest."""
    counts: list[dict[int, int]] = [{} for _ in range(workers)]
    for p in pushes:
        row = counts[p["rank"]]
        row[p["staleness"]] = row.get(p["staleness"], 0) + 1
    top = max((s for row in counts for s in row), default=-1)
    return [[row.get(s, 0) for s in range(top + 1)] for row in counts]


def add_histograms(hists: Sequence[list[list[int]]]) -> list[list[int]]:
    """Element-wise sum of per-worker histograms (repeats), padded to the longest."""
    if not hists:
        return []
    width = max((len(row) for h in hists for row in h), default=0)
    return [[sum(h[w][s] if s < len(h[w]) else 0 for h in hists) for s in range(width)]
            for w in range(len(hists[0]))]


def spread(values: Sequence[float | None]) -> dict:
    """Mean, min and max of repeats; all ``None`` when any repeat has no value."""
    if not values or any(v is None for v in values):
        return {"mean": None, "min": None, "max": None}
    return {"mean": fmean(values), "min": min(values), "max": max(values)}
