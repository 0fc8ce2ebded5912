"""OmniLearn in your own training loop: the public Python API.

    import omnilearn

    ol = omnilearn.setup(local_batch=64)          # or global_batch=...; torchrun's group, an existing one, or none
    model = ol.wrap_model(MyModel())              # DDP; gradients weighted by each worker's batch share
    loader = ol.data_loader(my_dataset)           # this worker's slice of every global batch
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for epoch in range(10):
        for x, y in loader:                       # one pass over the data per epoch, over all workers
            x, y = x.to(ol.device), y.to(ol.device)
            loss = loss_fn(model(x), y)           # the mean over this worker's batch
            opt.zero_grad()
            loss.backward()                       # or ol.backward(loss)
            opt.step()
            ol.step(loss)                         # timings in; every control interval, new batch sizes out
    ol.finish()                                   # summary on rank 0; run directory when out= was given

Gradient accumulation (``accumulation_steps=K``): the global batch is per
optimizer step; each item of the loader is the list of this worker's K
micro-batches; call ``ol.backward(loss)`` for each (it weights the
micro-batch exactly and lets DDP sync only on the last), then
``opt.step()`` and ``ol.step()`` once::

        for micro_batches in loader:
            opt.zero_grad()
            for x, y in micro_batches:
                ol.backward(loss_fn(model(x), y))
            opt.step()
            ol.step()

Token losses with padding: ``ol.backward(loss, count=n_tokens)`` weights by
terms instead of samples (:mod:`omnilearn.bsp.micro`). ``model.no_sync()``
is refused (:mod:`omnilearn.bsp.wrap`).

Memory (``max_batch``: one cap, one per worker, or ``"auto"`` on CUDA;
:mod:`omnilearn.bsp.memory`, docs/memory.md): ``ol.run_step(fn, batch)``
does a step's forward and backward within this rank's cap, whatever
``accumulation_steps``: ``fn(micro_batch)`` returns the mean loss (or
``(loss, count)``); a share above the cap runs as micro-batches, weighted
exactly; an out-of-memory error lowers the cap, clears the gradients and
redoes the step, and the next control interval re-plans within the cap::

        for batch in loader:                      # a batch, or the list of K micro-batches
            opt.zero_grad()
            ol.run_step(lambda b: loss_fn(model(b[0].to(ol.device)), b[1].to(ol.device)), batch)
            opt.step()
            ol.step()

Without recovery, ``for x, y in ol.micro_batches(batch): ol.backward(...)``
splits the same way. ``ol.max_batch`` is this rank's cap now. ``memory=[...]`` (each rank's memory): the first
step counts what it holds and the cap follows (:mod:`omnilearn.bsp.membytes`; ``ol.probe_needs``: the counts).

One rank fails, all ranks end: an error of this rank alone (one that
``run_step`` cannot redo, an out-of-memory error in ``backward()`` or
propagating through ``finish()``, a ``save_checkpoint()`` that fails here
and not everywhere) is announced in the group's store before it is raised;
every peer's listener thread ends its process within a second or so, naming
the rank and the error (:mod:`omnilearn.distributed.failures`).

Run it with ``torchrun --nproc-per-node N script.py`` or as one process.
``wrap_model`` seeds each rank's random streams with ``(seed, rank)``
afterwards (dropout and augmentation differ per rank; :mod:`omnilearn.bsp.rng`).
A step's clock starts when its batch is handed out, or when the previous
step is reported if the loop fetched ahead; ``step()`` ends it. Every
``control_interval`` steps one all-gather of ``n x 12`` numbers feeds the same
:class:`~omnilearn.balance.loop.ControlLoop` on every rank, and the
interval's per-step rows go to rank 0 only (:mod:`omnilearn.bsp.interval`).
``state_dict()`` / ``load_state_dict()`` hold everything but the user's
model and optimizer (a ``Stateful`` for ``torch.distributed.checkpoint``);
``save_checkpoint()`` / ``load_checkpoint()`` write and read all of it in
one file (:mod:`omnilearn.bsp.checkpointing`), and a checkpoint of one
worker count resumes at another. SIGTERM/SIGINT (:mod:`omnilearn.stopping`)
are agreed on at the next interval end: ``should_stop`` turns true on every
rank at the same step (the step after it: meetings are read a step later,
:mod:`omnilearn.bsp.steppers`). ``omnilearn train`` uses this class.

The class is split by concern: the data sources (:mod:`omnilearn.bsp.sources`), the state and checkpoints
(:mod:`omnilearn.bsp.persist`), the end of a run and teardown (:mod:`omnilearn.bsp.ending`), steps within a memory
cap and the window ends (:mod:`omnilearn.bsp.steppers`) are mixins; the mechanics live in backward, interval, micro, memory, wrap, sharded and checkpointing.

Run: ``python -m pytest -q tests/dist/test_api.py tests/unit/test_session_state.py tests/dist/test_rank_errors.py``
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.bsp.backward import HookState
from omnilearn.bsp.emulate import Emulation
from omnilearn.bsp.ending import Ending
from omnilearn.bsp.interval import check_same_settings
from omnilearn.bsp import membytes, memory, sharded
from omnilearn.bsp.micro import MicroSteps
from omnilearn.bsp.persist import Persistence
from omnilearn.bsp.rescue import Rescue
from omnilearn.bsp.rng import seed_rank
from omnilearn.bsp.sources import DataSources
from omnilearn.bsp.steppers import IntervalEnds, MemorySteps
from omnilearn.bsp.steps import StepLedger
from omnilearn.bsp.wrap import wrap
from omnilearn.clocks.step import StepTimer
from omnilearn.clocks.train import TrainClock
from omnilearn.config import AUTO, BalanceConfig, ConfigError
from omnilearn.data.loader import BalancedLoader
from omnilearn.data.plan import BatchSchedule, VariableBatchSampler
from omnilearn.data.windows import IndexStream
from omnilearn.decisions import MAX_STRETCH, check_every, make_loop
from omnilearn.distributed import failures, group
from omnilearn.distributed.lost import peer_lost
from omnilearn.distributed.collect import sum_tensor
from omnilearn.observe.rankrows import RankRows
from omnilearn.observe.recorder import Telemetry
from omnilearn.runplan import RunPlan


class Session(DataSources, Persistence, Ending, MemorySteps, IntervalEnds, Rescue):
    """One rank's view of a balanced run: wraps the model, serves the batches, runs the control loop."""

    def __init__(self, cfg: BalanceConfig, ctx: group.DistContext, run_dir: Path | None = None,
                 total_steps: int | None = None) -> None:
        if cfg.workers != ctx.world_size:
            raise ConfigError(f"config has {cfg.workers} workers but the process group has {ctx.world_size}")
        if total_steps is not None and total_steps < 1:
            raise ConfigError(f"total_steps={total_steps} must be at least 1")
        self.cfg, self.ctx, self.run_dir, self.total_steps = cfg, ctx, run_dir, total_steps
        check_same_settings(ctx, cfg, total_steps)  # before any other collective
        self.timer = StepTimer(ctx.device)
        self.emulation = Emulation(cfg, ctx, self.timer)
        self.emulator = self.emulation.delay
        self.hook = HookState(on_ready=self._local_grads_ready, on_reduced=self.timer.mark_reduced)
        self.loop = make_loop(cfg, ctx.world_size, total_steps)
        self.schedule = BatchSchedule(self.loop.batches)
        self.sampler = VariableBatchSampler(None, self.schedule, ctx.rank, total_steps, cfg.accumulation_steps)
        self.ledger = StepLedger(self.timer, self._start_step)
        self.micro = MicroSteps(cfg.accumulation_steps, cfg.global_batch, self.hook, self._sum_counts,
                                lambda: self.emulator.before_sync())
        self.memory = memory.MemoryCap(memory.rank_cap(cfg.max_batch, ctx.rank), cfg.accumulation_steps)
        auto = cfg.max_batch == AUTO and ctx.device.type == "cuda"
        self.probe = memory.CudaProbe(ctx.device) if auto else None  # the first step measures the memory
        self.probe_needs = None
        self.reducer_resets = memory.ReducerResets()  # DDP's reducer after out-of-memory redos
        self.caps_seen: list[int] | None = None  # rank 0: the caps the loop held at the last interval end
        # steps between looks for a speed shift (0: none; one worker has nothing to shift against)
        self.check_every = check_every(cfg.control_interval) if ctx.world_size > 1 else 0
        self.checks_on = True  # whether the checks pay at the last interval's step time (decisions.checks_pay)
        self.window_steps, self.intervals = cfg.control_interval, 0  # the open window's length, intervals read
        self.slots = cfg.control_interval * (MAX_STRETCH if cfg.min_window_s > 0 else 1)  # rows a meeting carries
        self.steps_done = self.next_step = 0
        self.model: nn.Module | None = None
        self.loader: BalancedLoader | None = None
        self.windows: IndexStream | None = None  # random_indices()'s draws
        self.run: RunPlan | None = None
        self.telemetry: Telemetry | None = None
        self.clock = TrainClock()
        self.rng_restored = False
        self.should_stop = False  # a stop signal reached some rank: every rank sees it after the same step
        self.resumed_from: tuple[int, int] | None = None  # (step, the checkpoint's worker count) after a load
        self.pending_telemetry: dict | None = None  # rank 0's record counters from a checkpoint, for the Telemetry
        self.rank_rows: RankRows | None = None  # this rank's step rows and sums, once the data source is known
        self.rows_resumed = False
        self.failed: str | None = None  # this rank's error, announced to its peers (they end): see _fail
        self.failures = failures.listen(ctx)  # last: a peer's announced error ends this process

    device = property(lambda self: self.ctx.device)
    rank = property(lambda self: self.ctx.rank)
    world_size = property(lambda self: self.ctx.world_size)
    is_main = property(lambda self: self.ctx.is_main)
    global_batch = property(lambda self: self.cfg.global_batch)

    @property
    def module(self) -> nn.Module | None:
        """The user's model without the DDP wrapper, nor ``torch.compile``'s (for evaluation and saving: its
        ``state_dict`` keys are the model's own, whichever order it was compiled and wrapped in)."""
        model = self.model.module if isinstance(self.model, DDP) else self.model
        return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule (private: tests/unit guards it)

    @property
    def epoch(self) -> int:
        """The epoch the loader's next iteration serves (after a resume: the checkpoint's)."""
        return self.sampler.epoch

    @property
    def batches(self) -> tuple[int, ...]:
        """Every worker's batch for the next step, as planned so far."""
        return self.schedule.peek(max(self.next_step, self.ledger.last_started + 1))

    def wrap_model(self, model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
        """Move ``model`` to this rank's device and wrap it in DDP with the weighted gradient hook.

        Then each rank's random streams (torch, numpy, ``random``) are seeded
        with ``(seed, rank)``: build the model before (DDP gives every rank
        rank 0's weights), and dropout masks differ per rank after. BatchNorm
        running statistics are not broadcast by DDP: they are averaged across
        workers, weighted by batch share, every control interval and in
        :meth:`finish` (:meth:`sync_buffers` on every rank before evaluating
        mid-interval). One process alone gets its model back unwrapped.
        """
        if self.model is not None:
            raise RuntimeError("wrap_model() was already called: one model per session")
        sharded.refuse_unbalanced(model, self.world_size)
        if sharded.is_sharded(model):
            self.model = self._adopt_sharded(model, ddp_kwargs)
        else:
            self.model = wrap(model, self.device, self.ctx.grouped, self.hook, **ddp_kwargs)
        self.micro.use_model(self.model, self.ctx.grouped, self.world_size)
        if self.cfg.memory is not None:  # the first step counts what it holds: the cap for this rank's memory
            self.probe = membytes.probe_for(self.cfg, self.ctx, self.model)
        emulated = memory.fault_oom_samples(self.rank)
        if emulated is not None:
            memory.emulate_oom(self.model, emulated)
        if not self.rng_restored:
            seed_rank(self.cfg.seed, self.rank)
        return self.model

    def _adopt_sharded(self, model: nn.Module, ddp_kwargs: dict) -> nn.Module:
        """An FSDP2 model as the user sharded it, its reductions weighted and timed (:mod:`omnilearn.bsp.sharded`)."""
        if ddp_kwargs:
            raise TypeError(f"ol.wrap_model(): DDP keyword arguments {sorted(ddp_kwargs)} for a model sharded with "
                            "fully_shard (not wrapped in DDP): set them in fully_shard() instead")
        if self.cfg.max_batch == AUTO:
            raise ConfigError('max_batch="auto" is not supported with FSDP2 (sharded memory is not probed): give '
                              "max_batch=<samples> (one cap, or one per worker); a share above it runs as micro-batches")
        return sharded.prepare(model, weight=lambda: self.hook.weight, before=lambda: self.emulator.before_sync(),
                               blocked=self.timer.add_blocked, stall=self.timer.add_stall, device=self.device,
                               cpu_time=lambda: self.emulator.slowdown > 1.0)

    def _start_step(self, step: int) -> None:
        """``step``'s clock is about to start: its speed emulation, weight and micro-batches."""
        if self.clock.start_s is None:
            self.clock.start()
        speeds = self.run.speeds
        if len(speeds.starts) > 1 or speeds.speeds[0] is not self.emulation.applied:  # constant: applied once
            speeds = speeds.at(step)
            if self.emulation.at_step(speeds) and self.telemetry is not None:
                self.telemetry.speeds(step, speeds)
        self.micro.begin(self.schedule.at(step)[self.ctx.rank])
        if self.probe is not None:
            self.probe.begin()

    def _local_grads_ready(self) -> None:
        """The hook's ready callback: this step's local compute is done; a slower machine is emulated here."""
        self.emulator.before_sync()
        self.timer.mark_ready()

    def _sum_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return sum_tensor(self.ctx, counts.to(self.device), self.hook.process_group)

    def backward(self, loss: torch.Tensor, count: int | float | torch.Tensor | None = None) -> None:
        """``loss.backward()`` for one micro-batch, weighted exactly (``count``: loss terms, e.g. tokens)."""
        if self.ledger.open is None:
            raise RuntimeError("backward() without a batch: call it for a batch the loader handed out")
        try:
            self.micro.backward(loss, count)
        except RuntimeError as e:  # OOM: this rank's alone (its peers wait in the step's collective); a lost peer:
            own = isinstance(e, torch.OutOfMemoryError)  # this rank saves the last step (omnilearn.bsp.rescue)
            if own or peer_lost(e):
                self._fail(e, own=own)
            raise

    def step(self, loss: torch.Tensor | float | None = None, lr: float | None = None) -> None:
        """Report the end of this rank's step (after ``optimizer.step()``); ``loss`` and ``lr`` are logged.

        The logged loss is the step's own when ``backward()`` was used, else ``loss``.
        """
        if self.ledger.open is None:
            raise RuntimeError("step() without a batch: iterate the loader from data_loader() and call step() "
                               "once per batch")
        logged = self.micro.finish()
        if logged is None and loss is not None:
            logged = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        ledger = self.ledger
        step = ledger.report(self.micro.batch, math.nan if logged is None else logged, math.nan if lr is None else lr)
        self.sampler.complete(step)
        self.steps_done, self.next_step = self.steps_done + 1, step + 1
        if self.meeting is not None:
            self._read_meeting()  # the previous step's meeting (its collective is done by now)
        size = len(ledger.resolved) + len(ledger.pending)  # ledger.window_size(), inline: every step
        if size >= self.window_steps or step + 1 == self.run.total_steps:
            self._end_interval(step)
        elif self.check_every and self.checks_on and size % self.check_every == 0:
            self._check(step)
        if self.probe is not None:
            self._probe_ended()
        self.clock.step_ended()
        if ledger.queue:  # a step fetched ahead: its clock starts now
            ledger.start_next()

    def paused(self) -> ContextManager[None]:
        """``with ol.paused():`` time inside (evaluation, checkpoints) is left out of the training time."""
        return self.clock.paused()

    def train_time_s(self) -> float:
        return self.clock.train_s()

    def log_eval(self, loss: float, accuracy: float | None = None, epoch: int | None = None) -> None:
        """Record a test evaluation (rank 0 writes it; call on every rank with the same numbers)."""
        if self.telemetry is not None:
            self.telemetry.evaluation(epoch, self.next_step, self.train_time_s(), loss, accuracy)
