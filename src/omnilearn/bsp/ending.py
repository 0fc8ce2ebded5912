"""The end of a run, and of a rank: buffers made equal, the summary, the teardown, one rank's failure told.

A mixin of :class:`~omnilearn.bsp.session.Session`: ``sync_buffers()``
(a meeting, then the batch-share-weighted average of the buffers),
``finish()`` (the last window flushed, the buffers equalised, every rank's
sums gathered to rank 0 and the summary written), ``release()`` and
``close()`` (give back throttles, loader workers and the process group),
and ``_fail`` (this rank's own error announced in the group's store, so
every peer ends naming it: :mod:`omnilearn.distributed.failures`).

Run: ``python -m pytest -q tests/dist/test_api.py tests/dist/test_teardown.py tests/dist/test_rank_errors.py``
"""

from __future__ import annotations

import sys

import torch

from omnilearn.bsp import rescue, sharded
from omnilearn.bsp.interval import SYNC_BUFFERS, meet
from omnilearn.distributed import group
from omnilearn.distributed.collect import average_buffers, gather_to_main
from omnilearn.distributed.lost import peer_lost
from omnilearn.observe.modelfile import saver


class Ending:
    """``sync_buffers``, ``finish``, ``release``, ``close`` (see the module docstring)."""

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
        meet(self.ctx, SYNC_BUFFERS, self.steps_done, slots=self.slots, fingerprint=self.replica_fingerprint())
        self._average_buffers()

    def _average_buffers(self) -> None:
        if self.model is None or not self.ctx.grouped:
            return
        # the shares of the last step begun (the first before any): they sum to 1 over the ranks
        weight = self.schedule.peek(max(self.ledger.last_started, 0))[self.rank] / self.cfg.global_batch
        average_buffers(self.ctx, list(self.model.buffers()), weight)

    def finish(self) -> dict | None:
        """Flush the last interval, equalise buffers, write the summary (rank 0's dict; None elsewhere).

        After this rank failed (:meth:`_fail`; e.g. ``finish()`` in a ``finally:``) only :meth:`release`: the
        peers are gone, and a collective would wait for them. Called while an out-of-memory error propagates
        (a ``finally:`` after one in the user's own code), that error is this rank's failure too."""
        propagating = sys.exc_info()[1]
        if self.failed is None and (isinstance(propagating, torch.OutOfMemoryError) or peer_lost(propagating)):
            self._fail(propagating)
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

    def release(self) -> None:
        """Give back OS throttles and end the loader's worker processes (idempotent); never hides the run's own
        outcome. ``finish()`` and ``close()`` call it; a loop left early calls it to let go at once. While a lost
        peer's error propagates (a ``finally:``), this rank saves the last completed step first."""
        propagating = sys.exc_info()[1]
        if self.failed is None and peer_lost(propagating):
            self._fail(propagating)
        rescue.unguard(self)
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
            try:
                group.barrier()
            except RuntimeError as e:
                if peer_lost(e):
                    self._fail(e)
                    group.destroy()
                raise
        group.destroy(wait_s=3.0)  # every rank passed the barrier: wait until every rank has torn down

    def _fail(self, error: BaseException, own: bool = False) -> None:
        """This rank alone failed with ``error`` (its peers wait for it in a collective): announce it, so every
        peer ends within a second or so naming this rank (:mod:`omnilearn.distributed.failures`); then re-raise.
        ``finish()`` and ``close()`` skip their collectives after it. Nothing to tell without peers. A collective
        that failed because a peer is gone (not ``own``) is no failure of this rank: it saves the last completed
        step instead (:mod:`omnilearn.bsp.rescue`), and skips those collectives too."""
        if not own and peer_lost(error):
            self.failed = self._lost(error)
        elif self.failures is not None:
            self.failed = self.failures.announce(error)
