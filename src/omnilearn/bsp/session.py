"""OmniLearn in your own training loop: the public Python API.

    import omnilearn

    ol = omnilearn.setup(global_batch=256)       # torchrun's process group, an existing one, or one process
    model = ol.wrap_model(MyModel())              # DDP; gradients weighted by each worker's batch share
    loader = ol.data_loader(my_dataset)           # this worker's slice of every global batch
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for epoch in range(10):
        for x, y in loader:                       # one pass over the data per epoch, over all workers
            x, y = x.to(ol.device), y.to(ol.device)
            loss = loss_fn(model(x), y)           # the mean over this worker's batch
            opt.zero_grad()
            loss.backward()
            opt.step()
            ol.step(loss)                         # timings in; every control interval, new batch sizes out
    ol.finish()                                   # summary on rank 0; run directory when out= was given

Run it with ``torchrun --nproc-per-node N script.py`` or as one process.
Each iteration of the loader starts the step's clock; ``step()`` ends it.
Every ``control_interval`` steps one all-gather brings every worker's
timings to every rank, each runs the same controller and registers the same
batch change for the same future step. ``omnilearn train`` uses this class.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from omnilearn.balance.allocation import Bounds
from omnilearn.config import BalanceConfig, ConfigError, dump_toml
from omnilearn.balance.controllers import Observation, make_controller
from omnilearn.distributed import group
from omnilearn.distributed.collect import average_buffers, gather_rows, same_everywhere
from omnilearn.distributed.hooks import HookState, weighted_allreduce_hook
from omnilearn.emulation.delay import DelayEmulator
from omnilearn.observe.rundir import prepare
from omnilearn.runplan import RunPlan, plan_run
from omnilearn.timing import StepTimer
from omnilearn.data.loader import BalancedLoader, keep_batch
from omnilearn.data.plan import BatchSchedule, GlobalPlan, VariableBatchSampler
from omnilearn.emulation.speeds import slowdown
from omnilearn.observe.recorder import Telemetry
from omnilearn.emulation.throttle import for_run

# Buffers are averaged by the session, not copied from rank 0 every forward (the flag's name changed in torch 2.13).
_NO_BUFFER_BROADCAST = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                        else {"broadcast_buffers": False})
HISTORY_INTERVALS = 10  # the controller sees at most this many intervals since the last change
FIELDS = ("step", "batch", "compute_s", "wait_s", "step_s", "loss", "delay_s", "lr")


def setup(config: BalanceConfig | None = None, *, total_steps: int | None = None, **settings: Any) -> "Session":
    """Join the process group (existing, torchrun's, or none) and start balancing.

    ``settings`` are :class:`~omnilearn.config.BalanceConfig` fields
    (``global_batch``, ``controller``, ``speeds``, ``min_batch``, ``out`` ...).
    ``total_steps`` bounds the run (needed for ``speed_schedule="paper"``).
    """
    cfg = dataclasses.replace(config, **settings) if config is not None else BalanceConfig(**settings)
    ctx = group.join(cfg.device, cfg.timeout_s)
    if cfg.workers is not None and cfg.workers != ctx.world_size:
        raise ConfigError(f"workers={cfg.workers} but the process group has {ctx.world_size}; drop workers")
    cfg = dataclasses.replace(cfg, workers=ctx.world_size)
    run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg)) if cfg.out is not None and ctx.is_main else None
    return Session(cfg, ctx, run_dir, total_steps)


class Session:
    """One rank's view of a balanced run: wraps the model, serves the batches, runs the controller."""

    def __init__(self, cfg: BalanceConfig, ctx: group.DistContext, run_dir: Path | None = None,
                 total_steps: int | None = None) -> None:
        if cfg.workers != ctx.world_size:
            raise ConfigError(f"config has {cfg.workers} workers but the process group has {ctx.world_size}")
        if total_steps is not None and total_steps < 1:
            raise ConfigError(f"total_steps={total_steps} must be at least 1")
        self.cfg, self.ctx, self.run_dir, self.total_steps = cfg, ctx, run_dir, total_steps
        bad = same_everywhere(ctx, zlib.crc32(dump_toml(cfg).encode()))  # before any other collective
        if bad:
            raise RuntimeError(f"ranks {bad} were started with a different config than rank 0; launch all ranks alike")
        self.timer = StepTimer(ctx.device)
        self.emulator = DelayEmulator(self.timer)
        self.hook = HookState(on_ready=self._local_grads_ready, on_reduced=self.timer.mark_reduced)
        self._pending: list[list] = []  # this rank's steps whose times the timer has not resolved yet
        self.model: nn.Module | None = None
        self.loader: BalancedLoader | None = None
        self.run: RunPlan | None = None
        self.telemetry: Telemetry | None = None
        self.throttle = for_run(cfg, ctx.rank, ctx.local_rank, ctx.local_world_size)
        self.window: list[list[float]] = []  # this rank's rows of the current interval
        self.history: list[list[tuple[int, float]]] = [[] for _ in range(ctx.world_size)]  # since last change
        self._next_step, self._open_step = 0, None
        self._start_s: float | None = None
        self._paused_s = 0.0
        self._applied_speeds: tuple[float, ...] | None = None

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def module(self) -> nn.Module | None:
        """The user's model without the DDP wrapper (for evaluation and saving)."""
        return self.model.module if isinstance(self.model, DDP) else self.model

    @property
    def batches(self) -> tuple[int, ...]:
        """Every worker's batch for the next step, as planned so far."""
        return self._schedule().peek(self._next_step)

    def wrap_model(self, model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
        """Move ``model`` to this rank's device and wrap it in DDP with the weighted gradient hook.

        BatchNorm running statistics are not broadcast by DDP here: they are
        averaged across workers, weighted by batch share, every control
        interval and in :meth:`finish` (call :meth:`sync_buffers` before
        evaluating mid-interval). One process alone gets its model back unwrapped.
        """
        if self.model is not None:
            raise RuntimeError("wrap_model() was already called: one model per session")
        model = model.to(self.device)
        if self.ctx.grouped:
            ids = [self.device] if self.device.type == "cuda" else None
            model = DDP(model, device_ids=ids, **{**_NO_BUFFER_BROADCAST, **ddp_kwargs})
            self.hook.process_group = model.process_group
            model.register_comm_hook(self.hook, weighted_allreduce_hook)
        self.model = model
        return model

    def data_loader(self, dataset, *, num_workers: int = 0, collate_fn=None, pin_memory: bool | None = None,
                    prefetch_factor: int | None = None) -> "BalancedLoader":
        """A loader over any map-style ``dataset``: each step, this rank's share of the global batch."""
        if self.loader is not None:
            raise RuntimeError("data_loader() was already called: one training loader per session")
        prefetch = (prefetch_factor or 2) if num_workers > 0 else 0
        self.run = plan_run(self.cfg, len(dataset), self.total_steps, num_workers * prefetch)
        bounds = Bounds(self.cfg.global_batch, self.world_size, self.cfg.min_batch, self.cfg.max_batch)
        self.controller = make_controller(self.cfg.controller, bounds, self.run.speeds.at(0), self.cfg.deadband)
        self.schedule = BatchSchedule(tuple(self.controller.initial()))
        plan = GlobalPlan(len(dataset), self.cfg.global_batch, self.cfg.seed)
        sampler = VariableBatchSampler(plan, self.schedule, self.rank, self.run.total_steps)
        if collate_fn is None and getattr(dataset, "returns_batches", False):
            collate_fn = keep_batch
        loader = DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
            persistent_workers=num_workers > 0, prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
        )
        if self.is_main:
            self.telemetry = Telemetry(self.cfg, self.run, self.run_dir)
        self.loader = BalancedLoader(loader, sampler, self._begin)
        return self.loader

    def _schedule(self) -> BatchSchedule:
        if self.loader is None:
            raise RuntimeError("call data_loader() first: batch sizes are planned per dataset")
        return self.schedule

    def _begin(self, step: int) -> None:
        """The loader is about to fetch ``step``'s batch: start its clock (and emulate its speed)."""
        if self._open_step is not None:
            raise RuntimeError(f"step {self._open_step} was never reported: call step() once per batch, "
                               "after optimizer.step()")
        if step < self._next_step:
            raise RuntimeError(f"step {step} comes after step {self._next_step - 1}: epochs must move forward")
        self._open_step, self._next_step = step, step + 1
        if self._start_s is None:
            self._start_s = time.perf_counter()
        speeds = self.run.speeds.at(step)
        if speeds != self._applied_speeds:
            self._applied_speeds = speeds
            if self.throttle is not None:
                self.throttle.apply(speeds)
            if self.telemetry is not None:
                self.telemetry.speeds(step, speeds)
        self.emulator.set_slowdown(slowdown(speeds, self.rank) if self.cfg.emulator == "delay" else 1.0)
        self.hook.weight = self.schedule.at(step)[self.rank] / self.cfg.global_batch
        self.timer.begin()

    def _local_grads_ready(self) -> None:
        """The hook's ready callback: this step's local compute is done; a slower machine is emulated here."""
        self.emulator.before_sync()
        self.timer.mark_ready()

    def step(self, loss: torch.Tensor | float | None = None, lr: float | None = None) -> None:
        """Report the end of this rank's step (after ``optimizer.step()``); ``loss`` and ``lr`` are logged."""
        step = self._open_step
        if step is None:
            raise RuntimeError("step() without a batch: iterate the loader from data_loader() and call step() "
                               "once per batch")
        self.timer.end()
        loss_value = float("nan") if loss is None else loss.detach() if torch.is_tensor(loss) else float(loss)
        self._pending.append([step, self.schedule.at(step)[self.rank], loss_value, float("nan") if lr is None else lr])
        self._open_step = None
        if len(self._pending) == self.cfg.control_interval or step + 1 == self.run.total_steps:
            self._end_interval(step)

    def _resolve_window(self) -> None:
        """Turn the pending steps into window rows (one device wait on CUDA, none per step)."""
        for (step, batch, loss, lr), t in zip(self._pending, self.timer.collect()):
            loss = float(loss) if torch.is_tensor(loss) else loss
            self.window.append([step, batch, t.compute_s, t.wait_s, t.step_s, loss, t.delay_s, lr])
        self._pending.clear()

    def _end_interval(self, step: int) -> None:
        self._resolve_window()
        table = gather_rows(self.ctx, self.window, len(FIELDS))
        self.window.clear()
        keep = HISTORY_INTERVALS * self.cfg.control_interval
        for past, rows in zip(self.history, table):
            past.extend((int(r[1]), r[2]) for r in rows)
            del past[:-keep]
        obs = Observation(step, self.schedule.at(step), tuple(map(tuple, self.history)), recent=len(table[0]))
        decision = self.controller.decide(obs)
        effective = step + 1 + self.run.lag
        if decision.changed and (self.run.total_steps is None or effective < self.run.total_steps):
            self.schedule.change(effective, decision.new)
            self.history = [[] for _ in self.history]
        self.sync_buffers()
        if self.telemetry is not None:
            self.telemetry.interval(table, decision, effective)

    def sync_buffers(self) -> None:
        """Make buffers (BatchNorm statistics) equal everywhere: their batch-share-weighted average."""
        if self.model is None or not self.ctx.grouped:
            return
        if self.loader is None:
            weight = 1.0 / self.world_size
        else:  # the shares of the last step begun (the first before any): they sum to 1 over the ranks
            weight = self.schedule.peek(max(self._next_step - 1, 0))[self.rank] / self.cfg.global_batch
        average_buffers(self.ctx, list(self.model.buffers()), weight)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside (evaluation, checkpoints) is left out of the training time in the summary."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - start

    def train_time_s(self) -> float:
        return 0.0 if self._start_s is None else time.perf_counter() - self._start_s - self._paused_s

    def log_eval(self, loss: float, accuracy: float | None = None, epoch: int | None = None) -> None:
        """Record a test evaluation (rank 0 writes it; call on every rank with the same numbers)."""
        if self.telemetry is not None:
            self.telemetry.evaluation(epoch, self._next_step, self.train_time_s(), loss, accuracy)

    def finish(self) -> dict | None:
        """Flush the last interval, equalise buffers, write the summary (rank 0's dict; None elsewhere)."""
        try:
            if self._pending:
                self._end_interval(int(self._pending[-1][0]))
            self.sync_buffers()
            wall_s = 0.0 if self._start_s is None else time.perf_counter() - self._start_s
            if self.telemetry is None or not self.telemetry.rows:
                return None
            return self.telemetry.finish(wall_s, wall_s - self._paused_s, self.module)
        finally:
            self.release()

    def release(self) -> None:
        """Give back OS throttles (idempotent); never hides the run's own outcome."""
        if self.throttle is None:
            return
        from omnilearn.emulation.throttle import ThrottleError

        throttle, self.throttle = self.throttle, None
        try:
            throttle.close()
        except ThrottleError as e:
            print(f"omnilearn: warning: rank {self.rank}: {e}", file=sys.stderr)

    def close(self) -> None:
        """Leave the process group (whoever created it), after every rank got here.

        The barrier keeps a fast rank from closing its connections while a
        peer's gloo threads still use them (that aborts the peer at exit).
        """
        self.release()
        if self.ctx.grouped:
            group.barrier()
        group.destroy()
