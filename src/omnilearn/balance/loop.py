"""ControlLoop: the one feedback loop that both BSP and ASP run around a batch controller. Pure numpy.

Every control window each worker sends one summary row (:func:`window_row`:
batch, sample count, median time, robust spread) of the steps (BSP
``compute_s``) or pushes (ASP ``cycle_s``) it ran at its current batch. The
loop turns the rows into per-worker time estimates, asks the controller for
a proposal and decides whether to apply it::

    loop = ControlLoop(make_controller("omnilearn", bounds, speeds), lag=2, total_steps=1000)
    d = loop.update(step, [window_row(b, times) for b, times in my_gathered_windows])
    if d.changed: plan d.new from step d.effective_step on

How it decides (figures from ``python -m omnilearn.experiments.simulate``):

- **Capped history.** A ring of the last ``history`` windows; per worker the
  loop uses those since its batch last changed: O(n * history) memory however
  long the run. The estimate is the count-weighted mean of the window
  medians: each median is already robust to in-window outliers (a GC pause),
  and weighting by count is the minimum-variance way to pool windows of
  unequal size (ASP workers push at different rates); a median of medians
  would ignore the counts and lose about a third of the efficiency. Its
  standard error is ``1.2533 * s / sqrt(count)``, ``s`` the pooled spread
  (within-window spreads plus the spread of the window medians, so windows
  of one sample still show their noise). Windows are kept as additive
  moments, so pooling is one weighted sum.
- **Shift detection.** When a worker's newest window median differs from its
  older estimate by more than ``shift`` (relative) and by more than
  ``max(SHIFT_Z, sqrt(2 ln n) + NOISE_Z)`` standard errors of the difference
  (n tests per window: without the multiple-test margin a few of 1,024 workers
  would "shift" every window), its speed changed: its older windows are
  dropped. So a 3x slowdown after 400 steady pushes shows at the next
  decision, not hundreds of pushes later.
- **Hold** while any worker has fewer than ``min_samples`` samples at its
  current batch. Rows whose batch is not the worker's current batch (measured
  before the latest change took effect) count as no samples.
- **Deadband on the predicted gain.** The step time is the slowest worker's:
  before ``max_i t_i``, after ``max_i t_i(b_i')`` by the controller's time
  model. Change only if the relative gain exceeds ``deadband``, AND the
  window noise: the proposal must win even with every estimate ``z``
  standard errors against it, ``max_i (t_i - z se_i) > max_i (t_i' + z se_i')``
  with ``z = sqrt(2 ln n) + NOISE_Z`` (the largest of n noisy estimates
  overshoots by about ``se * sqrt(2 ln n)``: that much "gain" is pure noise;
  per-worker ``se_i`` so a worker with few samples cannot carry the max
  alone; see :meth:`ControlLoop.noise`), AND some worker moves by at least
  ``MIN_MOVE_SAMPLES`` (see there why one). The old test, the largest
  single-worker change, fires on every decision at 64 noisy workers.
- **Effective step.** A change takes effect at ``step + 1 + lag``; one that
  would start at or after ``total_steps`` is held.

Run: ``python -m pytest -q tests/unit/test_loop.py``
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from omnilearn.balance.controllers import Controller, Decision, Estimates

WINDOW_FIELDS = 4  # batch, count, median time, robust spread
MAD_TO_SD = 1.4826  # robust standard deviation = 1.4826 * median absolute deviation (normal noise)
MEDIAN_SE = math.sqrt(math.pi / 2)  # standard error of a median = 1.2533 * sd / sqrt(count)
NOISE_Z = 0.5  # standard errors beyond the expected noise maximum sqrt(2 ln n), on each side of the gain
SHIFT_Z = 3.0  # standard errors a window must move, besides ``shift``, to count as a speed change
# Some worker must move by this many samples. One: the gain test already prices a move (one sample
# of a 64-sample batch cannot clear a 5% deadband, so rounding flips at usual batch sizes are held
# anyway), while a minimum of 2 would freeze small plans: 8 samples on 4 workers could never move.
MIN_MOVE_SAMPLES = 1


def window_row(batch: int, times_s: Sequence[float]) -> tuple[float, float, float, float]:
    """One worker's summary of one control window: (batch, count, median time, robust spread).

    ``times_s``: that worker's per-step (BSP ``compute_s``) or per-push (ASP
    ``cycle_s``) times measured at ``batch`` within this window; steps at
    another batch are left out by the caller. Median and spread are 0.0 when
    empty; the spread (1.4826 * MAD) is 0.0 with fewer than 2 times.
    """
    t = np.asarray(times_s, dtype=float)
    if t.size == 0:
        return float(batch), 0.0, 0.0, 0.0
    median = float(np.median(t))
    spread = MAD_TO_SD * float(np.median(np.abs(t - median))) if t.size >= 2 else 0.0
    return float(batch), float(t.size), median, spread


def window_table(batches: ArrayLike, times_s: ArrayLike) -> np.ndarray:
    """:func:`window_row` for all workers at once: ``times_s`` is (n, k), k >= 1 times each; (n, 4) out."""
    t = np.asarray(times_s, dtype=float)
    median = np.median(t, axis=1)
    spread = MAD_TO_SD * np.median(np.abs(t - median[:, None]), axis=1) if t.shape[1] >= 2 else 0.0 * median
    count = np.full(t.shape[0], float(t.shape[1]))
    return np.column_stack((np.asarray(batches, dtype=float), count, median, spread))


def moments(count: np.ndarray, median: np.ndarray, spread: np.ndarray) -> np.ndarray:
    """Per-window sums that pool by addition: (count, count * median, count * (spread^2 + median^2))."""
    return np.stack((count, count * median, count * (spread**2 + median**2)))


def pooled(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From summed :func:`moments`: total count, count-weighted mean of the medians, pooled per-sample spread.

    The spread pools the within-window spreads and the spread of the window
    medians (law of total variance), so windows of one sample still show noise.
    """
    total = sums[0]
    safe = np.where(total > 0, total, 1.0)
    mean = sums[1] / safe
    return total, mean, np.sqrt(np.maximum(sums[2] / safe - mean**2, 0.0))


class ControlLoop:
    """Windows in, decisions out; see the module docstring. State: the plan and the capped history."""

    def __init__(self, controller: Controller, *, deadband: float = 0.05, lag: int = 0, history: int = 10,
                 shift: float = 0.10, min_samples: int = 3, total_steps: int | None = None) -> None:
        if not 0 <= deadband < 1:
            raise ValueError(f"deadband {deadband} must be in [0, 1)")
        if lag < 0 or history < 1 or min_samples < 1 or not shift > 0:
            raise ValueError(f"need lag >= 0, history >= 1, min_samples >= 1, shift > 0; got lag={lag}, "
                             f"history={history}, min_samples={min_samples}, shift={shift}")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps {total_steps} must be at least 1 (or None: open-ended)")
        self.controller = controller
        self.deadband, self.lag, self.history, self.shift = deadband, lag, history, shift
        self.min_samples, self.total_steps = min_samples, total_steps
        self.plan = np.asarray(controller.initial(), dtype=np.int64)
        # A ring of the last ``history`` windows' moments, (3, history, n); row ``slot`` is the newest.
        # Worker i's history is its newest ``kept[i]`` rows; a window without fresh samples is all 0.
        self.ring = np.zeros((3, history, self.plan.size))
        self.kept = np.zeros(self.plan.size, dtype=np.int64)
        self.slot = 0

    @property
    def batches(self) -> tuple[int, ...]:
        """The most recently decided plan (initially ``controller.initial()``)."""
        return tuple(self.plan.tolist())

    @property
    def workers(self) -> int:
        return self.plan.size

    def update(self, step: int, rows: ArrayLike) -> Decision:
        """Take the window that ended at ``step`` (one row per worker, rank order) and decide."""
        table = np.asarray(rows, dtype=float)
        if table.shape != (self.workers, WINDOW_FIELDS):
            raise ValueError(f"rows must be ({self.workers}, {WINDOW_FIELDS}): one window_row per worker, "
                             f"got shape {table.shape}")
        if not np.isfinite(table).all():
            raise ValueError(f"window rows must be finite, got {table[~np.isfinite(table).all(axis=1)][:3]}")
        return self.decide(step, self.record(table))

    def ages(self) -> np.ndarray:
        """(history, 1): how many windows ago each ring row was written (0: the newest)."""
        return ((self.slot - np.arange(self.history)) % self.history)[:, None]

    def sums(self) -> np.ndarray:
        """Summed :func:`moments` of each worker's kept windows, (3, n)."""
        return np.einsum("khn,hn->kn", self.ring, (self.ages() < self.kept).astype(float))

    def record(self, table: np.ndarray) -> np.ndarray:
        """Write the window into the ring (rows at another batch count 0), drop history that shifted.

        Returns the summed moments of the kept windows.
        """
        fresh = (table[:, 1] > 0) & (np.rint(table[:, 0]) == self.plan)
        self.slot = (self.slot + 1) % self.history
        newest = np.where(fresh, moments(table[:, 1], table[:, 2], table[:, 3]), 0.0)
        self.ring[:, self.slot] = newest
        self.kept = np.minimum(self.kept + 1, self.history)
        total = self.sums()
        c_old, t_old, s_old = pooled(total - newest)
        c_new, t_new = newest[0], table[:, 2]
        with np.errstate(divide="ignore", invalid="ignore"):
            moved = np.abs(t_new - t_old) / t_old
            z = max(SHIFT_Z, self.margin_z())
            noise = z * MEDIAN_SE * s_old / t_old * np.sqrt(1 / c_new + 1 / c_old)
            shifted = fresh & (c_old > 0) & (t_old > 0) & (moved > self.shift) & (moved > noise)
        self.kept[shifted] = 1
        return np.where(shifted, newest, total)

    def estimates(self, sums: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per worker: samples at the current batch, time estimate, its standard error."""
        count, times, spread = pooled(self.sums() if sums is None else sums)
        stderr = MEDIAN_SE * spread / np.sqrt(np.where(count > 0, count, 1.0))
        return count, times, stderr

    def margin_z(self) -> float:
        """Standard errors that noise alone reaches in the largest of n estimates: ``sqrt(2 ln n) + NOISE_Z``."""
        return math.sqrt(2 * math.log(self.workers)) + NOISE_Z

    def noise(self, times: np.ndarray, stderr: np.ndarray, predicted: np.ndarray) -> float:
        """The relative gain noise could fake: ``(before - lcb) + (ucb - after)``, over ``before``.

        ``lcb = max_i (t_i - z se_i)`` bounds the current step time from below and
        ``ucb = max_i (t_i' + z se_i')`` the proposed one from above (``se_i'``
        scaled with the predicted time): a change must win even when every
        estimate errs by ``z`` standard errors against it. One side alone is not
        enough: a plan made from noisy estimates is off by about the largest
        error, and acting on that error with equally noisy estimates only deals
        the error out anew (churn at every decision at 1,024 workers).
        """
        z = self.margin_z()
        before, after = float(times.max()), float(predicted.max())
        lcb = float(np.max(times - z * stderr))
        ucb = float(np.max(predicted * (1 + z * stderr / times)))
        return ((before - lcb) + (ucb - after)) / before

    def decide(self, step: int, sums: np.ndarray | None = None) -> Decision:
        """Decide on the kept windows (``sums``: their summed moments, if already at hand)."""
        count, times, stderr = self.estimates(sums)
        old, times_s = self.batches, tuple(times.tolist())
        short = np.flatnonzero(count < self.min_samples)
        if short.size:
            return Decision(step, old, old, times_s, False, f"{short.size} worker(s) (rank {short[0]} first) "
                            f"have fewer than {self.min_samples} samples at their current batch")
        if not (times > 0).all():
            return Decision(step, old, old, times_s, False, f"non-positive time of rank {int(np.argmin(times))}")
        proposal = self.controller.propose(Estimates(self.plan.copy(), times, stderr))
        new = np.asarray(proposal.batches, dtype=np.int64)
        before, after = float(times.max()), float(np.max(proposal.times_s))
        gain = (before - after) / before
        noise = self.noise(times, stderr, np.asarray(proposal.times_s, dtype=float))
        why = f"predicted step {before:.4g} s -> {after:.4g} s (gain {gain:.1%})"
        if (new == self.plan).all():
            held = proposal.reason or "the controller keeps the plan"
        else:
            held = self.held(step, new, gain, noise, why)
        if held:
            return Decision(step, old, old, times_s, False, held, None, (before, after))
        self.kept[new != self.plan] = 0  # their windows measured the old batch
        self.plan = new
        return Decision(step, old, self.batches, times_s, True, f"{why} beats deadband {self.deadband:.1%} and "
                        f"noise {noise:.1%}", step + 1 + self.lag, (before, after))

    def held(self, step: int, new: np.ndarray, gain: float, noise: float, why: str) -> str:
        """Why the proposal ``new`` (not the current plan) is not worth making; "" when it is."""
        move = int(np.abs(new - self.plan).max())
        effective = step + 1 + self.lag
        if move < MIN_MOVE_SAMPLES:
            return f"largest move {move} < {MIN_MOVE_SAMPLES} samples"
        if gain <= self.deadband:
            return f"{why} within deadband {self.deadband:.1%}"
        if gain <= noise:
            return f"{why} within window noise {noise:.1%}"
        if self.total_steps is not None and effective >= self.total_steps:
            return f"{why}, but it would start at step {effective} >= total steps {self.total_steps}"
        return ""

    def state_dict(self) -> dict:
        """Plain Python (JSON-able): the plan, each worker's kept windows and the controller's state.

        A window is stored as its moments ``[count, count * median, count * (spread^2 + median^2)]``,
        oldest first, with the ring position of the newest, so a restored loop makes bit-for-bit
        the same decisions.
        """
        order = (self.slot - np.arange(self.history)[::-1]) % self.history  # ring rows, oldest first
        windows = np.moveaxis(self.ring[:, order], 0, -1)  # (history, n, 3)
        state = {"batches": self.plan.tolist(), "slot": self.slot,
                 "windows": [windows[self.history - k:, i].tolist() for i, k in enumerate(self.kept.tolist())]}
        if hasattr(self.controller, "state_dict"):
            state["controller"] = self.controller.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (keeps the newest ``history`` windows per worker)."""
        plan = np.asarray(state["batches"], dtype=np.int64)
        if plan.size != self.workers or len(state["windows"]) != self.workers:
            raise ValueError(f"loop state for {plan.size} workers loaded into a loop for {self.workers}")
        if "controller" in state and hasattr(self.controller, "load_state_dict"):
            self.controller.load_state_dict(state["controller"])
        self.plan, self.slot = plan, int(state.get("slot", 0)) % self.history
        self.ring[:] = 0.0
        for i, rows in enumerate(state["windows"]):
            rows = np.asarray(rows, dtype=float).reshape(-1, 3)[-self.history:]
            k = self.kept[i] = rows.shape[0]
            # back to the same ring rows (oldest first), so sums add in the same order
            self.ring[:, (self.slot - np.arange(k)[::-1]) % self.history, i] = rows.T
