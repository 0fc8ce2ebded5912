"""Fault injection for tests of the ASP runtime: a process SIGKILLs (or SIGSTOPs) itself at a chosen point.

Set ``OMNILEARN_FAULT_KILL_AT=RANK:COUNT[:PHASE[:SIGNAL]]`` in the
environment of the processes of a run (the spawned ones inherit it) and
process ``RANK`` sends itself ``SIGNAL`` -- ``KILL`` (the default: a crash,
the OOM killer) or ``STOP`` (frozen: a paused VM, a debugger, a machine cut
off the network; it never runs again and the test kills it at the end):

- a worker (``RANK`` >= 1) at its ``COUNT``-th push (counted from 1 in this
  process), in ``PHASE``: ``before`` (the default) once it computed the
  gradient, before sending it: the server sees it fall silent; ``sending``
  right after it posted its request's header (gloo sends the bytes only once
  the receiver is ready: if the server was not waiting yet, it takes up the
  request and the header's bytes never come; if it was, its gradients never
  come); ``after`` once the push was sent,
  before taking the reply: the server's reply to it fails (killed: a gloo
  error on that connection) or is never taken (stopped);
- the server (``RANK`` 0) once it answered the request that brought it to
  version ``COUNT`` (after any checkpoint due at that version); it takes no
  ``PHASE`` nor ``SIGNAL``.

The harness (:mod:`omnilearn.experiments.train.asp`) arms it only in a run
that is not a resume, so a restarted run goes past the point (as BSP's
trainer does with the same variable, ``RANK:STEP``).

Unset (always, outside tests), nothing happens: one environment lookup per
process. A malformed value is a one-line ``ValueError`` naming it.
Used by ``tests/faults/test_asp_faults.py``.

Run its tests: ``python -m pytest -q tests/faults/test_asp_faults.py tests/unit/test_aspmath.py -k fault``
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from omnilearn.distributed import ps

ENV = "OMNILEARN_FAULT_KILL_AT"
PHASES = ("before", "sending", "after")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass(frozen=True)
class KillPoint:
    rank: int
    count: int
    phase: str = "before"
    signal: str = "KILL"

    def reached(self, count: int, phase: str = "before") -> None:
        """Signal this process once ``count`` reached this point's count, in its phase.

        A worker calls this ``before`` and ``after`` sending a push; ``sending`` is armed at ``before``
        and fires inside the send (:func:`omnilearn.distributed.ps.after_next_header`).
        """
        if count < self.count:
            return
        if phase == self.phase:
            self.fire()
        elif self.phase == "sending" and phase == "before":
            ps.after_next_header(self.fire)

    def fire(self) -> None:
        os.kill(os.getpid(), SIGNALS[self.signal])


def kill_point(rank: int) -> KillPoint | None:
    """This process's kill point from :data:`ENV`; None when unset or meant for another rank."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    parts = value.split(":")
    try:
        point = KillPoint(int(parts[0]), int(parts[1]), *parts[2:4])
    except (ValueError, IndexError, TypeError):
        point = None
    if (point is None or len(parts) > 4 or point.phase not in PHASES or point.signal not in SIGNALS
            or point.rank < 0 or point.count < 1 or (point.rank == 0 and len(parts) > 2)):
        raise ValueError(f"{ENV}={value!r} is not RANK:COUNT[:PHASE[:SIGNAL]] (PHASE {', '.join(PHASES)}; SIGNAL "
                         f"{' or '.join(SIGNALS)}; workers only), e.g. 2:5:after, 2:5:sending:STOP or 0:30")
    return point if point.rank == rank else None
