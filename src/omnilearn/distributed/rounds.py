"""One key space per torchrun round in a store that outlives rounds: the ranks agree on it through the store.

Why. torchrun's agent store outlives a restart: with the static rendezvous
the agent's TCPStore, with the c10d rendezvous the TCPStore the rank-0 agent
made at its first round (shared by default since torch 2.4). A gloo group
built in it reads peer addresses a previous round left there and fails in
``connectFullMesh``, or waits forever. Keying the keys by
``TORCHELASTIC_RESTART_COUNT`` is not enough across nodes: an agent whose
own worker failed counts a restart, another that re-forms the job because a
node joined (a membership change) does not, so the workers of one round can
hold different counts (seen with two agents, one losing a worker).

The protocol (no clocks, nothing stale can match):

- every rank other than 0 writes a fresh random id under
  ``omnilearn/hello/<rank>`` and waits for ``omnilearn/ack/<its id>``;
- rank 0 makes the round's id, and until its group is up (the caller's
  ``init_process_group`` returns) a thread of its own answers every hello id
  it sees change with the round's id. A stale hello (a dead process's) gets
  an answer nobody reads;
- every rank then keys its group under ``omnilearn/round-<round id>/``.

A rank other than 0 that gets no answer within the group's timeout raises
naming the store, as ``init_process_group`` would.

Run: ``python -m pytest -q tests/unit/test_rounds.py tests/faults/test_rescue_torchrun.py``
"""

from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist

POLL_S = 0.01  # how often rank 0 looks for hellos while its group forms


@contextmanager
def round_store(store: dist.Store, rank: int, world_size: int) -> Iterator[dist.Store]:
    """``store`` keyed for this round (see the module docstring); rank 0 answers hellos while the block runs."""
    if rank != 0:
        me = uuid.uuid4().hex
        store.set(f"omnilearn/hello/{rank}", me)
        round_id = store.get(f"omnilearn/ack/{me}").decode()  # waits up to the store's timeout
        yield dist.PrefixStore(f"omnilearn/round-{round_id}/", store)
        return
    round_id = uuid.uuid4().hex
    done = threading.Event()
    answering = threading.Thread(target=_answer, args=(_own(store), world_size, round_id, done), daemon=True,
                                 name="omnilearn-round")
    answering.start()
    try:
        yield dist.PrefixStore(f"omnilearn/round-{round_id}/", store)
    finally:
        done.set()
        answering.join()


def _own(store: dist.Store) -> dist.Store:
    """A connection of the thread's own where the store can clone one (a TCPStore); else the store itself."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):
        return store


def _answer(store: dist.Store, world_size: int, round_id: str, done: threading.Event) -> None:
    """Rank 0: answer each new hello with the round's id until ``done``."""
    answered: dict[int, bytes] = {}
    keys = {rank: f"omnilearn/hello/{rank}" for rank in range(1, world_size)}
    while not done.wait(POLL_S):
        try:
            for rank, key in keys.items():
                if store.check([key]):
                    hello = store.get(key)
                    if answered.get(rank) != hello:
                        store.set(f"omnilearn/ack/{hello.decode()}", round_id)
                        answered[rank] = hello
        except (RuntimeError, ValueError):  # the store went away: init_process_group says so on the main thread
            return
