"""A TensorFlow worker's step clock: how long it computed, how long it waited in the all-reduce.

The same split as the PyTorch runtime's :class:`~omnilearn.clocks.step.StepTimer`::

    begin()        the step's batch is handed out
    mark_ready()   its scaled gradients exist (inside the step's graph, from a
                   ``tf.py_function`` that runs after every gradient and before
                   the all-reduce, after any emulated delay)
    end()          the step function returned (all-reduce and update done)

    wait_s    = end - ready        (the all-reduce, waiting for the slowest peer, and the update)
    compute_s = step_s - wait_s    (data slicing, forward, backward, emulated delay)

:meth:`native_compute_s` (what the delay emulator multiplies) is the process
CPU time since ``begin`` for a worker with one intra-op thread (on a host
shared by several workers, wall time also counts waits for a free core),
else wall time. Pure Python: no TensorFlow needed.

Run: ``python -m pytest -q tests/tf/test_cluster.py``
"""

from __future__ import annotations

import time
from typing import NamedTuple

from omnilearn.clocks.host import HostClock


class StepTimes(NamedTuple):
    compute_s: float
    wait_s: float
    step_s: float
    delay_s: float


class StepClock(HostClock):
    def __init__(self, single_thread: bool) -> None:
        super().__init__()
        self.single_thread = single_thread
        self.ready_s = 0.0

    def begin(self) -> None:
        self.start()
        self.ready_s = 0.0

    def native_compute_s(self) -> float:
        return self.host_native_s(self.single_thread)

    def mark_ready(self) -> None:
        self.ready_s = time.perf_counter()

    def end(self) -> StepTimes:
        now = time.perf_counter()
        step_s = now - self.start_s
        wait_s = max(0.0, now - self.ready_s) if self.ready_s else 0.0
        return StepTimes(step_s - wait_s, wait_s, step_s, self.delay_s)
