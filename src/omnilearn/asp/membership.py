"""Which workers take part in an ASP run: receive the next request, notice a dead or silent worker, drop it.

The parameter server's side of failures (the wire-level findings behind it
are in :mod:`omnilearn.distributed.ps`). Three sets: ``live`` (not
dropped), ``stopped`` (told the run is over) and ``gone`` (dropped, with the
reason). A live worker is dropped when

- its connection fails mid-exchange (a gloo error receiving its gradients or
  sending it a reply: it died; only its pair is closed), or
- it sends nothing for longer than its allowance
  (:class:`~omnilearn.asp.rules.Liveness`): ``heartbeat_s`` once it has
  spoken, ``timeout_s`` before its first request (start-up).

Dropping takes back the deal it held (the dealer deals those indices again,
first, to the others), gives its batch share to the others
(:meth:`~omnilearn.asp.control.PushControl.drop`) and logs a ``drop`` event
plus one warning line. The any-source receive waits only until the last
waiting worker would be overdue: a dead worker cannot block the others
(they keep the server awake and it checks the clocks at every request), and
a wait that expires means every waiting worker is overdue, so all are
dropped. With no live worker left (before the run's end) the run fails with
:class:`WorkersGone`, one line naming each worker and why. A worker that
hangs *mid-exchange* (its header sent, its gradients not, or its reply not
taken) for ``timeout_s`` cannot be dropped: gloo closes every connection
with that timeout, so the run fails with a ``PeerTimeout`` naming it.

Run its tests: ``python -m pytest -q tests/faults/test_asp_faults.py tests/dist/test_asp_server.py -k hung``
"""

from __future__ import annotations

import time

import torch

from omnilearn.asp.rules import Liveness
from omnilearn.distributed.ps import NoRequest, PeerLost, Request

MARGIN_S = 0.05  # a receive waits this much past the last allowance, so that all are overdue when it expires


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

    def start(self, now_s: float) -> None:
        self.liveness.start(now_s)

    def receive(self) -> tuple[Request, torch.Tensor | None] | None:
        """The next request, or None when a worker was dropped instead (then ask again)."""
        self.drop_overdue(time.perf_counter())
        if not self.waiting:
            return None
        try:
            req, payload = self.server.link.receive(self.liveness.wait_s(time.perf_counter(), self.waiting) + MARGIN_S)
        except PeerLost as e:
            self.drop(e.rank - 1, f"its connection failed: {e}")
            return None
        except NoRequest:  # every waiting worker is overdue now (and gloo closed all connections with the timeout)
            self.drop_overdue(time.perf_counter(), everyone=True)
            return None
        self.liveness.heard(req.rank - 1, time.perf_counter())
        return req, payload

    def drop_overdue(self, now_s: float, everyone: bool = False) -> None:
        """Drop each waiting worker silent past its allowance (``everyone``: each waiting worker)."""
        quiet = [(w, now_s - self.liveness.last_heard_s[w]) for w in sorted(self.waiting)] if everyone else \
            self.liveness.overdue(now_s, self.waiting)
        for worker, quiet_s in quiet:
            self.drop(worker, self.silence(worker, quiet_s))

    def silence(self, worker: int, quiet_s: float) -> str:
        cfg = self.server.cfg
        if not self.liveness.greeted[worker]:
            return f"sent no first request within {quiet_s:.1f} s (--timeout-s {cfg.timeout_s:g})"
        flag = "--heartbeat-s" if cfg.heartbeat_s <= cfg.timeout_s else "--timeout-s"
        return f"sent nothing for {quiet_s:.1f} s ({flag} {min(cfg.heartbeat_s, cfg.timeout_s):g})"

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
