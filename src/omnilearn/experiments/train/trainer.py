"""``omnilearn train``'s training loop, written on the public API (:mod:`omnilearn.bsp.session`).

Per rank: load the workload (``workload.py``), open a :class:`Session`, and
run the loop any user of the API would write — the session's loader serves
this rank's slice of each global batch (as ``accumulation_steps``
micro-batches when that is above 1), ``run_step()`` runs each micro-batch's
forward and weighted backward within this rank's memory cap (an
out-of-memory error lowers the cap and redoes the step: docs/memory.md),
``step()`` ends the optimizer step and feeds the controller.
One evaluation over the test split per epoch. Rank 0 says how long its
start-up took (data, model and DDP set-up) and when training starts (not
when ``quiet``); the first progress line follows at the first control-interval end,
and a first step slower than :data:`SLOW_FIRST_STEP_S` gets a line of its own.

Checkpoints (``RUN_DIR/checkpoints``, the newest ``--keep-checkpoints``):
at the first control-interval end at or after every ``--checkpoint-every``
steps, at the end, and when a stop signal was agreed on (then
:class:`~omnilearn.stopping.Stopped` is raised). With ``--resume`` the
newest intact one is loaded first (model, optimizer, LR schedule, session)
and the loop goes on from its epoch and step. A resume never quietly starts
over: checkpoints that are all damaged, or one that passed its checksum and
does not load, stop every rank with one line naming the file
(:class:`~omnilearn.checkpoint.CheckpointError`); only a run with no
checkpoint yet (stopped before its first, e.g. a ``--max-restarts`` retry)
starts over, with an ``omnilearn: warning:`` line saying so and a
``resume`` event at step 0 that voids the earlier records.

Fault injection for tests: ``OMNILEARN_FAULT_KILL_AT=<rank>:<step>`` makes
that rank SIGKILL itself when it reaches ``step`` in a run that is not a
resume (so a restarted run goes past it; :mod:`omnilearn.experiments.train.faultinject`).
``OMNILEARN_FAULT_OOM=<rank>:<samples>`` emulates a memory cap on that rank
(:mod:`omnilearn.bsp.memory`): the run goes on at a lower cap.

Run: ``python -m pytest -q tests/dist/test_bsp.py``
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.bsp import rescue
from omnilearn.bsp.session import Session
from omnilearn.stopping import Stopped, reason
from omnilearn.distributed.group import DistContext
from omnilearn.experiments.train import faultinject
from omnilearn.experiments.train import workload
from omnilearn.experiments.config import TrainConfig
from omnilearn.experiments.datasets import core as data
from omnilearn.experiments.train.workload import PREFETCH_FACTOR, resolve
from omnilearn.observe.console import startup, took, warn


SLOW_FIRST_STEP_S = 2.0  # a first step this slow is reported at once (the first progress line may be far off)


class BSPTrainer:
    def __init__(self, cfg: TrainConfig, ctx: DistContext, run_dir: Path | None) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.first_step_at: float | None = None  # set when fit() starts, cleared after the first step
        start = time.perf_counter()
        splits = workload.load_data(cfg)
        self.test = splits.test
        self.run = resolve(cfg, len(splits.train))
        self.session = Session(cfg, ctx, run_dir, self.run.total_steps)
        self.loader = self.session.data_loader(
            splits.train, num_workers=cfg.loader_workers, collate_fn=data.keep_batch,
            prefetch_factor=PREFETCH_FACTOR if cfg.loader_workers > 0 else None,
        )
        loaded = time.perf_counter()
        self.model = self.session.wrap_model(workload.build_model(cfg, splits))
        self._say(f"rank 0: data loaded in {took(loaded - start)}; model ready on {ctx.device.type}"
                  f"{' in DDP' if isinstance(self.model, DDP) else ''} in {took(time.perf_counter() - loaded)}")
        self.opt = workload.make_optimizer(cfg, self.model.parameters())
        self.lr_sched = workload.make_schedule(cfg, self.opt, self.run.total_steps, self.run.steps_per_epoch)
        self.checkpoints = run_dir / "checkpoints" if run_dir is not None else Path("checkpoints")
        self.objects = {"model": self.model, "optimizer": self.opt, "scheduler": self.lr_sched}
        where = run_dir if run_dir is not None else Path(cfg.out) if cfg.out else None  # every rank's, not only 0's
        if where is not None:  # a dead peer costs the step in flight: any survivor saves it (omnilearn.bsp.rescue)
            self.session.save_on_failure(where / "checkpoints", **self.objects)
            if ctx.world_size > 1:  # and a peer the watchdog names hung (omnilearn.bsp.rescue.guard)
                rescue.guard(self.session)
        if cfg.resume and not self._resume():
            if ctx.is_main:
                warn(f"--resume: no checkpoint in {self.checkpoints} yet (the run stopped before its first); "
                     "starting over from step 0")
            self.session.resumed_from = (0, cfg.workers)  # nothing saved yet: start over, voiding earlier records
            self.session.pending_telemetry = {}
            self.session.restore_telemetry()
        every = cfg.checkpoint_every
        self.next_checkpoint = (self.session.next_step // every + 1) * every if every else None
        self.kill_at = faultinject.kill_step(ctx.rank) if not cfg.resume else None
        self.hang_at = faultinject.hang_step(ctx.rank) if not cfg.resume else None

    def _resume(self) -> bool:
        """Load the newest checkpoint (False: none at all; none usable raises); rank 0 records how long it took."""
        start = time.perf_counter()
        loaded = self.session.load_checkpoint(self.checkpoints, **self.objects)
        if loaded and self.session.telemetry is not None:
            self.session.telemetry.loaded(time.perf_counter() - start)
        return loaded

    def _say(self, text: str) -> None:
        """A start-up line from rank 0 (nothing elsewhere or when quiet)."""
        if self.ctx.is_main:
            startup(text, self.cfg.quiet)

    def fit(self) -> dict | None:
        run, first = self.run, self.session.next_step
        verb = f"resumes at step {first} of" if first else "starts:"
        self._say(f"training {verb} {run.total_steps} steps, {run.steps_per_epoch} per epoch; a progress line every "
                  f"{self.cfg.control_interval} steps (the control interval)")
        self.first_step_at = time.perf_counter()
        try:
            for epoch in range(self.session.epoch, self.run.epochs):
                self.loader.set_epoch(epoch)
                for batch in self.loader:
                    self._step(batch)
                    self._first_step_done()
                    self._maybe_checkpoint()
                with self.session.paused():
                    self.session.sync_buffers()
                    loss, accuracy = workload.evaluate(self.session.module, self.test, self.ctx)
                self.session.log_eval(loss, accuracy, epoch)
            return self.session.finish()
        finally:
            self.session.release()

    def _first_step_done(self) -> None:
        if self.first_step_at is None:
            return
        took_s, self.first_step_at = time.perf_counter() - self.first_step_at, None
        if took_s >= SLOW_FIRST_STEP_S:
            self._say(f"first step done in {took(took_s)} (the first is the slowest); a progress line every "
                      f"{self.cfg.control_interval} steps")

    def _step(self, batch) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.session.run_step(self._loss, batch)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.lr_sched.step()
        self.session.step(lr=lr)

    def _loss(self, micro_batch) -> torch.Tensor:
        x, y = micro_batch
        x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
        return workload.criterion(self.model(x), y)

    def _maybe_checkpoint(self) -> None:
        """At an interval end: a due checkpoint, or the final one of an agreed stop (then raise :class:`Stopped`)."""
        if self.kill_at is not None and self.session.next_step >= self.kill_at:
            faultinject.die()
        if self.hang_at is not None and self.session.next_step >= self.hang_at:
            self.hang_at = None
            faultinject.freeze()
        session = self.session
        if not session.at_interval_boundary:
            return
        due = self.next_checkpoint is not None and session.next_step >= self.next_checkpoint
        if due or session.should_stop:
            start = time.perf_counter()
            path = session.save_checkpoint(self.checkpoints, **self.objects, keep=self.cfg.keep_checkpoints)
            if session.telemetry is not None and path is not None:
                session.telemetry.checkpoint(session.next_step, path.stat().st_size, time.perf_counter() - start)
            every = self.cfg.checkpoint_every
            self.next_checkpoint = (session.next_step // every + 1) * every if every else None
        if session.should_stop:
            raise Stopped(f"{reason() or 'a stop signal'}: stopped at step {session.next_step} after a checkpoint; "
                          f"continue with --resume")

