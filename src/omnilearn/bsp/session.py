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
splits the same way. ``ol.max_batch`` is this rank's cap now.

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

Why one file over 300 lines: ``Session`` is the runtime's public surface (every method a user calls, with its
docstring); the mechanics live in interval, steppers, micro, memory, wrap, sharded and checkpointing.

Run: ``python -m pytest -q tests/dist/test_api.py tests/unit/test_session_state.py tests/dist/test_rank_errors.py``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset

from omnilearn.bsp import checkpointing
from omnilearn.bsp.interval import SYNC_BUFFERS, agree_on_data, check_same_settings, meet
from omnilearn.bsp.steppers import IntervalEnds, MemorySteps
from omnilearn.bsp.emulate import Emulation
from omnilearn.bsp import memory, sharded
from omnilearn.bsp.micro import MicroSteps
from omnilearn.bsp.rng import rank_seed, seed_rank
from omnilearn.bsp.steps import StepLedger
from omnilearn.bsp.wrap import wrap
from omnilearn.checkpoint import CheckpointError
from omnilearn.config import AUTO, BalanceConfig, ConfigError, api_wording
from omnilearn.data.loader import BalancedLoader, keep_batch
from omnilearn.data.plan import BatchSchedule, GlobalPlan, VariableBatchSampler
from omnilearn.data.stream import StreamBatches, StreamPlan
from omnilearn.decisions import check_every, make_loop
from omnilearn.data.windows import IndexStream, WindowPlan
from omnilearn.distributed import failures, group
from omnilearn.distributed.collect import average_buffers, gather_to_main, share_path, sum_tensor
from omnilearn.bsp.backward import HookState
from omnilearn.observe.modelfile import saver
from omnilearn.observe.rankrows import RankRows
from omnilearn.observe.recorder import Telemetry
from omnilearn.runplan import RunPlan, plan_run
from omnilearn.clocks.step import StepTimer
from omnilearn.clocks.train import TrainClock



class Session(MemorySteps, IntervalEnds):
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
        self.reducer_resets = memory.ReducerResets()  # DDP's reducer after out-of-memory redos
        self.caps_seen: list[int] | None = None  # rank 0: the caps the loop held at the last interval end
        self.check_every = check_every(cfg.control_interval)  # steps between looks for a speed shift (0: none)
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
        """The user's model without the DDP wrapper (for evaluation and saving)."""
        return self.model.module if isinstance(self.model, DDP) else self.model

    @property
    def epoch(self) -> int:
        """The epoch the loader's next iteration serves (after a resume: the checkpoint's)."""
        return self.sampler.epoch

    @property
    def interval_ended(self) -> bool:
        """Whether the last reported step closed a control interval (buffers equal, no open window)."""
        return self.ledger.window_size() == 0

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

    def data_loader(self, dataset, *, num_workers: int = 0, collate_fn=None, pin_memory: bool | None = None,
                    prefetch_factor: int | None = None) -> BalancedLoader:
        """A loader over a map-style ``dataset`` or an ``IterableDataset``: each step, this rank's share.

        A stream (:mod:`omnilearn.data.stream`) gives each step its next ``b_i`` items; it needs ``total_steps``.
        """
        if isinstance(dataset, IterableDataset):
            return self._stream_loader(dataset, collate_fn, num_workers)
        prefetch = (prefetch_factor or 2) if num_workers > 0 else 0
        self._start_data(GlobalPlan, len(dataset), num_workers * prefetch)
        if collate_fn is None and getattr(dataset, "returns_batches", False):
            collate_fn = keep_batch
        # Its own generator: making an iterator (each epoch, and after a resume mid-epoch) then draws no number
        # from the global stream that dropout and augmentation use, so a resumed run draws what an unstopped one does.
        generator = torch.Generator().manual_seed(rank_seed(self.cfg.seed, self.rank))
        loader = DataLoader(
            dataset, batch_sampler=self.sampler, collate_fn=collate_fn, num_workers=num_workers, generator=generator,
            persistent_workers=num_workers > 0, prefetch_factor=prefetch_factor if num_workers > 0 else None,
            pin_memory=self.device.type == "cuda" if pin_memory is None else pin_memory,
        )
        self.loader = BalancedLoader(loader, self.sampler, self.ledger.handed_out, self.cfg.accumulation_steps)
        return self.loader

    def _stream_loader(self, dataset: IterableDataset, collate_fn, num_workers: int) -> BalancedLoader:
        if self.total_steps is None:
            raise ConfigError(f"data_loader({type(dataset).__name__}): a stream has no length; pass total_steps=N "
                              "to omnilearn.setup()")
        self._start_data(StreamPlan, self.total_steps * self.cfg.global_batch, 0, "stream")
        items = StreamBatches(dataset, self.sampler, collate_fn, num_workers)
        self.loader = BalancedLoader(items, self.sampler, self.ledger.handed_out, self.cfg.accumulation_steps)
        return self.loader

    def random_indices(self, high: int) -> torch.Tensor:
        """This rank's next micro-batch of random window starts in ``[0, high)`` (int64): nanoGPT's ``torch.randint``.

        Step ``s`` draws ``B`` starts seeded by ``(seed, s)``; this rank takes its slice
        (:mod:`omnilearn.data.windows`). Call it once per micro-batch (``accumulation_steps`` per step);
        the first call of a step starts its clock; fetching the next batch ahead is fine.
        """
        if self.windows is None:
            if type(high) is not int or high < 1:
                raise ConfigError(f"random_indices({high!r}): high must be a positive int (e.g. len(data) - block)")
            self._start_data(WindowPlan, high, 0, "random_indices() range")
            self.loader = BalancedLoader(self.sampler, self.sampler, self.ledger.handed_out,
                                         self.cfg.accumulation_steps)
            self.windows = IndexStream(self.loader, high)
        elif high != self.windows.high:
            raise ConfigError(f"random_indices({high}) after random_indices({self.windows.high}): the range is fixed "
                              "for a run; draw from one array")
        return self.windows.next()

    @property
    def local_batch(self) -> int:
        """This rank's batch in the next step handed out (what a loop that draws its own samples takes)."""
        return self.batches[self.rank]

    def _start_data(self, plan_type: type[GlobalPlan], size: int, prefetch_batches: int, what: str = "dataset") -> None:
        """Plan the run over ``size`` samples (one training data source per session); rank 0 starts the record.

        Every rank must read a source of the same size, and plans with the deepest prefetch of any rank (the
        same lag everywhere, so the same decisions): :func:`~omnilearn.bsp.interval.agree_on_data`.
        """
        if self.loader is not None:
            raise RuntimeError("data_loader() or random_indices() was already used: one training data source "
                               "per session")
        prefetch_batches = agree_on_data(self.ctx, size, prefetch_batches, what)
        try:
            self.run = plan_run(self.cfg, size if plan_type is GlobalPlan else max(size, self.cfg.global_batch),
                                self.total_steps, prefetch_batches, what, warn=self.is_main)
        except ConfigError as e:  # the API's user typed keywords, not flags
            raise ConfigError(api_wording(str(e))) from None
        self.loop.lag = self.run.lag
        self.sampler.use_plan(plan_type(size, self.cfg.global_batch, self.cfg.seed))
        self.rank_rows = RankRows(self.rank, self.run.steps_per_epoch, share_path(self.ctx, self.run_dir))
        if self.is_main:
            self.telemetry = Telemetry(self.cfg, self.run, self.run_dir, own_rows=True)
        self.restore_telemetry()

    def _start_step(self, step: int) -> None:
        """``step``'s clock is about to start: its speed emulation, weight and micro-batches."""
        self.clock.start()
        speeds = self.run.speeds.at(step)
        if self.emulation.at_step(speeds) and self.telemetry is not None:
            self.telemetry.speeds(step, speeds)
        self.micro.begin(self.schedule.at(step)[self.rank])
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
        except torch.OutOfMemoryError as e:  # this rank's alone: its peers wait in the step's collective
            self._fail(e)
            raise

    def step(self, loss: torch.Tensor | float | None = None, lr: float | None = None) -> None:
        """Report the end of this rank's step (after ``optimizer.step()``); ``loss`` and ``lr`` are logged.

        The logged loss is the step's own when ``backward()`` was used, else ``loss``.
        """
        if self.ledger.open is None:
            raise RuntimeError("step() without a batch: iterate the loader from data_loader() and call step() "
                               "once per batch")
        logged = self.micro.finish()
        if not self.hook.weighted and self.hook.unhooked is not None:
            raise ConfigError(f"the model's output ({self.hook.unhooked}) holds no tensor that needs a gradient, so "
                              "OmniLearn cannot weight loss.backward() through it: call ol.backward(loss) instead")
        if logged is None and loss is not None:
            logged = loss.detach() if torch.is_tensor(loss) else float(loss)
        batch = self.micro.batch  # the open step's share, set when it started
        step = self.ledger.report(batch, float("nan") if logged is None else logged, float("nan") if lr is None else lr)
        self.sampler.complete(step)
        self.steps_done, self.next_step = self.steps_done + 1, step + 1
        self._read_meeting()  # the previous step's meeting, if it had one (its collective is done by now)
        size = self.ledger.window_size()
        if size == self.cfg.control_interval or step + 1 == self.run.total_steps:
            self._end_interval(step)
        elif self.check_every and size % self.check_every == 0:
            self._check(step)
        if self.probe is not None:
            self.memory.probe(self.probe.end(max(self.micro.sizes)))
            if self.probe.done:
                self.probe = None
        self.clock.step_ended()
        self.ledger.start_next()

    def sync_buffers(self) -> None:
        """Make buffers (BatchNorm statistics) equal everywhere: their batch-share-weighted average.

        A collective: call it on every rank at the same point. Met by another
        rank's interval end or ``finish()``, every rank raises at once; a rank
        that never comes (waiting in a training step) leaves this one waiting
        until the process group's timeout, then it raises saying so.
        """
        self._read_meeting()
        if self.model is None or not self.ctx.grouped:
            return
        meet(self.ctx, SYNC_BUFFERS, self.steps_done, slots=self.cfg.control_interval)
        self._average_buffers()

    def _average_buffers(self) -> None:
        if self.model is None or not self.ctx.grouped:
            return
        # the shares of the last step begun (the first before any): they sum to 1 over the ranks
        weight = self.schedule.peek(max(self.ledger.last_started, 0))[self.rank] / self.cfg.global_batch
        average_buffers(self.ctx, list(self.model.buffers()), weight)

    def paused(self) -> ContextManager[None]:
        """``with ol.paused():`` time inside (evaluation, checkpoints) is left out of the training time."""
        return self.clock.paused()

    def train_time_s(self) -> float:
        return self.clock.train_s()

    def log_eval(self, loss: float, accuracy: float | None = None, epoch: int | None = None) -> None:
        """Record a test evaluation (rank 0 writes it; call on every rank with the same numbers)."""
        if self.telemetry is not None:
            self.telemetry.evaluation(epoch, self.next_step, self.train_time_s(), loss, accuracy)

    def finish(self) -> dict | None:
        """Flush the last interval, equalise buffers, write the summary (rank 0's dict; None elsewhere).

        After this rank failed (:meth:`_fail`; e.g. ``finish()`` in a ``finally:``) only :meth:`release`: the
        peers are gone, and a collective would wait for them. Called while an out-of-memory error propagates
        (a ``finally:`` after one in the user's own code), that error is this rank's failure too."""
        if self.failed is None and isinstance(sys.exc_info()[1], torch.OutOfMemoryError):
            self._fail(sys.exc_info()[1])
        if self.failed is not None:
            self.release()
            return None
        try:
            self._read_meeting()
            if self.ledger.window_size():
                self._end_interval(self.ledger.last_reported)
            self.sync_buffers()  # reads the last interval's meeting first
            # a sharded model's model.pt holds its full tensors: gathered by every rank, kept by rank 0
            full = sharded.full_state(self.model) if sharded.is_sharded(self.model) and self.cfg.out else None
            if self.rank_rows is not None:  # every rank's sums for the summary's per-worker means
                own, self.rank_rows = self.rank_rows, None
                sums = gather_to_main(self.ctx, [own.summary_row(self.cfg.control_interval)], 6)
                own.close()
                if self.telemetry is not None:
                    self.telemetry.worker_sums([rows[0] for rows in sums], own.add_s)
            if self.telemetry is None or not self.telemetry.steps_recorded:
                return None
            return self.telemetry.finish(self.clock.wall_s(), self.clock.train_s(), saver(self.module, full))
        finally:
            self.release()

    def state_dict(self) -> dict:
        """Everything but the user's model and optimizer, as plain values and tensors (a ``Stateful``).

        Rank-specific parts (random streams, this interval's rows; on rank 0
        the record's counters) sit under ``rank<r>``.
        """
        self._read_meeting()  # every rank calls it at the same point
        return checkpointing.session_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (same global batch; call before training on).

        From another worker count (elastic) the data position, step count and
        training time carry on and the split is re-planned for the new workers
        (:func:`omnilearn.bsp.checkpointing.load_session_state`).
        """
        self._read_meeting()
        checkpointing.load_session_state(self, state)
        caps = getattr(self.loop, "caps", None)
        if caps is not None and self.resumed_from is not None and self.resumed_from[1] == self.world_size:
            cap = int(caps.reported[self.rank])  # this rank's learned cap, as the planner held it
            if cap < 2**62:
                self.memory.restore(cap)

    def restore_telemetry(self) -> None:
        """Once the record exists after a resume: this rank's rows of redone steps are void, and rank 0's Telemetry
        gets the loaded checkpoint's record counters."""
        if self.resumed_from is not None and self.rank_rows is not None and not self.rows_resumed:
            self.rank_rows.resume(self.resumed_from[0])
            self.rows_resumed = True
        if self.telemetry is not None and self.resumed_from is not None and self.pending_telemetry is not None:
            self.telemetry.resume(self.pending_telemetry, *self.resumed_from)
            self.pending_telemetry = None

    def save_checkpoint(self, directory: str | Path, *, model: nn.Module | None = None, optimizer=None,
                        scheduler=None, extra: dict | None = None, keep: int = 3) -> Path | None:
        """Checkpoint the session and the given objects into ``directory`` (every rank calls it after ``step()``).

        Rank 0 writes ``step-<next step>.pt`` atomically with a checksum and
        keeps the newest ``keep``; it returns the path (None elsewhere).
        ``extra``: plain values or tensors of your own (epoch counters, best
        accuracy...); a value ``torch.load(weights_only=True)`` would not read
        back (a numpy scalar, a ``Path``) raises
        :class:`~omnilearn.checkpoint.CheckpointError` naming the field, before
        anything is written.
        """
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        self._read_meeting()  # the checkpoint holds its outcome, whenever a run without it would read it
        try:
            with self.paused():
                if sharded.is_sharded(model):  # FSDP2: shards through DCP first, then the commit mark
                    return checkpointing.save_with_shards(self, directory, objects, keep=keep, extra=extra)
                return checkpointing.save(self, directory, objects, keep=keep, extra=extra)
        except CheckpointError:  # told to every rank alike: each raises it, and may go on
            raise
        except Exception as e:  # one rank's (a state_dict() that raises): the others wait in the save's collectives
            self._fail(e)
            raise

    def load_checkpoint(self, directory: str | Path, *, model: nn.Module | None = None, optimizer=None,
                        scheduler=None) -> bool:
        """Resume from the newest intact checkpoint in ``directory``; False (nothing changed) when it holds none.

        Call it on every rank after ``wrap_model()`` and ``data_loader()`` and
        before training. A damaged newest checkpoint (checksum, cut short,
        missing) is set aside for the one before (a warning). When the
        directory holds checkpoints and none is usable (all damaged, or the
        newest passed its checksum and does not load) every rank raises
        :class:`~omnilearn.checkpoint.CheckpointError` naming the file: a resume
        never quietly becomes a fresh start. What was saved as ``extra`` is in
        :attr:`checkpoint_extra`.
        """
        objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        extra = checkpointing.load(self, directory, objects)  # FSDP2: from the shards (DCP reshards)
        self.checkpoint_extra = extra or {}
        return extra is not None

    def release(self) -> None:
        """Give back OS throttles and end the loader's worker processes (idempotent); never hides the run's own
        outcome. ``finish()`` and ``close()`` call it; a loop left early calls it to let go at once."""
        self.meeting = None  # a meeting in flight is not read: the peers may be gone
        if self.failures is not None:
            self.failures.stop()
        self.schedule.hold(None)
        self.emulation.release()
        if self.loader is not None:
            self.loader.shutdown()

    def close(self) -> None:
        """Leave the process group (whoever created it), after every rank got here.

        The barrier keeps a fast rank from closing its connections while a
        peer still syncs through them. :func:`~omnilearn.distributed.group.destroy`
        (the launcher's teardown too) first makes the model let go of the group
        (:func:`~omnilearn.bsp.wrap.release`: after it the model computes as its
        module and syncs nothing), so the group's gloo threads end here, not
        during interpreter finalisation, where one aborts the process.
        """
        self.release()
        if self.failed is not None:  # this rank failed: no peer comes to a barrier
            group.destroy()
            return
        if self.ctx.grouped:
            group.barrier()
        group.destroy(wait_s=3.0)  # every rank passed the barrier: wait until every rank has torn down

    def _fail(self, error: BaseException) -> None:
        """This rank alone failed with ``error`` (its peers wait for it in a collective): announce it, so every
        peer ends within a second or so naming this rank (:mod:`omnilearn.distributed.failures`); then re-raise.
        ``finish()`` and ``close()`` skip their collectives after it. Nothing to tell without peers."""
        if self.failures is not None:
            self.failed = self.failures.announce(error)
