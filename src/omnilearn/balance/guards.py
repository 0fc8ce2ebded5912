"""What the ControlLoop checks besides its controller: memory caps and the measured step time. Pure numpy.

- :class:`Caps`: each worker's largest batch, the smallest of three: the
  configured cap (``max_batch``, one or one per worker), the cap a worker
  reports after an out-of-memory error (gathered every window), and the
  predecessor paper's adaptive upper bound: when a worker's batch grew and
  its own throughput (samples/s) fell by more than ``THROUGHPUT_DROP`` (35%) and its noise, it is capped at
  the batch before (for ``LEARNED_WINDOWS`` windows, then it may try again).
  A plan above a cap is re-planned at once (no deadband); learned caps are
  forgotten when that worker's speed shifts. If the caps
  cannot hold the global batch the learned ones give way first; memory caps
  that cannot are stretched in proportion (those workers run micro-batches).
- :class:`StepGuard`: the objective is the measured step time, not equal
  compute times alone (on a shared host a bigger share on the fast worker
  can slow the others). After a change, the first full window at the new
  plan is compared with the (2 to 3) windows before it (a change after a
  single window at the old plan is not judged); a step measurably slower
  (by ``max(MIN_WORSE, 2 x`` the windows' relative spread``)``) takes the old
  plan back and holds still for ``hold`` windows or until a speed shift.

Run: ``python -m pytest -q tests/unit/test_guards.py``
"""

from __future__ import annotations

import numpy as np

from omnilearn.balance.allocation import Bounds

MIN_WORSE = 0.05  # a new plan's step this much slower (relative) than before is measurably worse
# A grown batch whose samples/s fell by more than this (and its noise) is capped. Memory pressure (allocator
# retries, swapping) costs far more; on a shared CPU host the other workers' shares alone move a worker's
# throughput by 16-26% (the default job, 2026-11-23), which a 10% limit mistook for pressure: churn.
THROUGHPUT_DROP = 0.35
LEARNED_WINDOWS = 10  # a learned cap lapses after this many windows (the worker may grow again)
BEFORE_WINDOWS = 3  # windows of the old plan that its step time is taken from


class Caps:
    """Per-worker batch caps: configured, reported (out of memory) and learned (throughput fell)."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.configured = bounds.caps()
        self.reported = np.full(bounds.workers, np.iinfo(np.int64).max)
        self.learned = self.reported.copy()
        # per worker before its latest change: batch, time, relative standard error (NaN: nothing to judge)
        self.last = (np.zeros(bounds.workers, dtype=np.int64), np.full(bounds.workers, np.nan),
                     np.zeros(bounds.workers))
        self.lapse = np.zeros(bounds.workers, dtype=np.int64)  # windows left of each learned cap

    def report(self, caps) -> None:
        """The caps the workers sent (0: none beyond the configured)."""
        c = np.asarray(caps, dtype=np.int64)
        self.reported = np.where(c > 0, np.maximum(c, self.bounds.min_batch), np.iinfo(np.int64).max)

    def changed(self, old: np.ndarray, new: np.ndarray, times: np.ndarray, rel_se: np.ndarray,
                judge: bool = True) -> None:
        """A plan change: remember each moved worker's batch, time and its relative standard error before it
        (``judge`` False: nothing to judge after it)."""
        moved = old != new
        self.last[0][moved], self.last[2][moved] = old[moved], rel_se[moved]
        self.last[1][moved] = times[moved] if judge else np.nan

    def window(self) -> None:
        """A window passed: learned caps age, and lapse after ``LEARNED_WINDOWS``."""
        self.lapse = np.maximum(self.lapse - 1, 0)
        self.learned[(self.lapse == 0)] = np.iinfo(np.int64).max

    def learn(self, batches: np.ndarray, count: np.ndarray, times: np.ndarray, stderr: np.ndarray,
              min_samples: int, z: float) -> np.ndarray:
        """Cap the workers whose batch grew and whose throughput fell (the adaptive upper bound); who was capped."""
        before_b, before_t, before_se = self.last
        ready = (count >= min_samples) & np.isfinite(before_t) & (before_b > 0) & (times > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            drop = 1.0 - (batches / times) / (before_b / before_t)
            limit = np.maximum(THROUGHPUT_DROP, z * np.hypot(stderr / times, before_se))
        capped = ready & (batches > before_b) & (drop > limit)
        self.learned[capped], self.lapse[capped] = before_b[capped], LEARNED_WINDOWS
        self.last[1][ready] = np.nan  # judged once per change
        return capped

    def forget(self, workers: np.ndarray) -> None:
        """These workers' speed shifted: what was learned about them no longer holds."""
        self.learned[workers] = np.iinfo(np.int64).max
        self.last[1][workers] = np.nan

    def effective(self) -> np.ndarray:
        """The caps to plan with: always able to hold the global batch (see the module docstring)."""
        b, total = self.bounds, self.bounds.global_batch
        hard = np.minimum(self.configured, self.reported)
        caps = np.minimum(hard, self.learned)
        if caps.sum() < total:
            caps = hard
        if caps.sum() < total:  # stretch in proportion: over-cap workers run micro-batches
            caps = np.ceil(caps * (total / caps.sum())).astype(np.int64)
        return np.maximum(caps, b.min_batch)

    def bounds_now(self) -> Bounds:
        caps = self.effective()
        if (caps >= self.bounds.global_batch).all() and self.bounds.max_batch is None:
            return self.bounds
        return Bounds(self.bounds.global_batch, self.bounds.workers, self.bounds.min_batch, tuple(caps.tolist()))

    def state_dict(self) -> dict:
        big = np.iinfo(np.int64).max
        return {"reported": [0 if c == big else int(c) for c in self.reported],
                "learned": [0 if c == big else int(c) for c in self.learned]}

    def load_state_dict(self, state: dict) -> None:
        big = np.iinfo(np.int64).max
        for name in ("reported", "learned"):
            values = np.asarray(state.get(name, [0] * self.bounds.workers), dtype=np.int64)
            if values.size == self.bounds.workers:
                setattr(self, name, np.where(values > 0, values, big))


class StepGuard:
    """Compare the measured step time after a change with before; say when to take the change back."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.steps: list[float] = []  # window step times at the current plan
        self.before: tuple[np.ndarray, float, float] | None = None  # old plan, its step time, relative spread
        self.holding = 0

    def window(self, step_s) -> None:
        """One window's measured step time: the workers' mean of their median step (0 or NaN: none)."""
        if step_s is None:
            return
        s = np.asarray(step_s, dtype=float)
        if s.size and np.isfinite(s).all() and (s > 0).all():
            self.steps.append(float(s.mean()))
        if self.holding:
            self.holding -= 1

    def changed(self, old: np.ndarray, forced: bool = False) -> None:
        """The plan changed from ``old``; a forced change (a cap) is never taken back."""
        recent = self.steps[-BEFORE_WINDOWS:]
        if len(recent) >= 2 and not forced:  # one window has no spread to judge the next by
            mean = float(np.mean(recent))
            self.before = (old.copy(), mean, float(np.std(recent, ddof=1) / mean))
        else:
            self.before = None
        self.steps = []

    def worse(self) -> tuple[np.ndarray, str] | None:
        """After a change's first measured window: the old plan and why, if the new step is measurably slower."""
        if self.before is None or not self.steps:
            return None
        old, before_s, spread = self.before
        self.before = None
        now = float(np.mean(self.steps))
        limit = max(MIN_WORSE, 2.0 * spread)
        if now <= before_s * (1 + limit):
            return None
        self.holding = self.hold
        return old, (f"measured step {now * 1e3:.4g} ms is {now / before_s - 1:.1%} slower than "
                     f"{before_s * 1e3:.4g} ms before the change (limit {limit:.1%}): back to the old plan")

    def reset(self) -> None:
        """A speed shift: old comparisons and holds no longer apply."""
        self.before, self.holding, self.steps = None, 0, []


def pinned_low(plan: np.ndarray, times: np.ndarray, lower: int, margin: float) -> int | None:
    """The worker held at the lower bound ``lower`` that is still the slowest by more than ``margin``; else None.

    The controller cannot give it less, so the step waits for it: ``min_batch``
    is too high for this job (a user-facing warning, never a silent stall).
    """
    plan, times = np.asarray(plan), np.asarray(times, dtype=float)
    if plan.size < 2 or not (times > 0).all():
        return None
    slowest = int(np.argmax(times))
    others = np.delete(times, slowest)
    if plan[slowest] <= lower and times[slowest] > (1 + margin) * float(others.max()):
        return slowest
    return None
