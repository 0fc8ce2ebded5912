"""A step's host clocks, for both runtimes' step timers: wall and process CPU time since the step began. Pure.

:class:`HostClock` is what the delay emulator reads
(:class:`~omnilearn.emulation.delay.Clock`): ``elapsed_s``, ``add_delay``
and the native compute so far (:meth:`HostClock.host_native_s`: process CPU
time for a worker computing on one thread, else wall time). The PyTorch
:class:`~omnilearn.clocks.step.StepTimer` adds CUDA events and the gradient
hook's marks; the TensorFlow :class:`~omnilearn.tf.timing.StepClock` the
mark inside its step's graph.

Run: ``python -m pytest -q tests/unit/test_timing.py tests/tf/test_tf_cluster.py``
"""

from __future__ import annotations

import time


class HostClock:
    def __init__(self) -> None:
        self.start_s = self.start_cpu_s = self.delay_s = self.blocked_s = self.blocked_cpu_s = 0.0
        # Whether a step reads the process CPU clock (only the delay emulator needs it, on a rank it slows down:
        # that clock sums every thread's time, the backend's running ones too, and costs more than the wall's).
        self.cpu_clock = True

    def start(self) -> None:
        """A step begins: both clocks start (the CPU clock where :attr:`cpu_clock`), no delay yet."""
        self.start_s = time.perf_counter()
        self.start_cpu_s = time.process_time() if self.cpu_clock else 0.0
        self.delay_s = self.blocked_s = self.blocked_cpu_s = 0.0

    def host_native_s(self, cpu_time: bool) -> float:
        """This step's compute so far: process CPU time (``cpu_time``: one compute thread), else wall time."""
        if cpu_time:
            return time.process_time() - self.start_cpu_s - self.blocked_cpu_s
        return time.perf_counter() - self.start_s - self.blocked_s

    def elapsed_s(self) -> float:
        """Wall time since the step began, less the time blocked in collectives (:meth:`add_blocked`)."""
        return time.perf_counter() - self.start_s - self.blocked_s

    def add_blocked(self, blocked_s: float, cpu_s: float = 0.0) -> None:
        """This step waited ``blocked_s`` (wall) in a collective inside its compute (FSDP's all-gathers and
        reduce-scatters), the process using ``cpu_s`` of CPU meanwhile (the backend's threads moving the
        bytes): not compute, so neither the native compute nor the emulator counts either."""
        self.blocked_s += blocked_s
        self.blocked_cpu_s += cpu_s

    def add_delay(self, delay_s: float) -> None:
        """An emulator slept ``delay_s`` inside this step's compute."""
        self.delay_s += delay_s
