"""Run one controller through a :class:`~omnilearn.experiments.simulate.model.Scenario`, step by step, and sum it up.

The controller is the library's own (:func:`~omnilearn.balance.controllers.make_controller`
inside a :class:`~omnilearn.balance.loop.ControlLoop`), fed the way the BSP
runtime feeds it: per window each worker's ``compute_s`` at its current
planned batch (:func:`~omnilearn.balance.windows.window_table`), a window
ending every ``interval`` steps or at a mid-interval look (every third of the
interval) that shows a speed shift; a change runs from its
``effective_step``. Per step the workers' times are vectors over workers, so
4,096 workers x 300 steps take about a second per controller.

Run: ``python -m pytest -q tests/unit/test_simulate.py``
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from omnilearn.balance.controllers import make_controller
from omnilearn.balance.loop import ControlLoop
from omnilearn.balance.windows import window_row, window_table
from omnilearn.config import BalanceConfig
from omnilearn.decisions import check_every, checks_pay, settled, window_steps
from omnilearn.experiments.simulate.model import NoiseStream, Scenario, balanced

MIN_WINDOW_S = BalanceConfig.min_window_s  # the runtime's default (decisions.window_steps)

REACTION_TOLERANCE, REACTION_WINDOW = 0.10, 5  # as the bench: within 10% of ideal, that step and a 5-step median


@dataclass
class Trace:
    """Per-step record of one controller's run."""

    name: str
    step_s: np.ndarray  # (steps,) slowest compute + sync
    bench_ideal_s: np.ndarray  # (steps,) the bench's T*: B / sum(b_i / compute_i) + sync
    batches: np.ndarray  # (steps, k) batches of the watched workers
    decision_ms: list[float] = field(default_factory=list)
    changes: int = 0


def window_rows(plan: np.ndarray, times: np.ndarray, at_plan: np.ndarray) -> np.ndarray:
    """One window row per worker from its ``times`` (n, k) measured at its planned batch (``at_plan`` (n, k)).

    Workers share few patterns of steps at the plan (all, or those after a
    change took effect): one :func:`window_table` per pattern.
    """
    if at_plan.all():
        return window_table(plan, times)
    patterns, which = np.unique(at_plan, axis=0, return_inverse=True)
    out = None
    for g, cols in enumerate(patterns):
        idx = np.flatnonzero(which.ravel() == g)
        part = (window_table(plan[idx], times[idx][:, cols]) if cols.any()
                else np.array([window_row(int(b), []) for b in plan[idx]], dtype=float))
        if out is None:
            out = np.zeros((plan.size, part.shape[1]))
        out[idx] = part
    return out


def median_step_s(step_s: np.ndarray, at_plan: np.ndarray) -> np.ndarray:
    """Each worker's median wall step over its steps at the plan (0 where none), as the runtime reports it."""
    masked = np.where(at_plan, step_s[None, :], np.nan)
    with np.errstate(all="ignore"):
        out = np.nanmedian(masked, axis=1) if at_plan.any() else np.zeros(at_plan.shape[0])
    return np.nan_to_num(out, nan=0.0)


def watched(sc: Scenario, k: int = 4) -> np.ndarray:
    """Up to ``k`` workers worth plotting: those a change hits, then the slowest and the fastest."""
    hit = [int(i) for _, m in sc.segments for i in np.flatnonzero(np.asarray(m) != 1.0)[:2]]
    speed = 1.0 / (np.asarray(sc.alpha_s) + np.asarray(sc.beta_s) * sc.global_batch / sc.workers)
    picks = dict.fromkeys([*hit, int(np.argmin(speed)), int(np.argmax(speed)), 0])
    return np.asarray(list(picks)[:k], dtype=np.int64)


def run_controller(sc: Scenario, name: str) -> Trace:
    """Simulate ``name`` over the scenario; see the module docstring."""
    bounds = sc.bounds()
    loop = ControlLoop(make_controller(name, bounds, sc.declared), deadband=sc.deadband, lag=sc.lag,
                       history=sc.history, total_steps=sc.steps)
    noise, alpha, beta = NoiseStream(sc), np.asarray(sc.alpha_s, float), np.asarray(sc.beta_s, float)
    keep = watched(sc)
    trace = Trace(name, np.empty(sc.steps), np.empty(sc.steps), np.empty((sc.steps, keep.size), dtype=np.int64))
    now = np.asarray(loop.batches, dtype=np.int64)  # the batches in effect
    pending: list[tuple[int, np.ndarray]] = []
    times, ran = [], []  # this window's per-step compute times and batches
    check = check_every(sc.interval) if sc.checks else 0
    checks_on = True  # as the runtime: held while the last interval's steps were too short for a check to pay
    window, intervals = sc.interval, 0  # as the runtime: stretched to whole intervals where they are short
    for step in range(sc.steps):
        while pending and pending[0][0] <= step:
            now = pending.pop(0)[1]
        factor, sync_s = noise.draw()
        compute = (alpha + beta * now) * sc.multiplier(step) * factor
        trace.step_s[step] = compute.max() + sync_s
        trace.bench_ideal_s[step] = sc.global_batch / float(np.sum(now / compute)) + sync_s
        trace.batches[step] = now[keep]
        times.append(compute)
        ran.append(now)
        size = len(times)
        if size >= window or step + 1 == sc.steps:
            first = 0
        elif check and checks_on and size % check == 0:
            first = size - check
        else:
            continue
        if first == 0:
            step_s = float(np.median(trace.step_s[step - size + 1: step + 1]))
            checks_on = checks_pay(step_s, check)
        decision = decide(loop, trace, step, np.array(times[first:]).T, np.array(ran[first:]).T,
                          trace.step_s[step - (size - first) + 1: step + 1], look=first > 0)
        if first == 0:
            intervals += 1
            window = window_steps(step_s, sc.interval, MIN_WINDOW_S, settled(decision, intervals))
        if decision is None:
            continue
        times, ran = [], []
        if decision.changed:
            trace.changes += 1
            pending.append((decision.effective_step, np.asarray(decision.new, dtype=np.int64)))
            pending.sort(key=lambda p: p[0])
    return trace


def decide(loop: ControlLoop, trace: Trace, step: int, times: np.ndarray, ran: np.ndarray, step_s: np.ndarray,
           look: bool):
    """Feed one window to the loop (a mid-interval ``look`` only if it shows a shift); None when not fed."""
    plan = np.asarray(loop.batches, dtype=np.int64)
    at_plan = ran == plan[:, None]
    rows = window_rows(plan, times, at_plan)
    if look and not np.asarray(loop.shifted(rows)).any():
        return None
    begin = time.perf_counter()
    decision = loop.update(step, rows, step_s=median_step_s(step_s, at_plan))
    trace.decision_ms.append(1e3 * (time.perf_counter() - begin))
    return decision


def ideal_trace(sc: Scenario) -> np.ndarray:
    """(steps,) step time of the balanced split of the true current speeds, under the same draws, plus sync."""
    noise, alpha, beta = NoiseStream(sc), np.asarray(sc.alpha_s, float), np.asarray(sc.beta_s, float)
    lo = np.full(sc.workers, float(sc.min_batch))
    hi = sc.bounds().caps().astype(float)
    out, cache = np.empty(sc.steps), {}
    for step in range(sc.steps):
        key = sc.segment(step)
        mult = sc.segments[key][1]
        if key not in cache:
            cache[key] = balanced(alpha * mult, beta * mult, lo, hi, sc.global_batch)[0]
        shares = cache[key]
        factor, sync_s = noise.draw()
        out[step] = float(np.max((alpha + beta * shares) * mult * factor)) + sync_s
    return out


def reaction_steps(step_s: np.ndarray, ideal_s: np.ndarray, changes: tuple[int, ...]) -> list[int | None]:
    """Steps after each change until that step and the median of the next 5 are within 10% of the ideal."""
    ends = list(changes[1:]) + [step_s.size]
    limit = (1 + REACTION_TOLERANCE) * ideal_s
    out: list[int | None] = []
    for start, stop in zip(changes, ends):
        found = None
        for j in range(start, stop - REACTION_WINDOW + 1):
            span = slice(j, j + REACTION_WINDOW)
            if step_s[j] <= limit[j] and np.median(step_s[span]) <= (1 + REACTION_TOLERANCE) * np.median(ideal_s[span]):
                found = j - start
                break
        out.append(found)
    return out


def summarise(sc: Scenario, traces: list[Trace], ideal_s: np.ndarray, first: int = 0) -> list[dict]:
    """One dict of figures per controller over the steps ``>= first`` (step times include ``gap_s``)."""
    ideal_ms = 1e3 * (float(ideal_s[first:].mean()) + sc.gap_s)
    step_ms = {t.name: 1e3 * (float(t.step_s[first:].mean()) + sc.gap_s) for t in traces}
    rows = []
    for t in traces:
        ms = step_ms[t.name]
        rows.append({
            "controller": t.name, "step_ms": ms, "ideal_ms": ideal_ms, "balance_efficiency": ideal_ms / ms,
            "bench_efficiency": float(t.bench_ideal_s[first:].mean() / t.step_s[first:].mean()),
            "speedup_uniform": step_ms["uniform"] / ms if "uniform" in step_ms else None,
            "speedup_static": step_ms["static"] / ms if "static" in step_ms else None,
            "changes": t.changes, "reaction_steps": reaction_steps(t.step_s, ideal_s, sc.change_steps),
            "decision_ms": float(np.median(t.decision_ms)) if t.decision_ms else 0.0,
        })
    return rows


def run_all(sc: Scenario, names: list[str], first: int = 0) -> tuple[list[dict], list[Trace], np.ndarray]:
    """Every controller on the same scenario and draws: (figures, traces, ideal per step)."""
    traces = [run_controller(sc, name) for name in names]
    ideal_s = ideal_trace(sc)
    return summarise(sc, traces, ideal_s, first), traces, ideal_s
