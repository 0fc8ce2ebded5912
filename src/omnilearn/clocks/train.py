"""Training time: wall time since the first step minus the time spent paused (evaluation, checkpoints). Pure.

One clock for both runtimes: the BSP session (``with clock.paused():``
around an evaluation; ``restore`` after loading a state) and the ASP server
(``pause``/``resume`` around an evaluation that runs in a helper thread).
Every reading takes an optional ``now_s`` (default: ``time.perf_counter()``)
so tests can drive it with explicit times.

Run: ``python -m pytest -q tests/unit/test_aspmath.py -k clock``
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


def _now(now_s: float | None) -> float:
    return time.perf_counter() if now_s is None else now_s


class TrainClock:
    """Wall time since :meth:`start` (plus a restored offset), and the part of it not paused."""

    def __init__(self) -> None:
        self.start_s: float | None = None
        self.pause_began_s: float | None = None
        self.paused_s = self.offset_s = self.at_last_step_s = 0.0

    def start(self, now_s: float | None = None) -> None:
        """Start counting (the first call only)."""
        if self.start_s is None:
            self.start_s = _now(now_s)

    def pause(self, now_s: float | None = None) -> None:
        if self.pause_began_s is None:
            self.pause_began_s = _now(now_s)

    def resume(self, now_s: float | None = None) -> None:
        if self.pause_began_s is not None:
            self.paused_s += _now(now_s) - self.pause_began_s
            self.pause_began_s = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def wall_s(self, now_s: float | None = None) -> float:
        return self.offset_s + (0.0 if self.start_s is None else _now(now_s) - self.start_s)

    def train_s(self, now_s: float | None = None) -> float:
        """Wall time minus pauses; while paused, frozen at the pause's start."""
        now_s = _now(now_s) if self.pause_began_s is None else self.pause_began_s
        return self.wall_s(now_s) - self.paused_s

    def step_ended(self) -> None:
        """Freeze the training time at a step's end (what a state taken between steps holds)."""
        if self.pause_began_s is None and self.start_s is not None:  # :meth:`train_s` inline: every step
            self.at_last_step_s = self.offset_s + (time.perf_counter() - self.start_s) - self.paused_s
        else:
            self.at_last_step_s = self.train_s()

    def restore(self, train_s: float) -> None:
        """Continue from a saved training time (counting starts again at the next :meth:`start`)."""
        self.start_s, self.pause_began_s = None, None
        self.paused_s, self.offset_s, self.at_last_step_s = 0.0, train_s, train_s
