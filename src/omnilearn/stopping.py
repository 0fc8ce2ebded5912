"""A stop asked for by a signal: SIGTERM/SIGINT set a flag; training loops end at their next safe point.

The launcher (``omnilearn train``) and torchrun send SIGTERM to every worker
on Ctrl-C, ``kill`` or a failure elsewhere. A worker's handler only records
the request (:func:`stop_requested`); the BSP session agrees on it across
ranks at the next control interval end (one flag in the interval's
all-gather), writes a final checkpoint where the loop has one, and raises
:class:`Stopped`. A second signal more than a second later gives up on the
safe point and exits at once, as does the launcher after its grace period
(one within a second is the same stop delivered twice: ``kill -TERM -<pgid>``
reaches every process, and the launcher forwards one too).

Pure Python (no torch). Run: ``python -m pytest -q tests/faults``
"""

from __future__ import annotations

import signal
import sys
import threading
import time

_requested = threading.Event()
_signal_name: list[str] = []
_signal: list[tuple[int, float]] = []  # (signum, monotonic time) of the first signal
DUPLICATE_S = 1.0  # a second signal this soon is the same stop (kill -TERM -<pgid> and the launcher both send one)


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


def signal_number() -> int | None:
    """The signal that asked for the stop (None: none, or asked for in code)."""
    return _signal[0][0] if _signal else None


def clear() -> None:
    """Forget a request (tests, and a process that starts a new run)."""
    _requested.clear()
    _signal_name.clear()
    _signal.clear()


def _handler(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    now = time.monotonic()
    if _requested.is_set():
        if _signal and now - _signal[0][1] < DUPLICATE_S:
            return  # the same stop, delivered twice (the process group and the launcher)
        sys.exit(128 + signum)  # a second, later signal: no safe point, leave now
    _signal.append((signum, now))
    request_stop(f"{name} received")


def install_handlers(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """Make ``signals`` request a stop instead of killing the process (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals:
        signal.signal(s, _handler)
