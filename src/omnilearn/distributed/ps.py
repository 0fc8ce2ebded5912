"""Parameter-server wire protocol over ``torch.distributed`` point-to-point (gloo, CPU tensors).

Rank 0 is the server; ranks 1..n are workers (worker ``i`` is rank ``i + 1``).
One exchange per worker cycle, always in this order:

    worker -> server  REQUEST  float64[6]: kind, batch, pulled_version, cycle_s, compute_s, loss
    worker -> server  PAYLOAD  float32[P+Q]: gradients of the P parameter values, then the Q
                               floating buffer values (BatchNorm statistics)   (kind PUSH only)
    server -> worker  REPLY    float64[5 + max_batch]: status, version, count, epoch, slowdown, indices...
    server -> worker  STATE    float32[P+Q]: parameters and buffers at ``version``  (status GO only)

Request kinds: ``HELLO`` (a worker's first), ``PUSH`` (a gradient),
``POLL`` (again, after a ``HOLD``). Reply status: ``GO`` (weights and
indices follow), ``STOP`` (the run is over for this worker: the last word),
``HOLD`` (the server is busy, evaluating: nothing follows; poll again after
``POLL_S``). HOLD keeps every wait of a worker short while the server evaluates.

Each worker talks to the server over a gloo group of its own
(:func:`pair_groups`: ``{0, k}``, created by every rank together, lazily,
at the first exchange). This module is the worker's end
(:class:`WorkerLink`); the server's end, one listening thread per worker
and the requests queued in arrival order, is
:mod:`omnilearn.distributed.serverlink`.

Why, as measured with torch 2.13 on Linux (gloo's TCP transport; trial 6.3
of issue 20, and ``tests/faults/test_asp_faults.py``):

- Every gloo send is a rendezvous: the sender announces it, and its bytes go
  out when the receiver has posted the matching receive -- sent by the
  *sender's* gloo thread if the receive came later. A worker frozen
  (SIGSTOP, a paused VM, a cut network) after announcing its request pins
  the receive that takes it up: an any-source receive commits to the first
  announcement it sees, so with one group for all, one frozen worker held
  the server until every other worker's deadline had lapsed (all dropped)
  or for ``timeout_s`` (a reply it never took). Any wait on a worker can be
  pinned this way; only its own can be allowed to be.
- A wait that *times out* closes every connection of its group ("Application
  timeout caused pair closure"), and only of its group. With one group per
  worker that is exactly "drop this worker": every server wait on a worker
  is bounded by its allowance (``heartbeat_s`` once it has spoken,
  ``timeout_s`` before: start-up) and ends in a :class:`PeerSilent`; the
  other groups keep working.
- A worker that dies (SIGKILL, a crash) closes its sockets: a wait posted on
  its group fails at once ("Connection closed by peer"), a :class:`PeerLost`.
  Its listener nearly always has one posted, so a dead worker is noticed
  within milliseconds. An any-source receive is not bound to a connection
  and noticed nothing: the old server waited out the heartbeat (60 s).
- A gloo ``Work`` cannot be tested without waiting, nor aborted from Python:
  hence one thread per worker, each waiting on its own group. A destroyed
  group lets a pending wait run on to its timeout.

Tests only: :func:`after_next_header` (:mod:`omnilearn.asp.faults` freezes a
worker between announcing its request and sending it).

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

HELLO, PUSH, POLL = 0, 1, 2  # request kinds
GO, STOP, HOLD = 0, 1, 2  # reply status
POLL_S = 0.02  # a held worker asks again after this long
TAG_REQUEST, TAG_PAYLOAD, TAG_REPLY, TAG_STATE = 11, 12, 13, 14
REQUEST_LEN, REPLY_HEAD = 6, 5
SERVER = 0
_after_header: list[Callable[[], None]] = []  # tests only: see after_next_header


def after_next_header(action: Callable[[], None]) -> None:
    """Tests only (:mod:`omnilearn.asp.faults`): run ``action`` once, right after this process posts its next
    request header (the server is told a header is ready; its bytes go out only when the server takes them)."""
    _after_header.append(action)


class PeerTimeout(RuntimeError):
    """The server sent or took nothing within the timeout, or closed the connection (a worker's error)."""


class NoRequest(PeerTimeout):
    """No worker sent a request and none was dropped within the wait (the server's guard against a lost listener)."""


class PeerLost(RuntimeError):
    """The connection to worker ``rank`` failed (it died); the other workers' connections still work."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class PeerSilent(PeerLost):
    """Worker ``rank`` ``what`` (e.g. "sent nothing", "took no reply") for ``quiet_s``, its allowance.

    The wait timed out, so its connection (its own group) is closed; the other workers' are not.
    """

    def __init__(self, rank: int, what: str, quiet_s: float) -> None:
        super().__init__(rank, f"worker rank {rank} {what} for {quiet_s:.1f} s")
        self.what, self.quiet_s = what, quiet_s


@dataclass(frozen=True)
class Request:
    rank: int
    kind: int
    batch: int
    pulled_version: int
    cycle_s: float
    compute_s: float
    loss: float


@dataclass(frozen=True)
class Reply:
    status: int  # GO, STOP or HOLD
    version: int
    epoch: int
    slowdown: float  # emulate a machine this many times slower for this batch (1: native)
    indices: list[int]

    @property
    def stop(self) -> bool:
        return self.status == STOP

    @property
    def hold(self) -> bool:
        return self.status == HOLD


def gloo_cause(e: BaseException) -> str:
    """gloo's message without its source path and advice: "Read error [127.0.0.1]:9935: Connection reset by peer"."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    return text.split(". This is typically", 1)[0][:160]


def pair_groups(timeout_s: float) -> dict[int, dist.ProcessGroup]:
    """One gloo group ``{0, k}`` per worker rank ``k``; every rank creates them all, in order. Those this rank is in.

    :class:`PeerTimeout` when the other end does not connect within ``timeout_s`` (it died or hangs while starting).
    """
    me, groups = dist.get_rank(), {}
    for k in range(1, dist.get_world_size()):
        try:
            group = dist.new_group([SERVER, k], timeout=timedelta(seconds=timeout_s), backend="gloo")
        except RuntimeError as e:
            other = f"worker rank {k}" if me == SERVER else "the server (rank 0)"
            raise PeerTimeout(f"{other} did not connect within {timeout_s:g} s ({gloo_cause(e)}): it died or hangs "
                              "while starting") from None
        if me in (SERVER, k):
            groups[k] = group
    return groups


class WorkerLink:
    def __init__(self, state_len: int, max_batch: int, timeout_s: float) -> None:
        self.state = torch.empty(state_len, dtype=torch.float32)
        self.max_batch, self.timeout_s = max_batch, timeout_s
        self.timeout = timedelta(seconds=timeout_s)
        self.group: dist.ProcessGroup | None = None  # this worker's group with the server, made at its first request

    def request(self, kind: int, batch: int, pulled_version: int, cycle_s: float, compute_s: float, loss: float,
                payload: torch.Tensor | None = None) -> Reply:
        """Send a request (:meth:`send`) and return the server's answer (:meth:`answer`)."""
        self.send(kind, batch, pulled_version, cycle_s, compute_s, loss, payload)
        return self.answer()

    def send(self, kind: int, batch: int, pulled_version: int, cycle_s: float, compute_s: float, loss: float,
             payload: torch.Tensor | None = None) -> None:
        head = torch.tensor([kind, batch, pulled_version, cycle_s, compute_s, loss], dtype=torch.float64)
        if self.group is None:
            self.group = pair_groups(self.timeout_s)[dist.get_rank()]
        with self.failing("the server (rank 0) took no request"):
            work = dist.isend(head, dst=SERVER, group=self.group, tag=TAG_REQUEST)
            while _after_header:
                _after_header.pop(0)()
            work.wait(timeout=self.timeout)
        if kind == PUSH:
            with self.failing("the server (rank 0) took no gradients"):
                dist.isend(payload, dst=SERVER, group=self.group, tag=TAG_PAYLOAD).wait(timeout=self.timeout)

    def answer(self) -> Reply:
        """The server's reply to the request just sent (and, for ``GO``, the weights into ``state``)."""
        reply = torch.empty(REPLY_HEAD + self.max_batch, dtype=torch.float64)
        with self.failing("the server (rank 0) did not answer"):
            dist.irecv(reply, src=SERVER, group=self.group, tag=TAG_REPLY).wait(timeout=self.timeout)
        status, version, count, epoch, slowdown = reply[:REPLY_HEAD].tolist()
        status, version, count, epoch = int(status), int(version), int(count), int(epoch)
        indices = [int(v) for v in reply[REPLY_HEAD : REPLY_HEAD + count].tolist()]
        if status == GO:
            with self.failing("the server (rank 0) sent no weights"):
                dist.irecv(self.state, src=SERVER, group=self.group, tag=TAG_STATE).wait(timeout=self.timeout)
        elif status == STOP:  # the server's last word to this worker
            self.close()
        return Reply(status, version, epoch, slowdown, indices)

    @contextmanager
    def failing(self, what: str) -> Iterator[None]:
        """A gloo error inside becomes one :class:`PeerTimeout` line saying ``what`` (and the group is let go)."""
        try:
            yield
        except RuntimeError as e:
            self.close()
            cause = gloo_cause(e)
            if "Timed out" in cause:
                raise PeerTimeout(f"{what} within {self.timeout_s:g} s ({cause})") from None
            raise PeerTimeout(f"{what}: the connection closed ({cause}); the server dropped this worker "
                              "(silent for its --heartbeat-s) or ended") from None

    def close(self) -> None:
        """Let go of the group with the server (its gloo threads end now, not at interpreter exit)."""
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None
