"""The parameter server's checkpoints: when one is due, what it holds, resuming from one, stopping on a signal.

Due every ``checkpoint_every`` steps (a step is ``n`` push slots, see
:mod:`omnilearn.asp.server`), checked after each request and never while an
evaluation runs (it comes right after). One checkpoint
(:class:`~omnilearn.checkpoint.CheckpointStore`, step = the server's step)
holds plain values and tensors only::

    kind "asp", workers, version, slots (numerator, denominator), train_s,
    model, optimizer, scheduler        (state_dicts)
    dealer    epoch, cursor, and the re-deal queue: the indices taken back
              from dropped workers PLUS those the workers hold right now (a
              restart deals them again; their pushes, if any come after the
              checkpoint, are lost with the process)
    coverage  per-epoch samples applied and the open epochs' bitmaps
    staleness, control (live workers, ControlLoop, window), evaluated_epoch,
    log       the record's counters (ASPLog.state_dict)

Before saving, the record's held events are written, so ``metrics.jsonl``
holds every event up to the checkpoint's version; the save's time is a
pause of the training clock (a worker's silence is timed by its listener,
which does not wait on the save).

Resume (``omnilearn train --resume``, :meth:`Snapshots.resume`): the newest
checkpoint that loads is restored and a ``resume`` event (``version``,
``step``) appended; records after that version before it are void
(:func:`~omnilearn.observe.metrics.replay`). The workers need nothing: they
are new processes and pull the weights at their first request. A relaunch
starts every worker again, so workers dropped before the checkpoint are
taken back in: then the controller starts afresh for all ``n``. No
checkpoint yet: the run starts over from version 0, with an ``omnilearn:
warning:`` line (the ``resume`` event at version 0 voids the earlier
attempt's records). Checkpoints that are all damaged, one that passed its
checksum and does not load, or one of another run shape: one line naming
the file, never a fresh start (:meth:`~omnilearn.checkpoint.CheckpointStore.read_latest`).

Stop signal (:mod:`omnilearn.stopping`): at the next request outside an
evaluation the server saves a checkpoint, then tells each worker to stop,
then raises :class:`~omnilearn.stopping.Stopped`.

Run its tests: ``python -m pytest -q tests/faults/test_asp_faults.py -k resume``
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

from omnilearn import stopping
from omnilearn.checkpoint import CheckpointError, CheckpointStore
from omnilearn.observe.console import warn

KIND = "asp"


class Snapshots:
    def __init__(self, server, store: CheckpointStore | None) -> None:
        self.server, self.store = server, store
        self.every = server.settings.checkpoint_every if store is not None else 0
        self.next_step = self.every or None
        self.stop_reason: str | None = None

    def after_request(self) -> None:
        """Save a due checkpoint; on a stop signal save one and make the server stop."""
        server = self.server
        if server.evaluation is not None:
            return
        if self.stop_reason is None and stopping.stop_requested():
            saved = self.save() if self.store is not None else False
            self.stop_reason = (f"{stopping.reason() or 'a stop signal'}: stopped at version {server.version} "
                                + ("after a checkpoint; continue with --resume" if saved else "(no checkpoint)"))
        elif self.next_step is not None and server.step >= self.next_step:
            self.save()

    def save(self) -> bool:
        server = self.server
        start = time.perf_counter()
        server.clock.pause(start)
        server.log.flush()
        meta = {"mode": KIND, "version": server.version, "step": server.step, "workers": server.n,
                "live": sorted(server.members.live)}
        self.store.save(server.step, self.state_dict(), meta)
        end = time.perf_counter()
        server.clock.resume(end)
        if self.every:
            self.next_step = (server.step // self.every + 1) * self.every
        return True

    def state_dict(self) -> dict:
        server = self.server
        pending = list(server.outstanding.values()) + [deal for *_, deal in server.held if deal is not None]
        return {
            "kind": KIND, "workers": server.n, "version": server.version,
            "slots": [server.slots.numerator, server.slots.denominator], "train_s": server.clock.train_s(),
            "model": server.model.state_dict(), "optimizer": server.opt.state_dict(),
            "scheduler": server.sched.state_dict(), "dealer": server.dealer.state_dict(pending),
            "coverage": server.coverage.state_dict(), "staleness": server.staleness.state_dict(),
            "control": server.control.state_dict(), "evaluated_epoch": server.evaluated_epoch,
            "log": server.log.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        server = self.server
        if state.get("kind") != KIND:
            raise CheckpointError(f"it is not a checkpoint of an ASP server (kind {state.get('kind')!r})")
        if state["workers"] != server.n:
            raise CheckpointError(f"it was written by a run with {state['workers']} workers and this one has "
                                  f"{server.n}; resume with --workers {state['workers']}")
        server.model.load_state_dict(state["model"])
        server.opt.load_state_dict(state["optimizer"])
        server.sched.load_state_dict(state["scheduler"])
        server.version, server.slots = int(state["version"]), Fraction(*state["slots"])
        server.dealer.load_state_dict(state["dealer"])
        server.coverage.load_state_dict(state["coverage"])
        server.staleness.load_state_dict(state["staleness"])
        if state["control"]["live"] == list(range(server.n)):  # else: every worker is back, the control starts afresh
            server.control.load_state_dict(state["control"])
        server.evaluated_epoch = int(state["evaluated_epoch"])
        server.clock.restore(float(state["train_s"]))

    def resume(self) -> None:
        """Restore the newest intact checkpoint (none at all: start over, saying so); mark the record with ``resume``."""
        server = self.server
        found = self.store.load_latest() if self.store is not None else None
        if found is None:
            if self.store is not None:
                warn(f"--resume: no checkpoint in {self.store.dir} yet (the run stopped before its first); "
                     "starting over from version 0")
            server.log.resume({}, 0, 0)
            return
        step, state = found
        try:
            self.load_state_dict(state)
        except (CheckpointError, KeyError, TypeError, ValueError, RuntimeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"checkpoint {self.store.path(step)} does not fit this run: {first}") from None
        if self.every:
            self.next_step = (server.step // self.every + 1) * self.every
        server.log.resume(state.get("log", {}), server.version, server.step)
        if math.floor(server.slots) >= server.total_pushes:
            server.log.console.info(f"the checkpoint at version {server.version} ends the run: nothing left to train")
