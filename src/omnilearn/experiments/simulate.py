"""Simulated heterogeneous workers driving the ControlLoop (and, for comparison, the legacy rule).

Worker i takes ``t_i(b) = alpha_i + beta_i * b`` seconds for a batch of b
(speeds spread over a heterogeneity level of 4, a fixed part of about 20% of
the step), times a multiplicative per-step noise ``1 + noise * N(0, 1)``.
The global batch is 64 per worker, a control window is 15 steps (the default
``control_interval``), and runs start from the balanced split. Per worker
count the CLI prints:

- ``churn``: control intervals, of ``--intervals``, in which batches changed
  with 10% noise and no real change of speed (each change restarts the windows);
- ``follow``: intervals until the plan follows a 2x slowdown of worker 0
  (its batch moves at least halfway to its new balanced share);
- ``ms``: median wall time of one decision (``ControlLoop.update``, or the
  legacy ``decide`` on the steps since the last change);
- one ASP line: 4 workers pushing, worker 0 3x slower after 400 pushes:
  control intervals (of 4 x 15 pushes) until its batch follows.

``--legacy`` runs the rule the loop replaces (``Observation`` / ``decide``:
every sample since the last change, at most 10 windows in BSP and all of them
in ASP, deadband on the largest single-worker change). It needs only names
the pre-ControlLoop ``omnilearn.balance`` had, so it also runs against that
old code for the "before" figures.

Run: ``python -m omnilearn.experiments.simulate [--legacy] [--workers 4 64] [--intervals 200]``
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import time
from dataclasses import dataclass

import numpy as np

from omnilearn.balance.allocation import Bounds, proportional_split
from omnilearn.balance.controllers import Observation, ProportionalController

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

    @property
    def workers(self) -> int:
        return self.alpha_s.size

    def mean_s(self, batches) -> np.ndarray:
        return self.alpha_s + self.beta_s * np.asarray(batches, dtype=float)

    def times(self, batches, steps: int) -> np.ndarray:
        """(n, steps) measured times at ``batches``."""
        factor = 1.0 + self.noise * self.rng.standard_normal((self.workers, steps))
        return self.mean_s(batches)[:, None] * np.maximum(factor, 0.05)

    def slow(self, worker: int, factor: float) -> None:
        self.alpha_s[worker] *= factor
        self.beta_s[worker] *= factor

    def balanced(self, global_batch: int) -> np.ndarray:
        """Real shares with equal times: ``alpha_i + beta_i * b_i = T``, ``sum(b) = B``."""
        t = (global_batch + np.sum(self.alpha_s / self.beta_s)) / np.sum(1 / self.beta_s)
        return (t - self.alpha_s) / self.beta_s


def make_cluster(workers: int, seed: int, noise: float = 0.10, level: float = 4.0) -> Cluster:
    """Speeds log-uniform over ``level`` (fastest / slowest); the fixed part is 20% of a balanced step."""
    rng = np.random.default_rng(seed)
    speed = 1000.0 * level ** rng.uniform(0.0, 1.0, workers)  # samples/s of the variable part
    beta = 1.0 / speed
    alpha = 0.25 * LOCAL_BATCH * beta.mean() * np.ones(workers)
    return Cluster(alpha, beta, noise, rng)


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


class LegacyRule:
    """The pre-ControlLoop BSP path: every step since the last change (at most 10 windows), ``recent`` window."""

    def __init__(self, bounds: Bounds, start: list[int]) -> None:
        self.ctl = ProportionalController(bounds, start=start)
        self.batches = tuple(start)
        self.history: list[list[tuple[int, float]]] = [[] for _ in start]

    def window(self, step: int, times: np.ndarray) -> tuple[bool, float]:
        for past, b, row in zip(self.history, self.batches, times.tolist()):
            past.extend((b, t) for t in row)
            del past[: -HISTORY_WINDOWS * times.shape[1]]
        obs = Observation(step, self.batches, tuple(map(tuple, self.history)), recent=times.shape[1])
        begin = time.perf_counter()
        d = self.ctl.decide(obs)
        spent = time.perf_counter() - begin
        if d.changed:
            self.batches, self.history = d.new, [[] for _ in self.history]
        return d.changed, spent


def churn(workers: int, intervals: int, legacy: bool, seed: int = 0) -> tuple[int, float]:
    """(intervals that changed, median decision ms) with 10% noise and no real change of speed."""
    cluster = make_cluster(workers, seed)
    bounds = Bounds(LOCAL_BATCH * workers, workers)
    rule = (LegacyRule if legacy else NewRule)(bounds, start_plan(cluster, bounds))
    changes, spent = 0, []
    for k in range(intervals):
        changed, s = rule.window((k + 1) * WINDOW_STEPS - 1, cluster.times(rule.batches, WINDOW_STEPS))
        changes += changed
        spent.append(s)
    return changes, 1e3 * statistics.median(spent)


def follow(workers: int, legacy: bool, seed: int = 1, warmup: int = 20, limit: int = 20) -> int | None:
    """Intervals after worker 0 turns 2x slower until its batch moves halfway to its new share (None: never)."""
    cluster = make_cluster(workers, seed)
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
    """The pre-ControlLoop ASP server: every push since the last change, no recent window."""

    def __init__(self, bounds: Bounds, start: list[int]) -> None:
        self.ctl, self.batches = ProportionalController(bounds, start=start), tuple(start)
        self.history: list[list[tuple[int, float]]] = [[] for _ in start]

    def push(self, i: int, batch: int, cycle_s: float) -> None:
        self.history[i].append((batch, cycle_s))

    def decide(self, version: int) -> None:
        if min(sum(1 for b, _ in h if b == self.batches[i]) for i, h in enumerate(self.history)) < 3:
            return
        d = self.ctl.decide(Observation(version, self.batches, tuple(map(tuple, self.history))))
        if d.changed:
            self.batches, self.history = d.new, [[] for _ in self.history]


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
    asp = asp_follow(args.legacy)
    print(f"ASP, 4 workers, worker 0 3x slower after 400 pushes: followed after "
          f"{asp if asp is not None else '> 40'} control intervals of 60 pushes")


if __name__ == "__main__":
    main()
