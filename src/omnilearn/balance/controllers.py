"""Batch-size controllers: time estimates in, a batch proposal out. Pure numpy.

A controller answers one question for the :class:`~omnilearn.balance.loop.ControlLoop`:
given each worker's batch, its time estimate and that estimate's standard
error (:class:`Estimates`), which batches next, and what time does it predict
for each worker there (:class:`Proposal`)? Whether the change is worth making
(deadband on the predicted gain, noise, minimum move, effective step) is the
loop's job, so controllers stay small and a model-based one (fit
``t_i(b) = alpha_i + beta_i * b``) can plug in beside these:

- ``omnilearn``: the paper's proportional rule (Tyagi & Sharma, TPDS 2025)
  ``b_i' = b_i * t_mean / t_i``, then clamp, re-share and round so
  ``sum(b) == B`` exactly; its time model is ``t_i(b) = t_i * b / b_i``.
- ``uniform`` (plain data parallel) and ``static`` (proportional to declared
  speeds): fixed plans, the paper's baselines.

Every rank runs the same controller on the same gathered numbers, so all
ranks reach the same decision without another message. Every controller has
``state_dict()``/``load_state_dict()``.

Legacy path (removed after integration): :class:`Observation` and
``decide(obs)`` take raw ``(batch, time)`` samples and judge the deadband on
the largest single-worker change, as before the ControlLoop existed.

Run: ``python -m pytest -q tests/unit/test_controller.py tests/unit/test_loop.py``
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from omnilearn.balance.allocation import Bounds, proportional_split, split_array, uniform_split

CONTROLLERS = ("omnilearn", "static", "uniform")


@dataclass(frozen=True)
class Decision:
    """The verdict on one control window; ``changed`` False means hold still (then ``new == old``).

    ``effective_step``: the first step that runs the new batches (None when held).
    ``predicted_s``: the predicted step time (slowest worker) before and after the proposal.
    """

    step: int
    old: tuple[int, ...]
    new: tuple[int, ...]
    times_s: tuple[float, ...]
    changed: bool
    reason: str
    effective_step: int | None = None
    predicted_s: tuple[float, float] | None = None


@dataclass(frozen=True)
class Estimates:
    """What a controller sees: per worker its current batch, time estimate and its standard error."""

    batches: np.ndarray  # int64, (n,)
    times_s: np.ndarray  # positive, (n,)
    stderr_s: np.ndarray  # >= 0, (n,)


@dataclass(frozen=True)
class Proposal:
    """A controller's answer: new batches (sum B, in bounds) and the time it predicts for each there."""

    batches: np.ndarray  # int64, (n,)
    times_s: np.ndarray  # predicted per-worker time at ``batches``
    reason: str = ""


class Controller(Protocol):
    name: str

    def initial(self) -> list[int]: ...

    def propose(self, est: Estimates) -> Proposal: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def robust_time(values: Sequence[float]) -> float:
    """Median of the window: robust to one-off pauses in either direction."""
    return float(statistics.median(values))


def proportional_targets(batches: Sequence[int], times_s: Sequence[float]) -> list[float]:
    """``b_i + delta_b_i`` of the paper's rule: ``b_i * t_mean / t_i``."""
    b, t = np.asarray(batches, dtype=float), np.asarray(times_s, dtype=float)
    return (b - (b / t) * (t - t.mean())).tolist()


def _check_name(state: dict, name: str) -> None:
    if state.get("name") != name:
        raise ValueError(f"state of controller {state.get('name')!r} loaded into controller {name!r}")


@dataclass
class FixedController:
    """A plan that never changes: ``uniform`` or ``static`` (declared speeds)."""

    name: str
    batches: list[int]

    def initial(self) -> list[int]:
        return list(self.batches)

    def propose(self, est: Estimates) -> Proposal:
        return Proposal(np.asarray(est.batches, dtype=np.int64), np.asarray(est.times_s, dtype=float),
                        f"{self.name} batches are fixed")

    def state_dict(self) -> dict:
        return {"name": self.name, "batches": [int(b) for b in self.batches]}

    def load_state_dict(self, state: dict) -> None:
        _check_name(state, self.name)
        self.batches = [int(b) for b in state["batches"]]

    def decide(self, obs: Observation) -> Decision:
        """Legacy path: always hold."""
        times = [robust_time([t for _, t in s]) if s else 0.0 for s in obs.samples]
        return Decision(obs.step, obs.batches, obs.batches, tuple(times), False, f"{self.name} batches are fixed")


@dataclass
class ProportionalController:
    """The paper's proportional rule ``b_i' = b_i * t_mean / t_i`` with bounds and exact rounding.

    ``deadband``, ``min_samples`` and ``shift`` only serve the legacy
    ``decide``; the ControlLoop has its own.
    """

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

    def propose(self, est: Estimates) -> Proposal:
        b, t = np.asarray(est.batches, dtype=float), np.asarray(est.times_s, dtype=float)
        new = split_array(b * t.mean() / t, self.bounds)
        return Proposal(new, t * new / b, "proportional rule b_i * t_mean / t_i")

    def state_dict(self) -> dict:
        return {"name": self.name, "start": [int(b) for b in self.start]}

    def load_state_dict(self, state: dict) -> None:
        _check_name(state, self.name)
        self.start = [int(b) for b in state["start"]]

    def decide(self, obs: Observation) -> Decision:
        """Legacy path: deadband on the largest single-worker change (see the module docstring)."""
        current = [[t for b, t in s if b == obs.batches[i]] for i, s in enumerate(obs.samples)]
        if any(len(c) < self.min_samples for c in current):
            return _hold(obs, [], f"fewer than {self.min_samples} steps at the current batches")
        times = [window_time(c, min(obs.recent, len(c)), self.shift) for c in current]
        if any(t <= 0 for t in times):
            return _hold(obs, times, "non-positive compute time")
        new = split_array(proportional_targets(obs.batches, times), self.bounds).tolist()
        rel = max(abs(n - b) / b for n, b in zip(new, obs.batches))
        if rel <= self.deadband:
            return _hold(obs, times, f"largest change {rel:.1%} within deadband {self.deadband:.0%}")
        return Decision(obs.step, obs.batches, tuple(new), tuple(times), True, f"largest change {rel:.1%}")


def make_controller(name: str, bounds: Bounds, speeds: Sequence[float], deadband: float = 0.05) -> Controller:
    """Build a controller by its CLI name; ``speeds`` are the declared speeds."""
    if name == "uniform":
        return FixedController("uniform", uniform_split(bounds))
    if name == "static":
        return FixedController("static", proportional_split(speeds, bounds))
    if name == "omnilearn":
        return ProportionalController(bounds, deadband=deadband)
    raise ValueError(f"unknown controller {name!r}; choose one of {', '.join(CONTROLLERS)}")


# ---------------------------------------------------------------- legacy path (deleted after integration)


@dataclass(frozen=True)
class Observation:
    """Legacy: what each worker measured since the last change of batches.

    ``samples[i]`` holds ``(batch, compute_s)`` pairs of worker ``i``, one per
    step, oldest first; the last ``recent`` of them are the newest interval
    (0: no split), used to notice a speed change (see :func:`window_time`).
    """

    step: int
    batches: tuple[int, ...]
    samples: tuple[tuple[tuple[int, float], ...], ...]
    recent: int = 0


def window_time(samples: Sequence[float], recent: int, shift: float) -> float:
    """Legacy: median over the steps since the last change, or the newest ``recent`` if they moved by > ``shift``."""
    old, new = samples[: len(samples) - recent], samples[len(samples) - recent :]
    if recent and old and new:
        t_old, t_new = robust_time(old), robust_time(new)
        if abs(t_new - t_old) > shift * t_old:
            return t_new
    return robust_time(samples)


def _hold(obs: Observation, times: Sequence[float], reason: str) -> Decision:
    return Decision(obs.step, obs.batches, obs.batches, tuple(times), False, reason)
