"""Batch-size controllers: observations in, batch plan out. Pure Python.

``omnilearn`` is the paper's proportional rule (Tyagi & Sharma, TPDS 2025)::

    delta_b_i = -(b_i / t_i) * (t_i - t_mean)      so  b_i' = b_i * t_mean / t_i

with a robust per-worker time ``t_i`` (median of the window, so one GC pause
does not move batches), a deadband (no change unless some worker's relative
change exceeds it; then all change together), clamping to the bounds with
re-sharing, and largest-remainder rounding so ``sum(b) == B`` exactly.
``uniform`` (plain data parallel) and ``static`` (proportional to declared
speeds, then fixed) are the paper's baselines. Every rank runs the same
controller on the same gathered observations, so all ranks reach the same
decision without another message.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from omnilearn.balance.allocation import Bounds, largest_remainder, clamp_reshare, proportional_split, uniform_split

CONTROLLERS = ("omnilearn", "static", "uniform")


@dataclass(frozen=True)
class Observation:
    """What each worker measured since the last change of batches.

    ``samples[i]`` holds ``(batch, compute_s)`` pairs of worker ``i``, one per
    step, oldest first; the last ``recent`` of them are the newest interval
    (0: no split), used to notice a speed change (see :func:`window_time`).
    """

    step: int
    batches: tuple[int, ...]
    samples: tuple[tuple[tuple[int, float], ...], ...]
    recent: int = 0


@dataclass(frozen=True)
class Decision:
    """A controller's verdict on one interval; ``changed`` False means hold still."""

    step: int
    old: tuple[int, ...]
    new: tuple[int, ...]
    times_s: tuple[float, ...]
    changed: bool
    reason: str


class Controller(Protocol):
    name: str

    def initial(self) -> list[int]: ...

    def decide(self, obs: Observation) -> Decision: ...


def robust_time(values: Sequence[float]) -> float:
    """Median of the window: robust to one-off pauses in either direction."""
    return float(statistics.median(values))


def window_time(samples: Sequence[float], recent: int, shift: float) -> float:
    """Robust time over the steps since the last change, unless the speed moved.

    The median of all samples, so noise averages out the longer batches hold
    still; but when the newest ``recent`` samples' median differs from the
    older ones' by more than ``shift`` (relative), the worker's speed changed
    and only the newest samples count.
    """
    old, new = samples[: len(samples) - recent], samples[len(samples) - recent :]
    if recent and old and new:
        t_old, t_new = robust_time(old), robust_time(new)
        if abs(t_new - t_old) > shift * t_old:
            return t_new
    return robust_time(samples)


def _hold(obs: Observation, times: Sequence[float], reason: str) -> Decision:
    return Decision(obs.step, obs.batches, obs.batches, tuple(times), False, reason)


@dataclass
class FixedController:
    """A plan that never changes: ``uniform`` or ``static`` (declared speeds)."""

    name: str
    batches: list[int]

    def initial(self) -> list[int]:
        return list(self.batches)

    def decide(self, obs: Observation) -> Decision:
        times = [robust_time([t for _, t in s]) if s else 0.0 for s in obs.samples]
        return _hold(obs, times, f"{self.name} batches are fixed")


@dataclass
class ProportionalController:
    """The paper's proportional rule with deadband, bounds and exact rounding."""

    bounds: Bounds
    deadband: float = 0.05
    min_samples: int = 3
    shift: float = 0.10  # relative change of a worker's time that means its speed changed
    name: str = "omnilearn"
    start: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.deadband < 1:
            raise ValueError(f"deadband {self.deadband} must be in [0, 1)")
        if not self.start:
            self.start = uniform_split(self.bounds)

    def initial(self) -> list[int]:
        return list(self.start)

    def decide(self, obs: Observation) -> Decision:
        current = [[t for b, t in s if b == obs.batches[i]] for i, s in enumerate(obs.samples)]
        if any(len(c) < self.min_samples for c in current):
            return _hold(obs, [], f"fewer than {self.min_samples} steps at the current batches")
        times = [window_time(c, min(obs.recent, len(c)), self.shift) for c in current]
        if any(t <= 0 for t in times):
            return _hold(obs, times, "non-positive compute time")
        targets = proportional_targets(obs.batches, times)
        new = largest_remainder(clamp_reshare(targets, self.bounds), self.bounds)
        rel = max(abs(n - b) / b for n, b in zip(new, obs.batches))
        if rel <= self.deadband:
            return _hold(obs, times, f"largest change {rel:.1%} within deadband {self.deadband:.0%}")
        return Decision(obs.step, obs.batches, tuple(new), tuple(times), True, f"largest change {rel:.1%}")


def proportional_targets(batches: Sequence[int], times_s: Sequence[float]) -> list[float]:
    """``b_i + delta_b_i`` of the paper's rule: ``b_i * t_mean / t_i``."""
    t_mean = sum(times_s) / len(times_s)
    return [b - (b / t) * (t - t_mean) for b, t in zip(batches, times_s)]


def make_controller(
    name: str, bounds: Bounds, speeds: Sequence[float], deadband: float = 0.05
) -> Controller:
    """Build a controller by its CLI name; ``speeds`` are the declared speeds."""
    if name == "uniform":
        return FixedController("uniform", uniform_split(bounds))
    if name == "static":
        return FixedController("static", proportional_split(speeds, bounds))
    if name == "omnilearn":
        return ProportionalController(bounds, deadband=deadband)
    raise ValueError(f"unknown controller {name!r}; choose one of {', '.join(CONTROLLERS)}")
