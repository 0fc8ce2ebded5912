"""Fault injection for tests: ``OMNILEARN_FAULT_KILL_AT=<rank>:<step>`` makes that rank SIGKILL itself at ``step``;
``OMNILEARN_FAULT_HANG_AT=<rank>:<step>`` makes it SIGSTOP itself there (a hung worker, for the TensorFlow job's
watchdog).

With ``OMNILEARN_FAULT_STAMP=<file>`` it first writes the time into that file
(:mod:`omnilearn.experiments.bench.faults` measures the time to resume from it).
The trainers skip both in a resumed run (so a restarted run goes past them).
No torch here.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def kill_step(rank: int, variable: str = "OMNILEARN_FAULT_KILL_AT") -> int | None:
    """The step at which ``OMNILEARN_FAULT_KILL_AT=<rank>:<step>`` kills this rank, if it names this rank."""
    spec = os.environ.get(variable)
    if not spec:
        return None
    target, _, step = spec.partition(":")
    return int(step) if int(target) == rank else None


def die() -> None:
    """SIGKILL this process now (the time first, where ``OMNILEARN_FAULT_STAMP`` names a file)."""
    stamp = os.environ.get("OMNILEARN_FAULT_STAMP")
    if stamp:
        Path(stamp).write_text(f"{time.time():.6f}")
    os.kill(os.getpid(), signal.SIGKILL)


def hang_step(rank: int) -> int | None:
    """The step at which ``OMNILEARN_FAULT_HANG_AT=<rank>:<step>`` stops this rank, if it names this rank."""
    return kill_step(rank, "OMNILEARN_FAULT_HANG_AT")


def freeze() -> None:
    """SIGSTOP this process: every thread stops, heartbeats too, until SIGCONT or SIGKILL."""
    os.kill(os.getpid(), signal.SIGSTOP)
