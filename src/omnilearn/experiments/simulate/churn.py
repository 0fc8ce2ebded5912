"""Simulated heterogeneous workers driving the ControlLoop (and, for comparison, the rule it replaced).

Worker i takes ``t_i(b) = alpha_i + beta_i * b`` seconds for a batch of b
(speeds spread over a heterogeneity level of 4, a fixed part of about 20% of
the step), times a multiplicative per-step noise ``1 + noise * N(0, 1)``
(optionally, a shared host: a ``spike_p`` share of steps ``spike`` times longer).
The global batch is 64 per worker, a control window is 15 steps (the default
``control_interval``), and runs start from the balanced split. Per worker
count the CLI prints:

- ``churn``: control intervals, of ``--intervals``, in which batches changed
  with 10% noise and no real change of speed (each change restarts the windows);
- ``follow``: intervals until the plan follows a 2x slowdown of worker 0
  (its batch moves at least halfway to its new balanced share);
- ``ms``: median wall time of one decision (``ControlLoop.update`` or :func:`legacy_decide`);
- one noisy-host line: 3 and 4 workers, 30% noise and 5% of steps 3x longer:
  the most intervals until a 2x slowdown is followed, over 10 seeds;
- one ASP line: 4 workers pushing, worker 0 3x slower after 400 pushes:
  control intervals (of 4 x 15 pushes) until its batch follows.

``--legacy`` runs the rule the loop replaced (:func:`legacy_decide`, kept in
this file as the reference baseline for the before/after comparison: every
sample since the last change, at most 10 windows in BSP and all of them in
ASP, deadband on the largest single-worker change).

Run: ``python -m omnilearn.experiments.simulate.churn [--legacy] [--workers 4 64] [--intervals 200]``
(also ``omnilearn simulate --scenario churn``; the what-if tool over speed mixes, noise and
speed changes, and its calibration on a bench, is :mod:`omnilearn.experiments.simulate.whatif`).
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import time
from dataclasses import dataclass

import numpy as np

from omnilearn.balance.allocation import Bounds, proportional_split, split_array
from omnilearn.balance.controllers import ProportionalController

WINDOW_STEPS = 15
LOCAL_BATCH = 64
HISTORY_WINDOWS = 10


@dataclass
class Cluster:
    """Linear-time workers with multiplicative noise; ``slow(i, f)`` makes worker i f times slower."""

    alpha_s: np.ndarray
    beta_s: np.ndarray
    noise: float
    rng: np.random.Generator
    spike_p: float = 0.0  # share of steps that take ``spike`` times longer (a shared, noisy host)
    spike: float = 3.0

    @property
    def workers(self) -> int:
        return self.alpha_s.size

    def mean_s(self, batches) -> np.ndarray:
        return self.alpha_s + self.beta_s * np.asarray(batches, dtype=float)

    def times(self, batches, steps: int) -> np.ndarray:
        """(n, steps) measured times at ``batches``."""
        factor = np.maximum(1.0 + self.noise * self.rng.standard_normal((self.workers, steps)), 0.05)
        if self.spike_p:  # no draw without spikes: the other scenarios keep their random streams
            factor = np.where(self.rng.random(factor.shape) < self.spike_p, self.spike * factor, factor)
        return self.mean_s(batches)[:, None] * factor

    def slow(self, worker: int, factor: float) -> None:
        self.alpha_s[worker] *= factor
        self.beta_s[worker] *= factor

    def balanced(self, global_batch: int) -> np.ndarray:
        """Real shares with equal times: ``alpha_i + beta_i * b_i = T``, ``sum(b) = B``."""
        t = (global_batch + np.sum(self.alpha_s / self.beta_s)) / np.sum(1 / self.beta_s)
        return (t - self.alpha_s) / self.beta_s


def make_cluster(workers: int, seed: int, noise: float = 0.10, level: float = 4.0, spikes: float = 0.0) -> Cluster:
    """Speeds log-uniform over ``level`` (fastest / slowest); the fixed part is 20% of a balanced step."""
    rng = np.random.default_rng(seed)
    speed = 1000.0 * level ** rng.uniform(0.0, 1.0, workers)  # samples/s of the variable part
    beta = 1.0 / speed
    alpha = 0.25 * LOCAL_BATCH * beta.mean() * np.ones(workers)
    return Cluster(alpha, beta, noise, rng, spike_p=spikes)


def start_plan(cluster: Cluster, bounds: Bounds) -> list[int]:
    """The balanced split, rounded."""
    return proportional_split(np.maximum(cluster.balanced(bounds.global_batch), 1.0).tolist(), bounds)


class NewRule:
    """The ControlLoop over the proportional controller, fed window rows."""

    def __init__(self, bounds: Bounds, start: list[int]) -> None:
        from omnilearn.balance.loop import ControlLoop, window_table

        self.loop = ControlLoop(ProportionalController(bounds, start=start), history=HISTORY_WINDOWS)
        self.table = window_table

    @property
    def batches(self) -> tuple[int, ...]:
        return self.loop.batches

    def window(self, step: int, times: np.ndarray) -> tuple[bool, float]:
        rows = self.table(self.loop.plan, times)
        begin = time.perf_counter()
        changed = self.loop.update(step, rows).changed
        return changed, time.perf_counter() - begin


# ---------------------------------------------------------------- reference baseline: the rule the loop replaced
# Not library code: kept only for the before/after comparison of ``--legacy``.
LEGACY_DEADBAND, LEGACY_MIN_SAMPLES, LEGACY_SHIFT = 0.05, 3, 0.10


def legacy_decide(bounds: Bounds, batches: tuple[int, ...], samples, recent: int = 0) -> tuple[int, ...]:
    """The replaced rule: new batches, or ``batches`` when it holds.

    ``samples[i]``: worker i's ``(batch, time_s)`` pairs since the last change,
    oldest first. Per worker the median of those at its current batch (of the
    newest ``recent`` when they moved by more than ``LEGACY_SHIFT``), the
    paper's step ``b_i * t_mean / t_i``, and a change only if some worker's
    relative change exceeds ``LEGACY_DEADBAND``: at 64 noisy workers one
    always does, hence the churn of ``--legacy``.
    """
    current = [[t for b, t in s if b == batches[i]] for i, s in enumerate(samples)]
    if any(len(c) < LEGACY_MIN_SAMPLES for c in current):
        return batches
    t = np.array([legacy_time(c, min(recent, len(c))) for c in current])
    if (t <= 0).any():
        return batches
    b = np.asarray(batches, dtype=float)
    new = split_array((b - (b / t) * (t - t.mean())).tolist(), bounds).tolist()
    return tuple(new) if max(abs(n - o) / o for n, o in zip(new, batches)) > LEGACY_DEADBAND else batches


def legacy_time(samples: list[float], recent: int) -> float:
    """Median of all samples, or of the newest ``recent`` if their median moved by more than ``LEGACY_SHIFT``."""
    old, new = samples[: len(samples) - recent], samples[len(samples) - recent :]
    if recent and old and new:
        t_old, t_new = statistics.median(old), statistics.median(new)
        if abs(t_new - t_old) > LEGACY_SHIFT * t_old:
            return t_new
    return statistics.median(samples)


class LegacyRule:
    """The replaced BSP path: every step since the last change (at most 10 windows), ``recent`` window."""

    def __init__(self, bounds: Bounds, start: list[int]) -> None:
        self.bounds, self.batches = bounds, tuple(start)
        self.history: list[list[tuple[int, float]]] = [[] for _ in start]

    def window(self, step: int, times: np.ndarray) -> tuple[bool, float]:
        for past, b, row in zip(self.history, self.batches, times.tolist()):
            past.extend((b, t) for t in row)
            del past[: -HISTORY_WINDOWS * times.shape[1]]
        begin = time.perf_counter()
        new = legacy_decide(self.bounds, self.batches, self.history, recent=times.shape[1])
        spent = time.perf_counter() - begin
        changed = new != self.batches
        if changed:
            self.batches, self.history = new, [[] for _ in self.history]
        return changed, spent


def churn(workers: int, intervals: int, legacy: bool, seed: int = 0, noise: float = 0.10,
          spikes: float = 0.0) -> tuple[int, float]:
    """(intervals that changed, median decision ms) with 10% noise (default) and no real change of speed."""
    cluster = make_cluster(workers, seed, noise, spikes=spikes)
    bounds = Bounds(LOCAL_BATCH * workers, workers)
    rule = (LegacyRule if legacy else NewRule)(bounds, start_plan(cluster, bounds))
    changes, spent = 0, []
    for k in range(intervals):
        changed, s = rule.window((k + 1) * WINDOW_STEPS - 1, cluster.times(rule.batches, WINDOW_STEPS))
        changes += changed
        spent.append(s)
    return changes, 1e3 * statistics.median(spent)


def follow(workers: int, legacy: bool, seed: int = 1, warmup: int = 20, limit: int = 20, noise: float = 0.10,
           spikes: float = 0.0) -> int | None:
    """Intervals after worker 0 turns 2x slower until its batch moves halfway to its new share (None: never)."""
    cluster = make_cluster(workers, seed, noise, spikes=spikes)
    bounds = Bounds(LOCAL_BATCH * workers, workers)
    rule = (LegacyRule if legacy else NewRule)(bounds, start_plan(cluster, bounds))
    for k in range(warmup):
        rule.window((k + 1) * WINDOW_STEPS - 1, cluster.times(rule.batches, WINDOW_STEPS))
    before = rule.batches[0]
    cluster.slow(0, 2.0)
    target = cluster.balanced(bounds.global_batch)[0]
    for k in range(1, limit + 1):
        rule.window((warmup + k) * WINDOW_STEPS - 1, cluster.times(rule.batches, WINDOW_STEPS))
        if abs(rule.batches[0] - target) <= 0.5 * abs(before - target):
            return k
    return None


def noisy_follow(workers: int, legacy: bool, seeds: int = 10) -> int | None:
    """The most intervals :func:`follow` takes on a noisy shared host (30% noise, 5% 3x spikes), None: never."""
    runs = [follow(workers, legacy, seed=s, noise=0.30, spikes=0.05) for s in range(seeds)]
    return None if None in runs else max(runs)


def asp_follow(legacy: bool, workers: int = 4, slow_after: int = 400, factor: float = 3.0,
               seed: int = 2, limit: int = 40) -> int | None:
    """ASP: control intervals (``workers * 15`` pushes) after worker 0 turns ``factor`` slower until it follows."""
    cluster = make_cluster(workers, seed)
    bounds = Bounds(LOCAL_BATCH * workers, workers)
    start = start_plan(cluster, bounds)
    rule = LegacyAsp(bounds, start) if legacy else NewAsp(bounds, start)
    clock: list[tuple[float, int, int, float]] = []  # in flight: (finish time, worker, batch, cycle_s)
    for i in range(workers):
        begin(clock, cluster, i, rule.batches[i], 0.0)
    before, target, interval = rule.batches[0], 0.0, WINDOW_STEPS * workers
    for version in range(1, slow_after + interval * limit + 1):
        now, i, batch, cycle_s = heapq.heappop(clock)
        rule.push(i, batch, cycle_s)
        if version % interval == 0:
            rule.decide(version)
        if version == slow_after:
            cluster.slow(0, factor)  # from the next cycle each worker starts
            target = cluster.balanced(bounds.global_batch)[0]
        if version > slow_after and abs(rule.batches[0] - target) <= 0.5 * abs(before - target):
            return -(-(version - slow_after) // interval)
        begin(clock, cluster, i, rule.batches[i], now)
    return None


def begin(clock: list, cluster: Cluster, worker: int, batch: int, now: float) -> None:
    """Worker ``worker`` pulls at ``now`` and computes on ``batch``: its push joins ``clock``."""
    cycle_s = float(cluster.times(np.full(cluster.workers, batch), 1)[worker, 0])
    heapq.heappush(clock, (now + cycle_s, worker, batch, cycle_s))


class NewAsp:
    """The ASP server's use of the loop: each window, each worker's pushes at its current batch."""

    def __init__(self, bounds: Bounds, start: list[int]) -> None:
        from omnilearn.balance.loop import ControlLoop, window_row

        self.loop, self.row = ControlLoop(ProportionalController(bounds, start=start)), window_row
        self.window: list[list[tuple[int, float]]] = [[] for _ in start]

    @property
    def batches(self) -> tuple[int, ...]:
        return self.loop.batches

    def push(self, i: int, batch: int, cycle_s: float) -> None:
        self.window[i].append((batch, cycle_s))

    def decide(self, version: int) -> None:
        rows = [self.row(b, [t for pb, t in w if pb == b]) for b, w in zip(self.batches, self.window)]
        self.loop.update(version, rows)
        self.window = [[] for _ in self.window]


class LegacyAsp:
    """The replaced ASP server path: every push since the last change, no recent window."""

    def __init__(self, bounds: Bounds, start: list[int]) -> None:
        self.bounds, self.batches = bounds, tuple(start)
        self.history: list[list[tuple[int, float]]] = [[] for _ in start]

    def push(self, i: int, batch: int, cycle_s: float) -> None:
        self.history[i].append((batch, cycle_s))

    def decide(self, version: int) -> None:
        new = legacy_decide(self.bounds, self.batches, self.history)
        if new != self.batches:
            self.batches, self.history = new, [[] for _ in self.history]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--legacy", action="store_true", help="the rule before the ControlLoop")
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 64, 1024, 4096])
    parser.add_argument("--intervals", type=int, default=200)
    args = parser.parse_args(argv)
    print(f"{'legacy rule' if args.legacy else 'ControlLoop'}: {WINDOW_STEPS}-step windows, {LOCAL_BATCH} "
          f"samples per worker, 10% noise, heterogeneity 4")
    print(f"{'workers':>8} {'churn':>10} {'follow 2x':>10} {'ms':>8}")
    for n in args.workers:
        changes, ms = churn(n, args.intervals, args.legacy)
        fol = follow(n, args.legacy)
        print(f"{n:>8} {changes:>4}/{args.intervals:<5} {fol if fol is not None else '> 20':>10} {ms:>8.2f}", flush=True)
    worst = {n: noisy_follow(n, args.legacy) for n in (3, 4)}
    print("noisy host, 30% noise, 5% of steps 3x: 2x slowdown followed within (worst of 10 seeds) "
          + ", ".join(f"{n} workers: {w if w is not None else '> 20'}" for n, w in worst.items()))
    asp = asp_follow(args.legacy)
    print(f"ASP, 4 workers, worker 0 3x slower after 400 pushes: followed after "
          f"{asp if asp is not None else '> 40'} control intervals of 60 pushes")


if __name__ == "__main__":
    main()
