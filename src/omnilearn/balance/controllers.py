"""Batch-size controllers: time estimates in, a batch proposal out. Pure numpy.

A controller answers one question for the :class:`~omnilearn.balance.loop.ControlLoop`:
given each worker's batch, its time estimate and that estimate's standard
error (:class:`Estimates`), which batches next, and what time does it predict
for each worker there (:class:`Proposal`)? Whether the change is worth making
(deadband on the predicted gain, noise, minimum move, effective step) is the
loop's job, so controllers stay small:

- ``omnilearn``: the paper's proportional rule (Tyagi & Sharma, TPDS 2025)
  ``b_i' = b_i * t_mean / t_i``, then clamp, re-share and round so
  ``sum(b) == B`` exactly; its time model is ``t_i(b) = t_i * b / b_i``.
- ``uniform`` (plain data parallel) and ``static`` (proportional to declared
  speeds): fixed plans, the paper's baselines.
- ``model``: per worker the slope ``beta_i`` of a robust fit of
  ``t_i(b) = alpha_i + beta_i * b`` to its (batch, time) windows
  (:attr:`Estimates.history`, :func:`~omnilearn.balance.model.fit_affine`),
  the line through its newest estimate at its current batch (recent data
  weighs most),
  then all batches in one decision so the predicted finish times are equal
  within the bounds (:func:`~omnilearn.balance.model.equal_finish`), rounded
  so ``sum(b) == B`` exactly. Until every worker has windows at two distinct
  batches it proposes the proportional rule's plan.

Every rank runs the same controller on the same gathered numbers, so all
ranks reach the same decision without another message. Every controller has
``state_dict()``/``load_state_dict()``. (The rule the loop replaced, a
deadband on the largest single-worker change, survives only as the
``--legacy`` baseline of ``omnilearn.experiments.simulate.churn``.)

Run: ``python -m pytest -q tests/unit/test_controller.py tests/unit/test_loop.py tests/unit/test_model_controller.py``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Sequence

import numpy as np

from omnilearn.balance.allocation import Bounds, proportional_split, round_shares, uniform_split, water_fill
from omnilearn.balance.model import distinct_batches, equal_finish, fit_affine

CONTROLLERS = ("omnilearn", "static", "uniform", "model")


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
    """What a controller sees: per worker its current batch, time estimate and its standard error.

    ``history`` (optional, filled by the ControlLoop): (windows, n, 2), per
    ring window oldest first the batch and median time each worker measured
    there; NaN where a window has no fresh samples or predates a speed shift.
    """

    batches: np.ndarray  # int64, (n,)
    times_s: np.ndarray  # positive, (n,)
    stderr_s: np.ndarray  # >= 0, (n,)
    history: np.ndarray | None = None  # (windows, n, 2): batch, median time; NaN where empty


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


def _check_name(state: dict, name: str) -> None:
    if state.get("name") != name:
        raise ValueError(f"state of controller {state.get('name')!r} loaded into controller {name!r}")


@dataclass
class FixedController:
    """A plan that never changes: ``uniform`` or ``static`` (declared speeds)."""

    name: str
    batches: list[int]
    bounds: Bounds | None = None  # for the loop's caps: a plan above a worker's cap is re-planned within it
    reads_history: ClassVar[bool] = False  # the loop builds Estimates.history only for a controller that reads it

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


@dataclass
class ProportionalController:
    """The paper's proportional rule ``b_i' = b_i * t_mean / t_i`` with bounds and exact rounding.

    Whether a proposal is applied (deadband, noise, minimum samples, speed
    shifts) is the ControlLoop's decision, not this rule's.
    """

    bounds: Bounds
    name: str = "omnilearn"
    start: list[int] = field(default_factory=list)
    reads_history: ClassVar[bool] = False  # the loop builds Estimates.history only for a controller that reads it

    def __post_init__(self) -> None:
        if not self.start:
            self.start = uniform_split(self.bounds)

    def initial(self) -> list[int]:
        return list(self.start)

    multiple: int = 1  # batches in multiples of this (fewer distinct sizes: fewer torch.compile recompiles)

    def propose(self, est: Estimates) -> Proposal:
        b, t = np.asarray(est.batches, dtype=float), np.asarray(est.times_s, dtype=float)
        shares = water_fill(b * t.mean() / t, self.bounds.min_batch, self.bounds.upper, self.bounds.global_batch)
        new = round_multiple(shares, self.bounds, self.multiple)
        return Proposal(new, t * new / b, "proportional rule b_i * t_mean / t_i")

    def state_dict(self) -> dict:
        return {"name": self.name, "start": [int(b) for b in self.start]}

    def load_state_dict(self, state: dict) -> None:
        _check_name(state, self.name)
        self.start = [int(b) for b in state["start"]]


@dataclass
class ModelController(ProportionalController):
    """Fit ``t_i(b) = alpha_i + beta_i * b`` per worker, then equal predicted finish times in one decision.

    Takes the proportional rule's step (its parent's) while any worker has
    windows at fewer than two distinct batches (or no history is given).
    Whether a proposal is applied is the ControlLoop's decision.
    """

    name: str = "model"
    reads_history: ClassVar[bool] = True

    def propose(self, est: Estimates) -> Proposal:
        h = None if est.history is None else np.asarray(est.history, dtype=float)
        if h is None or h.size == 0 or int(distinct_batches(h).min()) < 2:
            p = super().propose(est)
            return Proposal(p.batches, p.times_s, f"{p.reason} (model: a worker has fewer than 2 distinct batches)")
        _, beta = fit_affine(h)
        # The slope from the history, the line through the newest estimate at the current batch: recent
        # measurements weigh most (a drift of the fixed cost shows at once); a line that would start below
        # 0 goes through the origin instead.
        b, t = np.asarray(est.batches, dtype=float), np.asarray(est.times_s, dtype=float)
        alpha = t - beta * b
        beta = np.where(alpha >= 0, beta, t / b)
        alpha = np.maximum(alpha, 0.0)
        lo, hi, total = self.bounds.min_batch, self.bounds.upper, self.bounds.global_batch
        shares, finish = equal_finish(alpha, beta, lo, hi, total)
        new = round_multiple(shares, self.bounds, self.multiple)
        return Proposal(new, alpha + beta * new, f"affine model: equal finish at {finish:.4g} s")


def round_multiple(shares: np.ndarray, bounds: Bounds, multiple: int = 1) -> np.ndarray:
    """Integer batches summing to B within the bounds, each a multiple of ``multiple`` but one.

    The global batch's remainder ``B mod multiple`` goes to the worker whose
    share lost most to the rounding (and has room). Where the bounds allow no
    such split, plain rounding (:func:`~omnilearn.balance.allocation.round_shares`).
    """
    lo, hi, total = bounds.min_batch, bounds.upper, bounds.global_batch
    if multiple > 1:
        k = multiple
        lo_k = -(-np.broadcast_to(np.asarray(lo), shares.shape) // k)
        hi_k = np.broadcast_to(np.asarray(hi), shares.shape) // k
        units = total // k
        if lo_k.sum() <= units <= hi_k.sum():
            new = round_shares(np.clip(shares / k, lo_k, hi_k), lo_k, hi_k, units) * k
            rest = total - int(new.sum())
            room = np.broadcast_to(np.asarray(hi), shares.shape) - new >= rest
            if rest == 0 or room.any():
                new[int(np.argmax(np.where(room, shares - new, -np.inf)))] += rest
                return new
    return round_shares(shares, lo, hi, total)


def make_controller(name: str, bounds: Bounds, speeds: Sequence[float], multiple: int = 1) -> Controller:
    """Build a controller by its CLI name; ``speeds`` are the declared speeds (used by ``static``).

    ``multiple``: the adaptive controllers keep batches in multiples of it (see :func:`round_multiple`).

    The deadband is the ControlLoop's: ``ControlLoop(controller, deadband=...)``.
    """
    if name == "uniform":
        return FixedController("uniform", uniform_split(bounds), bounds)
    if name == "static":
        return FixedController("static", proportional_split(speeds, bounds), bounds)
    if name == "omnilearn":
        return ProportionalController(bounds, multiple=multiple)
    if name == "model":
        return ModelController(bounds, multiple=multiple)
    raise ValueError(f"unknown controller {name!r}; choose one of {', '.join(CONTROLLERS)}")

