"""One rank's step ledger: steps handed out, the one being timed, and what was measured.

The loader reports every step it hands out (:meth:`StepLedger.handed_out`).
The step's clock starts then if no step is open; otherwise (a loop that
fetches the next batch before calling ``ol.step()``, i.e. prefetches) it
waits in a queue and its clock starts when the open step is reported, so
each step's time is its own. A new iteration after an abandoned one
(``restart``: a ``break`` or a peek) forgets the steps handed out and never
reported; the loader hands them out again. More than
:data:`FETCH_AHEAD_LIMIT` steps handed out and not reported means
``ol.step()`` is not being called: an error, not a silent skew.

:meth:`report` ends the open step; :meth:`rows` resolves the timer's pending
steps (one device wait on CUDA, none per step) into rows of
:data:`~omnilearn.observe.recorder.ROW_FIELDS` (defined once, by the
recorder that reads them). The ledger's reported steps and the timer's timed
steps are two queues matched by position: if their lengths ever differ,
:meth:`rows` raises naming both counts instead of silently pairing a step
with another's times. Only the current control interval's rows are kept.

Run: ``python -m pytest -q tests/unit/test_timing.py`` (the pairing) and
``python -m pytest -q tests/dist/test_api.py -k prefetch``
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from omnilearn.observe.recorder import ROW_FIELDS  # noqa: F401  (the one definition; re-exported for the steppers)
from omnilearn.clocks.step import StepTimer

FETCH_AHEAD_LIMIT = 4  # steps a loop may hold handed out besides the open one


class StepLedger:
    """See the module docstring; ``on_start(step)`` runs just before a step's clock starts."""

    def __init__(self, timer: StepTimer, on_start: Callable[[int], None]) -> None:
        self.timer, self.on_start = timer, on_start
        self.queue: deque[int] = deque()  # handed out, not reported; queue[0] is the open step, if any
        self.open: int | None = None
        self.last_started = self.last_reported = -1
        self.pending: list[list] = []  # reported, times unresolved: [step, batch, loss, lr]
        self.resolved: list[list[float]] = []  # this interval's finished rows

    def handed_out(self, step: int, restart: bool) -> None:
        """The loader hands out ``step`` (``restart``: the first of a new iteration after an abandoned one)."""
        if restart:
            self.queue.clear()
            self.open = None
        if len(self.queue) > FETCH_AHEAD_LIMIT:
            raise RuntimeError(f"steps {list(self.queue)} were handed out but never reported: call ol.step() once per "
                               f"batch, after optimizer.step() (a loop may fetch at most {FETCH_AHEAD_LIMIT} ahead)")
        self.queue.append(step)
        self.start_next()

    def start_next(self) -> None:
        """Start the clock of the oldest queued step, if none is open."""
        if self.open is None and self.queue:
            self.open = self.last_started = self.queue[0]
            self.on_start(self.open)
            self.timer.begin()

    def report(self, batch: int, loss, lr: float) -> int:
        """End the open step (``loss`` may be a tensor: read at the interval's end); returns its number."""
        step = self.open
        if step is None:
            raise RuntimeError("step() without a batch: iterate the loader from data_loader() and call step() once "
                               "per batch")
        self.timer.end()
        self.pending.append([step, batch, loss, lr])
        self.queue.popleft()
        self.open, self.last_reported = None, step
        return step

    def window_size(self) -> int:
        return len(self.resolved) + len(self.pending)

    def rows(self) -> list[list[float]]:
        """This interval's rows so far (resolving the pending ones); raises if the timer's steps drifted."""
        times = self.timer.collect()
        if len(times) != len(self.pending):
            raise RuntimeError(f"step ledger drift: {len(self.pending)} step(s) reported but {len(times)} timed; "
                               "only StepLedger.report may end a StepTimer step, and only rows() collect it")
        self.resolved += [[float(step), float(batch), compute_s, wait_s, step_s, loss, delay_s, float(lr)]
                          for (step, batch, _, lr), (compute_s, wait_s, step_s, delay_s), loss
                          in zip(self.pending, times, _losses(self.pending))]
        self.pending.clear()
        return self.resolved

    def take_rows(self) -> list[list[float]]:
        """This interval's rows, and a fresh interval."""
        rows, self.resolved = self.rows(), []
        return rows

    def take_first(self, count: int) -> list[list[float]]:
        """The first ``count`` rows (resolved already, by :meth:`rows`), and an interval of the rest."""
        if count > len(self.resolved):
            raise RuntimeError(f"step ledger: {count} rows asked for, {len(self.resolved)} resolved")
        rows, self.resolved = self.resolved[:count], self.resolved[count:]
        return rows


def _losses(pending: list[list]) -> list[float]:
    """The pending rows' losses as floats; those on a device read in one go (one copy and wait, not one each)."""
    losses = [row[2] for row in pending]
    on_device = [i for i, v in enumerate(losses) if torch.is_tensor(v) and v.device.type != "cpu"]
    if len(on_device) > 1:
        for i, v in zip(on_device, torch.stack([losses[i].reshape(()).double() for i in on_device]).tolist()):
            losses[i] = v
    return [float(v) for v in losses]
