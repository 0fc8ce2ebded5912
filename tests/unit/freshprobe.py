"""A probe for tests/unit/test_fresh_children.py: what a worker process starts with (random draws, signal handling).

``python freshprobe.py OUT NAME`` (or :func:`probe` as a launcher's rank target) writes ``OUT/NAME-<pid>.json``:
one numpy global-RandomState draw, one ``random`` draw, and every signal's disposition by name.
``python freshprobe.py OUT --forkserver``: three ranks (two, then a restart) forked by the PyTorch launcher's fork
server (:func:`omnilearn.experiments.launch.supervise.start_context`, numpy.random preloaded, as torch and TensorFlow import it), and one fresh interpreter.

Run: ``python -m pytest -q tests/unit/test_fresh_children.py``
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path


def _disposition(handler) -> str:
    if handler is signal.SIG_IGN:
        return "ignored"
    if handler is signal.SIG_DFL:
        return "default"
    if handler is signal.default_int_handler:
        return "default_int_handler"
    return "outside Python" if handler is None else "a Python handler"


def state() -> dict:
    import numpy as np

    signals = {}
    for s in signal.valid_signals():
        if s not in (signal.SIGKILL, signal.SIGSTOP):
            signals[str(s)] = _disposition(signal.getsignal(s))
    blocked = sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    return {"numpy": float(np.random.random()), "random": random.random(), "signals": signals, "blocked": blocked}


def probe(name, out: str) -> None:
    Path(out, f"{name}-{os.getpid()}.json").write_text(json.dumps(state()))


def forkserver_ranks(out: str) -> None:
    """Ranks 0 and 1, then rank 0 again (a restart), from the PyTorch launcher's fork server; then a fresh python."""
    from omnilearn.experiments.launch import supervise

    supervise.PRELOAD = ("numpy.random", "omnilearn.experiments.launch.supervise", "freshprobe")
    context = supervise.start_context()
    assert context.get_start_method() == "forkserver", "TMPDIR too long for the fork server's socket?"
    for rank in (0, 1, 0):
        p = context.Process(target=supervise.in_launch_env, args=(rank, *supervise.launch_env(probe), out))
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode
    subprocess.run([sys.executable, __file__, out, "fresh"], check=True)


if __name__ == "__main__":
    if sys.argv[2] == "--forkserver":
        forkserver_ranks(sys.argv[1])
    else:
        probe(sys.argv[2], sys.argv[1])
