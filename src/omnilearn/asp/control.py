"""The batch controller of an ASP run: each live worker's cycle times per window into the shared ControlLoop.

The parameter server calls :meth:`PushControl.record` once per applied push.
Every ``control_interval x live`` pushes (one "step" of data per push slot)
it builds one :func:`~omnilearn.balance.loop.window_row` per live worker
from that worker's cycle times (pull + compute + push) at its current batch
in this window only, and calls
:meth:`~omnilearn.balance.loop.ControlLoop.update`; the loop keeps its own
capped history and drops a worker's older windows when its speed shifts,
so a slowdown shows at the next decision however long the run had been
steady. Memory: the current window's times (at most ``interval_pushes``)
plus the loop's ring. A push at another batch (computed before a change, or
an epoch's short last batch) is left out.

Dropped workers. The loop plans for the *live* workers only. When the
server drops one (:meth:`PushControl.drop`), its share of the global batch
goes to the others in proportion to their current batches (so what the
controller learned about their relative speeds is kept; the sum stays ``B``,
or ``live x max_batch`` when that is smaller), through a new loop over the
live workers built by ``new_loop(live, batches)`` (the server's: it knows
the bounds and the controller). Its windows start afresh: every batch just
changed. A dropped worker's batch reads 0 and its late pushes are not
recorded.

Scripted timings (tests only): with ``OMNILEARN_TEST_S_PER_SAMPLE`` set
(:data:`omnilearn.decisions.SCRIPTED_ENV`, one ``fixed_s:s_per_sample`` per
worker) each recorded push counts ``(fixed_s + s_per_sample x batch) x
slowdown`` instead of its measured cycle time, where ``slowdown`` is the
emulated slowdown the server sent with the batch (1 without emulation): the
scripted times are those at full speed, and a speed schedule's change
reaches them as the delay emulator's sleep reaches a measured cycle. So the
decisions do not depend on how busy the host is, as with the BSP and
TensorFlow runtimes' scripted compute times.

Run its tests: ``python -m pytest -q tests/unit/test_aspmath.py -k control tests/dist/test_asp_server.py``
"""

from __future__ import annotations

from typing import Callable, Sequence

from omnilearn.balance.allocation import Bounds, proportional_split
from omnilearn.balance.controllers import Decision, make_controller
from omnilearn.balance.loop import ControlLoop, window_row
from omnilearn.config import BalanceConfig
from omnilearn.decisions import scripted_times

NewLoop = Callable[[Sequence[int], Sequence[int]], ControlLoop]  # (live workers, their batches to keep) -> loop


def push_loop(cfg: BalanceConfig, declared: Sequence[float], total_pushes: int, live: Sequence[int],
              batches: Sequence[int] | None = None) -> ControlLoop:
    """A ControlLoop over the ``live`` workers (``declared``: every worker's declared speed); ``batches``: the plan
    shares ``B`` in their proportion. The servers' ``new_loop`` (PyTorch's and TensorFlow's)."""
    live = list(live)
    total = min(cfg.global_batch, len(live) * cfg.upper_batch)  # live x max_batch may no longer hold B
    bounds = Bounds(total, len(live), cfg.min_batch, cfg.max_batch)
    loop = ControlLoop(make_controller(cfg.controller, bounds, [declared[w] for w in live]), deadband=cfg.deadband,
                       total_steps=total_pushes)
    if batches is not None:
        plan = proportional_split([max(1, b) for b in batches], bounds)
        loop.load_state_dict({"batches": plan, "slot": 0, "windows": [[] for _ in live]})
    return loop


class PushControl:
    def __init__(self, loop: ControlLoop, control_interval: int, new_loop: NewLoop | None = None) -> None:
        if control_interval < 1:
            raise ValueError(f"control_interval {control_interval} must be at least 1")
        self.loop, self.control_interval, self.new_loop = loop, control_interval, new_loop
        self.workers = loop.workers
        self.live: list[int] = list(range(loop.workers))
        self.window_s: list[list[float]] = [[] for _ in self.live]  # per live worker, in ``live`` order
        self.pushes = 0  # in this window
        self.scripted = scripted_times(self.workers)  # tests: (fixed_s, s_per_sample) per worker, or None

    @property
    def batches(self) -> tuple[int, ...]:
        """Every worker's batch (0 for a dropped one)."""
        plan = dict(zip(self.live, self.loop.batches))
        return tuple(plan.get(w, 0) for w in range(self.workers))

    @property
    def interval_pushes(self) -> int:
        return self.control_interval * len(self.live)

    @property
    def held_times(self) -> int:
        """Cycle times held in memory (at most ``interval_pushes``)."""
        return sum(len(w) for w in self.window_s)

    def record(self, worker: int, batch: int, cycle_s: float, slowdown: float = 1.0) -> bool:
        """One applied push, computed under the emulated ``slowdown``; True when the window is full and
        :meth:`decide` is due."""
        if worker not in self.live:
            return False
        at = self.live.index(worker)
        if self.scripted is not None:
            fixed_s, s_per_sample = self.scripted[worker]
            cycle_s = (fixed_s + s_per_sample * batch) * slowdown
        if batch == self.loop.batches[at]:
            self.window_s[at].append(cycle_s)
        self.pushes += 1
        return self.pushes >= self.interval_pushes

    def decide(self, version: int) -> Decision:
        """Close the window (the server is at ``version``) and let the loop decide; a change applies at once."""
        rows = [window_row(b, times) for b, times in zip(self.loop.batches, self.window_s)]
        self.window_s = [[] for _ in self.window_s]
        self.pushes = 0
        return self.loop.update(version, rows)

    def drop(self, worker: int) -> tuple[int, ...]:
        """Plan without ``worker``: its share goes to the live others; the new batches (0 for dropped workers)."""
        if worker not in self.live or len(self.live) == 1:
            self.live = [w for w in self.live if w != worker]
            return self.batches if self.live else (0,) * self.workers
        if self.new_loop is None:
            raise RuntimeError("this PushControl was built without new_loop: it cannot drop a worker")
        kept = [w for w in self.live if w != worker]
        old = self.batches
        self._rebuild(kept, [old[w] for w in kept])
        return self.batches

    def _rebuild(self, live: Sequence[int], batches: Sequence[int]) -> None:
        self.loop, self.live = self.new_loop(list(live), list(batches)), list(live)
        self.window_s, self.pushes = [[] for _ in self.live], 0

    def state_dict(self) -> dict:
        return {"live": list(self.live), "loop": self.loop.state_dict(), "window_s": [list(w) for w in self.window_s],
                "pushes": self.pushes}

    def load_state_dict(self, state: dict) -> None:
        live = [int(w) for w in state.get("live", range(self.workers))]
        if live != self.live:
            if self.new_loop is None:
                raise ValueError(f"control state of live workers {live} loaded into one for {self.live}")
            self._rebuild(live, state["loop"]["batches"])
        self.loop.load_state_dict(state["loop"])
        self.window_s = [[float(t) for t in w] for w in state["window_s"]]
        self.pushes = int(state["pushes"])
