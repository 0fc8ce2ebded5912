"""The ASP parameter server (rank 0): holds the model, deals data, applies pushed gradients, balances batches.

It takes what it needs as arguments (the model, optimizer and LR schedule,
the training set's length, an ``evaluate(model) -> (loss, accuracy)``
callable, the :class:`~omnilearn.config.BalanceConfig`, the
:class:`~omnilearn.asp.settings.ASPSettings` and the run plan); the
experiment harness (:mod:`omnilearn.experiments.asp_train`) builds them.

Each request is handled alone, in arrival order: a push is one optimizer
step with the rate ``lr * b_i / b_ref`` (:func:`~omnilearn.asp.rules.push_lr`),
then the worker gets the next ``b_i`` indices of the epoch's permutation and
the weights. Every ``control_interval x n`` pushes the workers' cycle times go
to the ControlLoop (:mod:`omnilearn.asp.control`). When an epoch of data has
been dealt the model is evaluated in a helper thread while the server keeps
answering: it holds every request (pushes are kept, applied when the
evaluation ends; workers poll), so no worker waits on the server for long,
the liveness clocks see the polls, and training time excludes the pause.
A worker silent for longer than ``timeout_s`` stops the run with its rank named.

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py``
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from omnilearn.asp.control import PushControl
from omnilearn.asp.flat import Flat
from omnilearn.asp.rules import IndexDealer, Liveness, Staleness, push_lr
from omnilearn.asp.settings import ASPSettings
from omnilearn.balance.allocation import Bounds
from omnilearn.balance.controllers import make_controller
from omnilearn.balance.loop import ControlLoop
from omnilearn.config import BalanceConfig
from omnilearn.distributed.ps import GO, HOLD, PUSH, STOP, PeerTimeout, Request, ServerLink
from omnilearn.emulation.speeds import slowdown
from omnilearn.observe.asplog import ASPLog
from omnilearn.runplan import RunPlan
from omnilearn.trainclock import TrainClock

Evaluate = Callable[[nn.Module], tuple[float, float]]  # (test loss, test accuracy)


class WorkerSilent(RuntimeError):
    """A worker stopped talking to the server for longer than the timeout."""


class ParameterServer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, lr_schedule, *, dataset_len: int,
                 cfg: BalanceConfig, settings: ASPSettings, run: RunPlan, evaluate: Evaluate | None = None,
                 run_dir: Path | None = None) -> None:
        if run.total_steps is None:
            raise ValueError("an ASP run needs its length: a run plan with total_steps")
        self.cfg, self.settings, self.run, self.n = cfg, settings, run, cfg.workers
        self.total_pushes = run.total_steps * self.n  # one step = B samples = n balanced pushes
        self.b_ref = cfg.global_batch / self.n
        self.model, self.opt, self.sched, self.evaluate = model, optimizer, lr_schedule, evaluate
        self.flat = Flat(model)
        bounds = Bounds(cfg.global_batch, self.n, cfg.min_batch, cfg.max_batch)
        controller = make_controller(cfg.controller, bounds, run.speeds.at(0))
        loop = ControlLoop(controller, deadband=cfg.deadband, total_steps=self.total_pushes)
        self.control = PushControl(loop, cfg.control_interval * self.n)
        self.dealer = IndexDealer(dataset_len, cfg.seed)
        self.link = ServerLink(self.flat.size, cfg.upper_batch, cfg.timeout_s)
        self.staleness = Staleness(self.n)
        self.liveness = Liveness(self.n, cfg.timeout_s)
        self.clock = TrainClock()
        self.version = 0
        self.log = ASPLog(cfg, settings, self.total_pushes, run_dir)
        self.evaluated_epoch = 0
        self.evaluation: tuple[int, int, float, Future] | None = None  # epoch, version, train_s, result
        self.held: list[tuple[int, Request, torch.Tensor]] = []  # pushes that arrived while evaluating
        self.pool: ThreadPoolExecutor | None = None

    @property
    def batches(self) -> tuple[int, ...]:
        return self.control.batches

    def serve(self) -> dict:
        """Answer the workers until every one was told to stop; the summary (also in the run directory)."""
        now = time.perf_counter()
        self.clock.start(now)
        self.liveness.start(now)
        stopped: set[int] = set()
        try:
            while len(stopped) < self.n:
                req, payload = self.receive(stopped)
                if self.handle(req, payload):
                    stopped.add(req.rank - 1)
        finally:
            if self.pool is not None:  # on an error, raise it now rather than after a running evaluation
                self.pool.shutdown(wait=False, cancel_futures=True)
        wall_s = self.clock.wall_s(time.perf_counter())
        train_s = wall_s - self.clock.paused_s
        if self.evaluate is not None:
            self.log.evaluation(self.dealer.epoch, self.version, train_s, *self.evaluate(self.model))
        dealt = self.dealer.epoch * self.dealer.dataset_len + self.dealer.cursor
        return self.log.finish(wall_s, train_s, self.staleness, self.model, dealt)

    def handle(self, req: Request, payload: torch.Tensor | None) -> bool:
        """Answer one request; True when the worker was told to stop."""
        worker = req.rank - 1
        if self.evaluation is not None and not self.end_evaluation():
            if req.kind == PUSH:
                self.held.append((worker, req, payload.clone()))
            self.link.reply(req.rank, HOLD, self.version)
            return False
        if self.stopping():
            self.link.reply(req.rank, STOP, self.version, self.dealer.epoch)
            return True
        if req.kind == PUSH:
            self.apply(worker, req, payload, self.clock.train_s(time.perf_counter()))
        epoch, indices = self.dealer.deal(self.batches[worker])
        if epoch > self.evaluated_epoch:
            self.start_evaluation(epoch - 1)
        self.link.reply(req.rank, GO, self.version, epoch, self.slowdown(worker), indices, self.flat.state())
        return False

    def stopping(self) -> bool:
        """All pushes applied, or the training-time budget spent."""
        budget_s = self.settings.max_time_s
        return self.version >= self.total_pushes or (
            budget_s is not None and self.clock.train_s(time.perf_counter()) >= budget_s)

    def receive(self, stopped: set[int]) -> tuple[Request, torch.Tensor | None]:
        """The next request; a worker silent for longer than ``timeout_s`` stops the run, named."""
        try:
            req, payload = self.link.receive()
        except PeerTimeout:
            req = payload = None
        now = time.perf_counter()
        if req is not None:
            self.liveness.heard(req.rank - 1, now)
        silent = self.liveness.quietest(now, stopped) if req is None else self.liveness.silent(now, stopped)
        if silent is not None:
            worker, quiet_s = silent
            raise WorkerSilent(f"worker rank {worker + 1} sent nothing for {quiet_s:.0f} s: it died or hangs "
                               f"(--timeout-s {self.cfg.timeout_s:g}); stopping the run")
        return req, payload

    def slowdown(self, worker: int) -> float:
        speeds = self.run.speeds.at(min(self.version // self.n, self.run.total_steps - 1))
        self.log.speeds(self.version, speeds)
        return slowdown(speeds, worker) if self.cfg.emulator == "delay" else 1.0

    def apply(self, worker: int, req: Request, payload: torch.Tensor, train_s: float) -> None:
        """One push: an optimizer step with this push's rate on the server's current weights."""
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
        self.sched.step()
        self.version += 1
        self.log.push(self.version, worker, req, stale, lr, train_s, self.dealer.epochs_done)
        if self.control.record(worker, req.batch, req.cycle_s):
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
        held, self.held = self.held, []
        for worker, req, payload in held:
            if not self.stopping():
                self.apply(worker, req, payload, self.clock.train_s(time.perf_counter()))
        return True
