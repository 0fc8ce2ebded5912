"""Asynchronous training (``omnilearn train --mode asp``): a parameter server and n workers.

Rank 0 is the server: it holds the model and optimizer (on the CPU), deals
data, applies every pushed gradient as it arrives with a rate scaled for the
batch it came from, tracks staleness, evaluates, and runs the controller on
the workers' cycle times (pull + compute + push), so all of them push at the
same rate. Ranks 1..n are workers: pull weights and a batch of indices,
compute the gradient (slowed when emulating a slower machine), push it with
the version it was computed on. Protocol: :mod:`omnilearn.distributed.ps`.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from omnilearn.experiments import workload
from omnilearn.balance.allocation import Bounds
from omnilearn.asp.rules import IndexDealer, Staleness, push_lr
from omnilearn.observe.asplog import ASPLog
from omnilearn.experiments.config import TrainConfig
from omnilearn.balance.controllers import Observation, make_controller
from omnilearn.distributed.group import DistContext, pick_device
from omnilearn.emulation.delay import DelayEmulator
from omnilearn.distributed.ps import HELLO, PUSH, PeerTimeout, Request, ServerLink, WorkerLink
from omnilearn.experiments.workload import resolve
from omnilearn.emulation.speeds import slowdown
from omnilearn.timing import StepTimer

MIN_PUSHES_PER_WORKER = 3  # at the current batches, before a decision


class WorkerSilent(RuntimeError):
    """A worker stopped talking to the server for longer than the timeout."""


def train_asp(cfg: TrainConfig, ctx: DistContext, run_dir: Path | None) -> dict | None:
    if ctx.rank == 0:
        return ParameterServer(cfg, ctx, run_dir).serve()
    ASPWorker(cfg, ctx).run()
    return None


class Flat:
    """A model's parameters and floating buffers as one float32 vector (the wire format)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.n_params = sum(p.numel() for p in self.params)
        self.size = self.n_params + sum(b.numel() for b in self.buffers)

    def state(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in self.params + self.buffers])

    def gradients_and_buffers(self) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in grads + self.buffers])

    @torch.no_grad()
    def load(self, flat: torch.Tensor, grads: bool = False) -> None:
        """Copy ``flat`` into the parameters (or, ``grads``, into their ``.grad``) and the buffers."""
        offset = 0
        for t in self.params + self.buffers:
            part = flat[offset : offset + t.numel()].view_as(t).to(t.device, t.dtype)
            offset += t.numel()
            if grads and offset <= self.n_params:
                t.grad = part.clone()
            else:
                t.copy_(part)


class ParameterServer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, run_dir: Path | None) -> None:
        self.cfg, self.n = cfg, cfg.workers
        splits = workload.load_data(cfg)
        self.test = splits.test
        self.run = resolve(cfg, len(splits.train))
        self.total_pushes = self.run.total_steps * self.n  # one step = B samples = n balanced pushes
        self.b_ref = cfg.global_batch / self.n
        self.model = workload.build_model(cfg, splits)
        self.flat = Flat(self.model)
        self.opt = workload.make_optimizer(cfg, self.model.parameters())
        self.sched = workload.make_schedule(cfg, self.opt, self.total_pushes, self.run.steps_per_epoch * self.n)
        bounds = Bounds(cfg.global_batch, self.n, cfg.min_batch, cfg.max_batch)
        self.controller = make_controller(cfg.controller, bounds, self.run.speeds.at(0), cfg.deadband)
        self.batches = tuple(self.controller.initial())
        self.dealer = IndexDealer(len(splits.train), cfg.seed)
        self.link = ServerLink(self.flat.size, cfg.upper_batch, cfg.timeout_s)
        self.staleness = Staleness(self.n)
        self.version = 0
        self.history: list[list[tuple[int, float]]] = [[] for _ in range(self.n)]
        self.since_decision = 0
        self.log = ASPLog(cfg, self.run, self.total_pushes, run_dir)
        self.eval_s, self.evaluated_epoch = 0.0, 0

    def serve(self) -> dict:
        start, stopped = time.perf_counter(), set()
        self.log.start(start)
        self.last_seen = [start] * self.n
        while len(stopped) < self.n:
            req, payload = self._receive(stopped)
            worker = req.rank - 1
            self.last_seen[worker] = time.perf_counter()
            train_s = time.perf_counter() - start - self.eval_s
            stopping = self.version >= self.total_pushes or (self.cfg.max_time_s or float("inf")) <= train_s
            if req.kind == PUSH and not stopping:
                self._apply(worker, req, payload, train_s)
            elif req.kind not in (HELLO, PUSH):
                raise RuntimeError(f"worker rank {req.rank} sent an unknown request kind {req.kind}")
            if stopping:
                self.link.reply(req.rank, True, self.version, self.dealer.epoch, 1.0, [], None)
                stopped.add(worker)
                continue
            epoch, indices = self.dealer.deal(self.batches[worker])
            if epoch > self.evaluated_epoch:
                self._evaluate(epoch - 1, time.perf_counter() - start - self.eval_s)
            self.link.reply(req.rank, False, self.version, epoch, self._slowdown(worker), indices, self.flat.state())
        wall_s = time.perf_counter() - start
        self._evaluate(self.dealer.epoch, wall_s - self.eval_s)
        dealt = self.dealer.epoch * self.dealer.dataset_len + self.dealer.cursor
        return self.log.finish(wall_s, wall_s - self.eval_s, self.staleness, self.model, dealt)

    def _receive(self, stopped: set[int]) -> tuple[Request, torch.Tensor | None]:
        """The next request; a worker silent for longer than ``--timeout-s`` stops the run, named."""
        try:
            req, payload = self.link.receive()
        except PeerTimeout:
            req = payload = None
        now = time.perf_counter()
        silent = sorted((self.last_seen[w], w) for w in range(self.n) if w not in stopped)
        if silent and (req is None or now - silent[0][0] > self.cfg.timeout_s):
            seen, w = silent[0]
            raise WorkerSilent(f"worker rank {w + 1} sent nothing for {now - seen:.0f} s: it died or hangs "
                               f"(--timeout-s {self.cfg.timeout_s:g}); stopping the run")
        return req, payload

    def _slowdown(self, worker: int) -> float:
        speeds = self.run.speeds.at(min(self.version // self.n, self.run.total_steps - 1))
        self.log.speeds(self.version, speeds)
        return slowdown(speeds, worker) if self.cfg.emulator == "delay" else 1.0

    def _apply(self, worker: int, req: Request, payload: torch.Tensor, train_s: float) -> None:
        """One push: an optimizer step with this push's rate on the server's current weights."""
        if req.batch < 1:
            raise RuntimeError(f"worker rank {req.rank} pushed a gradient of an empty batch")
        if not torch.isfinite(payload).all():
            raise RuntimeError(f"worker rank {req.rank} pushed non-finite gradients (loss {req.loss:g}); "
                               "lower --lr")
        stale = self.staleness.record(worker, self.version, req.pulled_version)
        base = self.opt.param_groups[0]["lr"]
        lr = push_lr(base, req.batch, self.b_ref, stale, self.cfg.lr_scaling, self.cfg.staleness_lr)
        self.flat.load(payload, grads=True)
        # The push's rate enters through its gradient (lr / base times it), so momentum carries each past
        # push at the rate it was applied with instead of re-scaling the whole buffer by this push's batch.
        for param in self.flat.params:
            param.grad.mul_(lr / base if base > 0 else 0.0)
        self.opt.step()
        self.sched.step()
        self.version += 1
        self.history[worker].append((req.batch, req.cycle_s))
        self.since_decision += 1
        self.log.push(self.version, worker, req, stale, lr, train_s, self.dealer.epochs_done)
        if self.since_decision >= self.cfg.control_interval * self.n:
            self._decide()

    def _decide(self) -> None:
        counts = [sum(1 for b, _ in h if b == self.batches[i]) for i, h in enumerate(self.history)]
        if min(counts) < MIN_PUSHES_PER_WORKER:
            return  # a slow worker has not pushed enough at its batch yet: wait for it
        obs = Observation(self.version, self.batches, tuple(map(tuple, self.history)))
        decision = self.controller.decide(obs)
        self.since_decision = 0
        if decision.changed:
            self.batches = decision.new
            self.history = [[] for _ in range(self.n)]
        self.log.decision(decision)

    def _evaluate(self, epoch: int, train_s: float) -> None:
        before = time.perf_counter()
        loss, accuracy = workload.evaluate(self.model, self.test, SERVER_ALONE)
        self.eval_s += time.perf_counter() - before
        self.evaluated_epoch = epoch + 1
        self.log.evaluation(epoch, self.version, train_s, loss, accuracy)


SERVER_ALONE = DistContext(0, 1, 0, 1, torch.device("cpu"), "none")  # evaluation needs no peers


class ASPWorker:
    def __init__(self, cfg: TrainConfig, ctx: DistContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.device = worker_device(cfg, ctx)
        splits = workload.load_data(cfg)
        self.train = splits.train
        self.model = workload.build_model(cfg, splits).to(self.device)
        self.flat = Flat(self.model)
        self.link = WorkerLink(self.flat.size, cfg.upper_batch, cfg.timeout_s)
        self.timer = StepTimer(self.device)
        self.emulator = DelayEmulator(self.timer)

    def run(self) -> None:
        cycle_start = time.perf_counter()
        reply = self.link.request(HELLO, 0, 0, 0.0, 0.0, 0.0)
        while not reply.stop:
            self.flat.load(self.link.state)
            self.emulator.set_slowdown(reply.slowdown)
            self.timer.begin()
            x, y = self.train.__getitems__(reply.indices)
            x, y = x.to(self.device), y.to(self.device)
            loss = workload.criterion(self.model(x), y)
            self.model.zero_grad(set_to_none=True)
            loss.backward()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the gradients exist: compute is over
            self.emulator.before_sync()  # sleeps here when emulating a slower machine
            compute_s = self.timer.elapsed_s()
            payload = self.flat.gradients_and_buffers()
            now = time.perf_counter()
            cycle_s, cycle_start = now - cycle_start, now
            reply = self.link.request(PUSH, len(reply.indices), reply.version, cycle_s, compute_s, loss.item(),
                                      payload)


def worker_device(cfg: TrainConfig, ctx: DistContext) -> torch.device:
    """Workers 1..n take GPUs 0..n-1 of their host when every one can have one; the server stays on the CPU."""
    local_workers = max(1, ctx.local_world_size - (1 if ctx.rank < ctx.local_world_size else 0))
    local_index = ctx.local_rank - 1 if ctx.rank < ctx.local_world_size else ctx.local_rank
    return pick_device(cfg.device, max(0, local_index), local_workers)
