"""One key space per torchrun round (omnilearn.distributed.rounds), with threads for ranks over a real TCPStore.

The case it exists for: a store that outlives rounds holds a dead process's hello (and the ranks of one round
may disagree on TORCHELASTIC_RESTART_COUNT, which the protocol never reads). The ranks of a round still share
one key space, a new one each round.

Run: ``python -m pytest -q tests/unit/test_rounds.py``
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from omnilearn.distributed.rounds import round_store


def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


def client(host: dist.TCPStore, timeout_s: float = 10) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=timeout_s))


def one_round(host: dist.TCPStore, world: int) -> list[str]:
    """The ranks of one round as threads; rank 0 writes a key in its key space and every other rank reads it in
    its own (a blocking get: it fails unless they are the same). Returns the round ids the others were told."""
    read: dict[int, str] = {}
    up = threading.Event()

    def rank_main(rank: int) -> None:
        with round_store(client(host), rank, world) as store:
            if rank == 0:
                store.set("from-zero", "hello")
                up.wait(10)  # rank 0's group is "up" once every rank got its answer
            else:
                read[rank] = store.get("from-zero").decode()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(1, world)] + \
        [threading.Thread(target=rank_main, args=(0,))]
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join(15)
    up.set()
    threads[-1].join(15)
    assert read == {r: "hello" for r in range(1, world)}
    return [host.get(f"omnilearn/ack/{host.get(f'omnilearn/hello/{r}').decode()}").decode() for r in range(1, world)]


def test_each_round_gets_a_key_space_of_its_own_despite_a_stale_hello():
    host = server()
    host.set("omnilearn/hello/2", "a-dead-process")  # left by an earlier round's rank 2
    host.set("omnilearn/ack/a-dead-process", "an-earlier-round")
    first = one_round(host, 3)
    second = one_round(host, 3)
    assert len(set(first)) == 1 and len(set(second)) == 1
    assert first[0] != second[0] and "an-earlier-round" not in first + second


def test_a_rank_whose_rank_zero_never_comes_raises():
    host = server()
    with pytest.raises(RuntimeError):
        with round_store(client(host, timeout_s=0.5), 1, 2):
            pass
