"""A stop asked for by a signal: SIGTERM/SIGINT set a flag; training loops end at their next safe point.

The launcher (``omnilearn train``) and torchrun send SIGTERM to every worker
on Ctrl-C, ``kill`` or a failure elsewhere. A worker's handler only records
the request (:func:`stop_requested`); the BSP session agrees on it across
ranks at the next control interval end (one flag in the interval's
all-gather), writes a final checkpoint where the loop has one, and raises
:class:`Stopped`. A second signal gives up on the safe point and exits at
once, as does the launcher after its grace period.

Pure Python (no torch). Run: ``python -m pytest -q tests/faults``
"""

from __future__ import annotations

import signal
import sys
import threading

_requested = threading.Event()
_signal_name: list[str] = []


class Stopped(RuntimeError):
    """Training ended early because a stop was asked for (a signal); not a failure of this rank."""


def request_stop(reason: str = "a stop was requested") -> None:
    if not _requested.is_set():
        _signal_name.append(reason)
    _requested.set()


def stop_requested() -> bool:
    return _requested.is_set()


def reason() -> str:
    return _signal_name[0] if _signal_name else ""


def clear() -> None:
    """Forget a request (tests, and a process that starts a new run)."""
    _requested.clear()
    _signal_name.clear()


def _handler(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if _requested.is_set():  # the second signal: no safe point, leave now
        sys.exit(128 + signum)
    request_stop(f"{name} received")


def install_handlers(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Make ``signals`` request a stop instead of killing the process (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        signal.signal(s, _handler)
