"""Fault injection for tests: ``OMNILEARN_FAULT_KILL_AT=<rank>:<step>`` makes that rank SIGKILL itself at ``step``.

With ``OMNILEARN_FAULT_STAMP=<file>`` it first writes the time into that file
(:mod:`omnilearn.experiments.faultbench` measures the time to resume from it).
The PyTorch trainer skips it in a resumed run (so a restarted run goes past
it); the TensorFlow job has no resume. No torch here.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def kill_step(rank: int) -> int | None:
    """The step at which ``OMNILEARN_FAULT_KILL_AT=<rank>:<step>`` kills this rank, if it names this rank."""
    spec = os.environ.get("OMNILEARN_FAULT_KILL_AT")
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
