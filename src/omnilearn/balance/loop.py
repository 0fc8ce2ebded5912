"""ControlLoop: the one feedback loop that both BSP and ASP run around a batch controller. Pure numpy.

Every control window each worker sends one summary row (:func:`~omnilearn.balance.windows.window_row`:
batch, sample count, median time, robust spread) of the steps (BSP
``compute_s``) or pushes (ASP ``cycle_s``) it ran at its current batch. The
loop turns the rows into per-worker time estimates, asks the controller for
a proposal and decides whether to apply it::

    loop = ControlLoop(make_controller("omnilearn", bounds, speeds), lag=2, total_steps=1000)
    d = loop.update(step, [window_row(b, times) for b, times in my_gathered_windows])
    if d.changed: plan d.new from step d.effective_step on

How it decides (figures from ``python -m omnilearn.experiments.simulate.churn``):

- **Capped history.** A ring of the last ``history`` windows (as additive
  moments); per worker those since its batch last changed: O(n * history)
  memory. The estimate is the count-weighted mean of the window medians
  (minimum variance for windows of unequal size; a median of medians loses a
  third of the efficiency), its standard error ``1.2533 * s / sqrt(count)``,
  ``s`` the pooled spread (within and between windows). One wild time in a
  window of one or two samples is capped (:func:`robust_pool`), not left to
  bias the estimate and blind the noise gate for ``history`` windows.
- **Shift detection.** When a worker's newest window median differs from its
  older estimate by more than ``shift`` (relative) and its log by more than
  ``max(SHIFT_Z, z)`` standard errors (n tests per window, see ``z`` below),
  its speed changed: its older windows are dropped from the estimate and its
  older model pairs are rescaled by the ratio (a machine k times slower keeps
  its line's shape, so the ``model`` controller lands in one decision). So a
  3x slowdown after 400 steady pushes shows at the next decision, not
  hundreds of pushes later. :meth:`ControlLoop.shifted` runs the same test on
  a window without recording it: BSP checks a few steps into an interval and
  decides early when a shift is clear (:class:`omnilearn.bsp.steppers.IntervalEnds`).
- **Caps and the measured step** (:mod:`omnilearn.balance.guards`): a plan
  above a worker's cap (configured, reported after an out-of-memory error, or
  learned when its throughput fell after its batch grew) is re-planned at
  once; a change after which the measured wall step (``step_s``) got slower is
  taken back, and the loop holds still for ``history`` windows.
- **Hold** while any worker has fewer than ``min_samples`` samples at its
  current batch. Rows whose batch is not the worker's current batch (measured
  before the latest change took effect) count as no samples.
- **Deadband on the predicted gain.** The step time is the slowest worker's:
  before ``max_i t_i``, after ``max_i t_i(b_i')`` by the controller's time
  model. Change only if the relative gain exceeds ``deadband``, AND the
  window noise: the proposal must win for every true time within ``z``
  standard errors of each estimate (:meth:`ControlLoop.noise`), ``z`` the
  expected largest of n standard normal errors plus ``NOISE_Z``
  (:meth:`ControlLoop.margin_z`), AND some worker moves by at least
  ``MIN_MOVE_SAMPLES``. The old test, the largest single-worker change,
  fires on every decision at 64 noisy workers.
- **Model history.** Beside the moments, a ring of (batch, median) per
  worker and window, kept across batch changes (not across speed shifts),
  goes to the controller as :attr:`Estimates.history` (oldest first) for
  the ``model`` controller's fit of ``t_i(b) = alpha_i + beta_i * b``.
- **Effective step.** A change takes effect at ``step + 1 + lag``; one that
  would start at or after ``total_steps`` is held.
- **State.** :meth:`ControlLoop.state_dict` holds everything that can change
  a later decision (plan, kept windows, model pairs, controller, caps with
  each learned cap's windows left and the batch/time before each change, the
  step guard's hold and comparison, the pin counter) as plain values, so a
  loop restored from a checkpoint (``torch.load(weights_only=True)``) decides
  bit for bit alike; the ring holds exactly the kept windows (older rows are
  zeroed), which is what is saved. A state from an older checkpoint without
  the newer keys loads with their defaults.

Why one file over 300 lines: ``ControlLoop`` is one state machine (windows, shift detection, deadband, effective
step, state_dict); split, its invariants would be checked across files. The guards and windows are apart.

Run: ``python -m pytest -q tests/unit/test_loop.py tests/unit/test_guards.py tests/unit/test_loop_state.py``
"""

from __future__ import annotations

import functools
import weakref

from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike

from omnilearn.balance.allocation import split_array
from omnilearn.balance.controllers import Controller, Decision, Estimates
from omnilearn.balance.guards import Caps, PinWatch, StepGuard, pinned_low
from omnilearn.balance.windows import (  # noqa: F401  (window_row, window_table: re-exported for the runtimes)
    MEDIAN_SE, ROBUST_COUNT, WINDOW_FIELDS, moments, robust_pool, window_row, window_table)

NOISE_Z = 0.5  # standard errors beyond the expected noise maximum of n estimates, on each side of the gain
SHIFT_Z = 3.0  # standard errors a window must move, besides ``shift``, to count as a speed change
# Some worker must move by this many samples. One: the gain test already prices a move (one sample
# of a 64-sample batch cannot clear a 5% deadband, so rounding flips at usual batch sizes are held
# anyway), while a minimum of 2 would freeze small plans: 8 samples on 4 workers could never move.
MIN_MOVE_SAMPLES = 1
PIN_WINDOWS = 3  # decisions in a row a worker must sit at min_batch, still the slowest, to be warned about


@functools.lru_cache(maxsize=64)
def _margin_z(n: int) -> float:
    """:meth:`ControlLoop.margin_z` for ``n`` workers (a pure function of n: computed once per n)."""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) + NOISE_Z


_POOLS: "weakref.WeakKeyDictionary[ControlLoop, tuple]" = weakref.WeakKeyDictionary()  # _pooled's cache, outside the state

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
        # (batch, median) per ring row and worker, 0 where no fresh samples or before a speed shift;
        # unlike ``kept`` it survives batch changes: the model controller fits across batches.
        self.pairs = np.zeros((2, history, self.plan.size))
        bounds = getattr(controller, "bounds", None)
        self.caps = Caps(bounds) if bounds is not None else None
        self.guard = StepGuard(hold=history)
        self.pin = PinWatch(PIN_WINDOWS)

    @property
    def batches(self) -> tuple[int, ...]:
        """The most recently decided plan (initially ``controller.initial()``)."""
        return tuple(self.plan.tolist())

    @property
    def workers(self) -> int:
        return self.plan.size

    @property
    def pinned(self) -> int | None:
        """A worker at min_batch still the slowest for ``PIN_WINDOWS`` decisions in a row (None: none)."""
        return self.pin.pinned

    def update(self, step: int, rows: ArrayLike, *, caps: ArrayLike | None = None,
               step_s: ArrayLike | None = None) -> Decision:
        """Take the window that ended at ``step`` (one row per worker, rank order) and decide.

        ``caps``: each worker's current batch cap (0: none beyond the configured);
        ``step_s``: each worker's median wall time per step in the window (the measured objective).
        """
        table = self.table(rows)
        self.record(table)
        self.guard.window(step_s)
        if self.caps is not None:
            self.caps.window()
            if caps is not None:
                self.caps.report(caps)
            forced = self.enforce_caps(step)
            if forced is not None:
                return forced
        back = self.guard.worse()
        if back is not None:
            return self.apply(step, back[0], back[1], forced=True)
        return self.decide(step)

    def table(self, rows: ArrayLike) -> np.ndarray:
        table = np.asarray(rows, dtype=float)
        if table.shape != (self.workers, WINDOW_FIELDS):
            raise ValueError(f"rows must be ({self.workers}, {WINDOW_FIELDS}): one window_row per worker, "
                             f"got shape {table.shape}")
        if not np.isfinite(table).all():
            raise ValueError(f"window rows must be finite, got {table[~np.isfinite(table).all(axis=1)][:3]}")
        return table

    def _pooled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`robust_pool` of the kept windows, computed once per state of the ring (the mid-interval checks,
        the record and the decision of one window all read the same pool)."""
        key = (self.slot, self.kept.tobytes(), self.ring.tobytes())
        cached = _POOLS.get(self)
        if cached is None or cached[0] != key:
            cached = _POOLS[self] = (key, robust_pool(self.ring, self.ages() < self.kept))
        return cached[1]

    def ages(self) -> np.ndarray:
        """(history, 1): how many windows ago each ring row was written (0: the newest)."""
        return ((self.slot - np.arange(self.history)) % self.history)[:, None]

    def shifted(self, rows: ArrayLike) -> np.ndarray:
        """Per worker: does this window (not yet recorded) show a speed change against the kept ones?

        The log ratio of the window's median to the older estimate is judged by
        the older relative spread, or by the window's where it is small and
        noisier: two samples, one a pause, are noise, not a shift.
        """
        return self._shift(self.table(rows))[0]

    def _shift(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shifted mask, new / old time ratio) of an unrecorded window ``table``."""
        fresh = (table[:, 1] > 0) & (np.rint(table[:, 0]) == self.plan)
        c_old, t_old, s_old = self._pooled()
        c_new, t_new = table[:, 1], table[:, 2]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = t_new / t_old
            rel_old = s_old / t_old
            rel_new = np.where(c_new < ROBUST_COUNT, np.maximum(table[:, 3] / t_new, rel_old), rel_old)
            z = max(SHIFT_Z, self.margin_z())
            noise = z * MEDIAN_SE * np.sqrt(rel_old**2 / c_old + rel_new**2 / c_new)
            significant = np.abs(np.log(ratio)) > noise
            shifted = fresh & (c_old > 0) & (t_old > 0) & (np.abs(ratio - 1) > self.shift) & significant
        return shifted, ratio

    def record(self, table: np.ndarray) -> None:
        """Write the window into the ring (rows at another batch count 0); a worker whose speed shifted
        keeps only this window, its model pairs are rescaled by the shift, and its caps and the step
        guard's comparison are forgotten.
        """
        shifted, ratio = self._shift(table)
        fresh = (table[:, 1] > 0) & (np.rint(table[:, 0]) == self.plan)
        self.slot = (self.slot + 1) % self.history
        self.ring[:, self.slot] = np.where(fresh, moments(table[:, 1], table[:, 2], table[:, 3]), 0.0)
        self.kept = np.minimum(self.kept + 1, self.history)
        self.pairs[:, self.slot] = np.where(fresh, np.stack((table[:, 0], table[:, 2])), 0.0)
        if shifted.any():
            self.kept[shifted] = 1
            older = (self.ages()[:, 0] > 0)[:, None] & shifted[None, :]
            self.ring[:, older] = 0.0  # the ring holds exactly the kept windows (what state_dict saves)
            # a slower (or faster) machine: its older (batch, time) pairs keep their line's shape, scaled
            self.pairs[1] = np.where(older, self.pairs[1] * np.where(shifted, ratio, 1.0)[None, :], self.pairs[1])
            if self.caps is not None:
                self.caps.forget(shifted)
            self.guard.reset()

    def estimates(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per worker: samples at the current batch, time estimate (:func:`robust_pool`), its standard error."""
        count, times, spread = self._pooled()
        stderr = MEDIAN_SE * spread / np.sqrt(np.where(count > 0, count, 1.0))
        return count, times, stderr

    def history_pairs(self) -> np.ndarray:
        """(history, n, 2): per ring window, oldest first, each worker's batch and median time; NaN where empty."""
        order = (self.slot - np.arange(self.history)[::-1]) % self.history
        pairs = np.moveaxis(self.pairs[:, order], 0, -1)
        return np.where(pairs[..., :1] > 0, pairs, np.nan)

    def margin_z(self) -> float:
        """Standard errors that noise alone reaches in the largest of n estimates, plus ``NOISE_Z``.

        The expected maximum of n standard normals, ``Phi^-1((n - 0.375) / (n + 0.25))`` (Blom):
        0.87 at 3 workers, 2.34 at 64, 3.23 at 1,024. The asymptote ``sqrt(2 ln n)`` (1.48, 2.88,
        3.72) overstates it most where it hurts: 3-4 workers on a noisy host.
        """
        return _margin_z(self.workers)

    def noise(self, times: np.ndarray, stderr: np.ndarray, predicted: np.ndarray) -> float:
        """The relative gain noise could fake: predicted gain minus the least gain the estimates allow.

        Each true time ``tau_i`` may lie in ``t_i +- z se_i`` (:meth:`margin_z`)
        and the time at the proposal scales with it, ``r_i tau_i`` (``r_i =
        t_i' / t_i``). A change must win for all of them: ``min_tau max_i tau_i
        - max_j r_j tau_j > 0``. For the worker j slowest after, the others sit
        at their low ends and ``max(tau_j, rest_j) - r_j tau_j`` is convex, so
        the minimum is at ``lo_j``, ``hi_j`` or the kink: exact, O(n). Both
        sides count (acting on the largest error with equally noisy estimates
        deals it out anew: churn at 1,024 workers), but each worker's error
        once: the slowest worker cannot be fast before and slow after.
        """
        z = self.margin_z()
        lo, hi = np.maximum(times - z * stderr, 0.0), times + z * stderr
        ratio = predicted / times
        top = int(np.argmax(lo))
        rest = np.full(lo.size, lo[top])  # per worker, the largest low end of the others
        rest[top] = np.max(np.delete(lo, top), initial=0.0)
        worst = min(float(np.min(np.maximum(tau, rest) - ratio * tau)) for tau in (lo, hi, np.clip(rest, lo, hi)))
        before = float(times.max())
        return (before - float(predicted.max()) - worst) / before

    def decide(self, step: int) -> Decision:
        """Decide on the kept windows."""
        count, times, stderr = self.estimates()
        old, times_s = self.batches, tuple(times.tolist())
        if self.workers == 1:  # the whole batch is the one worker's: no proposal to make, no controller to ask
            return Decision(step, old, old, times_s, False, "one worker: nothing to balance")
        short = np.flatnonzero(count < self.min_samples)
        if short.size:
            return Decision(step, old, old, times_s, False, f"{short.size} worker(s) (rank {short[0]} first) "
                            f"have fewer than {self.min_samples} samples at their current batch")
        if not (times > 0).all():
            return Decision(step, old, old, times_s, False, f"non-positive time of rank {int(np.argmin(times))}")
        if self.caps is not None:
            capped = self.caps.learn(self.plan, count, times, stderr, self.min_samples, self.margin_z())
            if capped.any():
                forced = self.enforce_caps(step, f"rank {int(np.flatnonzero(capped)[0])}'s throughput fell after "
                                                 "its batch grew: capped at its batch before")
                if forced is not None:
                    return forced
        if self.guard.holding:
            return Decision(step, old, old, times_s, False, f"holding still {self.guard.holding} more window(s) "
                            "after taking a slower change back")
        # the model pairs only for a controller that reads them (a controller that does not say reads them)
        history = self.history_pairs() if getattr(self.controller, "reads_history", True) else None
        proposal = self.controller.propose(Estimates(self.plan.copy(), times, stderr, history))
        bounds = getattr(self.controller, "bounds", None)
        self.pin.decided(None if bounds is None else pinned_low(self.plan, times, bounds.min_batch, 2 * self.deadband))
        new = np.asarray(proposal.batches, dtype=np.int64)
        before, after = float(times.max()), float(np.max(proposal.times_s))
        gain = (before - after) / before
        why = f"predicted step {before:.4g} s -> {after:.4g} s (gain {gain:.1%})"
        if (new == self.plan).all():  # most decisions: nothing to judge, so no noise bound to compute
            held, noise = proposal.reason or "the controller keeps the plan", 0.0
        else:
            noise = self.noise(times, stderr, np.asarray(proposal.times_s, dtype=float))
            held = self.held(step, new, gain, noise, why)
        if held:
            return Decision(step, old, old, times_s, False, held, None, (before, after))
        return self.apply(step, new, f"{why} beats deadband {self.deadband:.1%} and noise {noise:.1%}",
                          predicted=(before, after))

    def apply(self, step: int, new: np.ndarray, reason: str, *, forced: bool = False,
              predicted: tuple[float, float] | None = None) -> Decision:
        """Make ``new`` the plan from ``step + 1 + lag`` on (``forced``: a cap or a take-back, never judged)."""
        old = self.plan.copy()
        count, times, stderr = self.estimates()
        if self.caps is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                self.caps.changed(old, new, np.where(count > 0, times, np.nan), stderr / times, judge=not forced)
        self.guard.changed(old, forced)
        moved = new != self.plan
        self.kept[moved], self.ring[:, :, moved] = 0, 0.0  # their windows measured the old batch
        self.plan = np.asarray(new, dtype=np.int64)
        return Decision(step, tuple(old.tolist()), self.batches, tuple(times.tolist()), True, reason,
                        step + 1 + self.lag, predicted)

    def enforce_caps(self, step: int, why: str = "") -> Decision | None:
        """Give the controller the current caps; re-plan at once when the plan is above one."""
        bounds = self.caps.bounds_now()
        if hasattr(self.controller, "bounds"):
            self.controller.bounds = bounds
        caps = np.broadcast_to(np.asarray(bounds.upper), self.plan.shape)
        over = np.flatnonzero(self.plan > caps)
        if not over.size:
            return None
        new = split_array(np.minimum(self.plan, caps).astype(float), bounds)
        reason = why or f"rank {int(over[0])}'s batch {int(self.plan[over[0]])} is above its cap {int(caps[over[0]])}"
        return self.apply(step, new, f"{reason}: re-planned within the caps", forced=True)

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
        """Plain Python (JSON-able): the plan, each worker's kept windows (:func:`moments`, oldest first,
        with the ring position of the newest), the model pairs, the controller's, caps', step guard's and pin
        watch's state: everything that can change a later decision, so a restored loop decides bit for bit alike.
        """
        order = (self.slot - np.arange(self.history)[::-1]) % self.history  # ring rows, oldest first
        windows = np.moveaxis(self.ring[:, order], 0, -1)  # (history, n, 3)
        state = {"batches": self.plan.tolist(), "slot": self.slot,
                 "windows": [windows[self.history - k:, i].tolist() for i, k in enumerate(self.kept.tolist())]}
        if self.pairs.any():  # the model history, oldest first: (history, n, 2), 0 where empty
            state["pairs"] = np.moveaxis(self.pairs[:, order], 0, -1).tolist()
        if hasattr(self.controller, "state_dict"):
            state["controller"] = self.controller.state_dict()
        if self.caps is not None:
            state["caps"] = self.caps.state_dict()
        state["guard"], state["pin"] = self.guard.state_dict(), self.pin.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (keeps the newest ``history`` windows per worker); a state without
        the guard's, pin watch's or caps' newer keys (an older checkpoint) loads their defaults."""
        plan = np.asarray(state["batches"], dtype=np.int64)
        if plan.size != self.workers or len(state["windows"]) != self.workers:
            raise ValueError(f"loop state for {plan.size} workers loaded into a loop for {self.workers}")
        if "controller" in state and hasattr(self.controller, "load_state_dict"):
            self.controller.load_state_dict(state["controller"])
        self.plan, self.slot = plan, int(state.get("slot", 0)) % self.history
        if self.caps is not None:
            self.caps.load_state_dict(state.get("caps", {}))
            if hasattr(self.controller, "bounds"):
                self.controller.bounds = self.caps.bounds_now()  # as the last update left it
        self.guard.load_state_dict(state.get("guard", {}))
        self.pin.load_state_dict(state.get("pin", {}))
        self.ring[:] = 0.0
        self.pairs[:] = 0.0
        if "pairs" in state:
            pairs = np.asarray(state["pairs"], dtype=float)[-self.history:]
            if pairs.ndim != 3 or pairs.shape[1:] != (self.workers, 2):
                raise ValueError(f"loop state pairs of shape {pairs.shape} for {self.workers} workers")
            k = pairs.shape[0]
            self.pairs[:, (self.slot - np.arange(k)[::-1]) % self.history] = np.moveaxis(pairs, -1, 0)
        for i, rows in enumerate(state["windows"]):
            rows = np.asarray(rows, dtype=float).reshape(-1, 3)[-self.history:]
            k = self.kept[i] = rows.shape[0]
            # back to the same ring rows (oldest first), so sums add in the same order
            self.ring[:, (self.slot - np.arange(k)[::-1]) % self.history, i] = rows.T
