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
indices follow), ``STOP`` (the run is over), ``HOLD`` (the server is busy,
evaluating: nothing follows; poll again after ``POLL_S``). HOLD exists because
gloo's sends wait for the matching receive and a timed-out wait closes the
connection: a server that stopped receiving for longer than the timeout
would kill its workers; one that holds them keeps every wait short.

The server receives requests from any source (``irecv`` with no ``src``)
and handles one at a time, so the state it sends is a consistent snapshot:
it never changes while being sent. Each wait has a timeout; a silent peer
becomes a :class:`PeerTimeout` naming the rank.

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py``
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
    """A peer sent nothing within the timeout: it died or hangs."""


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


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PeerTimeout(f"{what} within {timeout_s:g} s ({str(e).splitlines()[0][:120]})") from None


class ServerLink:
    def __init__(self, state_len: int, max_batch: int, timeout_s: float) -> None:
        self.payload = torch.empty(state_len, dtype=torch.float32)
        self.max_batch, self.timeout_s = max_batch, timeout_s

    def receive(self) -> tuple[Request, torch.Tensor | None]:
        """The next worker's request (from whichever worker sends first) and, for a push, its payload."""
        head = torch.empty(REQUEST_LEN, dtype=torch.float64)
        work = dist.irecv(head, tag=TAG_REQUEST)
        _wait(work, self.timeout_s, "no worker sent a request")
        src = int(work._source_rank()) if hasattr(work, "_source_rank") else int(work.source_rank())
        kind, batch, version, cycle_s, compute_s, loss = head.tolist()
        req = Request(src, int(kind), int(batch), int(version), cycle_s, compute_s, loss)
        if req.kind not in (HELLO, PUSH, POLL):
            raise RuntimeError(f"worker rank {src} sent an unknown request kind {req.kind}")
        if req.kind != PUSH:
            return req, None
        _wait(dist.irecv(self.payload, src=src, tag=TAG_PAYLOAD), self.timeout_s,
              f"worker rank {src} sent a header but no gradients")
        return req, self.payload

    def reply(self, rank: int, status: int, version: int, epoch: int = 0, slowdown: float = 1.0,
              indices: list[int] | None = None, state: torch.Tensor | None = None) -> None:
        """Answer worker ``rank``: ``GO`` sends ``indices`` and ``state``; ``STOP`` and ``HOLD`` send neither."""
        indices = indices or []
        if len(indices) > self.max_batch:
            raise ValueError(f"{len(indices)} indices exceed the largest batch {self.max_batch}")
        head = torch.zeros(REPLY_HEAD + self.max_batch, dtype=torch.float64)
        head[:REPLY_HEAD] = torch.tensor([status, version, len(indices), epoch, slowdown], dtype=torch.float64)
        head[REPLY_HEAD : REPLY_HEAD + len(indices)] = torch.tensor(indices, dtype=torch.float64)
        _wait(dist.isend(head, dst=rank, tag=TAG_REPLY), self.timeout_s, f"worker rank {rank} took no reply")
        if status == GO:
            _wait(dist.isend(state, dst=rank, tag=TAG_STATE), self.timeout_s, f"worker rank {rank} took no weights")


class WorkerLink:
    def __init__(self, state_len: int, max_batch: int, timeout_s: float) -> None:
        self.state = torch.empty(state_len, dtype=torch.float32)
        self.max_batch, self.timeout_s = max_batch, timeout_s

    def request(self, kind: int, batch: int, pulled_version: int, cycle_s: float, compute_s: float, loss: float,
                payload: torch.Tensor | None = None) -> Reply:
        head = torch.tensor([kind, batch, pulled_version, cycle_s, compute_s, loss], dtype=torch.float64)
        _wait(dist.isend(head, dst=0, tag=TAG_REQUEST), self.timeout_s, "the server (rank 0) took no request")
        if kind == PUSH:
            _wait(dist.isend(payload, dst=0, tag=TAG_PAYLOAD), self.timeout_s, "the server (rank 0) took no gradients")
        reply = torch.empty(REPLY_HEAD + self.max_batch, dtype=torch.float64)
        _wait(dist.irecv(reply, src=0, tag=TAG_REPLY), self.timeout_s, "the server (rank 0) did not answer")
        status, version, count, epoch, slowdown = reply[:REPLY_HEAD].tolist()
        status, version, count, epoch = int(status), int(version), int(count), int(epoch)
        indices = [int(v) for v in reply[REPLY_HEAD : REPLY_HEAD + count].tolist()]
        if status == GO:
            _wait(dist.irecv(self.state, src=0, tag=TAG_STATE), self.timeout_s, "the server (rank 0) sent no weights")
        return Reply(status, version, epoch, slowdown, indices)
