"""Heartbeat watchdog: a rank that stops answering is named within ``heartbeat_s``, not after the collective timeout.

Each rank runs one daemon thread. Every ``heartbeat_s / 6`` it adds 1 to its
own counter ``omnilearn/hb/<generation>/<rank>`` in the process group's store
and reads the counters of the ranks it watches (:func:`peers_of`):

- BSP (every rank is needed at every step): the next two ranks, a ring:
  every rank is watched by two others, so store traffic grows linearly with
  the world.
- ASP (only the parameter server, rank 0, is needed): each worker watches
  rank 0 alone. The server watches nobody -- it drops a dead or silent
  worker itself and goes on (:mod:`omnilearn.asp.membership`) -- but still
  beats, for its workers. Verdicts name it ``the parameter server (rank 0)``
  (:func:`rank_name`).

A watched counter that has not moved for ``heartbeat_s`` -- local monotonic
time of the last change, no clocks compared across hosts -- means every
thread of that rank stopped: hung, SIGSTOPped or dead. The watcher then
writes ``error-rank<own rank>.log`` naming THAT rank (:func:`hung_rank` reads
it back) and ends its own process with ``os._exit(1)``; the launcher (or
torchrun) stops the rest. A peer not heard from at all yet (still starting)
is given ``first_beat_s``. A slow rank is not a hung one: its thread still
beats. A rank that ends, normally or with its own error, says goodbye (its
counter jumps by :data:`DONE`), so a finished peer is never taken for a hung
one. A watcher that was itself frozen restarts its clocks instead of blaming
its peers. A store that fails or does not answer within ``heartbeat_s`` (the
process holding it is gone) ends the rank with a line saying so.

The thread talks to a clone of the store it is given (:func:`start_watchdog`:
the default group's), with its own connection and timeout: one ``add`` and
a read per watched rank per tick, at most 0.3 store operations a second per
rank at the default ``heartbeat_s`` of 60. :func:`running` tells a library
caller whether the launcher already runs one in this process. Limits: it
checks that a rank's process runs, not that its training progresses (a main
thread deadlocked with the GIL released still beats: the collective timeout
catches that); a rank SIGSTOPped in the microseconds it holds a FileStore's
file lock blocks its watchers' store calls too.

A rank that raises an error of its own, rather than falling silent, is
named faster: it announces the error in the same store and its peers end at
once (:mod:`omnilearn.distributed.failures`, a thread of its own polling
every 0.5 s, so the heartbeat's cadence stays cheap).

Error logs: :func:`write_error_log` is how any rank reports what ended it
(the watchdog's verdicts and a rank's own exceptions alike);
:func:`read_error_logs` is how the launcher reads them back.

Run: ``python -m pytest -q tests/faults/test_stops.py``
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from omnilearn.distributed.group import DistContext, default_store

PREFIX = "omnilearn/hb"
MODES = ("bsp", "asp")  # who watches whom: see peers_of
SERVER = 0  # the parameter server's rank in ASP
BEATS_PER_HEARTBEAT = 6  # ticks per heartbeat_s: a silence is noticed between heartbeat_s and 7/6 of it
WATCHED_PEERS = 2  # BSP: each rank watches the next ones in the ring
DONE = 1 << 40  # added to a counter when its rank leaves: watchers stop watching it
_HUNG = re.compile(r"^(?:worker rank (\d+)|the parameter server \(rank (\d+)\)) stopped answering:")
_generations = itertools.count()  # one key space per watchdog a process starts (same sequence on every rank)
_running: set["Watchdog"] = set()


def rank_name(rank: int, mode: str = "bsp") -> str:
    """How messages name a rank: ``worker rank R``; in ASP rank 0 is ``the parameter server (rank 0)``."""
    return f"the parameter server (rank {rank})" if mode == "asp" and rank == SERVER else f"worker rank {rank}"


def hung_message(rank: int, limit_s: float, heard: bool = True, mode: str = "bsp") -> str:
    """The verdict on a rank silent for ``limit_s`` (``heard``: it had beaten before, else it never did)."""
    if not heard:
        return (f"{rank_name(rank, mode)} stopped answering: no heartbeat at all in its first {limit_s:g} s "
                f"(hung, stopped or dead while starting)")
    return (f"{rank_name(rank, mode)} stopped answering: no heartbeat for {limit_s:g} s "
            f"(hung, stopped or dead; --heartbeat-s {limit_s:g})")


def hung_rank(cause: str) -> int | None:
    """The rank a watchdog's error line blames, or None for any other error."""
    found = _HUNG.match(cause)
    return int(found.group(1) or found.group(2)) if found else None


def peers_of(rank: int, world_size: int, mode: str = "bsp", k: int = WATCHED_PEERS) -> list[int]:
    """The ranks ``rank`` watches. BSP: the next ``k`` in the ring. ASP: a worker the server; the server none."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "asp":
        return [SERVER] if rank != SERVER else []
    return [(rank + i) % world_size for i in range(1, min(k, world_size - 1) + 1)]


def write_error_log(log_dir: Path, rank: int, cause: str, details: str = "") -> bool:
    """Atomically write ``log_dir/error-rank<rank>.log``: ``<unix time> <cause>``, then ``details``.

    False when it could not be written (disk full, directory gone): never raises.
    """
    path = Path(log_dir) / f"error-rank{rank}.log"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{time.time():.6f} {cause}\n{details}", encoding="utf-8")
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False


@dataclass(frozen=True, order=True)
class ErrorLog:
    """The first line of one ``error-rank<R>.log``."""

    stamp: float  # unix time of the error
    rank: int
    cause: str


def read_error_log(path: Path) -> ErrorLog | None:
    """One ``error-rank<R>.log``; a damaged one is stamped with its mtime; None if unreadable or misnamed."""
    try:
        rank = int(path.stem.removeprefix("error-rank"))
        first = path.read_text(encoding="utf-8", errors="replace").partition("\n")[0].strip()
        mtime = path.stat().st_mtime
    except (OSError, ValueError):
        return None
    stamp, _, cause = first.partition(" ")
    try:
        when = float(stamp)
    except ValueError:
        when, cause = mtime, first
    return ErrorLog(when, rank, cause.strip() or "(empty error log)")


def read_error_logs(log_dir: Path, since: float = 0.0) -> list[ErrorLog]:
    """The ``error-rank*.log`` in ``log_dir`` stamped at or after ``since``, oldest first; damaged ones by mtime."""
    logs = (read_error_log(path) for path in Path(log_dir).glob("error-rank*.log"))
    return sorted(log for log in logs if log is not None and log.stamp >= since)


_BEFORE_EXIT: list[Callable[[str], None]] = []  # what runs before a verdict ends this process (a survivor's save)


def before_exit(fn: Callable[[str], None]) -> None:
    """Run ``fn(verdict)`` in the watchdog's thread before :func:`exit_on_lost` ends the process (once each)."""
    if fn not in _BEFORE_EXIT:
        _BEFORE_EXIT.append(fn)


def exit_on_lost(rank: int, log_dir: Path | None, echo: bool = True) -> Callable[[str], None]:
    """What a watchdog does by default with a verdict: the :func:`before_exit` hooks (a survivor saves the last
    step: :mod:`omnilearn.bsp.rescue`), the error log, a line on stderr, then the process ends."""

    def lost(message: str) -> None:
        for fn in list(_BEFORE_EXIT):
            try:
                fn(message)
            except Exception as e:  # noqa: BLE001 - the verdict still ends the process, and says so
                print(f"omnilearn: rank {rank}: {type(e).__name__} before exit: {e}", file=sys.stderr, flush=True)
        note = "(written by the heartbeat watchdog)\n"
        written = log_dir is not None and write_error_log(log_dir, rank, message, note)
        if echo or not written:
            print(f"omnilearn: rank {rank}: {message}", file=sys.stderr, flush=True)
        os._exit(1)  # from a thread: the main thread may sit in a collective that will never return

    return lost


class Watchdog:
    """One rank's heartbeat thread; ``on_lost(message)`` gets the one-line verdict (default: :func:`exit_on_lost`).

    ``mode`` (``bsp`` or ``asp``) decides whom it watches (:func:`peers_of`) and how a verdict names the rank.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, heartbeat_s: float,
                 on_lost: Callable[[str], None], first_beat_s: float | None = None,
                 namespace: str | None = None, mode: str = "bsp") -> None:
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s {heartbeat_s} must be positive, e.g. 60")
        self.rank, self.heartbeat_s, self.on_lost, self.mode = rank, heartbeat_s, on_lost, mode
        self.first_beat_s = max(heartbeat_s, first_beat_s or 0.0)  # for a peer not heard from yet (still starting)
        self.interval_s = heartbeat_s / BEATS_PER_HEARTBEAT
        self.peers = peers_of(rank, world_size, mode)
        self.store = own_connection(store, heartbeat_s)
        space = namespace or f"{PREFIX}/{next(_generations)}"  # every rank's n-th watchdog shares one key space
        self.key = lambda r: f"{space}/{r}"
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"omnilearn-watchdog-rank{rank}", daemon=True)

    def start(self) -> "Watchdog":
        _running.add(self)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Say goodbye (peers stop watching this rank) and end the thread; waits at most ``heartbeat_s``."""
        self._stopping.set()
        self.wait(self.heartbeat_s)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the thread to end (after a verdict, a store failure or :meth:`stop`); True if it did."""
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _beat(self, add: int) -> list[int]:
        """Add to this rank's counter; the watched peers' counters."""
        self.store.add(self.key(self.rank), add)
        return [self.store.add(self.key(p), 0) for p in self.peers]

    def _run(self) -> None:
        try:
            self._watch()
            self.store.add(self.key(self.rank), DONE)  # goodbye
        except Exception as e:  # noqa: BLE001 - any store failure ends the rank, in one line
            if not self._stopping.is_set():
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                self.on_lost(f"rank {self.rank} lost the rendezvous store ({first}); the process holding it "
                             f"(the launcher's store file, rank 0 or the torchrun agent) is gone or hung")
        finally:
            _running.discard(self)

    def _watch(self) -> None:
        tick = time.monotonic()
        seen = {peer: (0, tick) for peer in self.peers}  # peer -> (counter, when it last changed); 0: not heard yet
        while not self._stopping.is_set():
            values = self._beat(1)
            now = time.monotonic()
            frozen = now - tick > self.heartbeat_s / 2  # this process did not run for a while: restart the clocks
            tick = now
            for peer, value in zip(self.peers, values):
                if value >= DONE:
                    continue
                if frozen or seen[peer][0] != value:
                    seen[peer] = (value, now)
                elif now - seen[peer][1] >= (limit_s := self.heartbeat_s if value else self.first_beat_s):
                    self.on_lost(hung_message(peer, limit_s, heard=value > 0, mode=self.mode))
                    return
            self._stopping.wait(self.interval_s)


def running() -> bool:
    """Whether this process runs a watchdog already (the launcher's): a library caller need not start another."""
    return bool(_running)


def start_watchdog(ctx: DistContext, heartbeat_s: float, log_dir: Path | None = None, *,
                   echo: bool = True, mode: str = "bsp") -> Watchdog | None:
    """Watch this rank's peers (:func:`peers_of` in ``mode``) in the default process group; None without a group
    of two or more.

    A verdict is written to ``log_dir/error-rank<R>.log`` (when given), printed on
    stderr (when ``echo`` or the log could not be written), and ends the process.
    Call :meth:`Watchdog.stop` before destroying the group.
    """
    if not ctx.grouped or ctx.world_size < 2:
        return None
    store = default_store()  # the group's store
    return Watchdog(store, ctx.rank, ctx.world_size, heartbeat_s, exit_on_lost(ctx.rank, log_dir, echo),
                    mode=mode).start()


def own_connection(store: dist.Store, timeout_s: float) -> dist.Store:
    """A clone with its own connection and a timeout of ``timeout_s``; the store itself where it cannot clone."""
    try:
        clone = store.clone()
        clone.set_timeout(timedelta(seconds=timeout_s))
        return clone
    except (RuntimeError, NotImplementedError, AttributeError):
        return store
