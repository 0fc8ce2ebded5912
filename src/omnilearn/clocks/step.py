"""Step timing: how long this worker computed, and how long it waited for its peers.

One :class:`StepTimer` per rank. The session calls ``begin()`` when the loader
hands out a step's batch (or, in a loop that fetched the next batch ahead,
when the previous step is reported) and ``end()`` when the user reports the
step; the
gradient hook's callbacks call ``mark_ready()`` when this worker's last
gradient bucket is ready (its own compute is done) and ``mark_reduced()``
when a bucket's all-reduce has finished (from a communication thread, hence
the lock). Per step::

    wait_s    = last reduction finished - local gradients ready   (DDP)
              + time blocked in collectives                      (FSDP: add_blocked, add_stall)
    compute_s = step_s - wait_s            (forward, backward, optimizer, data)

On CPU the clocks are the host's. On CUDA the marks are CUDA events on the
compute stream and nothing synchronises the device per step: ``collect()``
resolves every pending step at once, at the end of a control interval,
after waiting for the last step's end event only.

:meth:`native_compute_s` is the compute so far on the real hardware, which
the delay emulator multiplies: for a single-threaded CPU worker the process
CPU time (on a host shared by several workers wall time also counts waits
for a free core, which a dedicated slow machine would not have), else wall
time (on CUDA after synchronising the compute stream: only when emulating).

Tests: ``python -m pytest -q tests/unit/test_timing.py`` (CUDA: ``tests/gpu``).
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch

from omnilearn.clocks.host import HostClock


class StepTimes(NamedTuple):
    """One step's times (a tuple: a window's worth are made at once, :meth:`StepTimer.collect`)."""

    compute_s: float
    wait_s: float
    step_s: float
    delay_s: float


class StepTimer(HostClock):
    """Marks of the step in flight; finished steps wait in ``pending`` until :meth:`collect`."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._lock = threading.Lock()
        self.pending: list[tuple] = []
        self.ready_s = self.reduced_s = 0.0
        self._events: dict[str, torch.cuda.Event] = {}
        self._stalls: list[tuple] = []
        self.open = False
        self._free: list[torch.cuda.Event] = []  # events of collected steps, recorded again (no create per mark)
        self._stream: torch.cuda.Stream | None = None  # the compute stream at begin(), for begin() and end()

    def _event(self, stream: "torch.cuda.Stream | None" = None) -> "torch.cuda.Event":
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def begin(self) -> None:
        """The step's batch was handed out: its clock starts."""
        with self._lock:
            self.start()
            self.ready_s = self.reduced_s = 0.0
            if self.cuda:  # the host clocks need no per-step objects
                self._stream = torch.cuda.current_stream(self.device)
                self._events = {"start": self._event(self._stream)}
                self._stalls = []
            self.open = True

    def native_compute_s(self) -> float:
        """This step's compute so far on the real hardware (see the module docstring)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return self.host_native_s(not self.cuda and torch.get_num_threads() == 1)

    def mark_ready(self) -> None:
        """This worker's local gradients are ready (after any emulated delay)."""
        with self._lock:
            self.ready_s = time.perf_counter()
            if self.cuda:
                self._events["ready"] = self._event()

    def mark_reduced(self, last: bool = True) -> None:
        """A bucket's all-reduce finished; buckets may finish out of order, so keep the latest.

        On CUDA only the last bucket's callback records (it runs on the stream that waits for the reduction).
        """
        with self._lock:
            if self.cuda:
                if last:
                    self._events["reduced"] = self._event()
                return
            self.reduced_s = max(self.reduced_s, time.perf_counter())

    def add_stall(self, start: "torch.cuda.Event", end: "torch.cuda.Event") -> None:
        """CUDA: the compute stream stalled between these two events (waiting for a collective: FSDP)."""
        with self._lock:
            self._stalls.append((start, end))

    def end(self) -> None:
        """The step is over (after the optimizer): queue its times for :meth:`collect`."""
        with self._lock:
            if not self.open:
                raise RuntimeError("StepTimer.end() without begin()")
            self.open = False
            if self.cuda:
                self._events["end"] = self._event(self._stream)
                self.pending.append(("cuda", {**self._events, "stalls": self._stalls}, self.delay_s))
            else:
                step_s = time.perf_counter() - self.start_s
                wait_s = max(0.0, self.reduced_s - self.ready_s) if self.ready_s else 0.0
                wait_s = min(step_s, wait_s + self.blocked_s)
                self.pending.append(("cpu", (step_s - wait_s, wait_s, step_s, self.delay_s)))  # StepTimes at collect

    def collect(self) -> list[StepTimes]:
        """Every finished step's times since the last call, oldest first (one device wait on CUDA).

        In BSP only :meth:`omnilearn.bsp.steps.StepLedger.rows` calls it: it pairs these with its reported
        steps by position and raises if the two counts differ.
        """
        with self._lock:
            pending, self.pending = self.pending, []
        if pending and pending[-1][0] == "cuda":
            pending[-1][1]["end"].synchronize()
        times = [StepTimes._make(p[1]) if p[0] == "cpu" else _cuda_times(p[1], p[2]) for p in pending]
        done = [e for p in pending if p[0] == "cuda" for k, e in p[1].items() if k != "stalls"]
        with self._lock:  # resolved: each can be recorded again
            self._free.extend(done)
        return times


def _cuda_times(events: dict, delay_s: float) -> StepTimes:
    step_s = events["start"].elapsed_time(events["end"]) / 1e3
    wait_s = 0.0
    if "ready" in events and "reduced" in events:
        wait_s = max(0.0, events["ready"].elapsed_time(events["reduced"]) / 1e3)
    wait_s = min(step_s, wait_s + sum(max(0.0, a.elapsed_time(b) / 1e3) for a, b in events.get("stalls", ())))
    return StepTimes(step_s - wait_s, wait_s, step_s, delay_s)
