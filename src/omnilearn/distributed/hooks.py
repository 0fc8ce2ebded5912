"""DDP communication hook: weighted gradient sum, compute timing, delay emulation.

DDP averages gradients over ``n`` workers; with unequal batches the exact
global-batch gradient is ``g = sum_i (b_i / B) * g_i`` (``g_i`` is worker i's
mean gradient). The hook scales each bucket by ``b_i / B`` and all-reduces
with SUM, keeping DDP's bucketed, overlapped all-reduce.

The hook also marks when this worker's last gradient bucket is ready: the end
of its own compute, before any waiting for peers. A worker emulating a machine
``slowdown`` times slower sleeps there, inside its compute and before its last
bucket is reduced, so its peers really wait for it: it sleeps until
``slowdown`` times its native compute has passed since the step began. A
single-threaded CPU worker's native compute is the CPU time its process
spent in the step, not the wall time: on a host shared by several workers,
wall time also counts waits for a free core, which a dedicated slow machine
would not have and the slowdown must not multiply. Otherwise (several
intra-op threads, or CUDA after synchronising) it is the wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class StepClock:
    """Per-step state shared between the trainer and the hook (one per rank)."""

    weight: float = 1.0  # b_i / B for this step
    slowdown: float = 1.0  # emulate a worker this many times slower (>= 1)
    device: torch.device = torch.device("cpu")
    start_s: float = 0.0
    start_cpu_s: float = 0.0
    ready_s: float = 0.0  # when local gradients were ready (after any delay); 0: no hook ran
    synced_s: float = 0.0  # when the last bucket's all-reduce had finished
    delay_s: float = 0.0

    def begin(self, weight: float, slowdown: float) -> None:
        self.weight, self.slowdown = weight, slowdown
        self.start_s, self.start_cpu_s = time.perf_counter(), time.process_time()
        self.ready_s = self.synced_s = self.delay_s = 0.0

    def native_s(self, now: float) -> float:
        """This step's compute so far on the real hardware."""
        if self.device.type == "cpu" and torch.get_num_threads() == 1:
            return time.process_time() - self.start_cpu_s
        return now - self.start_s

    def local_grads_ready(self) -> None:
        if self.device.type == "cuda":
            # The compute stream only: NCCL's stream holds earlier buckets' all-reduces, which wait for peers.
            torch.cuda.current_stream(self.device).synchronize()
        now = time.perf_counter()
        if self.slowdown > 1.0:
            self.delay_s = max(0.0, self.slowdown * self.native_s(now) - (now - self.start_s))
            time.sleep(self.delay_s)
            now = time.perf_counter()
        self.ready_s = now

    def all_reduced(self, last: bool) -> None:
        """A bucket's all-reduce finished (buckets may finish out of order: keep the latest)."""
        if self.device.type == "cuda":
            if not last:
                return
            torch.cuda.current_stream(self.device).synchronize()  # the reduction's stream, inside its callback
        self.synced_s = max(self.synced_s, time.perf_counter())

    def wait_s(self) -> float:
        """This step's time spent waiting for peers in the gradient sync (0 without a hook)."""
        return max(0.0, self.synced_s - self.ready_s) if self.ready_s else 0.0


def weighted_allreduce_hook(clock, bucket):  # DDP rejects string annotations here
    """Register with ``ddp.register_comm_hook(clock, weighted_allreduce_hook)``; returns a Future."""
    buffer = bucket.buffer()
    buffer.mul_(clock.weight)
    last = bucket.is_last()
    if last:
        clock.local_grads_ready()
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True)

    def done(fut):
        clock.all_reduced(last)
        return fut.value()[0]

    return work.get_future().then(done)
