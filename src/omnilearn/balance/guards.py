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
- :class:`PinWatch`: counts the decisions in a row that the same worker sits
  at ``min_batch`` while still the slowest (:func:`pinned_low`) and names it
  after ``windows`` of them (the loop's ``PIN_WINDOWS``: a user-facing warning).

Each class saves everything that can change a later decision in its
``state_dict()`` (plain ints, floats, lists, dicts: no None, no NaN),
so a restored :class:`~omnilearn.balance.loop.ControlLoop` decides bit for
bit alike; a state without a key (an older checkpoint) loads that key's default
(a learned cap whose windows left were not saved gets a full ``LEARNED_WINDOWS``).

Run: ``python -m pytest -q tests/unit/test_guards.py tests/unit/test_loop_state.py``
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
        (``judge`` False, or no positive time: nothing to judge after it, time NaN, error 0)."""
        moved = old != new
        judged = judge & (np.nan_to_num(times) > 0)
        self.last[0][moved] = old[moved]
        self.last[1][moved] = np.where(judged, times, np.nan)[moved]
        self.last[2][moved] = np.where(judged, rel_se, 0.0)[moved]

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
        """The bounds to plan with: the configured ones while no reported or learned cap binds."""
        caps = self.effective()
        if (caps == self.configured).all():
            return self.bounds
        return Bounds(self.bounds.global_batch, self.bounds.workers, self.bounds.min_batch, tuple(caps.tolist()))

    def state_dict(self) -> dict:
        """Caps (0: none), each learned cap's windows left, and each worker's batch, time (0: nothing to
        judge) and relative standard error before its latest change. Plain numbers only: no None, no NaN."""
        big = np.iinfo(np.int64).max
        batches, times, rel_se = self.last
        return {"reported": [0 if c == big else int(c) for c in self.reported],
                "learned": [0 if c == big else int(c) for c in self.learned],
                "lapse": self.lapse.tolist(),
                "last": {"batches": batches.tolist(), "times_s": np.nan_to_num(times).tolist(),
                         "rel_se": rel_se.tolist()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a missing key (an older checkpoint) keeps its default."""
        big, n = np.iinfo(np.int64).max, self.bounds.workers
        for name in ("reported", "learned"):
            values = np.asarray(state.get(name, [0] * n), dtype=np.int64)
            if values.size == n:
                setattr(self, name, np.where(values > 0, values, big))
        if "lapse" in state:
            self.lapse = per_worker(state["lapse"], n, "lapse", np.int64)
        else:  # an older checkpoint: its learned caps (age unknown) get a full term
            self.lapse = np.where(self.learned < big, LEARNED_WINDOWS, self.lapse)
        if "last" in state:
            last = state["last"]
            times = per_worker(last["times_s"], n, "last times_s", float)
            self.last = (per_worker(last["batches"], n, "last batches", np.int64),
                         np.where(times > 0, times, np.nan), per_worker(last["rel_se"], n, "last rel_se", float))


def per_worker(values, workers: int, name: str, dtype) -> np.ndarray:
    """``values`` as an array of one entry per worker, or one clear error naming the field."""
    out = np.asarray(values, dtype=dtype)
    if out.shape != (workers,):
        raise ValueError(f"guard state {name!r} has {out.size} entries for {workers} workers: "
                         f"load a checkpoint of a run with {workers} workers")
    return out


class StepGuard:
    """Compare the measured step time after a change with before; say when to take the change back."""

    def __init__(self, hold: int) -> None:
        self.hold = hold
        self.steps: list[float] = []  # the newest BEFORE_WINDOWS window step times at the current plan
        self.before: tuple[np.ndarray, float, float] | None = None  # old plan, its step time, relative spread
        self.holding = 0

    def window(self, step_s) -> None:
        """One window's measured step time: the workers' mean of their median step (0 or NaN: none)."""
        if step_s is None:
            return
        s = np.asarray(step_s, dtype=float)
        if s.size and np.isfinite(s).all() and (s > 0).all():
            self.steps = [*self.steps[1 - BEFORE_WINDOWS:], float(s.mean())]  # all that is ever judged
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

    def state_dict(self) -> dict:
        """The window step times at the current plan, the change being judged ({}: none), the hold left."""
        before = {}
        if self.before is not None:
            old, step_s, spread = self.before
            before = {"batches": old.tolist(), "step_s": step_s, "spread": spread}
        return {"steps": list(self.steps), "before": before, "holding": self.holding}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a missing key (an older checkpoint) keeps its default."""
        self.steps = [float(s) for s in state.get("steps", self.steps)]
        self.holding = int(state.get("holding", self.holding))
        before = state.get("before") or None
        self.before = None if before is None else (
            np.asarray(before["batches"], dtype=np.int64), float(before["step_s"]), float(before["spread"]))


class PinWatch:
    """Which worker sits at ``min_batch`` while the slowest, for how many decisions in a row (see the module)."""

    def __init__(self, windows: int) -> None:
        self.windows = windows
        self.rank: int | None = None  # the worker pinned at the latest decision
        self.run = 0  # decisions in a row it has been
        self.pinned: int | None = None  # ``rank`` once ``run`` reached ``windows``

    def decided(self, rank: int | None) -> None:
        """One decision's :func:`pinned_low` verdict."""
        self.run = self.run + 1 if rank is not None and rank == self.rank else int(rank is not None)
        self.rank = rank
        self.pinned = rank if self.run >= self.windows else None

    def state_dict(self) -> dict:
        """The pinned worker at the latest decision, its run, the worker named (-1: none)."""
        return {"rank": -1 if self.rank is None else self.rank, "run": self.run,
                "pinned": -1 if self.pinned is None else self.pinned}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a missing key (an older checkpoint) keeps its default."""
        rank, pinned = state.get("rank", self.rank), state.get("pinned", self.pinned)
        self.rank, self.pinned = (None if r is None or r < 0 else int(r) for r in (rank, pinned))
        self.run = int(state.get("run", self.run))


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
