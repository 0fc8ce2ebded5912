"""A stop asked for by a signal: SIGTERM/SIGINT set a flag; training loops end at their next safe point.

The launcher (``omnilearn train``) and torchrun send SIGTERM to every worker
on Ctrl-C, ``kill`` or a failure elsewhere (torchrun then waits
``--shutdown-timeout``, 30 s by default, before SIGKILL). A worker's handler
only records the request (:func:`stop_requested`); the BSP session agrees on
it across ranks at the next control interval end (one flag in the interval's
all-gather), turns ``should_stop`` true on every rank after the same step,
and the loop writes a final checkpoint and ends (the harness raises
:class:`Stopped`; a user's script exits with :func:`exit_code`). A second
signal more than a second later gives up on the safe point and exits at
once, as does the launcher after its grace period (one within a second is
the same stop delivered twice: ``kill -TERM -<pgid>`` reaches every process,
and the launcher and torchrun forward one too).

Who installs the handlers (:func:`install_handlers`, main thread only): the
harness's ranks, and ``omnilearn.setup()`` unless ``handle_signals=False``
(docs/failures.md, "Stopping your own script", says why this is the
default); ``omnilearn.setup()`` off the main thread refuses
``handle_signals=True`` in one line (:func:`refuse_off_main_thread`), except
in a Ray Train worker, where Ray owns stops and restarts (docs/ray.md).
A handler already there is never silently replaced: one of ours stays;
Python's default (SIG_DFL, KeyboardInterrupt) is replaced; a Python handler
of the user's is chained (it still runs on every signal, after the flag is
set); SIG_IGN stays ignored; a handler set outside Python is left alone and
reported. :func:`restore_handlers` puts back what was replaced.

Pure Python (no torch). Run: ``python -m pytest -q tests/faults/test_api_stops.py tests/faults/test_stops.py
tests/ray/test_threads.py``
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

_requested = threading.Event()
_signal_name: list[str] = []
_signal: list[tuple[int, float]] = []  # (signum, monotonic time) of the first signal
_replaced: dict[int, object] = {}  # signum -> the handler install_handlers() replaced (restore_handlers)
_announce: list[bool] = [False]  # say on stderr what the first signal does (omnilearn.setup() on rank 0)
_leaving: list[bool] = [False]  # ending after a failure: a signal says nothing (leaving())
DUPLICATE_S = 1.0  # a second signal this soon is the same stop (kill -TERM -<pgid> and the launcher both send one)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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


def exit_code() -> int:
    """What a process that stopped on request exits with: 128 + its signal (SIGINT 130, SIGTERM 143).

    143 where this process got no signal itself (a peer's stop, or :func:`request_stop`).
    """
    return 128 + (signal_number() or signal.SIGTERM)


def clear() -> None:
    """Forget a request (tests, and a process that starts a new run)."""
    _leaving[0] = False
    _requested.clear()
    _signal_name.clear()
    _signal.clear()


def leaving() -> None:
    """This process is ending after a failure (a survivor of a lost peer, saving and raising on): a stop signal now
    still waits for the save, but says nothing (its "stopping after the next control interval end" would not
    happen)."""
    _leaving[0] = True


def _note(signum: int) -> bool:
    """Record a stop signal; True when it is a second, later one: no safe point, leave now."""
    now = time.monotonic()
    if _requested.is_set():
        return not (_signal and now - _signal[0][1] < DUPLICATE_S)  # within a second: the same stop, twice
    _signal.append((signum, now))
    name = signal.Signals(signum).name
    request_stop(f"{name} received")
    if _announce[0] and not _leaving[0]:  # os.write: print() could re-enter a stderr write the signal interrupted
        os.write(2, f"omnilearn: {name} received: stopping after the next control interval end "
                    f"(ol.should_stop); send it again to exit at once\n".encode())
    return False


def _handler(signum: int, frame) -> None:
    if _note(signum):
        sys.exit(128 + signum)


class _Chained:
    """The stop flag, then the handler that was there before (the user's own: it still runs on every signal)."""

    def __init__(self, previous: Callable) -> None:
        self.previous = previous

    def __call__(self, signum: int, frame) -> None:
        leave = _note(signum)
        self.previous(signum, frame)
        if leave:
            sys.exit(128 + signum)


def install_handlers(signals: tuple[int, ...] = STOP_SIGNALS, announce: bool = False) -> list[str]:
    """Make ``signals`` request a stop instead of killing the process; returns why any was left alone.

    Main thread only (Python's rule; elsewhere nothing is installed and the
    note says so). What was there before: see the module docstring.
    ``announce``: the first signal prints one line saying what it does.
    """
    names = "/".join(signal.Signals(s).name for s in signals)
    if threading.current_thread() is not threading.main_thread():
        return [f"{names} not handled: Python installs signal handlers from the main thread only, so should_stop "
                f"stays False; call omnilearn.setup() (or omnilearn.stopping.install_handlers()) from the main thread"]
    notes = []
    _announce[0] = _announce[0] or announce
    for s in signals:
        current = signal.getsignal(s)
        if current is _handler or isinstance(current, _Chained) or current is signal.SIG_IGN:
            continue  # ours already; or this process was started to ignore it
        if current is None:
            notes.append(f"{signal.Signals(s).name} has a handler installed outside Python; left alone, so it "
                         f"does not set should_stop (pass handle_signals=False to silence this)")
            continue
        default = current in (signal.SIG_DFL, signal.default_int_handler)
        signal.signal(s, _handler if default else _Chained(current))
        _replaced[s] = current
    return notes


def refuse_off_main_thread(who: str) -> None:
    """Refuse, in one line (:class:`~omnilearn.config.ConfigError`), stop signals asked for off the main thread, where
    Python cannot install their handlers (``should_stop`` would never turn true); before anything is set up."""
    thread = threading.current_thread()
    if thread is not threading.main_thread():
        from omnilearn.config import ConfigError  # torch-free

        raise ConfigError(f"{who} in thread {thread.name!r}: Python installs signal handlers from the main thread "
                          "only, so SIGTERM/SIGINT could not set ol.should_stop; pass handle_signals=False (and stop "
                          "the run yourself), or call it from the main thread")


def handle_for_run(world_size: int, is_main: bool, who: str) -> None:
    """What ``setup(handle_signals=True)`` does, in either runtime: SIGTERM, and SIGINT where there are peers (each
    rank gets Ctrl-C: one agreed stop, not n KeyboardInterrupts); a lone process keeps Ctrl-C as KeyboardInterrupt.
    Rank 0 announces the first signal; a handler left alone is a warning naming ``who``."""
    import warnings

    signals = STOP_SIGNALS if world_size > 1 else (signal.SIGTERM,)
    for note in install_handlers(signals, announce=is_main):
        warnings.warn(f"{who}: {note}", RuntimeWarning, stacklevel=3)


def restore_handlers() -> None:
    """Put back the handlers :func:`install_handlers` replaced, where ours is still there (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    while _replaced:
        s, previous = _replaced.popitem()
        current = signal.getsignal(s)
        if current is _handler or isinstance(current, _Chained):  # not one set over ours since
            signal.signal(s, previous)
    _announce[0] = False
