"""A child forked from a fork server made as a spawned process would be: its own random state, fresh signal handling.

Both launchers fork their workers from a server that imported the heavy
modules once (PyTorch: multiprocessing's ``forkserver`` preloaded with
:data:`~omnilearn.experiments.launch.supervise.PRELOAD`; TensorFlow:
:mod:`omnilearn.experiments.launch.tfforks`). A fork copies the server's
state, so without care every worker, and every restart of one, would
start with the same numpy global ``RandomState`` (seeded once, when the
server imported numpy), where spawned interpreters each draw a fresh seed
from the OS. And the server's signal dispositions (multiprocessing's server
ignores SIGINT; ``tfforks`` used to reset SIGPIPE to its default, so a
closed pipe killed a worker silently) would be the worker's.

- :func:`reseed` (in the child, first thing): numpy's global ``RandomState``
  from fresh OS entropy, as ``import numpy`` does in a new interpreter;
  ``random`` reseeds itself after a fork (CPython's at-fork hook) and is
  reseeded here too for good measure. PyTorch's default generator starts
  from the same fixed seed in every fresh interpreter, so a forked rank
  sharing it with its peers is what spawn gives too: left alone.
- :data:`AT_START` (taken when this module is imported, which the servers
  do before they change any handler) and :func:`restore_signals`: every
  signal's disposition as the server's interpreter had it at start, which is
  what a fresh ``python`` started by the launcher has (SIGPIPE and SIGXFSZ
  ignored, SIGINT ``default_int_handler``, the rest default, or ignored where
  the launcher ignored it: ``nohup``), and the signal mask.

Pure Python (no torch). Run: ``python -m pytest -q tests/unit/test_fresh_children.py``
"""

from __future__ import annotations

import random
import signal
import sys


def _dispositions() -> dict[int, object]:
    """Every catchable signal's Python-level handler now (``None``: set outside Python, left alone)."""
    found = {}
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            found[s] = signal.getsignal(s)
        except (ValueError, OSError):
            continue
    return found


AT_START: dict[int, object] = _dispositions()
MASK_AT_START: set[int] = set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) if hasattr(signal, "pthread_sigmask") \
    else set()


def reseed() -> None:
    """Fresh OS entropy for the random generators a preload left seeded alike in every child."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # no argument: from the OS, as numpy's import does


def restore_signals() -> None:
    """Put every signal's handler and the signal mask back to what the server's interpreter had at start."""
    for s, handler in AT_START.items():
        if handler is None:
            continue
        try:
            signal.signal(s, handler)
        except (ValueError, OSError):
            pass
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_SETMASK, MASK_AT_START)


def become_fresh() -> None:
    """In a forked child, first thing: :func:`restore_signals`, then :func:`reseed`."""
    restore_signals()
    reseed()
