"""A collective that failed because a peer process is gone, told apart from this rank's own errors.

When a peer dies (SIGKILL, the OOM killer, a lost machine whose kernel
still answers), its sockets close and gloo raises in every survivor whose
collective talks to it, within milliseconds (measured: 28 ms on one host),
a ``RuntimeError`` such as ``[.../gloo/transport/tcp/pair.cc:537] Read
error [127.0.0.1]:22181: Connection reset by peer``. A survivor that waits
only on another survivor hears it when that one exits after its own rescue
(:mod:`omnilearn.bsp.rescue`): its sockets close in turn. TensorFlow's
collective ops abort with the same words (an ``UnavailableError``). NCCL says
``remote process exited`` or reports a remote error when it notices.

Only these count as a lost peer. A timeout does not: a peer that is slow,
hung or calling another collective (a loop that skipped ``step()``) also
times out, and its state is not known to be at a step boundary; the
heartbeat watchdog names a hung peer (:mod:`omnilearn.distributed.watchdog`).
An error of this rank alone (out of memory, bad data) is announced to the
peers instead (:mod:`omnilearn.distributed.failures`).

No torch here. Run: ``python -m pytest -q tests/unit/test_survivor_save.py``
"""

from __future__ import annotations

import re

# gloo's transport errors when the other end is gone; NCCL's remote-failure wording
_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|Connection refused|Socket closed"
                   r"|remote process exited|ncclRemoteError|NCCL communicator was aborted", re.IGNORECASE)
_WHERE = re.compile(r"^.*?\[[^\]]*\.(cc|cpp|h):\d+\]\s*")  # gloo's "[.../pair.cc:553] ", and a wrapper before it
_ADVICE = re.compile(r"\. This is typically")  # gloo's advice after the cause


class PeerLost(RuntimeError):
    """A peer process of this run is gone; this rank saved what it could (its message says where)."""


def peer_lost(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a collective failing because a peer is gone."""
    return lost_cause(error) is not None


def lost_cause(error: BaseException | None) -> BaseException | None:
    """The deepest error in ``error``'s chain that says a peer is gone (the backend's own, not a wrapper that
    quotes it), or None."""
    found, seen = None, 0
    while error is not None and seen < 8:
        if isinstance(error, PeerLost) or (_backend_error(error) and _LOST.search(str(error))):
            found = error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return found


def _backend_error(error: BaseException) -> bool:
    """An error a collective backend raises: torch's ``RuntimeError`` (gloo, NCCL) or TensorFlow's (an
    ``UnavailableError`` of its collective ops: ``Collective ops is aborted by: recvmsg:Connection reset by peer``)."""
    return isinstance(error, RuntimeError) or type(error).__module__.startswith("tensorflow")


def first_line(error: BaseException, limit: int = 120) -> str:
    """What ``error`` says, short: its first line without gloo's source position and advice (``Connection closed by
    peer [127.0.0.1]:35241``), at most ``limit`` characters; its type's name if it says nothing."""
    return _short((str(error).strip().splitlines() or [type(error).__name__])[0], limit) or type(error).__name__


def why_lost(error: BaseException, limit: int = 120) -> str:
    """What says a peer is gone in ``error``'s chain, short: the line of the backend's own error that says so
    (TensorFlow's starts ``Graph execution error:``; the line that counts comes later)."""
    cause = lost_cause(error) or error
    lines = str(cause).strip().splitlines()
    line = next((x for x in lines if _LOST.search(x)), lines[0] if lines else type(cause).__name__)
    return _short(line, limit) or type(cause).__name__


def _short(line: str, limit: int) -> str:
    return _ADVICE.split(_WHERE.sub("", line.strip()), maxsplit=1)[0].rstrip(". ")[:limit]
