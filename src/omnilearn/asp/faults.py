"""Fault injection for tests of the ASP runtime: a process SIGKILLs itself at a chosen point. Pure Python.

Set ``OMNILEARN_FAULT_KILL_AT=RANK:COUNT[:PHASE]`` in the environment of
the processes of a run (the spawned ones inherit it) and process ``RANK``
kills itself with SIGKILL, as a crash or the OOM killer would:

- a worker (``RANK`` >= 1) at its ``COUNT``-th push (counted from 1 in this
  process): ``PHASE`` ``before`` (the default) once it computed the
  gradient, before sending it: the server sees it fall silent; ``after``
  once the push was sent, before taking the reply: the server's reply to it
  fails (a gloo error on that connection);
- the server (``RANK`` 0) once it answered the request that brought it to
  version ``COUNT`` (after any checkpoint due at that version); it takes no
  ``PHASE``.

The harness (:mod:`omnilearn.experiments.asp_train`) arms it only in a run
that is not a resume, so a restarted run goes past the point (as BSP's
trainer does with the same variable, ``RANK:STEP``).

Unset (always, outside tests), nothing happens: one environment lookup per
process. A malformed value is a one-line ``ValueError`` naming it.
Used by ``tests/faults/test_asp_faults.py``.

Run its tests: ``python -m pytest -q tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

ENV = "OMNILEARN_FAULT_KILL_AT"
PHASES = ("before", "after")


@dataclass(frozen=True)
class KillPoint:
    rank: int
    count: int
    phase: str = "before"

    def reached(self, count: int, phase: str = "before") -> None:
        """SIGKILL this process once ``count`` reached this point's count, in its phase."""
        if count >= self.count and phase == self.phase:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_point(rank: int) -> KillPoint | None:
    """This process's kill point from :data:`ENV`; None when unset or meant for another rank."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    parts = value.split(":")
    try:
        point = KillPoint(int(parts[0]), int(parts[1]), *parts[2:3])
    except (ValueError, IndexError, TypeError):
        point = None
    if (point is None or len(parts) > 3 or point.phase not in PHASES or point.rank < 0 or point.count < 1
            or (point.rank == 0 and len(parts) == 3)):
        raise ValueError(f"{ENV}={value!r} is not RANK:COUNT[:PHASE] (PHASE {' or '.join(PHASES)}, workers only), "
                         "e.g. 2:5:after or 0:30")
    return point if point.rank == rank else None
