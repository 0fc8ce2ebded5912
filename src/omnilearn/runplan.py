"""Resolve balancing settings against a dataset: steps per epoch, total steps, speed schedule, lag.

The Python API resolves when the data loader is made, from the dataset's
length and the loader's prefetch depth; the CLI's ``resolve`` (in
:mod:`omnilearn.experiments.train.workload`) does the same from ``--epochs`` /
``--max-steps`` before any worker starts. :func:`initial_speeds` answers
the one question asked before any dataset is known: the speeds at step 0
(the ``static`` controller's first plan).

``lag``: a ``DataLoader`` with worker processes asks its batch sampler for
``prefetch_batches`` index lists ahead; with ``accumulation_steps = k`` each
step is ``k`` lists, so the sampler runs ``ceil(prefetch_batches / k)``
steps ahead, and a batch change must be registered that far ahead.

A speed schedule with changes at or after the run's last step is kept (the
run simply ends first), but :func:`plan_run` warns (a
:class:`SpeedScheduleWarning`, one per plan): those changes never happen.
The CLI words the same warning with its own flags (``warn=False`` here).

Run: ``python -m pytest -q tests/unit/test_session_state.py``
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from omnilearn.config import BalanceConfig, ConfigError
from omnilearn.emulation.speeds import SpeedError, SpeedSchedule, load_schedule, paper_schedule

MIN_STEPS_PER_DECISION = 3  # steps at the current batches a decision needs


class SpeedScheduleWarning(UserWarning):
    """A speed schedule has changes the run never reaches (it ends first)."""


@dataclass(frozen=True)
class RunPlan:
    steps_per_epoch: int
    total_steps: int | None  # None: as many as the training loop asks for
    speeds: SpeedSchedule
    lag: int  # steps between a decision and the first step that uses it, minus one

    @property
    def epochs(self) -> int:
        if self.total_steps is None:
            raise ValueError("an open-ended run has no epoch count")
        return -(-self.total_steps // self.steps_per_epoch)

    @property
    def late_changes(self) -> tuple[int, ...]:
        """Steps of speed changes at or after the run's end: they never happen (none in an open-ended run)."""
        return () if self.total_steps is None else self.speeds.changes_from(self.total_steps)


def plan_run(cfg: BalanceConfig, dataset_len: int, total_steps: int | None, prefetch_batches: int,
             what: str = "dataset", warn: bool = True) -> RunPlan:
    """``prefetch_batches``: index lists the data loader prefetches (its workers x prefetch factor).

    ``warn``: a :class:`SpeedScheduleWarning` (``warnings.warn``) for schedule changes past the run's end.
    """
    lag = math.ceil(prefetch_batches / cfg.accumulation_steps)
    if dataset_len < cfg.global_batch:
        raise ConfigError(
            f"--global-batch {cfg.global_batch} is larger than the {what} ({dataset_len} samples); "
            "lower --global-batch"
        )
    if cfg.controller in ("omnilearn", "model") and cfg.control_interval < lag + MIN_STEPS_PER_DECISION:
        raise ConfigError(
            f"--control-interval {cfg.control_interval} is too short for a data loader that prefetches {lag} "
            f"steps; use at least {lag + MIN_STEPS_PER_DECISION}"
        )
    spe = dataset_len // cfg.global_batch
    try:
        plan = RunPlan(spe, total_steps, _speed_schedule(cfg, total_steps, spe), lag)
    except SpeedError as e:
        raise ConfigError(str(e)) from None
    if warn and plan.late_changes:
        warnings.warn(late_changes_text(cfg, plan, f"total_steps={total_steps}", "total_steps"), SpeedScheduleWarning,
                      stacklevel=3)
    return plan


def late_changes_text(cfg: BalanceConfig, plan: RunPlan, end: str, knob: str) -> str:
    """What :attr:`RunPlan.late_changes` means, for a warning: ``end`` says what sets the run's length and
    ``knob`` what lengthens it, in the caller's words (``total_steps=200``, ``--max-steps 200``)."""
    late, spe = plan.late_changes, plan.steps_per_epoch
    epoch = f" (epoch {late[0] // spe})" if late[0] % spe == 0 else ""
    more = f" (and {len(late) - 1} after it)" if len(late) > 1 else ""
    return (f"speed schedule {cfg.speed_schedule!r}: its change at step {late[0]}{epoch}{more} comes after the "
            f"run's end at step {plan.total_steps} ({end}), so it never happens; raise {knob} or move the change "
            f"earlier")


def initial_speeds(cfg: BalanceConfig, total_steps: int | None) -> tuple[float, ...]:
    """The emulated speeds at step 0, before the dataset (and so the epoch length) is known."""
    try:  # step 0 is epoch 0 whatever the epoch length: any length gives the same answer
        return _speed_schedule(cfg, total_steps, 1 << 40).at(0)
    except SpeedError as e:
        raise ConfigError(str(e)) from None


def _speed_schedule(cfg: BalanceConfig, total: int | None, spe: int) -> SpeedSchedule:
    if cfg.speed_schedule is None:
        return SpeedSchedule.constant(cfg.declared_speeds)
    if cfg.speed_schedule == "paper":
        if total is None:
            raise ConfigError("speed_schedule 'paper' needs the run length: pass total_steps to omnilearn.setup()")
        return paper_schedule(total, cfg.workers, cfg.levels)
    return load_schedule(cfg.speed_schedule, cfg.workers, spe, cfg.levels)
