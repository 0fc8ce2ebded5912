"""The batch controller of an ASP run: each worker's cycle times per window into the shared ControlLoop.

The parameter server calls :meth:`PushControl.record` once per applied push.
Every ``interval_pushes`` pushes (``control_interval x n``: one "step" of
data per push slot) it builds one :func:`~omnilearn.balance.loop.window_row`
per worker from that worker's cycle times (pull + compute + push) at its
current batch in this window only, and calls
:meth:`~omnilearn.balance.loop.ControlLoop.update`; the loop keeps its own
capped history and drops a worker's older windows when its speed shifts,
so a slowdown shows at the next decision however long the run had been
steady. Memory: the current window's times (at most ``interval_pushes``)
plus the loop's ring. A push at another batch (computed before a change, or
an epoch's short last batch) is left out.

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py -k controller``
"""

from __future__ import annotations

from omnilearn.balance.controllers import Decision
from omnilearn.balance.loop import ControlLoop, window_row


class PushControl:
    def __init__(self, loop: ControlLoop, interval_pushes: int) -> None:
        if interval_pushes < 1:
            raise ValueError(f"interval_pushes {interval_pushes} must be at least 1")
        self.loop, self.interval_pushes = loop, interval_pushes
        self.window_s: list[list[float]] = [[] for _ in range(loop.workers)]
        self.pushes = 0  # in this window

    @property
    def batches(self) -> tuple[int, ...]:
        return self.loop.batches

    @property
    def held_times(self) -> int:
        """Cycle times held in memory (at most ``interval_pushes``)."""
        return sum(len(w) for w in self.window_s)

    def record(self, worker: int, batch: int, cycle_s: float) -> bool:
        """One applied push; True when the window is full and :meth:`decide` is due."""
        if batch == self.loop.batches[worker]:
            self.window_s[worker].append(cycle_s)
        self.pushes += 1
        return self.pushes >= self.interval_pushes

    def decide(self, version: int) -> Decision:
        """Close the window (the server is at ``version``) and let the loop decide; a change applies at once."""
        rows = [window_row(b, times) for b, times in zip(self.loop.batches, self.window_s)]
        self.window_s = [[] for _ in self.window_s]
        self.pushes = 0
        return self.loop.update(version, rows)

    def state_dict(self) -> dict:
        return {"loop": self.loop.state_dict(), "window_s": [list(w) for w in self.window_s], "pushes": self.pushes}

    def load_state_dict(self, state: dict) -> None:
        self.loop.load_state_dict(state["loop"])
        self.window_s = [[float(t) for t in w] for w in state["window_s"]]
        self.pushes = int(state["pushes"])
