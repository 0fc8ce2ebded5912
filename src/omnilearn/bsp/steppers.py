"""The session's step machinery beyond the plain loop: steps within a memory cap, and the ends of windows.

Two mixins of :class:`~omnilearn.bsp.session.Session` (they use its
attributes: ``cfg``, ``ctx``, ``loop``, ``schedule``, ``ledger``, ``micro``,
``memory``, ``model``, ``telemetry``...), kept apart so each part reads alone:

- :class:`MemorySteps`: ``ol.run_step(fn, batch)``, ``ol.micro_batches(batch)``
  and ``ol.max_batch`` (:mod:`omnilearn.bsp.memory`, docs/memory.md);
- :class:`IntervalEnds`: the end of a control interval (one all-gather that
  also carries the step rows rank 0 totals, the decision, this rank's rows to
  its file, buffers, telemetry) and the mid-interval checks for a speed shift
  (:mod:`omnilearn.bsp.interval`), held while the last interval's steps were
  too short for a check's meeting to pay (:func:`~omnilearn.decisions.checks_pay`:
  a shift then waits for the interval's end), and a window stretched to whole
  intervals where they last under ``min_window_s`` once the loop has settled
  (:func:`~omnilearn.decisions.window_steps`); both carry this rank's pending
  reducer reset and, if any rank has one, make every rank reset DDP's reducer after
  the same step (:class:`~omnilearn.bsp.memory.ReducerResets`).

A meeting is read one step later. At the meeting's step ``s`` every rank
starts the all-gather of its row and trains on; the table is read at the
next ``step()`` (``s + 1``, when step ``s + 1``'s gradient all-reduce, issued
after it on every rank, has already finished), or earlier where every rank
passes the same point: ``sync_buffers()``, ``save_checkpoint()``,
``state_dict()``, ``load_state_dict()``, ``finish()``. So the collective
overlaps a step's compute instead of stopping every rank, which was the whole
of OmniLearn's cost over plain DDP with nothing to balance (docs/results.md).
Whenever it is read, it is read as at step ``s + 1``: a decision lands from
``s + 2 + lag`` on, and after every step any rank had sampled at the meeting
plus one; a loop that samples further ahead before the read (a fetch-ahead
that deepens, a new epoch's prefetch) makes its rank wait for the table and
decide first (:meth:`~omnilearn.data.schedule.BatchSchedule.hold`): every
rank reaches the same decision whenever it decides, and no change lands on a
sampled step. The rest (a stop, a reducer reset, the window's records and
reductions) applies at the read, on every rank alike, and a check's window
holds the steps through ``s``. A peer that never came raises there (one step
after the meeting's step); one at another point or with another plan too.

Run: ``python -m pytest -q tests/unit/test_memory.py tests/dist/test_oom.py tests/dist/test_api.py``
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.bsp import memory, replicas, sharded
from omnilearn.balance import memplan
from omnilearn.balance.controllers import Decision
from omnilearn.bsp.interval import Meeting, window_meeting
from omnilearn.decisions import (CHECK, INTERVAL, check, checks_pay, feed, interval_step_s, reset_asked,
                                 settled, stop_asked, window_steps)
from omnilearn.config import ConfigError
from omnilearn.distributed.lost import peer_lost
from omnilearn.observe.rankrows import Totals
from omnilearn.stopping import stop_requested


class MemorySteps:
    """Steps within this rank's memory cap; out-of-memory errors redone (see the session's docstring)."""

    @property
    def max_batch(self) -> int | None:
        """This rank's memory cap now: the most samples of one forward/backward (None: none)."""
        return self.memory.cap

    def micro_batches(self, batch) -> list:
        """The open step's micro-batches within this rank's cap: ``batch`` (or the loader's K micro-batches) cut
        further where a part is above the cap. Call ``ol.backward`` once for each, before any other."""
        if self.ledger.open is None or self.micro.done:
            raise RuntimeError("micro_batches() needs a batch the loader handed out, before its first backward()")
        return self._split(batch)

    def _split(self, batch) -> list:
        parts = list(batch) if self.cfg.accumulation_steps > 1 else [batch]
        cap, planned = self.memory.cap, self.micro.planned
        if sharded.is_sharded(self.model):  # each forward all-gathers: every rank must run as many micro-batches
            cap = self.memory.fixed
        if cap is None or max(planned) <= cap:
            self.micro.split(planned)
            return parts
        if sharded.is_sharded(self.model):
            raise RuntimeError(f"rank {self.rank}, step {self.ledger.open}: a share of {sum(planned)} samples is "
                               f"above this rank's max_batch={cap}; with FSDP2 shares are kept within the caps by "
                               "the planner and are not split further (a plan set by hand must respect max_batch)")
        out = [p for part, m in zip(parts, planned) for p in memory.split_batch(part, memory.split_sizes([m], cap))]
        self.micro.split(memory.split_sizes(planned, cap))
        return out

    def _probe_ended(self) -> None:
        """The probed step's cap (``max_batch="auto"`` on CUDA; ``memory=``: counted); a plan that cannot hold
        one sample is this rank's error, announced (its peers end naming it)."""
        try:
            cap = self.probe.end(max(self.micro.sizes))
        except ConfigError as e:
            self._fail(e)
            raise
        if cap is not None:
            self.memory.probe(cap)
        if self.probe.done:
            self.probe_needs = getattr(self.probe, "needs", None)  # memory=: what the first step held, counted
            self.probe = None

    def _check_memory_caps(self, table) -> None:
        """``memory=``: the caps the ranks counted can hold the step (the same table, so the same line, on every
        rank: each raises it)."""
        problem = memplan.caps_problem([int(row[4]) for row in table], self.cfg.global_batch, self.cfg.min_batch,
                                       self.cfg.accumulation_steps, sharded.is_sharded(self.model))
        if problem is not None:
            raise ConfigError(problem)

    @property
    def resets(self) -> memory.ReducerResets:
        """DDP's reducer after out-of-memory redos (:class:`~omnilearn.bsp.memory.ReducerResets`), following the model."""
        self.reducer_resets.watch(self.model)
        return self.reducer_resets

    def run_step(self, fn, batch) -> None:
        """Forward and backward of the open step within this rank's memory cap (see the module docstring).

        ``fn(micro_batch)`` returns the micro-batch's mean loss, or ``(loss, count)``
        (:meth:`backward`). Gradients must be zero or None when it starts
        (``optimizer.zero_grad()``); on ``torch.OutOfMemoryError`` the cap is
        halved, the gradients are cleared and the step is redone, so the update
        is the one the step would have made. An error it cannot recover from (one
        sample does not fit, the syncing backward under DDP, any under FSDP2),
        or any other error of ``fn``, is this rank's alone: it is announced and
        every peer ends at once naming it (:mod:`omnilearn.distributed.failures`).
        """
        if self.ledger.open is None or self.model is None:
            raise RuntimeError("run_step() needs the wrapped model and a batch the loader handed out")
        try:
            self._attempt_until_done(fn, batch)
        except Exception as e:  # this rank's alone (its peers wait in the step's collective): they end, naming it
            self._fail(e)
            raise

    def _attempt_until_done(self, fn, batch) -> None:
        """The step's attempts: each out-of-memory error lowers the cap and redoes it, or raises (FSDP2: always)."""
        params = list(self.model.parameters())
        had_grad = [p.grad is not None for p in params]
        resets = self.resets
        resets.watch(self.model, follow=True)  # what a failed attempt's forward announced
        while True:
            resets.begin()
            failure = memory.attempt(self.micro, fn, self._split(batch))
            if failure is None:
                resets.step_done()
                return
            if sharded.is_sharded(self.model):  # peers wait in this step's collectives: no redo
                raise RuntimeError(f"rank {self.rank}, step {self.ledger.open}: out of memory with a {failure.size}-"
                                   "sample micro-batch; out-of-memory recovery is not supported with FSDP2: set "
                                   "max_batch=<samples> below it (a share above the cap runs as micro-batches)")
            memory.clear_grads(params, had_grad)
            resets.after(failure)
            memory.free_memory(self.device)
            said = self.memory.after(failure, f"rank {self.rank}, step {self.ledger.open}")  # or raises
            print(f"omnilearn: {said}", file=sys.stderr, flush=True)


@dataclass
class WindowRead:
    """A meeting started at ``step``: its kind, the window's rows (INTERVAL) or the rows so far (CHECK: only their
    count is used), and once read, its table and decision."""

    meeting: Meeting
    kind: int
    step: int
    rows: list[list[float]]
    read: tuple[list[list[float]], Decision | None] | None = None


class IntervalEnds:
    """Window ends: at the interval's end, or at a check that sees a speed shift (see the module docstring)."""

    meeting: WindowRead | None = None

    @property
    def interval_ended(self) -> bool:
        """Whether the last reported step closed a control window (buffers equal, no open window)."""
        return self.ledger.window_size() == 0

    @property
    def at_interval_boundary(self) -> bool:
        """Whether the last reported step ends a whole number of control intervals in the open window: a window
        end, or a point inside one stretched for short steps where an unstretched run would end an interval
        (where ``omnilearn train`` saves a due checkpoint: the save syncs the buffers first)."""
        return self.ledger.window_size() % self.cfg.control_interval == 0

    def _end_interval(self, step: int) -> None:
        rows = self.ledger.take_rows()
        meeting = window_meeting(self.ctx, self.loop, self.schedule, INTERVAL, step, self.steps_done, rows,
                                 stop_requested(), cap=self.memory.reported(), reset=self.resets.report(),
                                 slots=self.slots, fingerprint=self.replica_fingerprint())
        self._started(WindowRead(meeting, INTERVAL, step, rows))

    def replica_fingerprint(self) -> tuple[float, float]:
        """This rank's replica fingerprint for a meeting (:mod:`omnilearn.bsp.replicas`): DDP replicas only."""
        if not isinstance(self.model, DDP) or self.world_size < 2:
            return replicas.NONE
        return replicas.fingerprint(self.model)

    def _check(self, step: int) -> None:
        """A look at the steps since the last check: the loop decides if some worker's speed clearly shifted."""
        rows = self.ledger.rows()
        meeting = window_meeting(self.ctx, self.loop, self.schedule, CHECK, step, self.steps_done, rows,
                                 cap=self.memory.reported(), reset=self.resets.report(), summarised=self.check_every,
                                 slots=self.slots)
        self._started(WindowRead(meeting, CHECK, step, rows[:]))

    def _started(self, read: WindowRead) -> None:
        self.meeting = read
        # by the read, a rank has sampled at most one step more than its row says, unless its loop samples further
        # ahead meanwhile: then it decides first (the schedule's hold), so no change can land on a sampled step
        self.schedule.hold(self.schedule.last_read + 1, self._decide)

    def _decide(self) -> None:
        """Wait for the meeting in flight and decide, as at the step after its own: on every rank the same
        decision whenever it runs (local: no collective). Its outcome applies at :meth:`_read_meeting`."""
        read = self.meeting
        if read is None or read.read is not None:
            return
        self.schedule.hold(None)
        try:
            table = read.meeting.table()
        except RuntimeError as e:
            self.meeting = None
            if peer_lost(e):
                self._fail(e)  # a lost peer: this rank saves the last step; finish() and close() skip collectives
            raise
        at = read.step + 1  # a change lands from at + 1 + lag on, after every step any rank can have sampled
        decision = feed(self.loop, self.schedule, at, table, read_ahead=1) if read.kind == INTERVAL else \
            check(self.loop, self.schedule, at, table, read_ahead=1)
        read.read = (table, decision)

    def _read_meeting(self) -> None:
        """The meeting in flight, decided and applied: at the next ``step()``, or where every rank flushes it."""
        read = self.meeting
        if read is None:
            return
        self._decide()
        self.meeting = None
        table, decision = read.read
        at = read.step + 1
        self.resets.met(reset_asked(table))
        if read.kind == INTERVAL:
            if self.cfg.memory is not None:
                self._check_memory_caps(table)
            self.should_stop = self.should_stop or stop_asked(table)
            step_s = interval_step_s(table)
            self.checks_on = checks_pay(step_s, self.check_every)
            self.intervals += 1
            self.window_steps = window_steps(step_s, self.cfg.control_interval, self.cfg.min_window_s,
                                             settled(decision, self.intervals))
            self._close_window(at, decision, read)
        elif decision is not None:  # recorded: the window ends with the steps the check saw
            self.ledger.take_first(len(read.rows))
            self._close_window(at, decision, read)

    def _close_window(self, step: int, decision, read: WindowRead) -> None:
        """After a decision: caps seen, the window's rows to this rank's file, rank 0 totals every rank's (the
        meeting carried them), buffers averaged, telemetry."""
        self._record_caps(step)
        self._warn_pinned()
        self.rank_rows.add(read.rows)
        self._average_buffers()
        if self.telemetry is not None:
            totals = Totals.of_table(read.meeting.rows(), self.cfg.global_batch) if read.rows else None
            effective = decision.effective_step
            self.telemetry.window(totals, decision, step + 1 + self.run.lag if effective is None else effective)

    def _warn_pinned(self) -> None:
        """Rank 0, once: a worker sits at ``min_batch`` and is still the slowest (the step waits for it)."""
        rank = self.loop.pinned
        if rank is None or self.telemetry is None or getattr(self, "pinned_warned", False):
            return
        self.pinned_warned = True
        self.telemetry.console.info(
            f"warning: worker {rank} sits at min_batch={self.cfg.min_batch} and is still the slowest, so every "
            f"step waits for it; lower min_batch (--min-batch) to let it take less")

    def _record_caps(self, step: int) -> None:
        """Rank 0: a ``memory_cap`` event for each worker whose reported cap changed at this interval end."""
        caps = getattr(self.loop, "caps", None)
        if self.telemetry is None or caps is None:
            return
        now = [int(c) if c < 2**62 else 0 for c in caps.reported]
        for rank, cap in enumerate(now):
            if cap != (self.caps_seen[rank] if self.caps_seen else 0):
                self.telemetry.events.write("memory_cap", step=step, rank=rank, cap=cap or None)
                self.telemetry.console.info(f"rank {rank}'s batch cap is now {cap or 'none'} (memory)")
        self.caps_seen = now
