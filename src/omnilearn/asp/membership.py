"""Which workers take part in an ASP run: receive the next request, notice a dead or silent worker, drop it.

The parameter server's side of failures (the wire-level findings behind it
are in :mod:`omnilearn.distributed.ps`). Three sets: ``live`` (not
dropped), ``stopped`` (told the run is over) and ``gone`` (dropped, with the
reason). Each worker has a connection (a gloo group) and a thread of its
own at the server that receives its requests and sends the answers
(:mod:`omnilearn.distributed.serverlink`): the server's main thread never
waits on a worker, and a live worker is dropped, only that worker, when

- its connection fails (it died: the wait its listener has posted fails at
  once; a SIGKILLed worker is dropped within milliseconds), or
- it is silent for longer than its allowance
  (:meth:`~omnilearn.asp.rules.Liveness.allowance_s`: ``heartbeat_s`` once it
  has spoken, ``timeout_s`` before its first request, start-up), wherever
  it froze (SIGSTOP, a paused VM, a cut network): between exchanges (``sent
  nothing for``) or in one (``sent a header but no gradients for``, ``took
  no reply for``, ``took no weights for``). Its silence is timed by its
  listener from the server's last answer to it, so time the server spent on
  others (a checkpoint, an evaluation, another worker) never counts against it.

Dropping takes back the deal it held (the dealer deals those indices again,
first, to the others), gives its batch share to the others
(:meth:`~omnilearn.asp.control.PushControl.drop`) and logs a ``drop`` event
plus one warning line. Its connection is closed: a dropped worker that wakes
up ends with one error line (the launcher reports it as lost; the run goes
on). With no live worker left (before the run's end) the run fails with
:class:`WorkersGone`, one line naming each worker and why.

Run its tests: ``python -m pytest -q tests/faults/test_asp_faults.py tests/dist/test_asp_server.py``
"""

from __future__ import annotations


import torch

from omnilearn.asp.rules import Liveness
from omnilearn.distributed.ps import PeerLost, PeerSilent, Request


class WorkersGone(RuntimeError):
    """Every worker was dropped; the message names each one and why."""


class Membership:
    def __init__(self, server, liveness: Liveness) -> None:
        self.server, self.liveness = server, liveness
        self.live: set[int] = set(range(liveness.workers))
        self.stopped: set[int] = set()
        self.gone: dict[int, str] = {}  # worker -> why it was dropped

    @property
    def waiting(self) -> set[int]:
        """Live workers not yet told to stop: the server serves until this is empty."""
        return self.live - self.stopped

    def start(self) -> None:
        """Connect to the workers and listen to each, for as long as :meth:`Liveness.allowance_s` lets it be silent."""
        self.liveness.start()
        self.server.link.start(lambda rank: self.liveness.allowance_s(rank - 1))

    def receive(self) -> tuple[Request, torch.Tensor | None] | None:
        """The next request, or None when a worker was dropped instead (then ask again)."""
        try:
            req, payload = self.server.link.receive()
        except PeerLost as e:
            self.lost(e)
            return None
        self.liveness.heard(req.rank - 1)
        return req, payload

    def lost(self, e: PeerLost) -> None:
        """Drop the worker whose connection failed or who was silent for its allowance (``e`` says which)."""
        worker = e.rank - 1
        self.drop(worker, self.silence(worker, e.quiet_s, e.what) if isinstance(e, PeerSilent)
                  else f"its connection failed: {e}")

    def silence(self, worker: int, quiet_s: float, what: str = "sent nothing") -> str:
        cfg = self.server.cfg
        if not self.liveness.greeted[worker]:
            return f"sent no first request within {quiet_s:.1f} s (--timeout-s {cfg.timeout_s:g})"
        flag = "--heartbeat-s" if cfg.heartbeat_s <= cfg.timeout_s else "--timeout-s"
        return f"{what} for {quiet_s:.1f} s ({flag} {min(cfg.heartbeat_s, cfg.timeout_s):g})"

    def drop(self, worker: int, reason: str) -> None:
        """Stop waiting for ``worker``: its deal is dealt again, its batch share goes to the others."""
        server = self.server
        if worker not in self.live:
            return
        self.live.discard(worker)
        self.stopped.discard(worker)
        self.gone[worker] = reason
        deal = server.outstanding.pop(worker, None)
        if deal is not None:
            server.dealer.take_back(*deal)
        batches = server.control.drop(worker)
        server.log.drop(server.version, worker, reason, 0 if deal is None else len(deal[1]), sorted(self.live),
                        batches, None if deal is None else deal[0])
        if not self.live and not server.stopping():
            named = "; ".join(f"worker rank {w + 1} {why}" for w, why in sorted(self.gone.items()))
            raise WorkersGone(f"all {len(self.gone)} workers are gone ({named}); the run stops at version "
                              f"{server.version}: fix them and continue from the latest checkpoint with --resume")
