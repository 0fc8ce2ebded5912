"""An ASP worker (ranks 1..n): pull weights and indices, compute a gradient, push it; again until told to stop.

It takes what it needs as arguments (the model, the training set, the loss
``criterion(output, target)``, its device, the largest batch and the
timeout); the experiment harness (:mod:`omnilearn.experiments.train.asp`)
builds them. A batch is ``dataset.__getitems__(indices)`` (or one item at a
time) through ``collate_fn`` (default: ``keep_batch`` for datasets that
serve whole batches, else torch's ``default_collate``) and must be
``(inputs, targets)``. When the server holds it (while evaluating) the
worker polls every ``POLL_S``; that wait is left out of its cycle time. A
worker the server dropped (it fell silent for longer than ``heartbeat_s``)
and that speaks again is told ``STOP`` and ends normally; one that loses the
server raises (the link's one-line error). Protocol:
:mod:`omnilearn.distributed.ps`. ``fault``: a test's kill point at one of
its pushes (:mod:`omnilearn.asp.faults`, ``OMNILEARN_FAULT_KILL_AT``).

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import default_collate

from omnilearn.asp.faults import KillPoint
from omnilearn.asp.flat import Flat
from omnilearn.data.loader import keep_batch
from omnilearn.distributed.group import DistContext, pick_device
from omnilearn.distributed.ps import HELLO, POLL, POLL_S, PUSH, Reply, WorkerLink
from omnilearn.emulation.delay import DelayEmulator
from omnilearn.clocks.step import StepTimer


class ASPWorker:
    def __init__(self, model: nn.Module, dataset, criterion: Callable[[Any, Any], torch.Tensor], *,
                 device: torch.device, max_batch: int, timeout_s: float,
                 collate_fn: Callable[[Any], Any] | None = None, fault: KillPoint | None = None) -> None:
        self.device = device
        self.dataset, self.criterion = dataset, criterion
        if collate_fn is None:
            collate_fn = keep_batch if getattr(dataset, "returns_batches", False) else default_collate
        self.collate_fn = collate_fn
        self.model = model.to(device)
        self.flat = Flat(self.model)
        self.link = WorkerLink(self.flat.size, max_batch, timeout_s)
        self.timer = StepTimer(device)
        self.emulator = DelayEmulator(self.timer)
        self.fault = fault  # tests only: see omnilearn.asp.faults
        self.pushes = 0

    def fetch(self, indices: Sequence[int]):
        """The batch of ``indices``, collated, on this worker's device."""
        getitems = getattr(self.dataset, "__getitems__", None)
        items = getitems(list(indices)) if getitems is not None else [self.dataset[i] for i in indices]
        x, y = self.collate_fn(items)
        return x.to(self.device), y.to(self.device)

    def run(self) -> None:
        """Work until the server says stop (or is lost: then the link raises)."""
        reply = self.link.request(HELLO, 0, 0, 0.0, 0.0, 0.0)
        cycle_start = time.perf_counter()  # after the hello: start-up (the server's, the peers') is no cycle
        while not reply.stop:
            if reply.hold:
                reply, held_s = self.wait_out(reply)
                cycle_start += held_s  # the server's pause is not this worker's cycle
                continue
            self.flat.load(self.link.state)
            compute_s, loss = self.compute(reply)
            payload = self.flat.gradients_and_buffers()
            now = time.perf_counter()
            cycle_s, cycle_start = now - cycle_start, now
            reply = self.push(reply, cycle_s, compute_s, loss, payload)

    def push(self, reply: Reply, cycle_s: float, compute_s: float, loss: float, payload: torch.Tensor) -> Reply:
        """Push the gradient of ``reply``'s batch; the server's answer."""
        self.pushes += 1
        if self.fault is not None:
            self.fault.reached(self.pushes, "before")
        self.link.send(PUSH, len(reply.indices), reply.version, cycle_s, compute_s, loss, payload)
        if self.fault is not None:
            self.fault.reached(self.pushes, "after")
        return self.link.answer()

    def compute(self, reply: Reply) -> tuple[float, float]:
        """The gradient of the mean loss over the batch of ``reply``; (compute_s, loss)."""
        self.emulator.set_slowdown(reply.slowdown)
        self.timer.begin()
        x, y = self.fetch(reply.indices)
        loss = self.criterion(self.model(x), y)
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the gradients exist: compute is over
        self.emulator.before_sync()  # sleeps here when emulating a slower machine
        return self.timer.elapsed_s(), loss.item()

    def wait_out(self, reply: Reply) -> tuple[Reply, float]:
        """Poll a holding server until it answers otherwise; (that answer, seconds held)."""
        start = time.perf_counter()
        while reply.hold:
            time.sleep(POLL_S)
            reply = self.link.request(POLL, 0, 0, 0.0, 0.0, 0.0)
        return reply, time.perf_counter() - start


def worker_device(preference: str, ctx: DistContext) -> torch.device:
    """Workers 1..n take GPUs 0..n-1 of their host when every one can have one; the server stays on the CPU."""
    local_workers = max(1, ctx.local_world_size - (1 if ctx.rank < ctx.local_world_size else 0))
    local_index = ctx.local_rank - 1 if ctx.rank < ctx.local_world_size else ctx.local_rank
    return pick_device(preference, max(0, local_index), local_workers)
