"""The parameter server's end of the wire: one gloo group and one listening thread per worker.

:class:`ServerLink` connects to every worker over a group of its own
(:func:`~omnilearn.distributed.ps.pair_groups`) and starts one thread per
worker (a listener). A listener waits for its worker's next request and,
for a push, its payload, queues them, and waits until the main thread has
answered before it listens again. The main thread takes the requests in
arrival order (:meth:`ServerLink.receive`), handles one at a time and
answers (:meth:`ServerLink.reply`), so the state it sends is a consistent
snapshot. Payloads land in a pool of :data:`PAYLOAD_BUFFERS` buffers: a
worker frozen in the middle of its payload holds one, the others go on with
the other. Every wait on a worker lasts at most its allowance (a callable
the server gives, ``heartbeat_s`` or ``timeout_s``); past it the worker's
group is closed and a :class:`~omnilearn.distributed.ps.PeerSilent` is
queued, a failure is a :class:`~omnilearn.distributed.ps.PeerLost`: the
server drops that worker, the others' connections never notice. Why this
shape (gloo's rendezvous sends, timeouts that close a whole group): the
findings in :mod:`omnilearn.distributed.ps`.

Run its tests: ``python -m pytest -q tests/faults/test_asp_faults.py tests/dist/test_asp_server.py``
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from omnilearn.distributed.ps import (GO, HELLO, POLL, PUSH, REPLY_HEAD, REQUEST_LEN, STOP, TAG_PAYLOAD, TAG_REPLY,
                                      TAG_REQUEST, TAG_STATE, NoRequest, PeerLost, PeerSilent, Request, gloo_cause,
                                      pair_groups)

PAYLOAD_BUFFERS = 2  # payloads received ahead of the server's main thread (each the size of the model)


class _Listener:
    """The server's thread for worker rank ``rank``: its requests into the inbox, the main thread's answers out.

    It waits for the worker's next request (and payload), queues it, waits for the main thread's answer
    (:meth:`answer`) and sends it; a failure is queued instead (a :class:`PeerLost`) and the thread ends, as
    after sending ``STOP`` or being told to finish (an answer of None). Every wait lasts at most the worker's
    allowance, so the main thread never waits on a worker, and a worker never waits on another.
    """

    def __init__(self, link: "ServerLink", rank: int, group: dist.ProcessGroup,
                 allowance_s: Callable[[int], float]) -> None:
        self.link, self.rank, self.group, self.allowance_s = link, rank, group, allowance_s
        self.answers: queue.SimpleQueue = queue.SimpleQueue()  # (status, head, state) to send; None: finish
        self.thread = threading.Thread(target=self.run, name=f"omnilearn-ps-rank{rank}", daemon=True)

    def answer(self, status: int, head: torch.Tensor, state: torch.Tensor | None) -> None:
        self.answers.put((status, head, state))

    def run(self) -> None:
        try:
            while (request := self.next_request()) is not None:
                self.link.inbox.put(request)
                if (answer := self.answers.get()) is None or not self.send(*answer):
                    return
        except BaseException as e:  # noqa: BLE001 - the main thread raises it (a PeerLost: it drops the worker)
            self.link.inbox.put(e)

    def next_request(self) -> tuple[Request, torch.Tensor | None] | None:
        """The worker's next request and, for a push, its payload; None if the link closed meanwhile."""
        head = torch.empty(REQUEST_LEN, dtype=torch.float64)
        self.exchange(dist.irecv(head, src=self.rank, group=self.group, tag=TAG_REQUEST), "sent nothing")
        kind, batch, version, cycle_s, compute_s, loss = head.tolist()
        req = Request(self.rank, int(kind), int(batch), int(version), cycle_s, compute_s, loss)
        if req.kind not in (HELLO, PUSH, POLL):
            raise RuntimeError(f"worker rank {self.rank} sent an unknown request kind {req.kind}")
        if req.kind != PUSH:
            return req, None
        payload = self.link.free.get()
        if payload is None:
            return None
        try:
            self.exchange(dist.irecv(payload, src=self.rank, group=self.group, tag=TAG_PAYLOAD),
                          "sent a header but no gradients")
        except BaseException:
            self.link.free.put(payload)
            raise
        return req, payload

    def send(self, status: int, head: torch.Tensor, state: torch.Tensor | None) -> bool:
        """Send one answer (``state`` after the head when ``GO``); whether to go on listening (not after STOP)."""
        self.exchange(dist.isend(head, dst=self.rank, group=self.group, tag=TAG_REPLY), "took no reply")
        if status == GO:
            self.exchange(dist.isend(state, dst=self.rank, group=self.group, tag=TAG_STATE), "took no weights")
        return status != STOP

    def exchange(self, work, what: str) -> None:
        """Wait for one operation with this worker, at most its allowance: :class:`PeerSilent` past it, else
        :class:`PeerLost` on any failure (its group is closed either way, the others' are not)."""
        start = time.perf_counter()
        try:
            work.wait(timeout=timedelta(seconds=self.allowance_s(self.rank)))
        except RuntimeError as e:
            cause = gloo_cause(e)
            if "Timed out" in cause:
                raise PeerSilent(self.rank, what, time.perf_counter() - start) from None
            raise PeerLost(self.rank, f"worker rank {self.rank} {what} ({cause})") from None


class ServerLink:
    """The server's end: :meth:`start` (connect, listen), :meth:`receive`, :meth:`reply`, :meth:`close`."""

    def __init__(self, state_len: int, max_batch: int, timeout_s: float) -> None:
        self.state_len, self.max_batch, self.timeout_s = state_len, max_batch, timeout_s
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (request, payload) or the exception of a listener
        self.free: queue.SimpleQueue = queue.SimpleQueue()  # payload buffers not in use (None: the link closed)
        self.lent: dict[int, torch.Tensor] = {}  # worker rank -> the payload buffer of its request in hand
        self.listeners: dict[int, _Listener] = {}

    def start(self, allowance_s: Callable[[int], float]) -> None:
        """Connect to every worker and listen to each; ``allowance_s(rank)``: how long that worker may be silent."""
        groups = pair_groups(self.timeout_s)
        for _ in range(min(PAYLOAD_BUFFERS, len(groups))):
            self.free.put(torch.empty(self.state_len, dtype=torch.float32))
        self.listeners = {rank: _Listener(self, rank, group, allowance_s) for rank, group in groups.items()}
        for listener in self.listeners.values():
            listener.thread.start()

    def receive(self) -> tuple[Request, torch.Tensor | None]:
        """The next worker's request, in arrival order, and for a push its payload (valid until the reply to it).

        :class:`PeerSilent` when a worker was silent for its allowance, :class:`PeerLost` when its connection
        failed (drop it: its connection is closed); :class:`NoRequest` after ``3 x timeout_s`` of neither.
        """
        try:
            item = self.inbox.get(timeout=3 * self.timeout_s)
        except queue.Empty:
            raise NoRequest(f"no worker sent a request and none was dropped within {3 * self.timeout_s:g} s "
                            "(a listener thread of the server is lost)") from None
        if isinstance(item, BaseException):  # its listener has ended
            raise item
        req, payload = item
        if payload is not None:
            self.lent[req.rank] = payload
        return req, payload

    def reply(self, rank: int, status: int, version: int, epoch: int = 0, slowdown: float = 1.0,
              indices: list[int] | None = None, state: torch.Tensor | None = None) -> None:
        """Answer worker ``rank``: ``GO`` sends ``indices`` and ``state`` (a snapshot: not changed afterwards);
        ``STOP`` (its last) and ``HOLD`` neither.

        Its payload buffer is free again. The answer is sent by the worker's listener; a worker that does not
        take it (dead, or frozen for its allowance) comes back from :meth:`receive` as a PeerLost.
        """
        if (payload := self.lent.pop(rank, None)) is not None:
            self.free.put(payload)
        indices = indices or []
        if len(indices) > self.max_batch:
            raise ValueError(f"{len(indices)} indices exceed the largest batch {self.max_batch}")
        head = torch.zeros(REPLY_HEAD + self.max_batch, dtype=torch.float64)
        head[:REPLY_HEAD] = torch.tensor([status, version, len(indices), epoch, slowdown], dtype=torch.float64)
        head[REPLY_HEAD : REPLY_HEAD + len(indices)] = torch.tensor(indices, dtype=torch.float64)
        self.listeners[rank].answer(status, head, state)

    def close(self, wait_s: float = 0.0) -> None:
        """Stop listening and destroy the pair groups; safe to call twice.

        ``wait_s``: wait this long for the listeners to end, e.g. to send the last ``STOP`` s (at a normal
        end every worker was told to stop or dropped: none waits for a request). A listener still in a wait
        (after an error) ends at its allowance.
        """
        for listener in self.listeners.values():
            listener.answers.put(None)  # a listener waiting for an answer ends
            self.free.put(None)  # as does one waiting for a payload buffer
        deadline = time.monotonic() + wait_s
        for listener in self.listeners.values():
            listener.thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if dist.is_initialized():
                dist.destroy_process_group(listener.group)
        self.listeners, self.lent = {}, {}
