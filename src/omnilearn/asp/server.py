"""The ASP parameter server (rank 0): holds the model, deals data, applies pushed gradients, balances batches.

It takes what it needs as arguments (the model, optimizer and LR schedule,
the training set's length, an ``evaluate(model) -> (loss, accuracy)``
callable, the :class:`~omnilearn.config.BalanceConfig`, the
:class:`~omnilearn.asp.settings.ASPSettings`, the run plan and, for
checkpoints, a :class:`~omnilearn.checkpoint.CheckpointStore`); the
experiment harness (:mod:`omnilearn.experiments.train.asp`) builds them.

Each request is handled alone, in arrival order: a push is one optimizer
step with the rate ``lr * b_i / b_ref`` (:func:`~omnilearn.asp.rules.push_lr`),
then the worker gets the next ``b_i`` indices of the epoch's permutation and
the weights. Every ``control_interval x live`` pushes the workers' cycle
times go to the ControlLoop (:mod:`omnilearn.asp.control`). When an epoch of
data has been dealt the model is evaluated in a helper thread while the
server keeps answering: it holds every request (pushes are kept, applied
when the evaluation ends; workers poll), so no worker waits on the server
for long (its listener sees the polls), and training time excludes the pause.
The helper thread is joined when ``serve()`` returns or raises (after an
error too: one running evaluation is waited for, queued ones are dropped).

Failures (:mod:`omnilearn.asp.membership`): a worker whose connection fails
(a gloo error: it died) or that is silent for ``heartbeat_s`` (``timeout_s``
before its first request), between exchanges or frozen in the middle of
one, is dropped, and only that worker (each has a connection and a
listening thread of its own, :mod:`omnilearn.distributed.ps`): the indices
it held go back to the dealer and are dealt again to the others, its batch
share goes to them, and the run goes on; its connection is closed (one that
wakes up ends with an error line). With no worker left the run fails,
naming each. The run's length is counted in push
*slots* of the full cluster: a push by one of ``m`` live workers of ``n``
uses ``n / m`` slots (its batch is about ``B / m``, not ``B / n``), so the
run ends after the samples it was planned for and the LR schedule (one
step per slot) ends with it; with every worker live a slot is a push.

Checkpoints (:mod:`omnilearn.asp.snapshot`): every ``checkpoint_every``
steps of ``n`` slots, never during an evaluation; ``resume()`` continues
from the newest. A stop signal (:mod:`omnilearn.stopping`) makes the server
save one, tell each worker to stop and raise :class:`~omnilearn.stopping.Stopped`.

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from omnilearn import stopping
from omnilearn.asp.control import PushControl, push_loop
from omnilearn.asp.faults import KillPoint
from omnilearn.asp.flat import Flat
from omnilearn.asp.membership import Membership
from omnilearn.asp.rules import Coverage, IndexDealer, Liveness, Staleness, over_bound, push_lr
from omnilearn.asp.settings import ASPSettings
from omnilearn.asp.snapshot import Snapshots
from omnilearn.balance.loop import ControlLoop
from omnilearn.checkpoint import CheckpointStore
from omnilearn.config import BalanceConfig
from omnilearn.distributed.ps import GO, HELLO, HOLD, PUSH, STOP, Request
from omnilearn.distributed.serverlink import ServerLink
from omnilearn.emulation.speeds import slowdown
from omnilearn.observe.asplog import ASPLog
from omnilearn.observe.modelfile import saver
from omnilearn.runplan import RunPlan
from omnilearn.clocks.train import TrainClock

Evaluate = Callable[[nn.Module], tuple[float, float]]  # (test loss, test accuracy)
Deal = tuple[int, list[int]]  # (data epoch, indices) dealt to a worker


class ParameterServer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_schedule, *, dataset_len: int,
                 cfg: BalanceConfig, settings: ASPSettings, run: RunPlan, evaluate: Evaluate | None = None,
                 run_dir: Path | None = None, checkpoints: CheckpointStore | None = None,
                 fault: KillPoint | None = None) -> None:
        if run.total_steps is None:
            raise ValueError("an ASP run needs its length: a run plan with total_steps")
        self.cfg, self.settings, self.run, self.n = cfg, settings, run, cfg.workers
        self.total_pushes = run.total_steps * self.n  # one step = B samples = n balanced pushes (slots)
        self.b_ref = cfg.global_batch / self.n
        self.model, self.opt, self.sched, self.evaluate = model, optimizer, lr_schedule, evaluate
        self.flat = Flat(model)
        self.control = PushControl(self.new_loop(range(self.n)), cfg.control_interval, self.new_loop)
        self.dealer = IndexDealer(dataset_len, cfg.seed)
        self.coverage = Coverage(dataset_len)
        self.link = ServerLink(self.flat.size, cfg.upper_batch, cfg.timeout_s)
        self.staleness = Staleness(self.n)
        self.members = Membership(self, Liveness(self.n, cfg.timeout_s, cfg.heartbeat_s))
        self.clock = TrainClock()
        self.version, self.slots = 0, Fraction(0)  # pushes applied; push slots of the full cluster used
        self.log = ASPLog(cfg, settings, self.total_pushes, run_dir)
        self.snapshots = Snapshots(self, checkpoints)
        self.fault = fault  # tests only: see omnilearn.asp.faults
        self.evaluated_epoch = 0
        self.evaluation: tuple[int, int, float, Future] | None = None  # epoch, version, train_s, result
        self.outstanding: dict[int, Deal] = {}  # per worker: what it was dealt and has not pushed yet
        self.sent_slowdown: dict[int, float] = {}  # per worker: the emulated slowdown of its last reply
        self.retried: set[int] = set()  # workers recomputing a push refused for its staleness (--max-staleness)
        self.held: list[tuple[int, Request, torch.Tensor, Deal]] = []  # pushes that arrived while evaluating
        self.pool: ThreadPoolExecutor | None = None

    def new_loop(self, live: Sequence[int], batches: Sequence[int] | None = None) -> ControlLoop:
        """A ControlLoop over the ``live`` workers; ``batches``: the plan shares ``B`` in their proportion."""
        return push_loop(self.cfg, self.run.speeds.at(0), self.total_pushes, live, batches)

    @property
    def batches(self) -> tuple[int, ...]:
        return self.control.batches

    @property
    def step(self) -> int:
        """Steps of ``B`` samples done: slots used // n."""
        return math.floor(self.slots) // self.n

    def resume(self) -> None:
        """Continue from the newest checkpoint (from the beginning when there is none yet)."""
        self.snapshots.resume()

    def serve(self) -> dict:
        """Answer the workers until every live one was told to stop; the summary (also in the run directory)."""
        now = time.perf_counter()
        self.clock.start(now)
        self.members.start()
        try:
            while self.members.waiting:
                got = self.members.receive()
                if got is not None:
                    self.answer(*got)
                self.snapshots.after_request()
                if self.fault is not None:
                    self.fault.reached(self.version)
            self.link.close(wait_s=self.cfg.timeout_s)  # the listeners send the last STOPs (each within its allowance)
        finally:
            if self.pool is not None:  # a running evaluation ends first: no thread of ours outlives serve()
                self.pool.shutdown(wait=True, cancel_futures=True)
            self.link.close()  # after an error: a listener still waiting for its worker ends at its allowance
        if self.snapshots.stop_reason:
            raise stopping.Stopped(self.snapshots.stop_reason)
        wall_s = self.clock.wall_s(time.perf_counter())
        train_s = wall_s - self.clock.paused_s
        if self.evaluate is not None:
            self.log.evaluation(self.dealer.epoch, self.version, train_s, *self.evaluate(self.model))
        return self.log.finish(wall_s, train_s, self.staleness, saver(self.model), self.dealer.dealt,
                               self.coverage.summary(),
                               self.step)

    def answer(self, req: Request, payload: torch.Tensor | None) -> None:
        """Handle one request. The reply goes out through the worker's listener: one the worker does not take
        (dead, or frozen) comes back from the next receive, and the worker is dropped then."""
        if self.handle(req, payload):
            self.members.stopped.add(req.rank - 1)

    def handle(self, req: Request, payload: torch.Tensor | None) -> bool:
        """Answer one request; True when the worker was told to stop."""
        worker = req.rank - 1
        if worker not in self.members.live:  # dropped earlier and speaking again: too late
            self.link.reply(req.rank, STOP, self.version, self.dealer.epoch)
            return False
        if req.kind == HELLO and worker in self.outstanding:  # cannot happen within one run: be safe anyway
            self.dealer.take_back(*self.outstanding.pop(worker))
        deal = self.outstanding.pop(worker, None) if req.kind == PUSH else None
        if req.kind == PUSH and (deal is None or len(deal[1]) != req.batch):
            raise RuntimeError(f"worker rank {req.rank} pushed a gradient of {req.batch} samples but holds "
                               f"{'no batch' if deal is None else f'{len(deal[1])} samples'}: a protocol error")
        if self.evaluation is not None and not self.end_evaluation():
            if req.kind == PUSH:
                self.held.append((worker, req, payload.clone(), deal))
            self.link.reply(req.rank, HOLD, self.version)
            return False
        now = time.perf_counter()  # one reading: a push applied because the budget was not spent counts within it
        if self.stopping(now):
            self.link.reply(req.rank, STOP, self.version, self.dealer.epoch)
            return True
        if req.kind == PUSH:
            stale = self.staleness.of(worker, self.version, req.pulled_version)
            if over_bound(stale, self.settings.max_staleness, worker in self.retried):
                self.refuse(worker, req, stale, deal)
                return False
            self.retried.discard(worker)
            self.apply(worker, req, payload, self.clock.train_s(now), deal)
        epoch, indices = self.outstanding[worker] = self.dealer.deal(self.batches[worker])
        if epoch > self.evaluated_epoch:
            self.start_evaluation(epoch - 1)
        self.link.reply(req.rank, GO, self.version, epoch, self.slowdown(worker), indices, self.flat.state())
        return False

    def refuse(self, worker: int, req: Request, stale: int, deal: Deal) -> None:
        """A push over the staleness bound: not applied; the worker gets fresh weights and the same samples."""
        self.retried.add(worker)
        self.staleness.refused[worker] += 1
        self.outstanding[worker] = deal
        self.log.refused(self.version, worker, stale)
        epoch, indices = deal
        self.link.reply(req.rank, GO, self.version, epoch, self.slowdown(worker), indices, self.flat.state())

    def stopping(self, now: float | None = None) -> bool:
        """All push slots used, the training-time budget spent (at ``now``, a ``perf_counter`` reading), or a stop
        asked for."""
        budget_s, now = self.settings.max_time_s, time.perf_counter() if now is None else now
        return (self.slots >= self.total_pushes or self.snapshots.stop_reason is not None
                or (budget_s is not None and self.clock.train_s(now) >= budget_s))

    def slowdown(self, worker: int) -> float:
        speeds = self.run.speeds.at(min(self.step, self.run.total_steps - 1))
        self.log.speeds(self.version, speeds)
        factor = slowdown(speeds, worker) if self.cfg.emulator == "delay" else 1.0
        self.sent_slowdown[worker] = factor  # the worker computes its next push under it
        return factor

    def apply(self, worker: int, req: Request, payload: torch.Tensor, train_s: float, deal: Deal | None = None) -> None:
        """One push: an optimizer step with this push's rate on the server's current weights.

        ``deal``: the ``(epoch, indices)`` it was computed on, counted in the coverage (None: a push fed in by hand).
        """
        if req.batch < 1:
            raise RuntimeError(f"worker rank {req.rank} pushed a gradient of an empty batch")
        if not torch.isfinite(payload).all():
            raise RuntimeError(f"worker rank {req.rank} pushed non-finite gradients (loss {req.loss:g}); "
                               "lower --lr")
        stale = self.staleness.record(worker, self.version, req.pulled_version)
        base = self.opt.param_groups[0]["lr"]
        lr = push_lr(base, req.batch, self.b_ref, stale, self.settings.lr_scaling, self.settings.staleness_lr)
        self.flat.load(payload, grads=True)
        # The push's rate enters through its gradient (lr / base times it), so momentum carries each past
        # push at the rate it was applied with instead of re-scaling the whole buffer by this push's batch.
        for param in self.flat.params:
            param.grad.mul_(lr / base if base > 0 else 0.0)
        self.opt.step()
        before, self.slots = self.slots, self.slots + Fraction(self.n, max(1, len(self.members.live)))
        for _ in range(math.floor(self.slots) - math.floor(before)):
            self.sched.step()
        self.version += 1
        if deal is not None:
            self.coverage.add(*deal)
        self.log.push(self.version, worker, req, stale, lr, train_s, self.dealer.epochs_done,
                      None if deal is None else deal[0])
        if self.control.record(worker, req.batch, req.cycle_s, self.sent_slowdown.get(worker, 1.0)):
            self.log.decision(self.control.decide(self.version))

    def start_evaluation(self, epoch: int) -> None:
        """Evaluate after ``epoch`` in a helper thread; until it ends, requests are held and training time stops."""
        self.evaluated_epoch = epoch + 1
        if self.evaluate is None:
            return
        now = time.perf_counter()
        self.clock.pause(now)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omnilearn-eval")
        self.evaluation = (epoch, self.version, self.clock.train_s(now), self.pool.submit(self.evaluate, self.model))

    def end_evaluation(self) -> bool:
        """If the evaluation is over: log it, resume the clock, apply the held pushes. Whether it is over."""
        epoch, version, train_s, result = self.evaluation
        if not result.done():
            return False
        self.evaluation = None
        self.log.evaluation(epoch, version, train_s, *result.result())
        self.clock.resume(time.perf_counter())
        while self.held:
            worker, req, payload, deal = self.held.pop(0)
            now = time.perf_counter()
            if not self.stopping(now):
                self.apply(worker, req, payload, self.clock.train_s(now), deal)
        return True
