"""Resolve balancing settings against a dataset: steps per epoch, total steps, speed schedule.

The Python API resolves when the data loader is made, from the dataset's
length and the loader's prefetch depth; the CLI's ``resolve`` (in
:mod:`omnilearn.experiments.workload`) does the same from ``--epochs`` /
``--max-steps`` before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnilearn.config import BalanceConfig, ConfigError
from omnilearn.emulation.speeds import SpeedError, SpeedSchedule, load_schedule, paper_schedule

MIN_STEPS_PER_DECISION = 3  # steps at the current batches a decision needs


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


def plan_run(cfg: BalanceConfig, dataset_len: int, total_steps: int | None, lag: int, what: str = "dataset") -> RunPlan:
    """``lag``: batches the data loader prefetches (its workers x prefetch factor)."""
    if dataset_len < cfg.global_batch:
        raise ConfigError(
            f"--global-batch {cfg.global_batch} is larger than the {what} ({dataset_len} samples); "
            "lower --global-batch"
        )
    if cfg.controller == "omnilearn" and cfg.control_interval < lag + MIN_STEPS_PER_DECISION:
        raise ConfigError(
            f"--control-interval {cfg.control_interval} is too short for a data loader that prefetches {lag} "
            f"batches; use at least {lag + MIN_STEPS_PER_DECISION}"
        )
    spe = dataset_len // cfg.global_batch
    try:
        return RunPlan(spe, total_steps, _speed_schedule(cfg, total_steps, spe), lag)
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
