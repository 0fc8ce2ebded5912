"""BSP trainer: one process per worker, DDP with weighted gradients, batches re-tuned at runtime.

Per step each rank reads its slice of the global batch (sampler), runs
forward and backward (the comm hook weights, times and, when emulating a
slower machine, delays it), then steps the optimizer. Every control interval
one all-gather brings all workers' step rows to every rank; each runs the
same controller on them and registers the same plan change for the same
future step, and rank 0 writes the rows and prints progress.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from omnilearn import data, models
from omnilearn.allocation import Bounds
from omnilearn.config import TrainConfig, dump_toml
from omnilearn.controller import Observation, make_controller
from omnilearn.dist.collect import gather_rows, same_everywhere, sum_across
from omnilearn.dist.group import DistContext
from omnilearn.dist.hooks import StepClock, weighted_allreduce_hook
from omnilearn.runplan import PREFETCH_FACTOR, resolve
from omnilearn.sampler import BatchSchedule, GlobalPlan, VariableBatchSampler
from omnilearn.speeds import slowdown
from omnilearn.telemetry import Telemetry

HISTORY_INTERVALS = 10  # the controller sees at most this many intervals since the last change
FIELDS = ("step", "batch", "compute_s", "wait_s", "step_s", "loss", "delay_s", "lr")


class BSPTrainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, run_dir: Path | None) -> None:
        self.cfg, self.ctx = cfg, ctx
        self._check_same_config()  # before any other collective (DDP's broadcast included)
        splits = data.load(cfg.dataset)
        self.test = splits.test
        self.run = resolve(cfg, len(splits.train))
        self.plan = GlobalPlan(len(splits.train), cfg.global_batch, cfg.seed)
        bounds = Bounds(cfg.global_batch, cfg.workers, cfg.min_batch, cfg.max_batch)
        self.controller = make_controller(cfg.controller, bounds, self.run.speeds.at(0), cfg.deadband)
        self.schedule = BatchSchedule(tuple(self.controller.initial()))
        self.sampler = VariableBatchSampler(self.plan, self.schedule, ctx.rank, self.run.total_steps)
        self.loader = DataLoader(
            splits.train, batch_sampler=self.sampler, collate_fn=data.keep_batch,
            num_workers=cfg.loader_workers, persistent_workers=cfg.loader_workers > 0,
            prefetch_factor=PREFETCH_FACTOR if cfg.loader_workers > 0 else None,
            pin_memory=ctx.device.type == "cuda",
        )
        torch.manual_seed(cfg.seed)
        model = models.build(cfg.model, splits.input_shape, splits.num_classes).to(ctx.device)
        self.ddp = DDP(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
        self.clock = StepClock(device=ctx.device)
        self.ddp.register_comm_hook(self.clock, weighted_allreduce_hook)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        self.lr_sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=self.run.total_steps)
        self.window: list[list[float]] = []  # this rank's rows of the current interval
        self.history: list[list[tuple[int, float]]] = [[] for _ in range(ctx.world_size)]  # since last change
        self.telemetry = Telemetry(cfg, self.run, run_dir) if ctx.is_main else None
        self.throttle = _throttle(cfg, ctx)
        self._applied_speeds: tuple[float, ...] | None = None

    def _check_same_config(self) -> None:
        bad = same_everywhere(self.ctx, zlib.crc32(dump_toml(self.cfg).encode()))
        if bad:
            raise RuntimeError(f"ranks {bad} were started with a different config than rank 0; launch all ranks alike")

    def fit(self) -> dict | None:
        try:
            return self._fit()
        finally:
            self._release_throttle()

    def _release_throttle(self) -> None:
        if self.throttle is None:
            return
        from omnilearn.throttle import ThrottleError

        try:
            self.throttle.close()
        except ThrottleError as e:  # never hide the run's own outcome behind a clean-up problem
            print(f"omnilearn: warning: rank {self.ctx.rank}: {e}", file=sys.stderr)

    def _fit(self) -> dict | None:
        step, start, eval_s = 0, time.perf_counter(), 0.0
        for epoch in range(self.run.epochs):
            self.sampler.set_epoch(epoch)
            batches = iter(self.loader)
            for _ in range(len(self.sampler)):
                self.window.append(self._step(step, batches))
                step += 1
                if step % self.cfg.control_interval == 0 or step == self.run.total_steps:
                    self._end_interval(step - 1)
            before = time.perf_counter()
            self._evaluate(epoch, step, before - start - eval_s)
            eval_s += time.perf_counter() - before
        wall_s = time.perf_counter() - start
        if self.telemetry is None:
            return None
        return self.telemetry.finish(wall_s, wall_s - eval_s, self.ddp.module)

    def _step(self, step: int, batches) -> list[float]:
        plan = self.schedule.at(step)
        speeds = self.run.speeds.at(step)
        slow = slowdown(speeds, self.ctx.rank) if self.cfg.emulator == "delay" else 1.0
        if speeds != self._applied_speeds:
            self._applied_speeds = speeds
            if self.throttle is not None:
                self.throttle.apply(speeds)
            if self.telemetry is not None:
                self.telemetry.speeds(step, speeds)
        self.clock.begin(plan[self.ctx.rank] / self.cfg.global_batch, slow)
        x, y = next(batches)
        x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
        loss = F.cross_entropy(self.ddp(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.ctx.synchronize()
        synced = time.perf_counter()
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.lr_sched.step()
        loss_value = loss.item()
        end = time.perf_counter()
        compute_s = (self.clock.ready_s - self.clock.start_s) + (end - synced)
        wait_s = synced - self.clock.ready_s
        return [step, plan[self.ctx.rank], compute_s, wait_s, end - self.clock.start_s, loss_value,
                self.clock.delay_s, lr]

    def _end_interval(self, step: int) -> None:
        table = gather_rows(self.ctx, self.window, len(FIELDS))
        self.window.clear()
        keep = HISTORY_INTERVALS * self.cfg.control_interval
        for past, rows in zip(self.history, table):
            past.extend((int(r[1]), r[2]) for r in rows)
            del past[:-keep]
        obs = Observation(step, self.schedule.at(step), tuple(map(tuple, self.history)), recent=len(table[0]))
        decision = self.controller.decide(obs)
        effective = step + 1 + self.run.lag
        if decision.changed and effective < self.run.total_steps:
            self.schedule.change(effective, decision.new)
            self.history = [[] for _ in self.history]
        if self.telemetry is not None:
            self.telemetry.interval(table, decision, effective)

    @torch.no_grad()
    def _evaluate(self, epoch: int, step: int, wall_s: float) -> None:
        model = self.ddp.module.eval()
        idx = torch.arange(self.ctx.rank, len(self.test), self.ctx.world_size)
        loss_sum, correct = 0.0, 0.0
        for chunk in idx.split(2048):
            x, y = self.test.__getitems__(chunk.tolist())
            logits = model(x.to(self.ctx.device))
            y = y.to(self.ctx.device)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
        model.train()
        loss_sum, correct, count = sum_across(self.ctx, [loss_sum, correct, float(len(idx))])
        if self.telemetry is not None:
            self.telemetry.evaluation(epoch, step, wall_s, loss_sum / count, correct / count)


def run_id() -> str:
    """Shared by every rank of a launch: names the run's cgroups."""
    if "OMNILEARN_RUN_ID" in os.environ:
        return os.environ["OMNILEARN_RUN_ID"]
    return f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.environ.get('MASTER_PORT', '0')}"


def _throttle(cfg: TrainConfig, ctx: DistContext):
    """The OS-level speed emulator for ``--emulator cgroup|affinity|docker``, else None."""
    if cfg.emulator not in ("cgroup", "affinity", "docker"):
        return None
    from omnilearn.throttle import make_throttle

    containers = tuple(cfg.containers.split(",")) if cfg.containers else ()
    return make_throttle(cfg.emulator, ctx.rank, ctx.local_rank, ctx.local_world_size, run_id(), containers,
                         cfg.throttle_cpus)
