"""Ideal step time and balance efficiency from per-step metrics. Pure.

With worker speeds ``v_i = b_i / compute_s_i`` the best BSP step time is
``T* = B / sum(v_i) + min_i wait_s_i``: perfectly balanced compute plus only
the sync time the slowest worker itself sees. ``balance_efficiency`` is
``mean(T*) / mean(T_measured)`` over a range of steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import fmean
from typing import Iterable, Mapping, Sequence


@dataclass(frozen=True)
class StepRow:
    """One worker's timing for one step (a subset of a ``metrics.jsonl`` record)."""

    step: int
    rank: int
    batch: int
    compute_s: float
    wait_s: float
    step_s: float


def ideal_step_s(rows: Sequence[StepRow]) -> float:
    """``T*`` for one step, given every worker's row for that step."""
    total = sum(r.batch for r in rows)
    speed = sum(r.batch / r.compute_s for r in rows if r.compute_s > 0)
    return total / speed + min(r.wait_s for r in rows)


def by_step(rows: Iterable[StepRow]) -> dict[int, list[StepRow]]:
    steps: dict[int, list[StepRow]] = defaultdict(list)
    for r in rows:
        steps[r.step].append(r)
    return dict(steps)


def measured_step_s(rows: Sequence[StepRow]) -> float:
    """The step's duration: the workers' mean ``step_s``.

    Each worker's step times add up to the time it spent in steps, so their
    mean is the step period; a per-step maximum would count clock jitter as
    imbalance. (Evaluation and the once-per-interval gather fall between steps.)
    """
    return fmean(r.step_s for r in rows)


def balance_efficiency(rows: Iterable[StepRow], first_step: int = 0) -> float:
    """``mean T* / mean T`` over the steps ``>= first_step``."""
    steps = [v for s, v in by_step(rows).items() if s >= first_step]
    if not steps:
        return float("nan")
    ideal = fmean(ideal_step_s(v) for v in steps)
    measured = fmean(measured_step_s(v) for v in steps)
    return ideal / measured


@dataclass(frozen=True)
class WorkerStats:
    rank: int
    mean_batch: float
    mean_compute_s: float
    mean_wait_s: float
    speed: float  # samples per second of compute


def worker_stats(rows: Iterable[StepRow], first_step: int = 0) -> list[WorkerStats]:
    """Per-worker means over the steps ``>= first_step``, ordered by rank."""
    per_rank: Mapping[int, list[StepRow]] = defaultdict(list)
    for r in rows:
        if r.step >= first_step:
            per_rank[r.rank].append(r)
    out = []
    for rank in sorted(per_rank):
        rs = per_rank[rank]
        batch, compute = fmean(r.batch for r in rs), fmean(r.compute_s for r in rs)
        out.append(WorkerStats(rank, batch, compute, fmean(r.wait_s for r in rs), batch / compute))
    return out
