"""One rank fails, all ranks end: a rank's error is announced in the group's store and every peer ends at once.

Why. In BSP every rank is needed at every step. When one rank raises (an
out-of-memory error it cannot recover from, any out-of-memory error under
FSDP2, a ``state_dict()`` that raises while saving), its peers sit in the
step's collective (DDP's all-reduce, FSDP's reduce-scatter, the save's
broadcast) until the process group's timeout, 30 minutes by default. gloo
tells them sooner only if the failing process exits (then: "Connection
closed by peer", which names neither the rank nor the error); a failing rank
that calls ``finish()`` in a ``finally:`` meets them in another collective
(a hang, or gloo's "collective mismatch" abort). And a thread cannot get a
peer's main thread out of a collective: ``ProcessGroup.abort()`` of a gloo
group (torch 2.13) returns at once and leaves its pending collective waiting.

Who sends what, when:

- The failing rank (:meth:`FailureListener.announce`, called by the session
  where it knows an error is this rank's alone) writes one line,
  ``rank R failed: <Type>: <message>``, under ``omnilearn/failed/<R>`` and
  then the marker ``omnilearn/failed`` in the default group's store, over a
  connection of its own with a short timeout. It then waits until every
  listening peer has acknowledged (``omnilearn/failed-heard`` reaches
  ``omnilearn/failed-listening`` - 1), at most :data:`ACK_S`, and only then
  re-raises: its process must not exit (closing its gloo connections) before
  its peers have read the line, or they would end with gloo's anonymous error.
- Every rank of a BSP session of two or more runs one daemon thread
  (:func:`listen`, stopped by ``Session.release()``) that checks the marker
  every :data:`POLL_S` (a ``check``: one read of the store, nothing written;
  no collective, nothing on the training thread). Once it exists, the thread
  reads the lowest-ranked announcement; if that is a peer's, it acknowledges,
  prints ``omnilearn: rank <own> ends: rank R failed: ...`` on stderr and ends
  its process with ``os._exit(1)`` (its main thread may sit in a collective
  that will never return; the watchdog ends a rank the same way). Two ranks
  failing together: both name the lower one, which alone raises its own error.
- Slow or dead peers: a slow peer's thread still runs (collectives release
  the GIL), so it hears within a poll. A dead one never acknowledges: the
  failing rank waits :data:`ACK_S`, then raises. A store that is gone (its
  host died) ends the announcement and the listening quietly: gloo's own
  errors and the watchdog (:mod:`omnilearn.distributed.watchdog`) take over.

Only errors of one rank are announced: an error every rank raises alike (a
checkpoint that cannot be written, told to every rank; a refused setting)
stays an ordinary exception every rank can catch. The launcher still names
the failing rank from its error log (:mod:`omnilearn.experiments.launch.supervise`):
the peers' exits (code 1) leave no log of their own.

Run: ``python -m pytest -q tests/dist/test_rank_errors.py``
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

import torch.distributed as dist

from omnilearn.distributed.group import DistContext, default_store
from omnilearn.distributed.watchdog import own_connection

PREFIX = "omnilearn/failed"  # the marker; announcements under PREFIX/<rank>
HEARD = "omnilearn/failed-heard"  # acknowledgements by the peers' listeners
LISTENING = "omnilearn/failed-listening"  # listeners running in the group
POLL_S = 0.5  # how often a listener looks for the marker
ACK_S = 10.0  # the longest a failing rank waits for its peers to hear it (a dead peer never does)
STORE_S = 5.0  # timeout of one store operation of the announcement or the listener
MESSAGE_CHARS = 300


def failure_line(rank: int, error: BaseException) -> str:
    """``rank R failed: <Type>: <first line of the message>`` (at most :data:`MESSAGE_CHARS` of it)."""
    first = (str(error).strip().splitlines() or [""])[0][:MESSAGE_CHARS]
    return f"rank {rank} failed: {type(error).__name__}" + (f": {first}" if first else "")


def exit_on_heard(rank: int) -> Callable[[str], None]:
    """What a listener does by default with a peer's announcement: say it on stderr and end the process."""

    def heard(line: str) -> None:
        print(f"omnilearn: rank {rank} ends: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # from a thread: the main thread may sit in a collective that will never return

    return heard


class FailureListener:
    """One rank's announcements out and its peers' in (see the module docstring); ``on_heard(line)`` ends it."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, on_heard: Callable[[str], None],
                 poll_s: float = POLL_S, ack_s: float = ACK_S) -> None:
        self.base, self.rank, self.world_size = store, rank, world_size
        self.on_heard, self.poll_s, self.ack_s = on_heard, poll_s, ack_s
        self.store = own_connection(store, STORE_S)
        self.announced: str | None = None  # this rank's line, once announced
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"omnilearn-failures-rank{rank}", daemon=True)

    def start(self) -> "FailureListener":
        self.store.add(LISTENING, 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening (a failing rank no longer waits for this one); idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join(self.poll_s + STORE_S)
        try:
            self.store.add(LISTENING, -1)
        except (RuntimeError, ValueError):  # the store's host is gone
            pass

    def announce(self, error: BaseException) -> str:
        """Tell the peers this rank failed with ``error``, wait for them to hear it; the line. Never raises."""
        if self.announced is None:
            self.announced = failure_line(self.rank, error)
            store = own_connection(self.base, STORE_S)  # the main thread's own: the listener's is its thread's
            try:
                store.set(f"{PREFIX}/{self.rank}", self.announced)
                store.set(PREFIX, "1")
                self._wait_heard(store)
            except (RuntimeError, ValueError):  # the store's host is gone: nobody left to tell
                pass
        return self.announced

    def _wait_heard(self, store: dist.Store) -> None:
        deadline = time.monotonic() + self.ack_s
        while store.add(HEARD, 0) < store.add(LISTENING, 0) - 1 and time.monotonic() < deadline:
            time.sleep(0.02)

    def first(self) -> tuple[int, str] | None:
        """(rank, line) of the lowest-ranked announcement in the store, or None."""
        if not self.store.check([PREFIX]):
            return None
        for rank in range(self.world_size):
            key = f"{PREFIX}/{rank}"
            if self.store.check([key]):
                return rank, self.store.get(key).decode("utf-8", errors="replace")
        return None

    def _run(self) -> None:
        try:
            while not self._stopping.wait(self.poll_s):
                found = self.first()
                if found is not None and found[0] != self.rank:
                    self.store.add(HEARD, 1)
                    self.on_heard(found[1])
                    return
        except (RuntimeError, ValueError):  # the store's host is gone: gloo's errors and the watchdog take over
            pass


def listen(ctx: DistContext, on_heard: Callable[[str], None] | None = None) -> FailureListener | None:
    """A started listener in the default group (None without a group of two or more)."""
    if not ctx.grouped or ctx.world_size < 2:
        return None
    return FailureListener(default_store(), ctx.rank, ctx.world_size, on_heard or exit_on_heard(ctx.rank)).start()
