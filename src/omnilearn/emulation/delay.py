"""The portable delay emulator: a worker at relative speed ``s <= 1`` takes ``compute / s``.

It sleeps the difference inside the worker's timed compute, before its
gradients are synced (the session calls :meth:`DelayEmulator.before_sync`
from the gradient hook's ready callback, and after every backward of a
micro-batch that does not sync), so the straggling is real for its peers:
they wait in the all-reduce exactly as they would for a slower machine.
The native compute it multiplies is :meth:`StepTimer.native_compute_s`.

Tests: ``python -m pytest -q tests/unit/test_timing.py``.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """What the emulator needs of a step timer (:class:`omnilearn.clocks.step.StepTimer`, the TensorFlow runtime's)."""

    def native_compute_s(self) -> float: ...
    def elapsed_s(self) -> float: ...
    def add_delay(self, delay_s: float) -> None: ...


class DelayEmulator:
    """Sleeps so that this step's compute becomes ``slowdown`` times its native compute."""

    def __init__(self, timer: Clock, slowdown: float = 1.0) -> None:
        self.timer = timer
        self.slowdown = slowdown

    def set_slowdown(self, slowdown: float) -> None:
        if not slowdown >= 1.0:
            raise ValueError(f"slowdown {slowdown} must be at least 1 (1: native speed)")
        self.slowdown = slowdown

    def before_sync(self) -> float:
        """Sleep until ``slowdown x native compute`` has passed since the step began; returns the sleep."""
        if self.slowdown <= 1.0:
            return 0.0
        target_s = self.slowdown * self.timer.native_compute_s()
        delay_s = max(0.0, target_s - self.timer.elapsed_s())
        if delay_s > 0:
            time.sleep(delay_s)
        self.timer.add_delay(delay_s)
        return delay_s
