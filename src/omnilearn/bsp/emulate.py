"""This rank's emulated speed at each step: an OS throttle (cgroup, affinity, docker) and the delay emulator.

The speeds of a run are a pure function of the step (the speed schedule);
:meth:`Emulation.at_step` applies them when a step starts (the throttle
only when they change) and :meth:`Emulation.release` gives the throttle
back. The delay emulator (``delay``) sleeps inside the step's compute
(:mod:`omnilearn.emulation.delay`).

Run: ``python -m pytest -q tests/dist/test_bsp.py -k "delay or paper"``
"""

from __future__ import annotations

import sys

from omnilearn.config import BalanceConfig
from omnilearn.distributed.group import DistContext
from omnilearn.emulation.delay import DelayEmulator
from omnilearn.emulation.speeds import slowdown
from omnilearn.emulation.throttle import ThrottleError, for_run
from omnilearn.clocks.step import StepTimer


class Emulation:
    """Applies the speeds in force at each step to this rank."""

    def __init__(self, cfg: BalanceConfig, ctx: DistContext, timer: StepTimer) -> None:
        self.rank, self.use_delay = ctx.rank, cfg.emulator == "delay"
        self.delay, self.timer = DelayEmulator(timer), timer
        self.throttle = for_run(cfg, ctx.rank, ctx.local_rank, ctx.local_world_size)
        self.applied: tuple[float, ...] | None = None

    def at_step(self, speeds: tuple[float, ...]) -> bool:
        """A step starts under ``speeds`` (before its clock starts); True when they differ from the last step's."""
        if speeds is self.applied:  # the schedule hands out the same tuple while the speeds hold
            return False
        changed = speeds != self.applied
        self.applied = speeds
        if changed and self.throttle is not None:
            self.throttle.apply(speeds)
        self.delay.set_slowdown(slowdown(speeds, self.rank) if self.use_delay else 1.0)
        self.timer.cpu_clock = self.delay.slowdown > 1.0  # only the emulator reads a step's CPU time
        return changed

    def release(self) -> None:
        """Give back the OS throttle (idempotent); a failure is a warning, never hides the run's outcome."""
        throttle, self.throttle = self.throttle, None
        if throttle is None:
            return
        try:
            throttle.close()
        except ThrottleError as e:
            print(f"omnilearn: warning: rank {self.rank}: {e}", file=sys.stderr)
