"""Resolve a config against its dataset: steps per epoch, total steps, speed schedule.

Run in the launcher before any worker starts (so bad input fails fast, with
one line) and again in every worker (cheap and deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

from omnilearn.config import ConfigError, TrainConfig
from omnilearn.speeds import BSP_LEVELS, SpeedError, SpeedSchedule, load_schedule, paper_schedule

PREFETCH_FACTOR = 2  # DataLoader batches in flight per loader worker
MIN_STEPS_PER_DECISION = 3  # steps at the current batches a decision needs


@dataclass(frozen=True)
class RunPlan:
    steps_per_epoch: int
    total_steps: int
    speeds: SpeedSchedule
    lag: int  # steps between a decision and the first step that uses it, minus one

    @property
    def epochs(self) -> int:
        return -(-self.total_steps // self.steps_per_epoch)


def resolve(cfg: TrainConfig, dataset_len: int) -> RunPlan:
    if dataset_len < cfg.global_batch:
        raise ConfigError(
            f"--global-batch {cfg.global_batch} is larger than the {cfg.dataset} training set "
            f"({dataset_len} samples); lower --global-batch"
        )
    spe = dataset_len // cfg.global_batch
    total = spe * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, spe * cfg.epochs)
    lag = cfg.loader_workers * PREFETCH_FACTOR
    if cfg.controller == "omnilearn" and cfg.control_interval < lag + MIN_STEPS_PER_DECISION:
        raise ConfigError(
            f"--control-interval {cfg.control_interval} is too short for --loader-workers {cfg.loader_workers} "
            f"(batches are prefetched {lag} steps ahead); use at least {lag + MIN_STEPS_PER_DECISION}"
        )
    try:
        return RunPlan(spe, total, _speed_schedule(cfg, total, spe), lag)
    except SpeedError as e:
        raise ConfigError(str(e)) from None


def _speed_schedule(cfg: TrainConfig, total: int, spe: int) -> SpeedSchedule:
    if cfg.speed_schedule is None:
        return SpeedSchedule.constant(cfg.declared_speeds)
    if cfg.speed_schedule == "paper":
        return paper_schedule(total, cfg.workers, BSP_LEVELS)
    return load_schedule(cfg.speed_schedule, cfg.workers, spe, BSP_LEVELS)
