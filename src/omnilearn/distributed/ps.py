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
indices follow), ``STOP`` (the run is over, or this worker was dropped),
``HOLD`` (the server is busy, evaluating: nothing follows; poll again after
``POLL_S``). HOLD exists because a server that stopped receiving for longer
than a worker's timeout would kill that worker (below: a timed-out wait
ends every connection of its process); one that holds them keeps every
wait short.

The server receives requests from any source (``irecv`` with no ``src``)
and handles one at a time, so the state it sends is a consistent snapshot:
it never changes while being sent.

How gloo behaves when a peer dies (measured with torch 2.13 on Linux; the
experiments: a SIGKILLed worker among three, and waits that time out):

- A worker killed (SIGKILL) while the server waits in an any-source
  ``irecv``: nothing is raised; the wait simply gets the other workers'
  requests, and every other pair keeps working. The dead worker is only
  *silent*: the server must notice it by time (:class:`~omnilearn.asp.rules.Liveness`).
- An operation bound to the dead worker's pair (``irecv(src=k)`` of its
  gradients after its header, or ``isend`` of a reply to it) raises at once
  ("Connection reset by peer" / "Connection closed by peer"): only that pair
  is closed, the others and any-source receives keep working. Here it is a
  :class:`PeerLost` naming the rank; the server drops that worker.
- Any wait that *times out* (``work.wait(timeout)`` expiring, any-source
  or not) makes gloo signal the timeout to every pair of the process: all
  connections close ("Application timeout caused pair closure") and nothing
  works afterwards. So a timeout can never serve as a poll. The server
  therefore waits for a request only as long as some live worker may still
  speak (:meth:`~omnilearn.asp.rules.Liveness.wait_s`): when even that
  expires every worker is gone and the run fails anyway.
- A gloo ``Work`` cannot be tested without waiting (``is_completed()`` stays
  False until ``wait()``) nor aborted from Python, so one ``irecv(src=k)``
  posted per worker and polled in turn is not possible: the any-source
  receive, which a dead peer does not disturb, is the right design.

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py tests/faults/test_asp_faults.py``
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HELLO, PUSH, POLL = 0, 1, 2  # request kinds
GO, STOP, HOLD = 0, 1, 2  # reply status
POLL_S = 0.02  # a held worker asks again after this long
TAG_REQUEST, TAG_PAYLOAD, TAG_REPLY, TAG_STATE = 11, 12, 13, 14
REQUEST_LEN, REPLY_HEAD = 6, 5


class PeerTimeout(RuntimeError):
    """A peer sent nothing within the timeout: it died or hangs (and every connection of this process is closed)."""


class NoRequest(PeerTimeout):
    """No worker sent a request within the wait (then every connection of this process is closed)."""


class PeerLost(RuntimeError):
    """The connection to worker ``rank`` failed mid-exchange (it died); the other connections still work."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


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


def _cause(e: BaseException) -> str:
    """gloo's message without its source path and advice: "Read error [127.0.0.1]:9935: Connection reset by peer"."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    return text.split(". This is typically", 1)[0][:160]


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerTimeout(f"{what} within {timeout_s:g} s ({_cause(e)})") from None


def _exchange(work, rank: int, timeout_s: float, what: str) -> None:
    """Wait for one operation on worker ``rank``'s pair: a failure is a :class:`PeerLost`, a timeout a PeerTimeout."""
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        cause = _cause(e)
        if "Timed out" in cause:  # every pair of this process is closed now, not only this one
            raise PeerTimeout(f"worker rank {rank} {what} within {timeout_s:g} s ({cause})") from None
        raise PeerLost(rank, f"worker rank {rank} {what} ({cause})") from None


class ServerLink:
    def __init__(self, state_len: int, max_batch: int, timeout_s: float) -> None:
        self.payload = torch.empty(state_len, dtype=torch.float32)
        self.max_batch, self.timeout_s = max_batch, timeout_s

    def receive(self, wait_s: float | None = None) -> tuple[Request, torch.Tensor | None]:
        """The next worker's request (from whichever worker sends first) and, for a push, its payload.

        :class:`NoRequest` when none came within ``wait_s`` (default ``timeout_s``): then every connection
        of this process is closed. :class:`PeerLost` when the sender of a header died before its payload,
        :class:`PeerTimeout` when it sent no payload within ``timeout_s`` (hung: every connection closed).
        """
        head = torch.empty(REQUEST_LEN, dtype=torch.float64)
        work = dist.irecv(head, tag=TAG_REQUEST)
        wait_s = self.timeout_s if wait_s is None else wait_s
        try:
            work.wait(timeout=timedelta(seconds=wait_s))
        except RuntimeError as e:
            raise NoRequest(f"no worker sent a request within {wait_s:g} s ({_cause(e)})") from None
        src = int(work._source_rank()) if hasattr(work, "_source_rank") else int(work.source_rank())
        kind, batch, version, cycle_s, compute_s, loss = head.tolist()
        req = Request(src, int(kind), int(batch), int(version), cycle_s, compute_s, loss)
        if req.kind not in (HELLO, PUSH, POLL):
            raise RuntimeError(f"worker rank {src} sent an unknown request kind {req.kind}")
        if req.kind != PUSH:
            return req, None
        _exchange(dist.irecv(self.payload, src=src, tag=TAG_PAYLOAD), src, self.timeout_s,
                  "sent a header but no gradients")
        return req, self.payload

    def reply(self, rank: int, status: int, version: int, epoch: int = 0, slowdown: float = 1.0,
              indices: list[int] | None = None, state: torch.Tensor | None = None) -> None:
        """Answer worker ``rank``: ``GO`` sends ``indices`` and ``state``; ``STOP`` and ``HOLD`` send neither.

        :class:`PeerLost` when the worker's connection fails (it died).
        """
        indices = indices or []
        if len(indices) > self.max_batch:
            raise ValueError(f"{len(indices)} indices exceed the largest batch {self.max_batch}")
        head = torch.zeros(REPLY_HEAD + self.max_batch, dtype=torch.float64)
        head[:REPLY_HEAD] = torch.tensor([status, version, len(indices), epoch, slowdown], dtype=torch.float64)
        head[REPLY_HEAD : REPLY_HEAD + len(indices)] = torch.tensor(indices, dtype=torch.float64)
        _exchange(dist.isend(head, dst=rank, tag=TAG_REPLY), rank, self.timeout_s, "took no reply")
        if status == GO:
            _exchange(dist.isend(state, dst=rank, tag=TAG_STATE), rank, self.timeout_s, "took no weights")


class WorkerLink:
    def __init__(self, state_len: int, max_batch: int, timeout_s: float) -> None:
        self.state = torch.empty(state_len, dtype=torch.float32)
        self.max_batch, self.timeout_s = max_batch, timeout_s

    def request(self, kind: int, batch: int, pulled_version: int, cycle_s: float, compute_s: float, loss: float,
                payload: torch.Tensor | None = None) -> Reply:
        """Send a request (:meth:`send`) and return the server's answer (:meth:`answer`)."""
        self.send(kind, batch, pulled_version, cycle_s, compute_s, loss, payload)
        return self.answer()

    def send(self, kind: int, batch: int, pulled_version: int, cycle_s: float, compute_s: float, loss: float,
             payload: torch.Tensor | None = None) -> None:
        head = torch.tensor([kind, batch, pulled_version, cycle_s, compute_s, loss], dtype=torch.float64)
        _wait(dist.isend(head, dst=0, tag=TAG_REQUEST), self.timeout_s, "the server (rank 0) took no request")
        if kind == PUSH:
            _wait(dist.isend(payload, dst=0, tag=TAG_PAYLOAD), self.timeout_s, "the server (rank 0) took no gradients")

    def answer(self) -> Reply:
        """The server's reply to the request just sent (and, for ``GO``, the weights into ``state``)."""
        reply = torch.empty(REPLY_HEAD + self.max_batch, dtype=torch.float64)
        _wait(dist.irecv(reply, src=0, tag=TAG_REPLY), self.timeout_s, "the server (rank 0) did not answer")
        status, version, count, epoch, slowdown = reply[:REPLY_HEAD].tolist()
        status, version, count, epoch = int(status), int(version), int(count), int(epoch)
        indices = [int(v) for v in reply[REPLY_HEAD : REPLY_HEAD + count].tolist()]
        if status == GO:
            _wait(dist.irecv(self.state, src=0, tag=TAG_STATE), self.timeout_s, "the server (rank 0) sent no weights")
        return Reply(status, version, epoch, slowdown, indices)
